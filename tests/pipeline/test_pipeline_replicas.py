"""Data x pipeline parallelism: R replicas of an S-stage pipeline equal one process accumulating
gradients over all R x m micro-batches in batch order.

The pure layout, batch sharing, node choice and BatchNorm algebra are tested without Ray; then
real replicas over gloo (CPU) on the session's CPUs (4 where there is no GPU): ResNet-18 at 64x64 as in
``test_pipeline_trainer`` (whose single-process reference this reuses), float64 to 1e-10 and
float32's first step to 1e-5, plus deferred BatchNorm with clipping, bad input and a killed actor.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import ray
import torch
from test_pipeline_trainer import LRS, _accumulate, _assert_state_close, _batches, _model, _reference
from torch import nn

from raytrain_mp.errors import UsageError
from raytrain_mp.optim import build_optimizer
from raytrain_mp.pipeline import PipelineTrainer, StageFailedError, convert_deferred_batchnorm, split_batch
from raytrain_mp.pipeline.placement import check_resources
from raytrain_mp.pipeline.replicas import (
    check_replicas,
    global_rank,
    pipeline_ranks,
    replica_and_stage,
    replica_nodes,
    replica_shares,
    running_stats_weights,
    stage_ranks,
)

from helpers import kill_actor, session_cpus

# -- pure ------------------------------------------------------------------------------------------


def test_check_replicas() -> None:
    check_replicas(2, 20, 2)
    with pytest.raises(UsageError, match=r"^num_replicas: must be a whole number >= 1, got 0$"):
        check_replicas(0)
    with pytest.raises(UsageError) as info:
        check_replicas(3, 20, 2)
    assert str(info.value) == (
        "num_replicas: 3 replicas x 2 micro-batches do not divide a batch of 20 samples; "
        "torch's pipeline runtime needs micro-batches of equal size"
    )


def test_replica_microbatches_are_the_batch_microbatches_in_order() -> None:
    x, y = torch.arange(24.0).view(12, 2), torch.arange(12)
    shares = replica_shares(x, y, 3)
    ours = [mb for share_x, share_y in shares for mb in split_batch(share_x, share_y, 2)]
    for got, want in zip(ours, split_batch(x, y, 6), strict=True):
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.targets, want.targets)


def test_rank_layout_is_replica_major() -> None:
    assert [pipeline_ranks(r, 3) for r in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [stage_ranks(s, 2, 3) for s in range(3)] == [[0, 3], [1, 4], [2, 5]]
    assert [replica_and_stage(rank, 3) for rank in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(global_rank(*replica_and_stage(rank, 3), 3) == rank for rank in range(6))


def test_replica_nodes_spread_where_they_can() -> None:
    cpu = {"CPU": 1}
    two = {"a": {"CPU": 2}, "b": {"CPU": 2}}
    assert replica_nodes(two, 2, [cpu] * 2) == ["a", "b"]
    assert replica_nodes(two, 3, [cpu] * 2) == ["a", "b", None]
    assert replica_nodes({"big": {"CPU": 8}, "small": {"CPU": 2}}, 3, [cpu] * 2) == ["big", "small", "big"]
    assert replica_nodes({"gpu": {"CPU": 8, "GPU": 2}, "cpu": {"CPU": 8}}, 2, [{"CPU": 1, "GPU": 1}] * 2) == [
        "gpu",
        None,
    ]


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_weights_equal_sequential_updates(momentum: float | None) -> None:
    replicas, m, tracked = 3, 2, 5
    generator = torch.Generator().manual_seed(0)
    r0 = torch.randn(4, dtype=torch.float64, generator=generator)
    batches = [torch.randn(4, dtype=torch.float64, generator=generator) for _ in range(replicas * m)]

    def update(r: torch.Tensor, n: int, xs: list[torch.Tensor]) -> torch.Tensor:
        for x in xs:  # BatchNorm's update of a running statistic with one batch's statistic x
            n += 1
            factor = 1 / n if momentum is None else momentum
            r = (1 - factor) * r + factor * x
        return r

    merged = torch.zeros(4, dtype=torch.float64)
    for replica in range(replicas):
        a, w, keep = running_stats_weights(momentum, tracked, m, replicas, replica)
        merged += w * (update(r0, tracked, batches[replica * m : (replica + 1) * m]) - a * r0)
    torch.testing.assert_close(keep * r0 + merged, update(r0, tracked, batches), rtol=1e-14, atol=1e-14)


def test_resource_check_counts_every_replica() -> None:
    nodes = [{"CPU": 2}, {"CPU": 2}]
    check_resources(nodes, [{"CPU": 1}] * 2, "STRICT_PACK", num_replicas=2)
    with pytest.raises(UsageError) as info:
        check_resources(nodes, [{"CPU": 1}] * 2, "PACK", num_replicas=3)
    assert str(info.value) == "cpus_per_stage: 3 replicas x 2 stages need 6 CPU (1 each); the Ray cluster has 4"
    with pytest.raises(
        UsageError, match=r"^placement_strategy: STRICT_PACK needs a node per replica .* hold 1 of 2 replicas"
    ):
        check_resources([{"CPU": 3}, {"CPU": 1}], [{"CPU": 1}] * 2, "STRICT_PACK", num_replicas=2)


# -- on Ray ------------------------------------------------------------------------------------------

BATCH = 20  # R x m = 4 and 2 both cut it into equal micro-batches


class TestReplicasAgainstGradientAccumulation:
    """One trainer per (dtype, replicas, stages, m), class-scoped so that its CPUs are free afterwards."""

    @pytest.fixture(
        scope="class",
        params=[(torch.float64, 2, 2, 2), (torch.float64, 2, 1, 1), (torch.float32, 2, 2, 2)],
        ids=["f64-R2xS2", "f64-R2xS1-data-parallel", "f32-R2xS2"],
    )
    def trainer(self, request: pytest.FixtureRequest, ray_session: object) -> Iterator[PipelineTrainer]:
        dtype, replicas, stages, m = request.param
        trainer = PipelineTrainer(
            _model(dtype),
            stages,
            num_replicas=replicas,
            num_microbatches=m,
            lr=LRS[0],
            momentum=0.9,
            weight_decay=0.0,
            use_gpu=False,
            memory_format="channels_last",  # a layout the reference can compute in too
        )
        trainer.dtype = dtype
        yield trainer
        trainer.shutdown()

    def test_steps_equal_gradient_accumulation_and_replicas_stay_equal(self, trainer: PipelineTrainer) -> None:
        float64 = trainer.dtype == torch.float64
        steps = 3 if float64 else 1  # float32 BatchNorm ResNets are chaotic beyond the first step
        losses = []
        for (x, y), lr in zip(_batches(trainer.dtype, steps), LRS):
            trainer.set_lr(lr)
            losses.append(trainer.train_step(x, y))
            # The cheap check that the replicas hold the same model: bit for bit after every step.
            first, second = trainer.state_dict(0), trainer.state_dict(1)
            assert all(torch.equal(first[key], second[key]) for key in first)
        # The reference: one process, the whole batch in R x m micro-batches.
        # (computed as the stages compute: channels-last)
        want_losses, want_state = _reference(
            trainer.dtype, trainer.num_replicas * trainer.num_microbatches, steps, True
        )
        rtol = 1e-10 if float64 else 1e-5
        assert losses == pytest.approx(want_losses, rel=rtol)
        _assert_state_close(trainer.state_dict(), want_state, rtol)
        # Where every actor landed (one per replica and stage), and a prediction through replica 0.
        assert len(trainer.nodes) == trainer.num_replicas * trainer.num_stages
        plain = _model(trainer.dtype)
        plain.load_state_dict(trainer.state_dict(), strict=True)
        torch.testing.assert_close(trainer.predict(x), plain.eval()(x))
        stats = trainer.stats()
        assert len(stats.busy_seconds) == trainer.num_replicas * trainer.num_stages


def test_deferred_bn_and_clipping_over_replicas(ray_session: object) -> None:
    """Deferred BatchNorm commits the statistics of one pass over the whole global batch (both
    replicas' shares), and clipping takes the norm of the averaged gradients over all stages."""
    model = _model(torch.float64)
    batches = _batches(torch.float64, 2)
    clip = 0.5
    with PipelineTrainer(
        model,
        2,
        num_replicas=2,
        num_microbatches=2,
        deferred_bn=True,
        clip_grad_norm=clip,
        lr=LRS[0],
        momentum=0.9,
        weight_decay=0.0,
        use_gpu=False,
    ) as pipeline:
        losses = [pipeline.train_step(*batches[0])]
        whole = copy.deepcopy(model.bn1)
        whole(model.conv1(batches[0][0]))
        after_one = pipeline.state_dict(1)
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(after_one[f"bn1.{key}"], getattr(whole, key), rtol=1e-12, atol=1e-12)
        losses.append(pipeline.train_step(*batches[1]))
        state = pipeline.state_dict()
    reference = convert_deferred_batchnorm(copy.deepcopy(model))
    optimizer = build_optimizer(reference.parameters(), "sgd", LRS[0], 0.9, 0.0)
    want = [_accumulate(reference, optimizer, x, y, 4, clip=clip) for x, y in batches]
    assert losses == pytest.approx(want, rel=1e-10)
    _assert_state_close(state, reference.state_dict(), 1e-10)


def _tiny() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), torch.randn(8, 4), torch.randint(0, 3, (8,))


