"""PipelineTrainer on real Ray stage actors over gloo (CPU): equivalence with single-process
gradient accumulation for every schedule (and for one registered by a test alone: adding a schedule
is one registry entry), deferred BatchNorm, state dicts, failures (a raising,
a killed and a hanging rank), and bad input.

ResNet-18 (standard stem) at 64x64, a batch of 20 so that m = 4 and m = 5 both cut it into equal
micro-batches (torch's runtime needs them equal); layer4 then sees 2x2 maps of 4-5 samples.
Trainers are created sparingly (start-up dominates on 2 cores): one per (dtype, ranks, virtual
stages), reused across schedules and micro-batch counts through load_state_dict and set_schedule.
"""

from __future__ import annotations

import copy
import os
import platform
import resource
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

import pytest
import ray
import torch
import torch.nn.functional as F
from tiny_models import TinyNet
from torch import nn

from raytrain_mp.errors import UsageError
from raytrain_mp.faults import ABRUPT
from raytrain_mp.models import build_model
from raytrain_mp.optim import build_optimizer
from raytrain_mp.pipeline import PipelineTrainer, StageFailedError, convert_deferred_batchnorm, split_batch
from raytrain_mp.pipeline import failures as failures_module
from raytrain_mp.pipeline import placement as placement_module
from raytrain_mp.pipeline import trials as trials_module
from raytrain_mp.pipeline.blocks import flatten_model
from raytrain_mp.pipeline.deferred_bn import commit_deferred_batchnorm
from raytrain_mp.pipeline.partition import balance_bounds, cut_score, rescale_to_measured, split_bounds
from raytrain_mp.pipeline.placement import check_resources
from raytrain_mp.pipeline.schedule import SCHEDULES, Schedule
from raytrain_mp.pipeline.stage import StageWorker

from helpers import kill_actor, session_cpus, session_gpus

BATCH, SIZE = 20, 64
# by virtual stages: gpipe and 1f1b; interleaved-1f1b and interleaved-zb
SCHEDULES_OF = {v: tuple(name for name, entry in SCHEDULES.items() if entry.multi_stage == (v > 1)) for v in (1, 2)}
CASES = [(schedule, m) for schedule in (*SCHEDULES_OF[1], *SCHEDULES_OF[2]) for m in (4, 5)]
LRS = [0.05, 0.03, 0.02]  # set per step, as a learning-rate schedule would
OVER_HALF = session_cpus() // 2 + 1  # CPUs per stage that 2 stages cannot get on the session's Ray


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return build_model("resnet18", 10, in_channels=1, small_stem=False).to(dtype).train()


def _batches(dtype: torch.dtype, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 1, SIZE, SIZE, generator=generator, dtype=dtype),
            torch.randint(0, 10, (BATCH,), generator=generator),
        )
        for _ in range(steps)
    ]


def _accumulate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    clip: float | None = None,
    label_smoothing: float = 0.0,
) -> float:
    """The single-process reference step: losses weighted by micro-batch share, one update."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for mb in split_batch(x, y, m):
        loss = F.cross_entropy(model(mb.inputs), mb.targets, label_smoothing=label_smoothing) * mb.weight
        loss.backward()
        total += loss.item()
    if clip is not None:
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip  # the clip acts
    commit_deferred_batchnorm(model)
    optimizer.step()
    return total


@cache  # the same for every stage count and schedule
def _reference(
    dtype: torch.dtype, m: int, steps: int, channels_last: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``channels_last``: the model and batches in that layout, on one thread, as the stages compute
    under ``memory_format="channels_last"``.
    In float32 the layouts' kernels round differently (conv1.weight 7.6e-5 apart after one step of
    ResNet-18 at 64x64 here), and channels-last ones also by thread count (4.2e-5 between 1 and 2
    threads, 3.5e-8 for contiguous ones), so a float32 pipeline is held to the reference computed
    as its stages compute."""
    model = _model(dtype)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=LRS[0], momentum=0.9)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a stage's threads (cpus_per_stage)
    try:
        for (x, y), lr in zip(_batches(dtype, steps), LRS):
            for group in optimizer.param_groups:
                group["lr"] = lr
            losses.append(_accumulate(model, optimizer, x.contiguous(memory_format=layout), y, m))
    finally:
        torch.set_num_threads(threads)
    return losses, model.state_dict()


