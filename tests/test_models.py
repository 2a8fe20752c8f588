"""models: any torchvision classifier or the user's ``module:callable``, adapted to the data, and
every way a name can fail as its one line. Pure: no Ray, no data set; one forward and backward per
model on 32x32 inputs (vit_b_16, 86M parameters, is built once)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torchvision import models as tv_models

from raytrain_mp.errors import UsageError
from raytrain_mp.models import PROBE_SIZES, RESNET_NAMES, build_model, check_model, check_model_syntax

TRIED = ", ".join(map(str, PROBE_SIZES))


@pytest.mark.parametrize(
    "name, first_conv",
    [("mobilenet_v3_small", "features.0.0"), ("efficientnet_b0", "features.0.0"), ("convnext_tiny", "features.0.0"),
     ("regnet_y_400mf", "stem.0"), ("shufflenet_v2_x0_5", "conv1.0"), ("vit_b_16", "conv_proj")],
)  # fmt: skip
def test_a_torchvision_model_trains_on_32px_and_adapts_to_one_channel(name, first_conv):
    torch.manual_seed(0)  # each of these takes 32x32 (the README's table says so): the forward is check_model's probe
    model = build_model(name, 10, 3, image_size=32)
    logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

    gray = build_model(name, 10, 1, image_size=32)
    ours, theirs = gray.state_dict(), model.state_dict()  # at 3 channels a non-ResNet is torchvision's own
    assert list(ours) == list(theirs)  # torchvision's keys, in torchvision's order
    differing = {k for k in ours if ours[k].shape != theirs[k].shape}
    assert differing == {f"{first_conv}.weight"}
    assert ours[f"{first_conv}.weight"].shape[1] == 1
    fresh = build_model(name, 10, 1, image_size=32)
    fresh.load_state_dict(ours, strict=True)
    assert gray(torch.randn(2, 1, 32, 32)).shape == (2, 10)


def test_resnets_keep_the_small_stem_rule():
    auto = build_model("resnet18", 10, 1, None, image_size=32)
    assert (
        auto.conv1.kernel_size == (3, 3) and auto.conv1.in_channels == 1 and isinstance(auto.maxpool, torch.nn.Identity)
    )
    large = build_model("resnet18", 10, 1, None, image_size=64)
    assert large.conv1.kernel_size == (7, 7) and large.conv1.in_channels == 1
    assert build_model("resnet18", 3, 3, True).conv1.stride == (1, 1)  # the positional form the tests use
    mobilenet = build_model("mobilenet_v3_small", 10, 3, None, image_size=32)  # auto: nothing to do
    assert mobilenet.features[0][0].stride == (2, 2)
    names = tv_models.list_models(module=tv_models)
    assert sorted(RESNET_NAMES) == sorted(
        n for n in names if tv_models.get_model_builder(n).__module__ == "torchvision.models.resnet"
    )


def test_googlenet_returns_logits_in_training():
    model = build_model("googlenet", 10, 1, image_size=32).train()
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``mymodels`` in a temporary working directory, importable only because the working
    directory is (the console script does not put it on sys.path)."""
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent("""
        from torch import nn

        def tiny_net(num_classes, in_channels, image_size):
            return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.Conv2d(8, 8, 3, stride=image_size, padding=1), nn.Flatten(),
                                 nn.Linear(8, num_classes))

        def fixed16(num_classes, in_channels, image_size):  # takes 16 px only
            return nn.Sequential(nn.Conv2d(in_channels, 8, 4, stride=4), nn.Flatten(),
                                 nn.Linear(8 * 4 * 4, num_classes))

        def fails(num_classes, in_channels, image_size):
            raise ValueError("no GPU here")

        def not_a_module(num_classes, in_channels, image_size):
            return [1, 2]

        NOT_CALLABLE = 3
    """)
    )
    (tmp_path / "broken.py").write_text("import no_such_package_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in ("mymodels", "broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_a_user_callable_gets_the_data_and_its_model_is_used_as_it_is(user_module):
    check_model("mymodels:tiny_net", 4, 2, 16)  # its stride-16 conv fits 16 px exactly
    model = build_model("mymodels:tiny_net", 4, 2, image_size=16)
    assert model[0].in_channels == 2 and model[3].stride == (16, 16) and model[5].out_features == 4
    assert str(user_module) in sys.path
    with pytest.raises(UsageError) as info:
        check_model("mymodels:tiny_net", 4, 2, 16, small_stem=True)
    assert str(info.value) == "--small-stem: applies to torchvision ResNets; mymodels:tiny_net builds its own stem"


@pytest.mark.parametrize(
    "name, size, message",
    [
        ("resnt18", 32, "--model: unknown model 'resnt18'; closest: resnet18, resnet152, resnet101; accepted: a "
                        "torchvision.models classifier (torchvision.models.list_models()) or package.module:callable"),
        ("broken:net", 32, "--model: module 'broken' does not import "
                           "(ModuleNotFoundError: No module named 'no_such_package_xyz')"),
        ("nomodule:net", 32, "--model: module 'nomodule' does not import "
                             "(ModuleNotFoundError: No module named 'nomodule')"),
        ("mymodels:absent", 32, "--model: module 'mymodels' has no attribute 'absent'"),
        ("mymodels:NOT_CALLABLE", 32, "--model: mymodels:NOT_CALLABLE is not callable (an int)"),
        ("mymodels:fails", 32, "--model: mymodels:fails(num_classes=10, in_channels=1, image_size=32) "
                               "raised ValueError: no GPU here"),
        ("mymodels:not_a_module", 32,
         "--model: mymodels:not_a_module(num_classes=10, in_channels=1, image_size=32) returned builtins.list, not a "
         "torch.nn.Module"),
        ("mobilenet_v3_small", 32, None),
        ("vit_b_16", 40, "--model: vit_b_16 cuts images into 16x16 patches, so the image size must be a multiple "
                         "of 16; the data's 40 px is not: prepare the data with --image-size 48 (the smallest size "
                         "that works is 16)"),
        ("alexnet", 32, "--model: alexnet cannot take 32x32 images (RuntimeError: Given input size: (256x1x1). "
                        "Calculated output size: (256x0x0). Output size is too small); the smallest size that works "
                        "(of " + TRIED + " px tried) is 64: prepare the data with --image-size 64"),
        ("mymodels:fixed16", 12, "--model: mymodels:fixed16 cannot take 12x12 images (RuntimeError: mat1 and mat2 "
                                 "shapes cannot be multiplied (2x72 and 128x10)); the smallest size that works "
                                 "(of " + TRIED + " px tried) is 16: prepare the data with --image-size 16"),
    ],
)  # fmt: skip
def test_every_bad_model_is_one_line(user_module, name, size, message):
    if message is None:  # explicit --small-stem on a model without the rule
        name, message = (
            name,
            (
                f"--small-stem: applies to torchvision ResNets ({', '.join(RESNET_NAMES)}); "
                f"mobilenet_v3_small has no such rule"
            ),
        )
        with pytest.raises(UsageError) as info:
            check_model(name, 10, 1, size, small_stem=True)
    else:
        with pytest.raises(UsageError) as info:
            check_model(name, 10, 1, size)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "name, message",
    [("my models:net", "--model: 'my models:net' is not of the form package.module:callable (e.g. mymodels:tiny_net)"),
     ("pkg.mod:", "--model: 'pkg.mod:' is not of the form package.module:callable (e.g. mymodels:tiny_net)"),
     ("resnet-18", "--model: 'resnet-18' is neither a torchvision model name (e.g. resnet18) "
                   "nor package.module:callable")],
)  # fmt: skip
def test_a_malformed_name_fails_without_importing(name, message):
    with pytest.raises(UsageError) as info:
        check_model_syntax(name)
    assert str(info.value) == message
    check_model_syntax("pkg.sub.mod:Factory.build")


