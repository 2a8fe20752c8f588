"""The summary a command prints: without ``--json`` floats read as a person reads them (4
significant digits, also inside lists and dicts, whole ones still as floats: ``readable``, the format
of epoch and progress lines too); with ``--json`` they keep full precision."""

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
