"""``ema``: the weight average against torchvision's reference ``train.py`` (its decay adjustment,
its update schedule and warmup reset, over ``AveragedModel`` with ``get_ema_multi_avg_fn``), and a
restore mid-run that continues it exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from raytrain_mp.ema import ModelEMA, adjusted_decay


def test_the_decay_is_adjusted_as_the_reference_adjusts_it():
    # references/classification/train.py: adjust = world_size * batch_size * model_ema_steps / epochs;
    # alpha = min(1, (1 - decay) * adjust); its ResNet-50 recipe: 8 GPUs x 128, every 32 steps, 600 epochs
    assert adjusted_decay(0.99998, 32, 8 * 128, 600) == pytest.approx(1 - 2e-5 * 1024 * 32 / 600, rel=1e-12)
    assert adjusted_decay(0.9, 10, 256, 1) == 0.0  # alpha capped at 1: the average is the model
    assert adjusted_decay(1.0, 32, 1024, 600) == 1.0


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()


def train(model: nn.Module, steps: int, on_step) -> None:
    """``steps`` SGD steps of a seeded regression; ``on_step(i)`` after each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(16, 4, generator=generator, dtype=torch.float64)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        on_step(i)


EPOCHS, STEPS_PER_EPOCH, EVERY, WARMUP, DECAY = 3, 5, 2, 1.0, 0.7


def test_updates_and_warmup_resets_follow_the_reference():
    model, reference_model = tiny_model(), tiny_model()
    ours = ModelEMA(model, DECAY, EVERY, WARMUP)
    # the reference's ExponentialMovingAverage: AveragedModel over parameters and buffers
    reference = AveragedModel(
        copy.deepcopy(reference_model), multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True
    )

    def ours_step(i):
        ours.after_step(model, i // STEPS_PER_EPOCH, i % STEPS_PER_EPOCH)

    def reference_step(i):  # train_one_epoch: i is the batch index within the epoch
        epoch, index = divmod(i, STEPS_PER_EPOCH)
        if index % EVERY == 0:
            reference.update_parameters(reference_model)
            if epoch < WARMUP:
                reference.n_averaged.fill_(0)

    train(model, EPOCHS * STEPS_PER_EPOCH, ours_step)
    train(reference_model, EPOCHS * STEPS_PER_EPOCH, reference_step)
    ema, expected = ours.module.state_dict(), reference.module.state_dict()
    assert ema.keys() == expected.keys()
    for key in ema:
        assert torch.equal(ema[key], expected[key]), key
    # the average is not the model: it lags it (two epochs after warmup, 3 updates each)
    assert not torch.equal(ema["0.weight"], model.state_dict()["0.weight"])
    assert ours.averaged == int(reference.n_averaged) == 6


def test_a_restore_mid_run_continues_the_average_exactly():
    # stop after 7 steps (mid-epoch 2, after warmup); a new average loads the saved one and its count
    model = tiny_model()
    first = ModelEMA(model, DECAY, EVERY, WARMUP)
    saved: dict = {}

    def first_step(i):
        first.after_step(model, *divmod(i, STEPS_PER_EPOCH))
        if i == 6:
            saved.update(
                model=copy.deepcopy(model.state_dict()),
                ema=copy.deepcopy(first.module.state_dict()),
                averaged=first.averaged,
            )

    train(model, 7, first_step)
    assert saved["averaged"] == 1  # one update since warmup ended (index 0 of epoch 2)
    resumed_model = tiny_model()
    resumed_model.load_state_dict(saved["model"])
    resumed = ModelEMA(resumed_model, DECAY, EVERY, WARMUP)
    resumed.load(saved["ema"], saved["averaged"])
    # against the average restored whole (AveragedModel's own state dict), both continued by the
    # same 8 steps (7..14) of the same model: the plain state dict and the count are all it needs
    continued_model = tiny_model()
    continued_model.load_state_dict(saved["model"])
    continued = ModelEMA(continued_model, DECAY, EVERY, WARMUP)
    continued.average.load_state_dict(first.average.state_dict())
    for m, e in ((resumed_model, resumed), (continued_model, continued)):
        train(m, 8, lambda i, m=m, e=e: e.after_step(m, *divmod(i + 7, STEPS_PER_EPOCH)))
    for key, value in continued.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[key], value), key
    assert resumed.averaged == continued.averaged == 6  # 1 + updates at steps 7, 9, 10, 12, 14
