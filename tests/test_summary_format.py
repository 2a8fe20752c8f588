"""The summary a command prints: without ``--json`` floats read as a person reads them (4
significant digits, also inside lists and dicts, whole ones still as floats: ``readable``, the format
of epoch and progress lines too) and a pipeline's stages take a short line each; with ``--json`` they
keep full precision and every detail."""

from __future__ import annotations

import json

import pytest

from raytrain_mp.cli import emit
from raytrain_mp.readable import number

RESULT = {
    "lr": 5.0979e-06,
    "val_accuracy": 0.969444,
    "epochs": 2,
    "world_size_history": [[0, 2]],
    "stage_seconds_per_step": [0.123456, 1.5],
    "best": {"base_lr": 0.05, "trial": "t1"},
    "checkpoint": None,
    "top3_accuracy": 1.0,
    "per_class_accuracy": {"solid": 0.0, "striped": 0.25},
}


def test_text_summary_prints_4_significant_digits(capsys):
    emit(RESULT, False, "ddp training finished")
    assert capsys.readouterr().out.splitlines() == [
        "ddp training finished",
        "  lr: 5.098e-06",
        "  val_accuracy: 0.9694",
        "  epochs: 2",
        "  world_size_history: [[0, 2]]",
        "  stage_seconds_per_step: [0.1235, 1.5]",
        "  best: {'base_lr': 0.05, 'trial': 't1'}",
        "  checkpoint: None",
        "  top3_accuracy: 1.0",
        "  per_class_accuracy: {'solid': 0.0, 'striped': 0.25}",
    ]


@pytest.mark.parametrize("value, text", [
    (5.0979e-06, "5.098e-06"), (0.00001, "1e-05"), (0.969444, "0.9694"), (1.0552, "1.055"), (1.0, "1.0"),
    (0.0, "0.0"), (-2.0, "-2.0"), (1234.56, "1235"), (2500.0, "2500.0"), (123456.0, "1.235e+05"), (float("nan"), "nan"),
    (float("inf"), "inf"),
])  # fmt: skip
def test_one_number_format(value, text):
    assert number(value) == text


def test_json_summary_keeps_full_precision(capsys):
    emit(RESULT, True, "ddp training finished")
    assert json.loads(capsys.readouterr().out) == RESULT


def test_pipeline_stages_print_one_short_line_each(capsys):
    """141 blocks over 2 stages on nodes with 64-hex ids: a line a stage (first and last block,
    counts, the node's first 8 hex), none over 160 characters; the JSON line keeps every block."""
    from raytrain_mp.pipeline.summary import text_summary

    blocks = [f"features.{i}.block.{j}" for i in range(47) for j in range(3)]
    stages = [
        {"index": 0, "blocks": blocks[:100], "params": 1_234_567, "param_share": 0.4, "node_id": "5f35" + "a" * 60},
        {"index": 1, "blocks": blocks[100:], "params": 812, "param_share": 0.6, "node_id": "9a0c" + "b" * 60},
    ]
    actors = [{"replica": 0, "stage": s["index"], "node_id": s["node_id"]} for s in stages]
    result = {"val_accuracy": 0.5, "num_nodes": 2, "stages": stages, "actors": actors}
    emit(result, False, "pipeline training finished", text_summary)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "pipeline training finished",
        "  val_accuracy: 0.5",
        "  num_nodes: 2",
        "  stage 0: features.0.block.0 ... features.33.block.0 (100 blocks, 1.23M params) on node 5f35aaaa",
        "  stage 1: features.33.block.1 ... features.46.block.2 (41 blocks, 812 params) on node 9a0cbbbb",
    ]
    emit(result, True, "pipeline training finished", text_summary)
    assert json.loads(capsys.readouterr().out) == result
    replicated = {**result, "actors": [*actors, *({**a, "replica": 1, "node_id": "c" * 64} for a in actors)]}
    emit(replicated, False, "pipeline training finished", text_summary)
    lines = capsys.readouterr().out.splitlines()
    assert lines[3:] == [
        "  stage 0: features.0.block.0 ... features.33.block.0 (100 blocks, 1.23M params)",
        "  stage 1: features.33.block.1 ... features.46.block.2 (41 blocks, 812 params)",
        "  replica 0: stage 0 on node 5f35aaaa, stage 1 on node 9a0cbbbb",
        "  replica 1: stages 0-1 on node cccccccc",
    ]
    assert max(map(len, lines)) <= 160