def test_torchvision_names_are_read_without_importing_torch_and_equal_list_models():
    from raytrain_mp.model_names import torchvision_names

    assert list(torchvision_names()) == tv_models.list_models(module=tv_models)
    code = (
        "import sys\nfrom raytrain_mp.cli import main\n"
        "code = main(['ddp', '--model', 'resnt18'])\n"
        "print(code, [m for m in ('torch', 'torchvision', 'ray', 'pyarrow') if m in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[0] == "2 []", done.stderr[-2000:]  # the error said before any of them loads
    assert done.stderr.startswith("raytrain-mp: error: --model: unknown model 'resnt18'; closest: resnet18")


def test_weights_load_strict_and_a_misfit_is_one_line(tmp_path):
    model = build_model("shufflenet_v2_x0_5", 10, 1, image_size=32)
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    loaded = build_model("shufflenet_v2_x0_5", 10, 1, weights=path, image_size=32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(UsageError) as info:
        check_model("shufflenet_v2_x0_5", 10, 3, 32, weights=path)
    assert str(info.value) == (
        f"--weights: {path} fits neither the model nor the model with a new head (fc): first mismatch: conv1.0.weight "
        "is 24x1x3x3 in the file, 24x3x3x3 in the model"
    )


def test_the_check_leaves_the_random_state_alone():
    torch.manual_seed(5)
    check_model("regnet_y_400mf", 10, 3, 32)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))
