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
from raytrain_mp.pipeline.partition import (
    balance_bounds,
    balance_fill_drain_bounds,
    cut_score,
    plan_stages,
    profile_blocks,
    rescale_to_measured,
    split_bounds,
)

RESNET18 = ["stem"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + ["head"]
IN_ORDER = "give split points in model order"


@pytest.mark.parametrize("point", ["layer3", "layer3.0"])
def test_the_layer3_split_cuts_before_layer3(point: str) -> None:
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


def _random_costs(rng: random.Random, n: int) -> list[float]:
    # Zeros, ties (integers) and small blocks beside large ones.
    return [rng.choice([0, rng.randint(1, 20), rng.random() * 10, rng.random() * 0.5]) for _ in range(n)]


def test_balance_is_optimal_against_brute_force() -> None:
    # With no allowance for negligible stages the bottleneck is the smallest possible one.
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = _random_costs(rng, n)
        bounds = balance_bounds(costs, k, negligible=0.0)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == k + 1
        assert all(a < b for a, b in zip(bounds, bounds[1:]))  # contiguous, no empty stage
        best = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert best == pytest.approx(_brute_force_best(costs, k), rel=1e-12, abs=1e-12)


def _brute_force_choice(costs: list[float], k: int, negligible: float) -> list[int]:
    """The documented rule, applied to every cut. Stage costs are prefix differences, as in
    balance_bounds, so that both compare the same floats and the answer is exact."""
    n = len(costs)
    prefix = [0.0, *itertools.accumulate(costs)]
    floor = negligible * prefix[n]
    cuts = [(0, *c, n) for c in itertools.combinations(range(1, n), k - 1)]
    stages = {cut: [prefix[b] - prefix[a] for a, b in zip(cut, cut[1:])] for cut in cuts}
    best = min(max(s) for s in stages.values())
    without = [max(s) for s in stages.values() if min(s) >= floor]
    cap = min(without) if without and min(without) <= best + floor else best
    allowed = [cut for cut in cuts if max(stages[cut]) <= cap]
    smallest = max(min(stages[cut]) for cut in allowed)
    chosen = [cut for cut in allowed if min(stages[cut]) == smallest]
    return list(min(chosen, key=lambda cut: cut[::-1]))


@pytest.mark.parametrize("negligible", [0.0, 0.01, 0.05, 0.1])
def test_balance_follows_the_rule_on_every_cut(negligible: float) -> None:
    rng = random.Random(1)
    paid = 0  # cases whose bottleneck exceeds the smallest possible one
    for _ in range(1000):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = _random_costs(rng, n)
        bounds = balance_bounds(costs, k, negligible=negligible)
        assert bounds == _brute_force_choice(costs, k, negligible), (costs, k)
        # The promises in plain words: the bottleneck gives up at most the allowance, and a
        # negligible stage is left only when no cut within the allowance avoids one.
        stage = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        floor = negligible * sum(costs)
        best = _brute_force_best(costs, k)
        assert max(stage) <= best + floor + 1e-9
        if min(stage) < floor - 1e-9:
            for cut in itertools.combinations(range(1, n), k - 1):
                other = [sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, n))]
                assert min(other) < floor + 1e-9 or max(other) > best + floor - 1e-9
        paid += max(stage) > best + 1e-9
    # The rule was exercised: with an allowance, some cases paid on the bottleneck to avoid a
    # negligible stage; without one, none did.
    assert (paid > 0) == (negligible > 0), paid


# Forward+backward seconds of ResNet-18 (small stem, 32x32, micro-batch 2, one CPU thread), in
# percent of the total, as profile_blocks measured them: layer4.1 alone is a third of the work and
# the head (0.01M parameters) 0.7%.
RESNET18_SECONDS = [1.18, 6.88, 6.59, 6.02, 6.15, 7.15, 7.74, 23.2, 34.38, 0.7]


