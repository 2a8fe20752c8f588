"""Models cut from their traced graph (``pipeline.traced``): MobileNetV3 (BatchNorm,
squeeze-excitation, in-place activations), a small torchvision VisionTransformer (class token,
attention, LayerNorm, parameters outside any leaf module) and a user network whose skip connection
crosses the cut.

First without Ray: every cut of each model, as two stages with the tensors between them packed
and unpacked, computes the model's forward and gradients exactly; names, state ownership and the
refusals. Then on real stage actors over gloo, in float64: 3 steps of GPipe and 1F1B on 2 ranks,
and an interleaved schedule with deferred BatchNorm, equal single-process gradient accumulation
over the same micro-batches (1e-10), the deferred running statistics one BatchNorm pass over the
batch (1e-12). The models are deterministic (dropout 0): dropout draws per stage.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
import torchvision
from test_pipeline_trainer import _accumulate, _assert_state_close  # the same reference step and comparison
from torch import nn

from raytrain_mp.errors import UsageError
from raytrain_mp.pipeline import PipelineTrainer, convert_deferred_batchnorm
from raytrain_mp.pipeline.blocks import StageModule, flatten_model
from raytrain_mp.pipeline.partition import split_bounds

BATCH, M = 16, 4
LRS = [0.05, 0.03, 0.02]


class SkipNet(nn.Module):
    """A user network that is not a chain: ``h`` skips over ``b`` to the sum before ``c``."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.c = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        z = self.c(self.b(h) + h)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(z, 1), 1))


def _mobilenet() -> nn.Module:
    return torchvision.models.mobilenet_v3_small(num_classes=10, dropout=0.0)


def _vit() -> nn.Module:
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=10
    )


MODELS = {"mobilenet_v3_small": (_mobilenet, 32), "vit": (_vit, 32), "skipnet": (SkipNet, 16)}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().double().train()


def _batches(name: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    size = MODELS[name][1]
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 3, size, size, generator=generator, dtype=torch.float64),
            torch.randint(0, 10, (BATCH,), generator=generator),
        )
        for _ in range(steps)
    ]


# -- without Ray ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_every_cut_computes_the_model_and_its_gradients(name: str) -> None:
    # 140 cuts of MobileNet: each kept cheap (float32: CPU convolutions in float64 take a slow path)
    model = _model(name).float()
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 3, 3, 9])
    blocks = flatten_model(model, x)
    names = [block.name for block in blocks]
    assert len(set(names)) == len(names) and len(blocks) > 5
    reference = copy.deepcopy(model).eval()  # eval: the running statistics stay, run after run
    want = reference(x)
    F.cross_entropy(want, y).backward()
    want_grads = {key: p.grad for key, p in reference.named_parameters()}
    crossing_many = 0
    for cut in range(1, len(blocks)):
        model.zero_grad(set_to_none=True)
        first, second = StageModule(model, blocks[:cut]).eval(), StageModule(model, blocks[cut:]).eval()
        first, second = pickle.loads(pickle.dumps(first)), pickle.loads(pickle.dumps(second))  # as Ray ships them
        sent = first(x)
        crossing_many += len(blocks[cut].run.inputs) > 1
        received = sent.detach().requires_grad_()  # a stage's input: a leaf that needs a gradient
        got = second(received)
        assert torch.equal(got, want), f"cut before {names[cut]}"
        F.cross_entropy(got, y).backward()
        sent.backward(received.grad)
        grads = {**dict(first.named_parameters()), **dict(second.named_parameters())}
        assert sorted(grads) == sorted(want_grads), f"cut before {names[cut]}"
        got_flat, want_flat = (
            torch.cat([g[key].flatten() for key in sorted(g)])
            for g in ({key: p.grad for key, p in grads.items()}, want_grads)
        )
        torch.testing.assert_close(got_flat, want_flat, rtol=1e-5, atol=1e-7, msg=f"cut before {names[cut]}")
        assert sorted([*first.state_dict(), *second.state_dict()]) == sorted(model.state_dict())
    assert crossing_many  # some cut sends several tensors packed into one


def test_names_follow_the_module_paths() -> None:
    model = _model("vit")
    names = [block.name for block in flatten_model(model, _batches("vit", 1)[0][0])]
    # The class token and positional embedding are the root's and the encoder's own parameters:
    # they ride with the first node that uses them.
    assert names[:3] == ["conv_proj", "encoder", "encoder.dropout"]
    assert names[-2:] == ["encoder.ln", "heads.head"]
    cut = split_bounds(names, ["encoder.layers.encoder_layer_1"], 2)
    assert names[cut[1]] == "encoder.layers.encoder_layer_1"
    with pytest.raises(
        UsageError, match=r"^split_points: 'encoder.layer_9' names no block; blocks: conv_proj, encoder, "
    ):
        split_bounds(names, ["encoder.layer_9"], 2)


def test_the_skip_crosses_the_cut() -> None:
    model = _model("skipnet")
    x = _batches("skipnet", 1)[0][0]
    blocks = flatten_model(model, x)
    names = [block.name for block in blocks]
    assert names == ["a.0", "a.1", "a.2", "b.0", "b.1", "b.2", "c", "head"]
    cut = names.index("b.1")
    sent = StageModule(model, blocks[:cut])(x)
    # b.0's output and the skipped h, each 8x16x16 per sample, flattened and joined.
    assert sent.shape == (BATCH, 2 * 8 * 16 * 16)


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a value: fx cannot trace it
            return x * 2
        return x


