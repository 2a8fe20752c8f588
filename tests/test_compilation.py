"""``compilation`` and its options without Ray: the driver's probe (a machine that cannot compile is
one line, exit 2, before anything starts), the cache folder, the counts a first step reports, the
note where compiling loses, and ``memory_format.layout_seconds`` timing compiled copies."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from raytrain_mp import compilation
from raytrain_mp.compilation import CompileWatch, check_compiler, compiler, slower_note, use_cache
from raytrain_mp.compile_options import DEFAULT_CACHE, CompileOptions
from raytrain_mp.errors import UsageError
from raytrain_mp.memory_format import layout_seconds


def test_without_a_cxx_compiler_compile_is_one_line_before_anything_starts(tmp_path, digits_dir):
    runs = tmp_path / "runs"
    argv = ["ddp", "--compile", "--data", digits_dir, "--storage-path", str(runs), "--compile-cache", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_mp.cli", *argv],
        env={**os.environ, "CXX": "/nonexistent/g++"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr == (
        f"raytrain-mp: error: --compile: torch {torch.__version__} cannot compile here (No working C++ compiler found "
        "in torch._inductor.config.cpp.cxx: (None, '/nonexistent/g++')); accepted: --no-compile, or a C++ compiler "
        "inductor can run (set CXX)\n"
    )
    assert not runs.exists()


def test_the_probe_passes_here_once_per_process(tmp_path, monkeypatch):
    monkeypatch.setenv(compilation.CACHE_ENV, str(tmp_path / "unused"))
    options = CompileOptions(compile=True, compile_cache=str(tmp_path / "graphs"))
    check_compiler(options)
    check_compiler(options)
    assert compilation._probe.cache_info().hits >= 1  # the second check compiled nothing
    assert os.environ[compilation.CACHE_ENV] == str(tmp_path / "graphs")
    check_compiler(CompileOptions())  # eager: nothing to probe


def test_the_cache_folder_is_the_option_else_the_nodes_variable_else_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(compilation.CACHE_ENV, raising=False)
    assert use_cache(None) == str(tmp_path / DEFAULT_CACHE.removeprefix("~/"))
    monkeypatch.setenv(compilation.CACHE_ENV, str(tmp_path / "node"))
    assert use_cache(None) == str(tmp_path / "node")
    assert use_cache(str(tmp_path / "mine")) == str(tmp_path / "mine") == os.environ[compilation.CACHE_ENV]
    assert (tmp_path / "mine").is_dir()


def test_a_second_compile_of_the_same_graph_is_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(compilation.CACHE_ENV, str(tmp_path))
    compile = compiler(CompileOptions(compile=True))
    assert compiler(CompileOptions()) is None
    x = torch.randn(4, 3, dtype=torch.float64)
    watch = CompileWatch.start()
    eager = nn.Linear(3, 2).double()
    assert torch.equal(compile(eager)(x), eager(x))
    assert watch.since() == (0, 1)
    torch._dynamo.reset()  # as a new process would: nothing compiled in memory
    compile(nn.Linear(3, 2).double())(x)
    assert watch.since() == (1, 1)
    assert watch.line().endswith(f": 1 of 2 graphs from the cache {tmp_path}")


def test_the_note_says_where_compiling_loses():
    assert slower_note(eager=0.2, compiled=0.1) is None
    assert slower_note(eager=0.221, compiled=0.273) == (
        "--compile: a forward and backward take 273 ms compiled, 221 ms eager at these shapes (0.81x): "
        "--no-compile trains faster here"
    )


def test_layout_seconds_times_compiled_copies_and_leaves_the_module(tmp_path, monkeypatch):
    monkeypatch.setenv(compilation.CACHE_ENV, str(tmp_path))
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seconds = layout_seconds(model, torch.randn(2, 2, 6, 6), False, compile=compiler(CompileOptions(compile=True)))
    assert set(seconds) == {"channels_last", "contiguous"} and all(s > 0 for s in seconds.values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert layout_seconds(model, torch.randn(2, 8), False) == {}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"compile_mode": "max-autotune"}, "--compile-mode: needs --compile"),
        ({"compile_cache": "/tmp/graphs"}, "--compile-cache: needs --compile"),
        (
            {"compile": True, "compile_mode": "fast"},
            "--compile-mode: unknown value 'fast'; accepted: default, reduce-overhead, max-autotune",
        ),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(UsageError) as info:
        CompileOptions(**options).validate()
    assert str(info.value) == message