def test_time_balance_does_not_give_the_head_a_stage_of_its_own() -> None:
    # The smallest possible bottleneck is layer4.1 alone (34.38), which forces the head into a
    # stage by itself: [0, 6, 8, 9, 10]. Joining the head to layer4.1 costs 0.7 on the bottleneck,
    # less than the 1% of the total that counts as negligible, and frees a stage for the rest.
    bounds = balance_bounds(RESNET18_SECONDS, 4)
    assert bounds == [0, 4, 7, 8, 10]
    plans = plan_stages(RESNET18, bounds, [1] * 10, RESNET18_SECONDS)
    assert [plan.blocks for plan in plans] == [
        ("stem", "layer1.0", "layer1.1", "layer2.0"),
        ("layer2.1", "layer3.0", "layer3.1"),
        ("layer4.0",),
        ("layer4.1", "head"),
    ]
    assert [round(plan.seconds, 2) for plan in plans] == [20.67, 21.04, 23.2, 35.08]
    # With no allowance the exact optimum stands, head alone.
    assert balance_bounds(RESNET18_SECONDS, 4, negligible=0.0) == [0, 6, 8, 9, 10]


def _brute_force_fill_drain_choice(forward: list[float], backward: list[float], k: int, negligible: float) -> list[int]:
    """balance_fill_drain_bounds's documented rule, applied to every cut, on prefix differences."""
    n = len(forward)
    pf, pb = [0.0, *itertools.accumulate(forward)], [0.0, *itertools.accumulate(backward)]
    size = [0.0, *itertools.accumulate(f + b for f, b in zip(forward, backward))]
    cuts = [(0, *c, n) for c in itertools.combinations(range(1, n), k - 1)]

    def stages(prefix: list[float], cut: tuple[int, ...]) -> list[float]:
        return [prefix[b] - prefix[a] for a, b in zip(cut, cut[1:])]

    score = {cut: max(stages(pf, cut)) + max(stages(pb, cut)) for cut in cuts}
    floor = negligible * size[n]
    best = min(score.values())
    without = [score[cut] for cut in cuts if min(stages(size, cut)) >= floor]
    target = min(without) if without and min(without) <= best + floor else best
    allowed = [cut for cut in cuts if score[cut] <= target]
    smallest = max(min(stages(size, cut)) for cut in allowed)
    chosen = [cut for cut in allowed if min(stages(size, cut)) == smallest]
    return list(min(chosen, key=lambda cut: cut[::-1]))


@pytest.mark.parametrize("negligible", [0.0, 0.01, 0.05, 0.1])
def test_fill_drain_balance_follows_the_rule_on_every_cut(negligible: float) -> None:
    rng = random.Random(2)
    differs = 0  # cases where the fill-drain cut is not the forward+backward one
    for _ in range(600):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        forward, backward = _random_costs(rng, n), _random_costs(rng, n)
        bounds = balance_fill_drain_bounds(forward, backward, k, negligible=negligible)
        assert bounds == _brute_force_fill_drain_choice(forward, backward, k, negligible), (forward, backward, k)
        differs += bounds != balance_bounds([f + b for f, b in zip(forward, backward)], k, negligible=negligible)
    assert differs > 0


def test_fill_drain_balance_with_proportional_phases_is_the_plain_balance() -> None:
    # When every block's backward is twice its forward, max F + max B is 3/2 of max(F + B): the
    # two rules rank the cuts alike.
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        forward = [float(rng.randint(0, 20)) for _ in range(n)]
        backward = [2 * f for f in forward]
        total = [f + b for f, b in zip(forward, backward)]
        assert balance_fill_drain_bounds(forward, backward, k) == balance_bounds(total, k)