def test_an_untraceable_submodule_runs_whole_and_an_untraceable_forward_is_refused() -> None:
    holder = _Holder(nn.Sequential(nn.Linear(4, 4), _DataDependent(), nn.Linear(4, 3)))  # not a Sequential: traced
    blocks = flatten_model(holder, torch.randn(3, 4))
    assert [block.name for block in blocks] == ["body.0", "body.1", "body.2"]
    assert blocks[1].paths == ("body.1",)  # the module fx could not trace is one call
    x = torch.randn(5, 4)
    stage = StageModule(holder, blocks)
    torch.testing.assert_close(stage(x), holder(x))

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if x.sum() > 0 else self.fc(-x)

    with pytest.raises(UsageError) as info:
        flatten_model(Top(), torch.randn(3, 4))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "model: the pipeline cannot trace Top.forward with torch.fx (symbolically traced variables cannot be used "
        "as inputs to control flow at "
    )
    assert message.endswith(
        "its own forward must be traceable (move the untraceable part into a submodule, which then runs whole in "
        "one stage), or give an nn.Sequential"
    )
    assert "test_pipeline_traced.py:" in message  # the line of the user's code


class _Holder(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_traced_model_needs_an_example_input() -> None:
    with pytest.raises(
        UsageError,
        match=r"^model: cutting a SkipNet from its traced graph needs an example input "
        r"\(PipelineTrainer's sample_input, a batch like the training batches\)$",
    ):
        flatten_model(SkipNet())


def test_a_forward_that_returns_more_than_logits_is_refused() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.fc(x), x

    with pytest.raises(UsageError) as info:
        flatten_model(Pair(), torch.randn(3, 4))
    assert (
        str(info.value) == "model: Pair.forward returns a tuple; the pipeline's last stage needs one tensor of logits"
    )


def test_shared_state_is_never_cut_apart() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.mid = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.mid(self.fc(x)))  # fc's weights are used before and after mid

    blocks = flatten_model(Tied(), torch.randn(3, 4))
    assert [block.name for block in blocks] == ["fc"]  # no cut can fall between the two uses


# -- on stage actors --------------------------------------------------------------------------


def _reference(model: nn.Module, batches: list) -> tuple[list[float], dict]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LRS[0], momentum=0.9)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a stage's threads
    try:
        losses = []
        for (x, y), lr in zip(batches, LRS):
            for group in optimizer.param_groups:
                group["lr"] = lr
            losses.append(_accumulate(model, optimizer, x, y, M))
    finally:
        torch.set_num_threads(threads)
    return losses, model.state_dict()


def _train(trainer: PipelineTrainer, batches: list, lrs: list[float] = LRS) -> list[float]:
    losses = []
    for (x, y), lr in zip(batches, lrs):
        trainer.set_lr(lr)
        losses.append(trainer.train_step(x, y))
    return losses


# The skip net's cut falls where its skip crosses; the others are balanced by parameters.
SPLITS = {"mobilenet_v3_small": None, "vit": None, "skipnet": ["b.1"]}


@pytest.mark.parametrize("name", MODELS)
def test_gpipe_and_1f1b_equal_gradient_accumulation(name: str, ray_session: object) -> None:
    model, batches = _model(name), _batches(name, 3)
    want_losses, want_state = _reference(copy.deepcopy(model), batches)
    with PipelineTrainer(
        model,
        2,
        split_points=SPLITS[name],
        num_microbatches=M,
        lr=LRS[0],
        momentum=0.9,
        weight_decay=0.0,
        use_gpu=False,
        sample_input=batches[0][0],
    ) as trainer:
        initial, optimizers = trainer.state_dict(), trainer.optimizer_state_dicts()
        if SPLITS[name]:
            assert trainer.plan[1].blocks[0] == SPLITS[name][0]
        for schedule in ("gpipe", "1f1b"):
            trainer.load_state_dict(initial)
            trainer.load_optimizer_state_dicts(optimizers)
            trainer.set_schedule(schedule, M)
            losses = _train(trainer, batches)
            assert losses == pytest.approx(want_losses, rel=1e-10), schedule
            _assert_state_close(trainer.state_dict(), want_state, 1e-10)
        # The merged state dict loads strict into the user's model, which then predicts as the stages do.
        fresh = _model(name)
        fresh.load_state_dict(trainer.state_dict(), strict=True)
        x = batches[0][0]
        torch.testing.assert_close(trainer.predict(x), fresh.eval()(x), rtol=1e-10, atol=1e-12)


def test_interleaved_with_deferred_batchnorm_on_mobilenet(ray_session: object) -> None:
    model, batches = _model("mobilenet_v3_small"), _batches("mobilenet_v3_small", 3)
    with PipelineTrainer(
        model,
        2,
        schedule="interleaved-1f1b",
        virtual_stages=2,
        num_microbatches=M,
        lr=LRS[0],
        momentum=0.9,
        weight_decay=0.0,
        use_gpu=False,
        deferred_bn=True,
        sample_input=batches[0][0],
    ) as trainer:
        losses = _train(trainer, batches[:1])
        # The stem's BatchNorm saw its convolution's output in M micro-batches; its running
        # statistics are those of one BatchNorm pass over the whole batch.
        whole = copy.deepcopy(model.features[0][1])
        whole(model.features[0][0](batches[0][0]))
        after_one = trainer.state_dict()
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(after_one[f"features.0.1.{key}"], getattr(whole, key), rtol=1e-12, atol=1e-12)
        losses += _train(trainer, batches[1:], LRS[1:])
        state = trainer.state_dict()
    want_losses, want_state = _reference(convert_deferred_batchnorm(copy.deepcopy(model)), batches)
    assert losses == pytest.approx(want_losses, rel=1e-10)
    _assert_state_close(state, want_state, 1e-10)