def _assert_state_close(got: dict, want: dict, rtol: float) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        scale = value.double().abs().max().clamp(min=1.0)
        error = (got[key].double() - value.double()).abs().max()
        assert error <= rtol * scale, f"{key}: {error.item():.3g} off"


def _receives_posted_ahead(trainer: PipelineTrainer) -> list[int]:
    return ray.get([trainer.actor(rank).receives_posted_ahead.remote() for rank in range(trainer.num_stages)])


def _split_backwards(trainer: PipelineTrainer) -> list[int]:
    return ray.get([trainer.actor(rank).split_backwards.remote() for rank in range(trainer.num_stages)])


@dataclass
class Pipeline:
    trainer: PipelineTrainer
    dtype: torch.dtype
    memory_format: str
    initial_state: dict
    initial_optimizer_states: list


@pytest.fixture
def looped_bfs(monkeypatch: pytest.MonkeyPatch) -> Schedule:
    """A schedule the package does not register: torch's looped BFS (backwards in reverse order)."""
    entry = Schedule("looped-bfs", "looped BFS", "ScheduleLoopedBFS", multi_stage=True)
    monkeypatch.setitem(SCHEDULES, entry.name, entry)
    return entry


def _check_against_accumulation(pipeline: Pipeline, schedule: str, m: int) -> None:
    """``schedule`` over m micro-batches from the initial state against ``_reference``, and the
    receives posted ahead and backwards split that its entry asks for."""
    trainer = pipeline.trainer
    entry = SCHEDULES[schedule]
    float64 = pipeline.dtype == torch.float64
    steps = 3 if float64 else 1  # float32 BatchNorm ResNets are chaotic beyond the first step
    trainer.load_state_dict(pipeline.initial_state)
    trainer.load_optimizer_state_dicts(pipeline.initial_optimizer_states)
    trainer.set_schedule(schedule, m)
    posted_before, split_before = _receives_posted_ahead(trainer), _split_backwards(trainer)
    batches = list(zip(_batches(pipeline.dtype, steps), LRS))
    if m == 5:  # the run loop's way: steps and their lrs 2 to a call (then 1), the second call queued
        losses = list(trainer.train_steps(((x, y, lr) for (x, y), lr in batches), ahead=1, steps_per_call=2))
    else:  # a step at a time, the lr set by its own call
        losses = []
        for (x, y), lr in batches:
            trainer.set_lr(lr)
            losses.append(trainer.train_step(x, y))
    want_losses, want_state = _reference(pipeline.dtype, m, steps, pipeline.memory_format == "channels_last")
    rtol = 1e-10 if float64 else 1e-5
    assert losses == pytest.approx(want_losses, rel=rtol)
    _assert_state_close(trainer.state_dict(), want_state, rtol)
    # The steps after a schedule's first post their receives ahead (GPipe: activations and
    # gradients; 1F1B: gradients), so the equality above covers them too.
    ranks = range(trainer.num_stages)
    ahead = [(direction in entry.post_ahead) for direction in ("forward", "backward")]
    per_step = [m * ((ahead[0] and rank > 0) + (ahead[1] and rank < trainer.num_stages - 1)) for rank in ranks]
    posted = [after - before for before, after in zip(posted_before, _receives_posted_ahead(trainer))]
    assert posted == [(steps - 1) * count for count in per_step]
    # GPipe and 1F1B split the last backward of every rank but the first, every step.
    split = [after - before for before, after in zip(split_before, _split_backwards(trainer))]
    assert split == [steps * (entry.split_last_backward and rank > 0) for rank in ranks]
    # Each stage computed in a layout; the configured one, or under auto the one measured faster.
    layouts = trainer.memory_formats
    assert [len(rank) for rank in layouts] == [trainer.virtual_stages] * trainer.num_stages
    if pipeline.memory_format == "auto":
        assert {layout for rank in layouts for layout in rank} <= {"channels_last", "contiguous"}
    else:
        assert layouts == [[pipeline.memory_format] * trainer.virtual_stages] * trainer.num_stages


