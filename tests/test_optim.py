"""The optimizer every trainer builds: which parameters each weight decay reaches."""

from __future__ import annotations

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
