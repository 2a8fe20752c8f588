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
    blocks = flatten_model(_resnet18())
    pieces = [f"layer{i}.{j}.conv{k}" for i in range(1, 5) for j in range(2) for k in (1, 2)]
    assert [block.name for block in blocks] == ["stem", *pieces, "head"]
    # A BasicBlock's downsample rides with its strided conv1, so both halves of the pair match.
    assert blocks[5].paths == ("layer2.0.conv1", "layer2.0.bn1", "layer2.0.relu", "layer2.0.downsample")
    resnet50 = flatten_model(build_model("resnet50", 10))
    assert len(resnet50) == 1 + 3 * (3 + 4 + 6 + 3) + 1
    # A Bottleneck's stride is on conv2 (ResNet v1.5), and so is its downsample.
    assert resnet50[1].paths == ("layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu")
    assert resnet50[2].paths == ("layer1.0.conv2", "layer1.0.bn2", "layer1.0.relu", "layer1.0.downsample")
    assert resnet50[3].paths == ("layer1.0.conv3", "layer1.0.bn3", "layer1.0.relu")


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_a_cut_before_any_block_equals_the_model(arch: str) -> None:
    # Two stages cut before every block: one tensor crosses the cut, the forward equals the
    # whole model's exactly and every gradient within 1e-13 of its largest element.
    torch.manual_seed(0)
    model = build_model(arch, 10, in_channels=1, small_stem=True).double()
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    expected = model(x)
    expected.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    blocks = flatten_model(model)
    for cut in range(1, len(blocks)):
        model.zero_grad()
        first, second = StageModule(model, blocks[:cut]), StageModule(model, blocks[cut:])
        sent = first(x)
        assert isinstance(sent, torch.Tensor)
        received = sent.detach().requires_grad_()
        out = second(received)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        out.sum().backward()
        sent.backward(received.grad)
        # Inside a block with a downsample the input's gradient sums its two paths in another order.
        for name, p in model.named_parameters():
            error = (p.grad - grads[name]).abs().max() / grads[name].abs().max()
            assert error < 1e-13, (blocks[cut].name, name, error.item())


def test_a_cut_after_a_first_piece_sends_main_path_and_identity_packed() -> None:
    model = build_model("resnet50", 10)
    blocks = flatten_model(model)
    first = StageModule(model, blocks[: [b.name for b in blocks].index("layer3.0.conv2")])
    # layer2's output (512 channels at 8x8 for 64x64) and layer3.0's conv1 output (256) side by side
    assert first(torch.randn(2, 3, 64, 64)).shape == (2, 256 + 512, 8, 8)


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
    stages = [StageModule(model, blocks[a:b]) for a, b in [(0, 6), (6, 12), (12, 18)]]
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


def test_a_model_no_flattener_knows_is_cut_from_its_graph() -> None:
    # pipeline.traced; a lone Linear traces to one block that holds the root's own parameters.
    model, x = nn.Linear(2, 3), torch.randn(4, 2)
    (block,) = flatten_model(model, x)
    assert (block.name, block.paths) == ("input", ("weight", "bias"))
    stage = StageModule(model, [block])
    assert list(stage.state_dict()) == ["weight", "bias"]
    torch.testing.assert_close(stage(x), model(x))


def test_state_outside_blocks_is_refused() -> None:
    model = _resnet18()
    model.extra = nn.Linear(2, 2)
    with pytest.raises(UsageError) as info:
        flatten_model(model)
    assert str(info.value) == "model: state outside every pipeline block: extra.weight, extra.bias"
