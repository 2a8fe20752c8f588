"""The summary a command prints: without ``--json`` floats read as a person reads them (4
significant digits, also inside lists and dicts); with ``--json`` they keep full precision."""

from __future__ import annotations

import json

from raytrain_mp.cli import emit

RESULT = {
    "lr": 5.0979e-06,
    "val_accuracy": 0.969444,
    "epochs": 2,
    "world_size_history": [[0, 2]],
    "stage_seconds_per_step": [0.123456, 1.5],
    "best": {"base_lr": 0.05, "trial": "t1"},
    "checkpoint": None,
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
    ]


def test_json_summary_keeps_full_precision(capsys):
    emit(RESULT, True, "ddp training finished")
    assert json.loads(capsys.readouterr().out) == RESULT
