"""scaled_lr and the warmup/decay schedule: boundary values, per-iteration ramp, every rule, errors."""

from __future__ import annotations

import math

import pytest

from raytrain_mp import scaled_lr
from raytrain_mp.lr_schedule import LRSchedule, make_schedule


@pytest.mark.parametrize(
    "rule, batch, expected",
    [
        ("linear", 256, 0.1), ("linear", 8192, 3.2), ("linear", 32, 0.0125), ("linear", 1, 0.1 / 256),
        ("sqrt", 256, 0.1), ("sqrt", 1024, 0.2), ("sqrt", 64, 0.05),
        ("none", 8192, 0.1), ("none", 1, 0.1),
    ],
)  # fmt: skip
def test_scaled_lr_rules(rule, batch, expected):
    assert scaled_lr(0.1, batch, 256, rule) == pytest.approx(expected, rel=1e-12)


def test_scaled_lr_default_base_batch_is_256():
    assert scaled_lr(0.1, 512) == pytest.approx(0.2)


@pytest.mark.parametrize(
    "args, message",
    [
        ((0.0, 256), "base_lr must be a finite number > 0, got 0.0"),
        ((-0.1, 256), "base_lr must be a finite number > 0, got -0.1"),
        ((math.inf, 256), "base_lr must be a finite number > 0, got inf"),
        ((math.nan, 256), "base_lr must be a finite number > 0, got nan"),
        ((0.1, 0), "global_batch must be an integer >= 1, got 0"),
        ((0.1, 2.5), "global_batch must be an integer >= 1, got 2.5"),
        ((0.1, 256, 0), "base_batch must be an integer >= 1, got 0"),
        ((0.1, 256, 256, "cubic"), "rule must be one of linear, sqrt, none, got 'cubic'"),
    ],
)
def test_scaled_lr_errors(args, message):
    with pytest.raises(ValueError) as info:
        scaled_lr(*args)
    assert str(info.value) == message


def test_warmup_ramps_per_iteration_from_base_to_scaled():
    # Goyal et al.: 5 epochs of warmup, base 0.1 at 256, batch 8192 -> peak 3.2.
    s = make_schedule(0.1, 8192, 256, "linear", 5, 90, 100, decay="step", step_epochs=30, gamma=0.1)
    assert s.warmup_steps == 500 and s.peak_lr == pytest.approx(3.2)
    assert s(0) == pytest.approx(0.1)
    assert s(250) == pytest.approx(0.1 + 3.1 / 2)
    steps = [s(i) for i in range(501)]
    deltas = {round(b - a, 12) for a, b in zip(steps, steps[1:])}
    assert deltas == {round(3.1 / 500, 12)}  # one equal increment every iteration
    assert s(500) == pytest.approx(3.2) and s(2999) == pytest.approx(3.2)
    assert s(3000) == pytest.approx(0.32) and s(6000) == pytest.approx(0.032)


def test_cosine_decay_after_warmup_is_continuous_and_ends_at_zero():
    s = make_schedule(0.1, 1024, 256, "linear", 1, 10, 10)
    assert s(0) == pytest.approx(0.1)
    assert s(10) == pytest.approx(0.4)  # end of warmup = peak, continuous
    assert s(55) == pytest.approx(0.2)  # half way through the decay
    assert s(100) == pytest.approx(0.0, abs=1e-15) and s(150) == pytest.approx(0.0, abs=1e-15)
    values = [s(i) for i in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:])) and min(values) >= 0


def test_no_warmup_and_smaller_batch_than_base():
    s = make_schedule(0.4, 64, 256, "linear", 0, 6, 22, decay="none")
    assert s.warmup_steps == 0 and s(0) == pytest.approx(0.1) and s(131) == pytest.approx(0.1)
    # Below the base batch the peak is smaller than base_lr: the warmup starts at the peak, never above it.
    s = make_schedule(0.4, 64, 256, "linear", 1, 6, 22)
    assert s(0) == pytest.approx(0.1) and max(s(i) for i in range(132)) == pytest.approx(0.1)


def test_factor_is_relative_to_peak():
    s = make_schedule(0.1, 512, 256, "linear", 2, 4, 5)
    assert s.factor(0) == pytest.approx(0.5) and s.factor(10) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decay": "exp"}, "decay must be one of cosine, step, none, got 'exp'"),
        ({"total_steps": 0}, "total_steps and steps_per_epoch must be >= 1"),
        ({"warmup_steps": 11}, "warmup_steps must be in [0, total_steps], got 11"),
    ],
)
def test_schedule_errors(kwargs, message):
    args = {"start_lr": 0.1, "peak_lr": 0.2, "warmup_steps": 1, "total_steps": 10, **kwargs}
    with pytest.raises(ValueError) as info:
        LRSchedule(**args)
    assert str(info.value) == message
