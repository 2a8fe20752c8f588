"""Flattening models into blocks and building stages that keep the original state-dict keys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrain_mp.errors import UsageError
from raytrain_mp.models import build_model
from raytrain_mp.pipeline.blocks import StageModule, flatten_model


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    return build_model("resnet18", 10, in_channels=1, small_stem=True)


def test_resnet_blocks() -> None:
    names = [block.name for block in flatten_model(_resnet18())]
    assert names == ["stem"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + ["head"]
    resnet50 = build_model("resnet50", 10)
    assert len(flatten_model(resnet50)) == 1 + 3 + 4 + 6 + 3 + 1


@pytest.mark.parametrize("train", [False, True])
def test_blocks_compose_to_forward(train: bool) -> None:
    model = _resnet18().double().train(train)
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    expected = model(x)
    h = x
    for block in flatten_model(model):
        h = block.forward_on(model, h)
    torch.testing.assert_close(h, expected, rtol=0, atol=0)


def test_stages_keep_original_keys_and_merge_strictly() -> None:
    model = _resnet18()
    blocks = flatten_model(model)
    stages = [StageModule(model, blocks[a:b]) for a, b in [(0, 3), (3, 8), (8, 10)]]
    assert "layer3.0.conv1.weight" in stages[1].state_dict()
    merged = {}
    for stage in stages:
        assert not set(merged) & set(stage.state_dict())
        merged.update(stage.state_dict())
    fresh = build_model("resnet18", 10, in_channels=1, small_stem=True)
    fresh.load_state_dict(merged, strict=True)
    model.eval()
    x = torch.randn(2, 1, 8, 8)
    h = x
    for stage in stages:
        h = stage.eval()(h)
    torch.testing.assert_close(h, fresh.eval()(x))


def test_sequential_flattens_into_children_with_parameters() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(3, 4), nn.ReLU(), nn.Dropout(), nn.Linear(4, 2), nn.ReLU())
    blocks = flatten_model(model)
    # parameter-free children ride with a neighbour, so that no stage lacks an optimizer
    assert [block.name for block in blocks] == ["0+1+2+3", "4+5"]
    assert list(StageModule(model, blocks[1:]).state_dict()) == ["4.weight", "4.bias"]
    x = torch.randn(5, 3, 1)
    torch.testing.assert_close(StageModule(model, blocks).eval()(x), model.eval()(x))


def test_unsupported_model() -> None:
    with pytest.raises(UsageError) as info:
        flatten_model(nn.Linear(2, 2))
    assert str(info.value) == "model: cannot cut a Linear into pipeline blocks; supported: ResNet, Sequential"


def test_state_outside_blocks_is_refused() -> None:
    model = _resnet18()
    model.extra = nn.Linear(2, 2)
    with pytest.raises(UsageError) as info:
        flatten_model(model)
    assert str(info.value) == "model: state outside every pipeline block: extra.weight, extra.bias"