# Milliseconds per micro-batch of ResNet-50's 50 blocks (128x128, micro-batch 8, one CPU thread),
# forward then backward, as a profile measured them: the early, high-resolution blocks spend
# relatively more in their forward (stem 18.2 / 6.8) than the late ones (layer4.2.conv3 4.0 / 8.2).
RESNET50_FORWARD_MS = [
    18.24, 1.8, 9.1, 6.59, 3.81, 3.78, 6.49, 3.89, 3.78, 6.35, 7.04, 8.36, 4.7, 3.24, 3.21, 4.56, 3.19, 3.18, 4.56,
    3.24, 3.23, 4.52, 5.91, 7.01, 3.74, 2.99, 3.06, 3.56, 2.9, 3.0, 3.58, 2.98, 3.09, 3.68, 3.0, 3.07, 3.64, 2.94,
    3.06, 3.65, 5.7, 8.36, 4.22, 3.67, 3.89, 4.17, 3.6, 3.89, 4.02, 1.1,
]  # fmt: skip
RESNET50_BACKWARD_MS = [
    6.77, 2.29, 14.23, 8.77, 7.46, 7.07, 8.7, 7.55, 7.04, 8.56, 13.28, 18.45, 6.66, 6.31, 5.84, 6.54, 6.22, 5.86,
    6.61, 6.33, 5.89, 6.65, 11.27, 14.72, 5.93, 6.32, 5.77, 5.78, 6.22, 5.9, 5.91, 6.48, 5.99, 6.03, 6.39, 6.01,
    5.97, 6.34, 5.88, 5.85, 12.12, 21.97, 8.18, 9.8, 7.87, 8.24, 9.79, 7.72, 8.16, 2.99,
]  # fmt: skip


def test_gpipe_cut_of_resnet50_balances_each_phase() -> None:
    model = build_model("resnet50", 10)
    names = [block.name for block in flatten_model(model)]
    forward, backward = RESNET50_FORWARD_MS, RESNET50_BACKWARD_MS
    total = [f + b for f, b in zip(forward, backward)]
    # Forward+backward balance cuts before layer3.0.conv2: 307 against 310 ms, but stage 0's
    # forward is the larger (123 against 102) and stage 1's backward (208 against 184), so GPipe's
    # step pays max F + max B = 331 ms per micro-batch beyond the first.
    plain = balance_bounds(total, 2)
    assert names[plain[1]] == "layer3.0.conv2"
    # One block later the two phases are nearer even: 130 + 199 = 329 (stage 1: 95 and 194).
    fill_drain = balance_fill_drain_bounds(forward, backward, 2)
    assert names[fill_drain[1]] == "layer3.0.conv3"

    def score(bounds: list[int], costs: list[float]) -> float:
        return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))

    assert round(score(plain, forward) + score(plain, backward), 1) == 331.1
    assert round(score(fill_drain, forward) + score(fill_drain, backward), 1) == 328.9


def test_rescaled_costs_sum_to_each_ranks_measured_seconds() -> None:
    costs = [1.0, 2.0, 3.0, 4.0, 0.0, 5.0]
    # 4 parts on 2 ranks (2 virtual stages each): rank 0 holds parts 0 and 2, rank 1 parts 1 and 3.
    bounds = [0, 1, 3, 4, 6]
    scaled = rescale_to_measured(costs, bounds, 2, [10.0, 6.0])
    # rank 0: blocks 0 and 3 (profiled 5), x2; rank 1: blocks 1, 2, 4, 5 (profiled 10), x0.6
    assert scaled == pytest.approx([2.0, 1.2, 1.8, 8.0, 0.0, 3.0], rel=1e-15)
    assert rescale_to_measured([0.0, 0.0, 2.0], [0, 2, 3], 2, [3.0, 1.0]) == [
        0.0,
        0.0,
        1.0,
    ]  # nothing to scale on rank 0