class TestAgainstGradientAccumulation:
    """One trainer per (dtype, ranks, virtual stages), class-scoped so that its CPUs are free afterwards."""

    @pytest.fixture(
        scope="class",
        params=[
            (torch.float64, 2, 1),
            (torch.float64, 3, 1),
            (torch.float64, 2, 2),
            (torch.float64, 3, 2),
            (torch.float32, 2, 1),
            (torch.float32, 3, 2),
        ],
        ids=["f64-2ranks", "f64-3ranks", "f64-2ranks-v2", "f64-3ranks-v2", "f32-2ranks", "f32-3ranks-v2"],
    )
    def pipeline(self, request: pytest.FixtureRequest, ray_session: object) -> Iterator[Pipeline]:
        dtype, num_stages, virtual = request.param
        memory_format = {torch.float32: "channels_last", torch.float64: "auto"}[dtype]
        memory_format = "contiguous" if (dtype, num_stages, virtual) == (torch.float64, 3, 1) else memory_format
        # float32 runs use split points by name (the layer3 split for 2 stages); float64 runs the
        # default parameter balance, whose cuts fall inside residual blocks (test_plan_and_stats).
        # Layouts: float32 channels-last, so that the reference can compute as the stages do;
        # float64 measured per stage (the default), but contiguous on f64-3ranks.
        split = {(2, 1): ["layer3"], (3, 2): ["layer1.1", "layer2.0", "layer2.1", "layer3.1", "layer4.0"]}
        trainer = PipelineTrainer(
            _model(dtype),
            num_stages,
            split_points=split[num_stages, virtual] if dtype == torch.float32 else None,
            schedule=SCHEDULES_OF[virtual][0],
            virtual_stages=virtual,
            lr=LRS[0],
            momentum=0.9,
            weight_decay=0.0,
            use_gpu=False,
            memory_format=memory_format,
        )
        yield Pipeline(trainer, dtype, memory_format, trainer.state_dict(), trainer.optimizer_state_dicts())
        trainer.shutdown()

    @pytest.mark.parametrize(("schedule", "m"), CASES)
    def test_step_equals_gradient_accumulation(self, pipeline: Pipeline, schedule: str, m: int) -> None:
        if schedule not in SCHEDULES_OF[pipeline.trainer.virtual_stages]:
            pytest.skip(f"{schedule} runs on the trainers with another number of virtual stages")
        if (schedule, m, pipeline.trainer.num_stages) in {("interleaved-1f1b", 5, 2), ("interleaved-zb", 5, 2)}:
            with pytest.raises(UsageError, match="so m must be a multiple of 2, got 5"):
                pipeline.trainer.set_schedule(schedule, m)  # torch's interleaved schedules cannot run this
            return
        _check_against_accumulation(pipeline, schedule, m)

    def test_a_schedule_registered_by_one_entry_trains_the_same(self, pipeline: Pipeline, looped_bfs: Schedule) -> None:
        """Registered in this process only: the entry itself reaches the actors in the trainer's calls."""
        if pipeline.trainer.virtual_stages == 1:
            pytest.skip(f"{looped_bfs.name} runs several stages per rank")
        schedule, m = pipeline.trainer.schedule, pipeline.trainer.num_microbatches
        try:
            _check_against_accumulation(pipeline, looped_bfs.name, 4)
        finally:  # the entry goes with this test: the trainer's next tests run a registered schedule
            pipeline.trainer.set_schedule(schedule, m)

    def test_state_dict_loads_into_torchvision_and_predictions_match(self, pipeline: Pipeline) -> None:
        x, _ = _batches(pipeline.dtype, 1)[0]
        plain = _model(pipeline.dtype)
        plain.load_state_dict(pipeline.trainer.state_dict(), strict=True)
        torch.testing.assert_close(pipeline.trainer.predict(x), plain.eval()(x))
        assert pipeline.trainer.predict(x[:1]).shape == (1, 10)  # fewer samples than micro-batches

    def test_plan_and_stats(self, pipeline: Pipeline) -> None:
        trainer = pipeline.trainer
        plans = trainer.plan
        assert [p.index for p in plans] == list(range(trainer.num_stages * trainer.virtual_stages))
        assert sum(p.param_share for p in plans) == pytest.approx(1.0)
        if pipeline.dtype == torch.float32:
            assert plans[1].blocks[0] == {2: "layer3.0.conv1", 3: "layer1.1.conv1"}[trainer.num_stages]
        else:
            # The parameter balance cuts inside residual blocks (before a conv2) on 3 ranks and on
            # 2 x 2 and 3 x 2 parts, so the equivalence covers stages that send packed pairs:
            # layer4.0.conv2 receives (main path, downsampled identity), layer4.1.conv2 (main path, identity).
            assert [p.blocks[0] for p in plans[1:]] == {
                (2, 1): ["layer4.1.conv1"],
                (3, 1): ["layer4.0.conv2", "layer4.1.conv2"],
                (2, 2): ["layer4.0.conv1", "layer4.1.conv1", "layer4.1.conv2"],
                (3, 2): ["layer3.1.conv1", "layer4.0.conv1", "layer4.0.conv2", "layer4.1.conv1", "layer4.1.conv2"],
            }[trainer.num_stages, trainer.virtual_stages]
        x, y = _batches(pipeline.dtype, 1)[0]
        trainer.stats()
        trainer.train_step(x, y)
        stats = trainer.stats()
        assert stats.steps == 1 and len(stats.busy_seconds) == trainer.num_stages
        assert all(seconds > 0 for seconds in stats.busy_seconds)
        assert all(0 < forward < busy for forward, busy in zip(stats.forward_busy_seconds, stats.busy_seconds))
        assert stats.bubble_fraction < 1
        assert trainer.stats().steps == 0
        done = trainer.steps_done
        queued = trainer.train_steps(((x, y, None) for _ in range(3)), ahead=2)
        assert next(queued) > 0 and trainer.steps_done == done + 1
        queued.close()  # the two steps queued behind the first still run, and count
        assert trainer.steps_done == done + 3 and trainer.stats().steps == 3

    def test_ranks_run_at_torchruns_niceness_and_keep_freed_memory(self, pipeline: Pipeline) -> None:
        # Ray starts workers at 15; root (CAP_SYS_NICE) may lower it, anyone else keeps it.
        allowed = os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
        assert pipeline.trainer.niceness == [0 if allowed else 15] * pipeline.trainer.num_stages
        # and, on glibc, keep the memory a step frees for the next (allocator.keep_freed_memory)
        assert pipeline.trainer.keeps_freed_memory == [platform.libc_ver()[0] == "glibc"] * pipeline.trainer.num_stages


