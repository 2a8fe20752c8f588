"""The pipeline's data-set form (``feed``): each replica's first stage reads its share of every
batch itself, the last stage its labels, and the driver's calls carry positions, not pixels.

Pure rules first (shares, checkpoint segments and order), then ``PipelineTrainer(data=...)`` on
real stage actors against single-process gradient accumulation over the same samples, in float64,
for every schedule, with augmentation, loader processes and replicas; with one stage per rank (1
and 2 replicas) also with every option of torchvision's recipe (auto-augment, random erasing,
mixup/cutmix, label smoothing, repeated augmentation, and a weight average of each stage, against
``ema.ModelEMA`` over the single-process model).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from test_pipeline_trainer import _accumulate, _assert_state_close
from torch import nn

from raytrain_mp.checkpointing import checkpoint_name, checkpoint_order
from raytrain_mp.data import ParquetImageDataset
from raytrain_mp.data.recipe_draws import Recipe, pair_inputs, step_mix
from raytrain_mp.ema import ModelEMA
from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline import PipelineTrainer
from raytrain_mp.pipeline.feed import ShareSampler, StageData, epoch_batches, val_batch_sizes, val_chunks
from raytrain_mp.pipeline.replicas import replica_shares
from raytrain_mp.pipeline.run import step_segments

BATCH, SEED = 16, 7
LRS = [0.05, 0.03, 0.02]
RECIPE = Recipe(auto_augment="ta_wide", random_erase=0.25, mixup_alpha=0.2, cutmix_alpha=1.0)
REPS = 2  # with the recipe: repeated augmentation (--ra-sampler --ra-reps 2)
SMOOTHING = 0.1
EMA_DECAY = 0.8  # an update every step: after 3 steps the average is far from both the start and the model


# -- pure ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_replica_shares_of_the_epoch_order_are_the_driver_fed_shares(replicas: int) -> None:
    length, batch = 70, 16  # 4 full batches, 6 samples dropped
    for epoch in (0, 1):
        batches = epoch_batches(length, batch, SEED, epoch)
        shares = []
        for r in range(replicas):
            sampler = ShareSampler(length, batch, SEED, replicas, r)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
            assert len(shares[r]) == len(sampler) == 4 * batch // replicas
        for step, indices in enumerate(batches):
            driver = replica_shares(indices, indices, replicas)
            share = batch // replicas
            assert [shares[r][step * share : (step + 1) * share] for r in range(replicas)] == [
                x.tolist() for x, _ in driver
            ]
    assert not torch.equal(epoch_batches(length, batch, SEED, 0)[0], epoch_batches(length, batch, SEED, 1)[0])


def test_step_segments_end_where_the_global_step_is_a_multiple() -> None:
    assert step_segments(0, 5, 0, None) == [range(0, 5)]
    assert step_segments(0, 5, 0, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert step_segments(0, 5, 1, 2) == [range(0, 1), range(1, 3), range(3, 5)]  # global steps 5..9
    assert step_segments(3, 5, 1, 2) == [range(3, 5)]  # resumed at step 3: its checkpoint came before
    assert step_segments(2, 5, 0, 7) == [range(2, 5)]


def test_checkpoint_order_is_the_order_of_writing() -> None:
    written = [
        checkpoint_name(1, 2),
        checkpoint_name(1, 4),
        checkpoint_name(1),
        checkpoint_name(2, 1),
        checkpoint_name(2),
        checkpoint_name(10),
    ]
    assert written[:3] == ["checkpoint_000001_step_000002", "checkpoint_000001_step_000004", "checkpoint_000001"]
    assert sorted(reversed(written), key=checkpoint_order) == written
    assert sorted(written) != written  # by name alone, the end of epoch 1 would sort first


def test_val_batches_cover_the_split_once() -> None:
    assert val_batch_sizes(40, 16) == [16, 16, 8]
    assert val_chunks(40, 16, 4) == [4, 4, 4]
    assert val_chunks(35, 16, 4) == [4, 4, 3]


# -- on Ray ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    """200 8x8 grey images of 4 classes (160 train: 10 steps of 16; 40 val), stored raw: augmentation
    crops and flips."""
    from raytrain_mp.data.prepare import write_dataset
    from raytrain_mp.data.sources import make_synthetic_source

    out = tmp_path_factory.mktemp("feed") / "d"
    write_dataset(make_synthetic_source(200, 8, 4, 1, 0.2, 11), out)
    return str(out)


def _model() -> nn.Module:
    """Four blocks with parameters each (torch's zero-bubble runtime fails a stage that has none)."""
    torch.manual_seed(0)

    def block(a: int, b: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU())

    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return nn.Sequential(block(1, 6), block(6, 8), block(8, 8), head).double()


def _reference(
    root: str, steps: int, parts: int, recipe: Recipe, smoothing: float, reps: int
) -> tuple[list[float], nn.Module, ModelEMA]:
    """Single-process gradient accumulation over the samples of epoch 0's first ``steps`` global
    batches, read and augmented on the driver, in ``parts`` micro-batches each; mixed, where the
    ``recipe`` mixes, with each sample's partner by the step's draw; the model's average, updated
    after every step."""
    model = _model()
    average = ModelEMA(model, EMA_DECAY, 1, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LRS[0], momentum=0.9)
    train = ParquetImageDataset(root, "train", augment=True, seed=SEED, recipe=recipe)
    losses = []
    for step, (indices, lr) in enumerate(zip(epoch_batches(len(train), BATCH, SEED, 0, reps)[:steps], LRS)):
        images, y, params = train.batch((0, int(i)) for i in indices)
        if recipe.mixing:  # (sample, partner) pairs
            to_input = partial(train.transform, device=torch.device("cpu"), dtype=torch.float64)
            x = pair_inputs(to_input, images, params)
            mix = step_mix(recipe.mixup_alpha, recipe.cutmix_alpha, tuple(x.shape[-2:]), SEED, 0, step)
            x, y = mix.images(x[:, 0], x[:, 1]), mix.targets(y[:, 0], y[:, 1], 4, torch.float64)
        else:
            x = train.transform(images, params, torch.device("cpu"), torch.float64)
        for group in optimizer.param_groups:
            group["lr"] = lr
        losses.append(_accumulate(model, optimizer, x, y, parts, label_smoothing=smoothing))
        average.after_step(model, 0, step)
    return losses, model, average


def _evaluate(model: nn.Module, root: str) -> dict:
    val = ParquetImageDataset(root, "val")
    images, y, params = val.batch(range(len(val)))
    with torch.no_grad():
        logits = model.eval()(val.transform(images, params, torch.device("cpu"), torch.float64))
    model.train()
    return {
        "val_loss": F.cross_entropy(logits, y, reduction="sum").item() / len(y),
        "val_accuracy": (logits.argmax(1) == y).double().mean().item(),
    }


class _Spy:
    """An actor handle that records the pickled size of every call's arguments."""

    def __init__(self, actor: object, sizes: list[tuple[str, int]]) -> None:
        self._actor, self._sizes = actor, sizes

    def __getattr__(self, name: str) -> object:
        method, sizes = getattr(self._actor, name), self._sizes

        class _Method:
            def remote(self, *args: object) -> object:
                sizes.append((name, len(pickle.dumps(args))))
                return method.remote(*args)

        return _Method()


@pytest.fixture(scope="module")
def trainer_for(images: str, ray_session: object) -> Iterator:
    """A trainer per layout (virtual stages, replicas), made once and reset to its initial state
    for each use: 2 ranks, one loader process on the first (3 CPUs); with 2 replicas none (4 CPUs,
    the least the session has; a replica's result does not depend on who reads, which this also checks).
    One stage per rank: with the recipe (``RECIPE``, ``SMOOTHING``); two: without."""
    made: dict[tuple[int, int], tuple[PipelineTrainer, dict, list]] = {}

    def trainer_for(schedule: str, virtual: int, replicas: int) -> PipelineTrainer:
        if (virtual, replicas) not in made:
            for trainer, _, _ in made.values():  # the session's CPUs (4 on a CPU machine) hold one at a time
                trainer.shutdown()
            made.clear()
            recipe = RECIPE if virtual == 1 else Recipe()
            data = StageData(
                images, BATCH, seed=SEED, augment=True, loader_workers=int(replicas == 1), val_batch_size=16,
                recipe=recipe, reps=REPS if recipe.mixing else 1,
            )  # fmt: skip
            trainer = PipelineTrainer(
                _model(),
                2,
                schedule=schedule,
                num_microbatches=4 // replicas,
                virtual_stages=virtual,
                num_replicas=replicas,
                lr=LRS[0],
                momentum=0.9,
                weight_decay=0.0,
                label_smoothing=SMOOTHING if recipe.mixing else 0.0,
                ema_decay=EMA_DECAY if recipe.mixing else None,
                use_gpu=False,
                memory_format="contiguous",
                data=data,
            )
            made[virtual, replicas] = trainer, trainer.state_dict(), trainer.optimizer_state_dicts()
        trainer, state, optimizer_states = made[virtual, replicas]
        trainer.load_state_dict(state)
        if virtual == 1:  # the average restarts: its next update copies the model
            trainer.load_state_dict(state, average=True, averaged=0)
        trainer.load_optimizer_state_dicts(optimizer_states)
        trainer.set_schedule(schedule)
        return trainer

    yield trainer_for
    for trainer, _, _ in made.values():
        trainer.shutdown()


@pytest.mark.parametrize(
    "schedule, virtual, replicas",
    [("gpipe", 1, 1), ("1f1b", 1, 1), ("interleaved-1f1b", 2, 1), ("interleaved-zb", 2, 1), ("gpipe", 1, 2)],
)
def test_stages_read_their_batches_and_equal_gradient_accumulation(
    trainer_for, images, schedule, virtual, replicas
) -> None:
    """Three steps (2 a call, the second call queued), then the val split: the model equals single-process
    gradient accumulation over the same 4 micro-batches a step (mixed by the recipe, one stage per
    rank), and the driver sent positions."""
    trainer = trainer_for(schedule, virtual, replicas)
    reads_before = trainer.reads()
    sizes: list[tuple[str, int]] = []
    stages = trainer._stages  # the actor handles the trainer calls
    actors = stages.actors
    stages.actors = [_Spy(actor, sizes) for actor in actors]
    try:
        losses = list(trainer.train_data_steps([(0, step, lr) for step, lr in enumerate(LRS)], steps_per_call=2))
        evaluation = trainer.evaluate()
        averaged = trainer.evaluate(average=True) if virtual == 1 else None
    finally:
        stages.actors = actors
    recipe = RECIPE if virtual == 1 else Recipe()
    smoothing, reps = (SMOOTHING, REPS) if recipe.mixing else (0.0, 1)
    want_losses, want_model, want_average = _reference(images, len(LRS), 4, recipe, smoothing, reps)
    assert losses == pytest.approx(want_losses, rel=1e-10)
    _assert_state_close(trainer.state_dict(), want_model.state_dict(), 1e-10)
    for name, (got, model) in {"model": (evaluation, want_model), "average": (averaged, want_average.module)}.items():
        if got is None:
            continue
        want_eval = _evaluate(model, images)
        assert got["val_count"] == 40
        assert got["val_loss"] == pytest.approx(want_eval["val_loss"], rel=1e-10), name
        assert got["val_accuracy"] == want_eval["val_accuracy"], name
    if virtual == 1:  # each stage's average, merged as the model is; it lags the model
        for replica in range(replicas):
            _assert_state_close(trainer.state_dict(replica, average=True), want_average.module.state_dict(), 1e-10)
        assert trainer.averaged() == 3
        gap = max((a - b).abs().max().item() for a, b in zip(want_average.module.parameters(), want_model.parameters()))
        assert gap > 1e-4
    # What the driver sent: 2 calls x every actor, then an evaluation call per rank of replica 0 (two
    # with the average).
    evaluations = 2 * (1 + (virtual == 1))
    assert [name for name, _ in sizes] == ["train_steps"] * 2 * 2 * replicas + ["evaluate"] * evaluations
    assert max(size for _, size in sizes) < 2048, sizes
    # Who read: every first stage its share of 3 steps (and each sample's partner, mixing) and
    # the val split on replica 0 (twice with the average); every last stage the same number of labels.
    reads = [after - before for before, after in zip(reads_before, trainer.reads())]
    share = BATCH // replicas * (1 + recipe.mixing)
    val_reads = 40 * (1 + (virtual == 1))  # the average's evaluation reads the val split again
    assert reads == [3 * share + val_reads * (replica == 0) for replica in range(replicas) for _ in range(2)]


def test_data_form_checks_before_any_actor(images: str) -> None:
    with pytest.raises(
        UsageError, match=r"^data: global_batch_size 500 must be between 1 and the 160 training samples$"
    ):
        PipelineTrainer(_model(), 2, data=StageData(images, 500))
    with pytest.raises(UsageError, match=r"^num_microbatches: 3 micro-batches do not divide a batch of 16 samples"):
        PipelineTrainer(_model(), 2, num_microbatches=3, data=StageData(images, 16))
