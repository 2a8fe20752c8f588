"""memory_format: ChannelsLast gives the same values as the contiguous module, contiguous tensors at
the edges (what a peer's receive buffer expects), the module's own parameters and keys; in_layout
converts both ways; faster_layout measures on a copy."""

from __future__ import annotations

import copy

import torch
from torch import nn

from raytrain_mp.config import LAYOUTS
from raytrain_mp.memory_format import ChannelsLast, faster_layout, in_layout, layout_runner
from raytrain_mp.models import build_model
from raytrain_mp.pipeline.blocks import StageModule, flatten_model


def _stage() -> tuple[nn.Module, nn.Module]:
    """The middle of a ResNet-18 (a cut inside a residual block, so it sends a packed pair) twice."""
    torch.manual_seed(0)
    model = build_model("resnet18", 10, in_channels=3, small_stem=False).double()
    blocks = flatten_model(model)
    names = [block.name for block in blocks]
    stage = StageModule(model, blocks[names.index("layer1.0.conv1") : names.index("layer2.1.conv2")])
    return stage, copy.deepcopy(stage)


def test_values_and_gradients_equal_the_contiguous_stage_and_the_edges_are_contiguous() -> None:
    plain, converted = _stage()
    wrapped = ChannelsLast(converted)
    assert list(wrapped.module.state_dict()) == list(plain.state_dict())
    assert wrapped.module.get_submodule("layer1.0.conv1").weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(3, 64, 16, 16, dtype=torch.float64)
    ins = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [plain(ins[0]), wrapped(ins[1])]
    assert outs[1].is_contiguous() and not outs[1].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(outs[0])
    grads = [torch.autograd.grad(out, [inp], upstream)[0] for out, inp in zip(outs, ins)]
    # torch.autograd.grad, as torch's zero-bubble runtime takes input gradients: no layout contract
    assert grads[1].is_contiguous() and not grads[1].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)


def test_inputs_that_are_not_4d_floating_point_pass_untouched() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    torch.testing.assert_close(ChannelsLast(copy.deepcopy(mlp))(x), mlp(x), rtol=0, atol=0)
    embed = nn.Embedding(10, 2)
    tokens = torch.randint(0, 10, (2, 3, 4, 5))
    assert torch.equal(ChannelsLast(embed)(tokens), embed(tokens))


def test_in_layout_converts_both_ways_in_place() -> None:
    plain, stage = _stage()
    weight = stage.get_submodule("layer1.0.conv1").weight
    runner = in_layout(stage, "channels_last")
    assert isinstance(runner, ChannelsLast) and runner.module is stage
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
    assert in_layout(stage, "contiguous") is stage and weight.is_contiguous()
    x = torch.randn(2, 64, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(stage(x), plain(x), rtol=0, atol=0)


def test_faster_layout_measures_a_copy_and_leaves_the_module_alone() -> None:
    stage, before = _stage()
    x = torch.randn(2, 64, 16, 16, dtype=torch.float64)
    assert faster_layout(stage, x, input_grad=True) in LAYOUTS
    assert all(p.grad is None for p in stage.parameters())
    for (key, value), (_, want) in zip(stage.state_dict().items(), before.state_dict().items(), strict=True):
        assert torch.equal(value, want) and value.is_contiguous(), key  # BatchNorm statistics too
    # nothing to choose without a 4-D floating point input
    assert faster_layout(nn.Linear(4, 2), torch.randn(3, 4), input_grad=False) == "contiguous"


def test_a_compiled_runner_keeps_its_edges_contiguous(tmp_path, monkeypatch) -> None:
    """layout_runner compiles the module inside the layout's edges: whatever strides the graph
    takes or gives, the output and the input's gradient (as torch's pipeline runtime takes it,
    ``torch.autograd.grad``) leave contiguous, what a P2P send needs. A channels-last input shows
    why: the compiled module alone hands its gradient back channels-last."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(128, 4))
    x = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last).requires_grad_()

    def input_grad(runner: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        out = runner(x)
        return out, torch.autograd.grad(out.sum(), x)[0]

    assert not input_grad(torch.compile(copy.deepcopy(stage)))[1].is_contiguous()
    _, eager = input_grad(copy.deepcopy(stage))
    for layout in LAYOUTS:
        out, grad = input_grad(layout_runner(copy.deepcopy(stage), layout, torch.compile))
        assert out.is_contiguous() and grad.is_contiguous(), layout
        torch.testing.assert_close(grad, eager)  # the same values, in another layout