def test_deferred_bn_time_balance_trials_adamw_and_clipping(ray_session: object) -> None:
    model = _model(torch.float64)
    batches = _batches(torch.float64, 2)
    options = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01, "norm_weight_decay": 0.05, "clip_grad_norm": 0.5}
    # The zero-bubble schedule splits each backward into input and weight gradients: the clipping
    # and the deferred statistics must not care. The profile's cut first runs on the actors for a
    # step, and the cut of the profile rescaled to what the ranks measured then, while it is new.
    with PipelineTrainer(
        model,
        2,
        balance="time",
        sample_input=batches[0][0],
        deferred_bn=True,
        num_microbatches=4,
        schedule="interleaved-zb",
        virtual_stages=2,
        use_gpu=False,
        balance_trials=1,
        **options,
    ) as pipeline:
        assert all(plan.seconds > plan.forward_seconds > 0 for plan in pipeline.plan)
        names = [block.name for block in flatten_model(model)]
        forward, backward = (list(phase) for phase in zip(*pipeline.profile))
        trials = pipeline.balance_trials
        cuts = [split_bounds(names, trial.split_points, 4) for trial in trials]
        assert cuts[0] == balance_bounds([f + b for f, b in zip(forward, backward)], 4)
        assert len(trials) in range(1, trials_module.TRIAL_CUTS + 1) and len(set(map(tuple, cuts))) == len(cuts)
        for index, (trial, cut) in enumerate(zip(trials, cuts)):
            assert trial.profile_score == cut_score(forward, backward, cut, False)
            assert all(seconds > 0 for seconds in trial.forward_seconds + trial.backward_seconds)
            assert trial.seconds_per_step > 0 and 0 <= trial.bubble_fraction < 1
            rescaled = [
                rescale_to_measured(costs, cut, 2, getattr(trial, key))
                for costs, key in ((forward, "forward_seconds"), (backward, "backward_seconds"))
            ]
            following = balance_bounds([f + b for f, b in zip(*rescaled)], 4)
            if index + 1 < len(cuts):
                assert following == cuts[index + 1]
            else:  # the trials stop at a cut already run, or after TRIAL_CUTS
                assert following in cuts or len(cuts) == trials_module.TRIAL_CUTS
        fastest = min(trials, key=lambda trial: trial.bubble_fraction)
        assert [plan.blocks[0] for plan in pipeline.plan[1:]] == fastest.split_points
        # The trial steps ran on stages that are gone: the steps below start from the model as given.
        assert pipeline.steps_done == 0 and pipeline.stats().steps == 0
        losses = [pipeline.train_step(x, y) for x, y in batches[:1]]
        # The stem's BatchNorm saw conv1(x) in 4 micro-batches; its running statistics are those
        # of one BatchNorm pass over the whole batch.
        whole = copy.deepcopy(model.bn1)
        whole(model.conv1(batches[0][0]))
        after_one = pipeline.state_dict()
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(after_one[f"bn1.{key}"], getattr(whole, key), rtol=1e-12, atol=1e-12)
        losses += [pipeline.train_step(x, y) for x, y in batches[1:]]
        state = pipeline.state_dict()

    reference = convert_deferred_batchnorm(copy.deepcopy(model))
    decays = {name: options[name] for name in ("weight_decay", "norm_weight_decay")}
    optimizer = build_optimizer(reference.parameters(), "adamw", options["lr"], 0.0, **decays)
    want = [_accumulate(reference, optimizer, x, y, 4, clip=options["clip_grad_norm"]) for x, y in batches]
    assert losses == pytest.approx(want, rel=1e-10)
    _assert_state_close(state, reference.state_dict(), 1e-10)


