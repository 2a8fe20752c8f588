"""The storage layer against a real S3 protocol server on 127.0.0.1 (and the local filesystem):
URIs keep their scheme and query, a folder is visible only when complete, a torn one is never
picked, a file written under Ctrl-C is written whole, and bad locations are one line."""

from __future__ import annotations

import os
import signal

import pytest

from raytrain_mp.errors import UsageError
from raytrain_mp.interruption import Interrupted, signals_interrupt
from raytrain_mp.storage import (
    COMPLETE_MARKER,
    Location,
    check_reachable,
    is_complete,
    join,
    latest_complete,
    local_replacement,
    locate,
    name_of,
    publish_folder,
    umask,
    write_local,
)


def test_join_keeps_the_query_at_the_end():
    uri = "s3://b/runs?endpoint_override=127.0.0.1:9000&scheme=http"
    assert (
        join(uri, "r1", "checkpoint_000002")
        == "s3://b/runs/r1/checkpoint_000002?endpoint_override=127.0.0.1:9000&scheme=http"
    )
    assert name_of(join(uri, "r1", "checkpoint_000002")) == "checkpoint_000002"
    assert join("/tmp/runs/", "r1") == "/tmp/runs/r1"


@pytest.fixture
def umask_022():
    saved = os.umask(0o022)
    yield
    os.umask(saved)


def test_written_files_get_the_mode_the_umask_gives_and_replace_atomically(umask_022, tmp_path):
    assert umask() == 0o022
    target = tmp_path / "new" / "metrics.csv"
    write_local(target, b"a")
    locate(str(tmp_path / "loc.csv"), "--out").write_bytes(b"b")
    with pytest.raises(ValueError), local_replacement(target) as tmp:
        tmp.write_bytes(b"torn")
        raise ValueError("the writer failed")
    assert target.read_bytes() == b"a" and os.listdir(target.parent) == ["metrics.csv"]  # no temporary left
    assert oct(target.stat().st_mode & 0o777) == oct((tmp_path / "loc.csv").stat().st_mode & 0o777) == "0o644"
    local = tmp_path / "private"
    (local / "sub").mkdir(parents=True)
    (local / "sub" / "model.pt").write_bytes(b"model")
    os.chmod(local, 0o700)
    os.chmod(local / "sub" / "model.pt", 0o600)
    publish_folder(local, locate(str(tmp_path / "published"), "--storage-path"))
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "published").rglob("*")}
    assert modes == {"sub": "0o755", "model.pt": "0o644"}
    assert oct((tmp_path / "published").stat().st_mode & 0o777) == "0o755"
    os.umask(0o077)
    write_local(target, b"c")
    assert umask() == 0o077 and oct(target.stat().st_mode & 0o777) == "0o600"  # the user's umask decides


def local_checkpoint(tmp_path, name: str):
    folder = tmp_path / name
    (folder / "sub").mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"model")
    (folder / "sub" / "x").write_bytes(b"x")
    return folder


@pytest.mark.parametrize("where", ["s3", "local"])
def test_published_folders_are_complete_and_torn_ones_are_never_picked(where, bucket, tmp_path):
    run = locate(join(bucket, "runs", "r1") if where == "s3" else str(tmp_path / "runs" / "r1"), "--storage-path")
    publish_folder(local_checkpoint(tmp_path, "a"), run.child("checkpoint_000001"))
    publish_folder(local_checkpoint(tmp_path, "b"), run.child("checkpoint_000002"))
    assert [f.uri for f in run.folders("checkpoint_")] == [run.child(f"checkpoint_00000{i}").uri for i in (1, 2)]
    assert run.child("checkpoint_000002", "sub", "x").read_bytes() == b"x"
    assert latest_complete(run, "checkpoint_").uri == run.child("checkpoint_000002").uri
    if where == "s3":
        # An upload killed half-way: files there, no marker. It is never chosen.
        torn = run.child("checkpoint_000003")
        torn.child("model.pt").write_bytes(b"half")
        assert not is_complete(torn) and is_complete(run.child("checkpoint_000002"))
        assert latest_complete(run, "checkpoint_").uri == run.child("checkpoint_000002").uri
        assert run.child("checkpoint_000002", COMPLETE_MARKER).is_file()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # consumed


