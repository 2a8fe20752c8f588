"""Cutting blocks into stages: split points, parameter and time balance, reports, error texts."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from raytrain_mp.errors import UsageError
from raytrain_mp.models import build_model
from raytrain_mp.pipeline.blocks import block_parameter_counts, flatten_model
from raytrain_mp.pipeline.partition import balance_bounds, plan_stages, profile_blocks, split_bounds

RESNET18 = ["stem"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + ["head"]
IN_ORDER = "give split points in model order"


@pytest.mark.parametrize("point", ["layer3", "layer3.0"])
def test_seeds_split_before_layer3(point: str) -> None:
    assert split_bounds(RESNET18, [point], 2) == [0, 5, 10]


def test_split_into_three() -> None:
    assert split_bounds(RESNET18, ["layer2", "layer4.1"], 3) == [0, 3, 8, 10]


@pytest.mark.parametrize(
    ("points", "num_stages", "message"),
    [
        (["layer9"], 2, "split_points: 'layer9' names no block; blocks: " + ", ".join(RESNET18)),
        (["layer3", "layer2"], 3, f"split_points: 'layer2' does not come after 'layer3.0'; {IN_ORDER}"),
        (["layer3", "layer3.0"], 3, f"split_points: 'layer3.0' does not come after 'layer3.0'; {IN_ORDER}"),
        (["stem"], 2, "split_points: cutting before 'stem' would leave stage 0 empty"),
        (["layer2", "layer3"], 2, "split_points: 2 stages need 1 split point(s), got 2"),
        ([], 2, "split_points: 2 stages need 1 split point(s), got 0"),
        (["layer1"] * 10, 11, "num_stages: 11 stages for 10 blocks; each stage needs at least one block"),
        ([], 0, "num_stages: need at least 1 stage, got 0"),
    ],
)
def test_split_point_errors(points: list[str], num_stages: int, message: str) -> None:
    with pytest.raises(UsageError) as info:
        split_bounds(RESNET18, points, num_stages)
    assert str(info.value) == message


def _brute_force_best(costs: list[float], k: int) -> float:
    n = len(costs)
    return min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
        for cuts in itertools.combinations(range(1, n), k - 1)
    )


def test_balance_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0, rng.randint(1, 20), rng.random() * 10]) for _ in range(n)]
        bounds = balance_bounds(costs, k)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == k + 1
        assert all(a < b for a, b in zip(bounds, bounds[1:]))  # contiguous, no empty stage
        best = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert best == pytest.approx(_brute_force_best(costs, k), rel=1e-12, abs=1e-12)


def test_balance_errors() -> None:
    with pytest.raises(UsageError) as info:
        balance_bounds([1.0, 2.0], 3)
    assert str(info.value) == "num_stages: 3 stages for 2 blocks; each stage needs at least one block"


def test_params_balance_of_resnet18() -> None:
    model = build_model("resnet18", 10, in_channels=1, small_stem=True)
    blocks = flatten_model(model)
    counts = block_parameter_counts(model, blocks)
    assert sum(counts) == sum(p.numel() for p in model.parameters())
    bounds = balance_bounds(counts, 2)
    plans = plan_stages([b.name for b in blocks], bounds, counts)
    # layer4 alone holds most of ResNet-18's parameters
    assert [plan.blocks for plan in plans] == [tuple(RESNET18[:8]), ("layer4.1", "head")]
    assert sum(plan.param_share for plan in plans) == pytest.approx(1.0)
    assert [plan.params for plan in plans] == [sum(counts[:8]), sum(counts[8:])]
    assert all(plan.seconds is None for plan in plans)


def test_plan_reports_seconds() -> None:
    plans = plan_stages(["a", "b", "c"], [0, 1, 3], [1, 1, 2], [0.5, 0.25, 0.25])
    assert [(p.index, p.blocks, p.params, p.param_share, p.seconds) for p in plans] == [
        (0, ("a",), 1, 0.25, 0.5),
        (1, ("b", "c"), 3, 0.75, 0.5),
    ]


def test_profile_blocks_times_each_block_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seconds = profile_blocks(model, flatten_model(model), torch.randn(6, 8), repeats=2)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)  # blocks 0, 1+2 and 3
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