def _tiny() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.randn(6, 4), torch.randint(0, 3, (6,))


def _assert_stopped(pipeline: PipelineTrainer, model: nn.Module, x: torch.Tensor, y: torch.Tensor, why: str) -> None:
    """Every use that needs the stages says, in one line, that they were stopped and why."""
    uses = [
        lambda: pipeline.train_step(x, y),
        lambda: pipeline.predict(x),
        pipeline.state_dict,
        pipeline.optimizer_state_dicts,
        lambda: pipeline.set_lr(0.1),
        lambda: pipeline.actor(0),
        lambda: pipeline.load_state_dict(model.state_dict()),
    ]
    for use in uses:
        with pytest.raises(RuntimeError) as info:
            use()
        assert str(info.value) == f"PipelineTrainer: used after {why}; build a new PipelineTrainer"
    pipeline.shutdown()  # safe to call again


def test_compiled_stages_equal_gradient_accumulation(ray_session: object, compile_cache: str) -> None:
    """compile=True: each stage compiled in its actor, channels-last inside its contiguous edges
    (``memory_format.layout_runner``: a compiled stage's input gradient once left non-contiguous
    and the send refused it), trains as the single-process accumulation does, in float64 to the
    eager stages' 1e-10: compiling reorders floating point sums inside fused kernels, nothing
    else. A small network (``tiny_models``, cut across its skip connection): compiling ResNet-18's
    stages takes minutes here; auto's compiled trial is ddp's test's."""
    torch.manual_seed(0)
    model = TinyNet(10, 1).double()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LRS[0], momentum=0.9)
    batches = _batches(torch.float64, 3)
    options = {"lr": LRS[0], "momentum": 0.9, "weight_decay": 0.0, "use_gpu": False, "schedule": "1f1b"}
    compiled = {"memory_format": "channels_last", "compile": True, "compile_cache": compile_cache}
    with PipelineTrainer(model, 2, sample_input=batches[0][0], **compiled, **options) as pipeline:
        losses, want = [], []
        for (x, y), lr in zip(batches, LRS):
            pipeline.set_lr(lr)
            losses.append(pipeline.train_step(x, y))
            for group in optimizer.param_groups:
                group["lr"] = lr
            want.append(_accumulate(reference, optimizer, x, y, 4))
        assert losses == pytest.approx(want, rel=1e-10)
        _assert_state_close(pipeline.state_dict(), reference.state_dict(), 1e-10)
        assert pipeline.memory_formats == [["channels_last"], ["channels_last"]]


