"""The optimizer every trainer builds: which parameters each weight decay reaches."""

from __future__ import annotations

import pytest
import torch

from raytrain_mp.finetune import lr_scales
from raytrain_mp.models import build_model
from raytrain_mp.optim import build_optimizer, param_groups


def test_weight_decay_reaches_conv_and_linear_weights_and_norm_weight_decay_the_rest():
    model = build_model("resnet18", 10, in_channels=1, small_stem=True)
    weights = {id(p) for name, p in model.named_parameters() if name.endswith("weight") and p.ndim > 1}
    groups = param_groups(model.parameters(), 5e-4, norm_weight_decay=0.01)
    assert [group["weight_decay"] for group in groups] == [5e-4, 0.01]
    assert {id(p) for p in groups[0]["params"]} == weights
    rest = {name for name, p in model.named_parameters() if id(p) in {id(q) for q in groups[1]["params"]}}
    assert rest == {name for name, p in model.named_parameters() if id(p) not in weights}
    assert "fc.bias" in rest and "bn1.weight" in rest and "layer4.1.bn2.bias" in rest
    assert [group["weight_decay"] for group in param_groups(model.parameters(), 5e-4)] == [5e-4, 0.0]  # the default


def test_with_a_backbone_lr_scale_each_scale_has_both_decays():
    model = build_model("resnet18", 3, in_channels=3, small_stem=True)
    optimizer = build_optimizer(model.parameters(), "sgd", 0.1, 0.9, 5e-4, lr_scales(model, 0.5), 0.02)
    groups = [(group["lr"], group["weight_decay"], len(group["params"])) for group in optimizer.param_groups]
    assert [(lr, decay) for lr, decay, _ in groups] == [(0.1, 5e-4), (0.1, 0.02), (0.05, 5e-4), (0.05, 0.02)]
    assert [count for *_, count in groups][:2] == [1, 1]  # the head: fc.weight; fc.bias
    assert sum(count for *_, count in groups) == len(list(model.parameters()))


def test_norm_weight_decay_decays_batchnorm_weights_in_a_step():
    torch.manual_seed(0)
    model = build_model("resnet18", 3, in_channels=3, small_stem=True)
    before = model.bn1.weight.detach().clone()
    optimizer = build_optimizer(model.parameters(), "sgd", 0.1, 0.0, 0.0, norm_weight_decay=0.5)
    optimizer.zero_grad()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # zero gradients: only the decay moves a weight, by lr * decay * weight
    torch.testing.assert_close(model.bn1.weight.detach(), before * (1 - 0.1 * 0.5))


def _trained(base_lr: float, weight_decay: float, name: str, steps: int):
    """A tiny model's optimizer and warmup-cosine schedule after ``steps`` steps from the same init."""
    from raytrain_mp.lr_schedule import make_schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    schedule = make_schedule(base_lr, 64, 256, "linear", 1.0, 3, 4)
    optimizer = build_optimizer(model.parameters(), name, schedule.peak_lr, 0.9, weight_decay, None, 0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)
    for _ in range(steps):
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler, schedule


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_restored_optimizer_keeps_the_runs_own_options_and_the_checkpoints_state(name):
    from raytrain_mp.optim import load_under_own_options

    _, saved, saved_scheduler, _ = _trained(0.4, 5e-4, name, 5)
    # the same options: exactly what was saved (groups, per-parameter state, the schedule)
    _, same, same_scheduler, _ = _trained(0.4, 5e-4, name, 0)
    load_under_own_options(same, same_scheduler, saved.state_dict(), saved_scheduler.state_dict())
    assert same.state_dict()["param_groups"] == saved.state_dict()["param_groups"]
    assert same_scheduler.state_dict() == saved_scheduler.state_dict()
    # new options (PBT's perturbation): their lr at the restored step and their weight decay, the saved buffers
    _, new, new_scheduler, schedule = _trained(0.1, 1e-3, name, 0)
    load_under_own_options(new, new_scheduler, saved.state_dict(), saved_scheduler.state_dict())
    assert new_scheduler.last_epoch == 5 and new_scheduler.get_last_lr() == [schedule(5)] * 2
    assert [(g["lr"], g["weight_decay"]) for g in new.param_groups] == [(schedule(5), 1e-3), (schedule(5), 0.01)]
    for ours, theirs in zip(new.state_dict()["state"].values(), saved.state_dict()["state"].values()):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    new_scheduler.step()  # and the schedule goes on from there
    assert new.param_groups[0]["lr"] == pytest.approx(schedule(6), rel=1e-12)