def test_bad_locations_are_one_line(bucket, s3_endpoint):
    with pytest.raises(UsageError) as info:
        locate("foo://x/y", "--storage-path")
    assert str(info.value) == (
        "--storage-path: cannot use foo://x/y (unknown scheme 'foo'); accepted: a local folder or a URI such as "
        "s3://BUCKET/PATH (schemes: file, s3, gs, gcs, hdfs, viewfs, abfs, abfss)"
    )
    with pytest.raises(UsageError, match=r"^--data: cannot use s3:///x\?\S+ \(no bucket name\); accepted: "):
        locate(f"s3:///x?endpoint_override={s3_endpoint}&scheme=http", "--data")
    with pytest.raises(UsageError, match=r"\(Unexpected query parameter in S3 URI: 'timeout'\)"):
        locate(f"s3://b/x?endpoint_override={s3_endpoint}&timeout=1", "--data")  # what only pyarrow knows
    missing = f"s3://no-such-bucket/runs?endpoint_override={s3_endpoint}&scheme=http"
    with pytest.raises(UsageError) as info:
        check_reachable(locate(missing, "--storage-path"), "--storage-path")
    assert str(info.value) == f"--storage-path: {missing}: no bucket 'no-such-bucket'; create it first"
    check_reachable(locate(bucket, "--storage-path"), "--storage-path")  # the fixture's bucket exists


def test_download_folder_copies_every_file(bucket, tmp_path):
    from raytrain_mp.storage import download_folder

    target = locate(join(bucket, "c"), "--resume-from")
    publish_folder(local_checkpoint(tmp_path, "a"), target)
    got = download_folder(target, tmp_path / "down")
    assert sorted(str(p.relative_to(got)) for p in got.rglob("*") if p.is_file()) == [
        COMPLETE_MARKER,
        "model.pt",
        "sub/x",
    ]
    assert (got / "sub" / "x").read_bytes() == b"x"


def test_a_store_that_refuses_is_one_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket is closed
    uri = f"s3://bucket/runs?endpoint_override=127.0.0.1:{port}&scheme=http"
    with pytest.raises(
        UsageError, match=r"^--storage-path: s3://bucket/runs\?.*: the store refused the request \(.+\)$"
    ):
        check_reachable(locate(uri, "--storage-path"), "--storage-path")


def test_an_upload_killed_half_way_is_never_chosen(bucket, tmp_path):
    """A real kill: a process publishing a 300-file folder is SIGKILLed once 5 files are in the bucket."""
    import subprocess
    import sys

    source = tmp_path / "big"
    source.mkdir()
    for i in range(300):
        (source / f"part-{i:03d}").write_bytes(b"x" * 1000)
    run = locate(join(bucket, "runs", "r1"), "--storage-path")
    publish_folder(local_checkpoint(tmp_path, "first"), run.child("checkpoint_000001"))
    code = f"""
import os, signal, threading, time
import pyarrow.fs as pafs
from pathlib import Path
from raytrain_mp.storage import locate, join, publish_folder
target = locate({run.child("checkpoint_000002").uri!r}, "--storage-path")
def kill_after_five():
    while True:
        try:
            n = len(target.fs.get_file_info(pafs.FileSelector(target.path, allow_not_found=True)))
        except OSError:
            n = 0
        if n >= 5:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.005)
threading.Thread(target=kill_after_five, daemon=True).start()
publish_folder(Path({str(source)!r}), target)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    torn = run.child("checkpoint_000002")
    uploaded = torn.fs.get_file_info(__import__("pyarrow.fs").fs.FileSelector(torn.path))
    assert 5 <= len(uploaded) < 300 and not is_complete(torn)
    assert latest_complete(run, "checkpoint_").uri == run.child("checkpoint_000001").uri


class CtrlCBeforeTheBytes:
    """A real output stream of the bucket; Ctrl-C arrives after it opened, before its bytes are written."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __enter__(self):
        self.stream.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.stream.__exit__(*exc)

    def write(self, data: bytes) -> int:
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next instruction
        return self.stream.write(data)


class CtrlCFilesystem:
    """The bucket's filesystem, whose output streams are ``CtrlCBeforeTheBytes``."""

    def __init__(self, fs) -> None:
        self.fs = fs

    def open_output_stream(self, path: str):
        return CtrlCBeforeTheBytes(self.fs.open_output_stream(path))


def test_ctrl_c_during_an_upload_leaves_the_file_whole(bucket):
    """Closing an S3 stream uploads what it holds, also on the way out of an exception: without
    ``uninterrupted`` this upload left an empty object (a rerun then lost its metrics.csv rows)."""
    file = locate(join(bucket, "run", "metrics.csv"), "--storage-path")
    file.write_bytes(b"old rows\n")
    with pytest.raises(Interrupted), signals_interrupt():
        Location(CtrlCFilesystem(file.fs), file.path, file.uri).write_bytes(b"old rows\nnew row\n")
    assert file.read_bytes() == b"old rows\nnew row\n"