def test_bf16_step_then_a_raising_stage_is_named_and_every_stage_stopped(ray_session: object) -> None:
    model, x, y = _tiny()
    # One trainer for both (start-up dominates): a plain nn.Sequential under bf16 autocast ...
    pipeline = PipelineTrainer(model, 2, num_microbatches=2, autocast_bf16=True, use_gpu=False)
    assert pipeline.train_step(x, y) == pytest.approx(F.cross_entropy(model(x), y).item(), rel=3e-2)
    # ... then bad batches, refused before any call ...
    with pytest.raises(UsageError, match="need a batch of at least 2 samples, got 1"):
        pipeline.train_step(x[:1], y[:1])
    with pytest.raises(UsageError) as info:
        pipeline.train_step(x[:5], y[:5])
    assert str(info.value) == (
        "num_microbatches: 2 micro-batches do not divide a batch of 5 samples; "
        "torch's pipeline runtime needs micro-batches of equal size"
    )
    # ... and a stage that raises while its peer waits for its gradients.
    with pytest.raises(StageFailedError) as info:
        pipeline.train_step(x, torch.full((6,), 7))  # class 7 of 3: cross-entropy raises on the last stage
    assert (info.value.stage, info.value.step) == (1, 2)
    assert str(info.value).startswith("pipeline stage 1 (of stages 0-1) failed at step 2: ")
    assert "out of bounds" in str(info.value)
    _assert_stopped(pipeline, model, x, y, "a failure of stage 1, after which it stopped every stage actor")


def test_a_killed_stage_is_named(ray_session: object) -> None:
    model, x, y = _tiny()
    with PipelineTrainer(model, 2, num_microbatches=2, use_gpu=False) as pipeline:
        pipeline.train_step(x, y)
        kill_actor(pipeline.actor(0))
        with pytest.raises(StageFailedError) as info:
            pipeline.train_step(x, y)
    assert (info.value.stage, info.value.step) == (0, 2)
    assert str(info.value) == ("pipeline stage 0 (of stages 0-1) failed at step 2: its actor died: killed by ray.kill")
    _assert_stopped(pipeline, model, x, y, "a failure of stage 0, after which it stopped every stage actor")


def _stage_1_hangs_in_step_2(prepare_stage_0: Callable[[StageWorker], None] | None = None) -> StageFailedError:
    """The error of a 2-stage pipeline's second step, in which stage 1 stops answering (SIGSTOP:
    alive, silent), stage 0 first changed by ``prepare_stage_0``; it must name stage 1 at step 2."""
    model, x, y = _tiny()
    with PipelineTrainer(model, 2, num_microbatches=2, p2p_timeout_s=3, use_gpu=False) as pipeline:
        pipeline.train_step(x, y)
        if prepare_stage_0 is not None:
            ray.get(pipeline.actor(0).__ray_call__.remote(prepare_stage_0))
        pid = ray.get(pipeline.actor(1).__ray_call__.remote(lambda worker: os.getpid()))
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(StageFailedError) as info:
            pipeline.train_step(x, y)
    assert (info.value.stage, info.value.step) == (1, 2)
    return info.value


def test_a_hanging_stage_is_named_after_its_peer_times_out(ray_session: object) -> None:
    assert str(_stage_1_hangs_in_step_2()).startswith(
        "pipeline stage 1 (of stages 0-1) failed at step 2: TimeoutError: it stopped answering; "
        "stage 0 gave up waiting for it: "
    )