def test_interleaved_replicas_on_an_mlp(ray_session: object) -> None:
    """Replicas of an interleaved pipeline (2 stages x 2 virtual stages each): the schedule's
    point-to-point traffic stays inside each replica's group."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)
    )
    model = model.double()
    generator = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(16, 4, generator=generator, dtype=torch.float64), torch.randint(0, 3, (16,), generator=generator))
        for _ in range(2)
    ]
    with PipelineTrainer(
        model,
        2,
        num_replicas=2,
        num_microbatches=4,
        schedule="interleaved-1f1b",
        virtual_stages=2,
        lr=0.1,
        momentum=0.9,
        weight_decay=0.0,
        use_gpu=False,
    ) as pipeline:
        losses = [pipeline.train_step(x, y) for x, y in batches]
        state = pipeline.state_dict(1)
    reference = copy.deepcopy(model)
    optimizer = build_optimizer(reference.parameters(), "sgd", 0.1, 0.9, 0.0)
    want = [_accumulate(reference, optimizer, x, y, 8) for x, y in batches]
    assert losses == pytest.approx(want, rel=1e-12)
    _assert_state_close(state, reference.state_dict(), 1e-12)


def test_bad_replicas_fail_before_any_actor(ray_session: object) -> None:
    model, _, _ = _tiny()
    actors_before = len(ray.util.list_named_actors(all_namespaces=True)), len(ray.util.placement_group_table())
    with pytest.raises(UsageError, match=r"^num_replicas: must be a whole number >= 1, got 0$"):
        PipelineTrainer(model, 2, num_replicas=0)
    cpus = session_cpus()
    replicas = cpus // 2 + 1  # of 2 stages: one replica more than the session's CPUs hold
    with pytest.raises(UsageError) as info:
        PipelineTrainer(model, 2, num_replicas=replicas, use_gpu=False)
    assert (
        str(info.value)
        == f"cpus_per_stage: {replicas} replicas x 2 stages need {2 * replicas} CPU (1 each); the Ray cluster has "
        f"{cpus}"
    )
    assert (
        len(ray.util.list_named_actors(all_namespaces=True)),
        len(ray.util.placement_group_table()),
    ) == actors_before


def test_a_killed_actor_of_replica_1_is_named(ray_session: object) -> None:
    model, x, y = _tiny()
    with PipelineTrainer(model, 2, num_replicas=2, num_microbatches=2, use_gpu=False) as pipeline:
        with pytest.raises(UsageError, match=r"^num_replicas: 2 replicas x 2 micro-batches do not divide a batch of 6"):
            pipeline.train_step(x[:6], y[:6])  # refused before any call: the next step still runs
        pipeline.train_step(x, y)
        kill_actor(pipeline.actor(0, replica=1))
        with pytest.raises(StageFailedError) as info:
            pipeline.train_step(x, y)
    assert (info.value.stage, info.value.replica, info.value.step) == (0, 1, 2)
    assert str(info.value).startswith("pipeline stage 0 of replica 1 (of stages 0-1) failed at step 2: its actor died")