def test_a_cut_moves_blocks_off_the_stage_that_runs_slower_than_profiled() -> None:
    forward, backward = [1.0] * 10, [2.0] * 10
    bounds = balance_fill_drain_bounds(forward, backward, 2)
    assert bounds == [0, 5, 10]
    # Running, stage 1 took 40% longer than its profile said (stage 0 as profiled): the cut moves later.
    scaled_f = rescale_to_measured(forward, bounds, 2, [5.0, 7.0])
    scaled_b = rescale_to_measured(backward, bounds, 2, [10.0, 14.0])
    assert balance_fill_drain_bounds(scaled_f, scaled_b, 2) == [0, 6, 10]
    assert cut_score(scaled_f, scaled_b, [0, 6, 10], True) < cut_score(scaled_f, scaled_b, bounds, True)
    assert cut_score(forward, backward, bounds, True) == 15.0 and cut_score(forward, backward, bounds, False) == 15.0


@pytest.mark.parametrize(
    ("num_stages", "negligible", "message"),
    [
        (3, 0.01, "num_stages: 3 stages for 2 blocks; each stage needs at least one block"),
        (2, 1.0, "negligible: a share of the total cost in [0, 1), got 1.0"),
        (2, -0.1, "negligible: a share of the total cost in [0, 1), got -0.1"),
    ],
)
def test_balance_errors(num_stages: int, negligible: float, message: str) -> None:
    with pytest.raises(UsageError) as info:
        balance_bounds([1.0, 2.0], num_stages, negligible=negligible)
    assert str(info.value) == message
    with pytest.raises(UsageError) as info:
        balance_fill_drain_bounds([1.0, 2.0], [2.0, 1.0], num_stages, negligible=negligible)
    assert str(info.value) == message


def test_fill_drain_balance_needs_a_backward_per_forward() -> None:
    with pytest.raises(UsageError) as info:
        balance_fill_drain_bounds([1.0, 2.0], [1.0], 2)
    assert str(info.value) == "backward: 1 backward times for 2 forward times"


def test_params_balance_of_resnet18() -> None:
    model = build_model("resnet18", 10, in_channels=1, small_stem=True)
    blocks = flatten_model(model)
    names = [b.name for b in blocks]
    counts = block_parameter_counts(model, blocks)
    assert sum(counts) == sum(p.numel() for p in model.parameters())
    bounds = balance_bounds(counts, 2)
    plans = plan_stages(names, bounds, counts)
    # layer4 holds most of ResNet-18's parameters: its last block's two convs (2.36M each) and
    # the head against the rest
    assert [plan.blocks for plan in plans] == [tuple(names[:15]), ("layer4.1.conv1", "layer4.1.conv2", "head")]
    assert sum(plan.param_share for plan in plans) == pytest.approx(1.0)
    assert [plan.params for plan in plans] == [sum(counts[:15]), sum(counts[15:])]
    assert all(plan.seconds is None and plan.forward_seconds is None for plan in plans)
    # Over 4 stages: everything before layer4 (2.77M), layer4.0 (3.67M, the bottleneck), then each of layer4.1's
    # 3x3 convs (2.36M), the head (5,130 parameters) with the last.
    assert balance_bounds(counts, 4, negligible=0.0) == balance_bounds(counts, 4) == [0, 13, 15, 16, 18]


def test_plan_reports_seconds() -> None:
    plans = plan_stages(["a", "b", "c"], [0, 1, 3], [1, 1, 2], [0.5, 0.25, 0.25], [0.125, 0.0625, 0.125])
    assert [p.forward_seconds for p in plans] == [0.125, 0.1875]
    assert [(p.index, p.blocks, p.params, p.param_share, p.seconds) for p in plans] == [
        (0, ("a",), 1, 0.25, 0.5),
        (1, ("b", "c"), 3, 0.75, 0.5),
    ]


def test_profile_blocks_times_each_block_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seconds = profile_blocks(model, flatten_model(model), torch.randn(6, 8), repeats=2)
    assert len(seconds) == 3 and all(f > 0 and b > 0 for f, b in seconds)  # blocks 0, 1+2 and 3
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