def test_a_hanging_stage_is_named_when_its_peer_aborts_as_on_nccl(
    ray_session: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(failures_module, "_WATCHDOG_DUMP_S", 0.0)  # this abort waits for no debug dump
    monkeypatch.setattr(failures_module, "_FAILURE_GRACE_S", 1.0)  # stage 1 never answers: no race to wait out

    # Stage 0 ends its process where its step raises (a timed-out receive among the causes), as NCCL's
    # watchdog does where gloo raises. Defined here, not at module level, so that Ray ships it by value.
    def abort_when_a_step_fails(worker: StageWorker) -> None:
        step = worker.train_step

        def train_step(*args: object, **kwargs: object) -> tuple[float | None, float, float, float]:
            try:
                return step(*args, **kwargs)
            except RuntimeError:
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file where the worker runs
                os.abort()

        worker.train_step = train_step  # train_steps calls it through the instance

    message = str(_stage_1_hangs_in_step_2(abort_when_a_step_fails))
    assert message.startswith(
        "pipeline stage 1 (of stages 0-1) failed at step 2: TimeoutError: it stopped answering; "
        "stage 0 gave up waiting for it: its actor died: "
    )
    assert message.endswith(ABRUPT)  # stage 0 aborted, it did not raise


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_stages": 19}, "num_stages: 19 stages for 18 blocks; each stage needs at least one block"),
        (
            {"split_points": ["layer9"]},
            "split_points: 'layer9' names no block; blocks: stem, "
            + ", ".join(f"layer{i}.{j}.conv{k}" for i in range(1, 5) for j in range(2) for k in (1, 2))
            + ", head",
        ),
        (
            {"num_stages": 3, "split_points": ["layer4", "layer2"]},
            "split_points: 'layer2' does not come after 'layer4.0.conv1'; give split points in model order",
        ),
        ({"num_microbatches": 0}, "num_microbatches: need at least 1 micro-batch, got 0"),
        (
            {"num_stages": 3, "schedule": "1f1b", "num_microbatches": 2},
            "num_microbatches: 1F1B over 3 stages needs at least 3 micro-batches, got 2; "
            "use more micro-batches or the gpipe schedule",
        ),
        ({"optimizer": "lamb"}, "optimizer: unknown optimizer 'lamb'; accepted: sgd, adamw"),
        ({"lr": 0}, "lr: must be > 0, got 0"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm: must be > 0, got -1.0"),
        ({"split_points": ["layer3"], "balance": "params"}, "split_points, balance: give one of them, not both"),
        ({"balance": "flops"}, "balance: unknown mode 'flops'; accepted: time, params"),
        ({"balance": "time"}, "balance: 'time' needs sample_input, a batch like the training batches, to profile on"),
        (
            {"balance": "time", "sample_input": torch.zeros(3, 1, 8, 8)},
            "num_microbatches: 4 micro-batches need a batch of at least 4 samples, got 3",
        ),
        ({"balance_trials": -1}, "balance_trials: a whole number of steps >= 0, got -1"),
        (
            {"balance_trials": 2},
            "balance_trials: tries the cuts of balance='time' on running stages; the cut here is params",
        ),
        (
            {"split_points": ["layer3"], "balance_trials": 2},
            "balance_trials: tries the cuts of balance='time' on running stages; the cut here is split_points",
        ),
        (
            {"balance": "time", "sample_input": torch.zeros(6, 1, 8, 8), "balance_trials": 1},
            "num_microbatches: 4 micro-batches do not divide a batch of 6 samples; torch's pipeline runtime needs "
            "micro-batches of equal size",
        ),
        ({"schedule": "interleaved-1f1b"}, "virtual_stages: interleaved-1f1b needs at least 2 stages per rank, got 1"),
        ({"virtual_stages": 0}, "virtual_stages: must be >= 1, got 0"),
        ({"p2p_timeout_s": 0}, "p2p_timeout_s: must be > 0 seconds, got 0"),
        ({"memory_format": "nhwc"}, "memory_format: unknown layout 'nhwc'; accepted: auto, channels_last, contiguous"),
        (
            {"compile": True, "compile_mode": "fast"},
            "compile_mode: unknown mode 'fast'; accepted: default, reduce-overhead, max-autotune",
        ),
        ({"cpus_per_stage": 0}, "cpus_per_stage: must be a whole number >= 1, got 0"),
        (
            {"cpus_per_stage": OVER_HALF},
            f"cpus_per_stage: 2 stages need {2 * OVER_HALF} CPU ({OVER_HALF} each); the Ray cluster has "
            f"{session_cpus()}",
        ),
        (
            {"placement_strategy": "RANDOM"},
            "placement_strategy: unknown strategy 'RANDOM'; accepted: STRICT_PACK, PACK, SPREAD, STRICT_SPREAD",
        ),
    ],
)
def test_bad_input_fails_before_any_actor(
    ray_session: object, monkeypatch: pytest.MonkeyPatch, kwargs: dict, message: str
) -> None:
    def no_placement(*args: object, **kw: object) -> None:
        raise AssertionError("a placement group was requested before validation finished")

    monkeypatch.setattr(placement_module, "placement_group", no_placement)
    kwargs = {"num_stages": 2, **kwargs}
    with pytest.raises(UsageError) as info:
        PipelineTrainer(build_model("resnet18", 10, in_channels=1, small_stem=True), **kwargs)
    assert str(info.value) == message


def test_more_stages_than_gpus_fails_before_any_actor(ray_session: object) -> None:
    gpus = session_gpus()
    stages = max(2, gpus + 1)  # whatever machine runs the test; the session's CPUs hold them (helpers.session_cpus)
    with pytest.raises(UsageError) as info:
        PipelineTrainer(build_model("resnet18", 10, in_channels=1, small_stem=True), stages, use_gpu=True)
    assert str(info.value) == f"use_gpu: {stages} stages need {stages} GPU (1 each); the Ray cluster has {gpus}"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            build_model("resnet18", 10).half(),
            "model: parameters are torch.float16; use float32 or float64 (bf16 through autocast_bf16)",
        ),
        (nn.Sequential(nn.ReLU()), "model: has no parameters to train"),
    ],
)
def test_bad_models(model: nn.Module, message: str) -> None:
    with pytest.raises(UsageError) as info:
        PipelineTrainer(model, 1)
    assert str(info.value) == message


def test_placement_checks() -> None:
    nodes = [{"CPU": 4, "GPU": 2}, {"CPU": 4, "GPU": 2}]
    check_resources(nodes, [{"CPU": 1, "GPU": 1}] * 4, "PACK")
    check_resources(nodes, [{"CPU": 2, "GPU": 1}] * 2, "STRICT_SPREAD")
    with pytest.raises(UsageError) as info:
        check_resources(nodes, [{"CPU": 1, "GPU": 1}] * 4, "STRICT_PACK")
    assert str(info.value) == (
        "placement_strategy: STRICT_PACK needs one node that holds all 4 stages ({'CPU': 1, 'GPU': 1} each) "
        "and no node does; use PACK or SPREAD"
    )
    with pytest.raises(UsageError) as info:
        check_resources(nodes, [{"CPU": 1}] * 3, "STRICT_SPREAD")
    assert str(info.value) == (
        "placement_strategy: STRICT_SPREAD needs 3 nodes that each hold one stage ({'CPU': 1}); use SPREAD or PACK"
    )
    with pytest.raises(UsageError) as info:
        check_resources(nodes, [{"CPU": 1, "GPU": 1}] * 5, "SPREAD")
    assert str(info.value) == "use_gpu: 5 stages need 5 GPU (1 each); the Ray cluster has 4"
    # A first stage's loader processes (data.loader_workers) take CPUs of its bundle only.
    loading = [{"CPU": 3}, {"CPU": 1}]
    check_resources(nodes, loading, "STRICT_PACK", num_replicas=2)
    with pytest.raises(UsageError) as info:
        check_resources(nodes, loading, "PACK", num_replicas=3)
    assert str(info.value) == (
        "cpus_per_stage: 3 replicas x 2 stages need 12 CPU (3/1 by stage: the first stage's loader processes "
        "(data.loader_workers) count); the Ray cluster has 8"
    )
    with pytest.raises(
        UsageError, match=r"^placement_strategy: STRICT_SPREAD needs 2 nodes that each hold one stage each"
    ):
        check_resources([{"CPU": 2}, {"CPU": 2}], loading, "STRICT_SPREAD")


@pytest.mark.gpu(2)  # NCCL needs a GPU per rank
def test_gpu_stages_over_nccl_equal_gradient_accumulation(ray_session: object) -> None:
    if ray.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("the Ray session sees fewer than 2 GPUs")
    options = {"lr": LRS[0], "weight_decay": 0.0, "use_gpu": True}
    with PipelineTrainer(_model(torch.float64), 2, **options) as pipeline:
        assert len(pipeline.devices) == 2
        x, y = _batches(torch.float64, 1)[0]
        loss = pipeline.train_step(x, y)
        state = pipeline.state_dict()
    want_losses, want_state = _reference(torch.float64, 4, 1)
    assert loss == pytest.approx(want_losses[0], rel=1e-8)
    _assert_state_close(state, want_state, 1e-8)
