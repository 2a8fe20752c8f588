"""Fine-tuning from pretrained weights (issue 50), with no network.

torchvision's weights are read through its cache, ``TORCH_HOME/hub/checkpoints/<the URL's file
name>``; each test points ``TORCH_HOME`` at a temporary folder and writes a seeded
``torchvision.models.resnet18()``'s state dict there under the name torchvision expects
(``resnet18-f37072fd.pth``). torch checks the hash in that name only when it downloads the file,
never for one already in the cache (``torch.hub.load_state_dict_from_url``), so the file is read as
it is, as a user's copied file would be: ``pretrained.fetch`` still asks for ``check_hash=True``,
which guards what it downloads. ``--weights IMAGENET1K_V1`` then runs the whole path a user's
runs take: name -> cached file -> a model of 3 classes with a new seeded head -> the weights'
preprocessing (resize 256, crop 224, bilinear, ImageNet mean/std) in training, ``eval`` and ``predict``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision import models as tv_models

from raytrain_mp.data.transforms import BatchTransform
from raytrain_mp.finetune import backbone_state, freeze_backbone, lr_scales
from raytrain_mp.inference.checkpoint import load_run
from raytrain_mp.optim import build_optimizer
from raytrain_mp.preprocessing import Preprocess
from raytrain_mp.pretrained import cached_path, fit_state

from helpers import assert_usage_error, run_cli, run_cli_json, run_cli_text

WEIGHTS_FILE = "resnet18-f37072fd.pth"  # the file name of ResNet18_Weights.IMAGENET1K_V1's URL
PREPROCESS = "resize=256,crop=224,interpolation=bilinear,mean=0.485:0.456:0.406,std=0.229:0.224:0.225"


def pretrained_state() -> dict[str, torch.Tensor]:
    """What stands in for ImageNet weights: a seeded torchvision resnet18 of 1000 classes (a new
    dict of the same tensors each call, built once)."""
    return dict(_pretrained_state())


@functools.lru_cache(maxsize=1)
def _pretrained_state() -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return tv_models.resnet18().state_dict()


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    """A private ``TORCH_HOME`` whose cache holds the seeded weights under torchvision's file name."""
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    path = home / "hub" / "checkpoints" / WEIGHTS_FILE
    path.parent.mkdir(parents=True)
    torch.save(pretrained_state(), path)
    assert cached_path(tv_models.ResNet18_Weights.IMAGENET1K_V1) == path
    return home


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """A 3-class image folder (8 PNGs of 20 to 40 px a class) prepared raw at 32 px: 18 train, 6 val."""
    from PIL import Image

    root = tmp_path_factory.mktemp("finetune")
    rng = np.random.default_rng(0)
    for c in range(3):
        (root / "tree" / f"class{c}").mkdir(parents=True)
        for i in range(8):
            h, w = (int(v) for v in rng.integers(20, 41, size=2))
            pixels = rng.normal(60 + 60 * c, 30, size=(h, w, 3))
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(root / "tree" / f"class{c}" / f"{i}.png")
    out = root / "data"
    code, text = run_cli_text(
        "data", "prepare", f"imagefolder:{root / 'tree'}", "--out", str(out), "--image-size", "32", "--val-fraction",
        "0.25",
    )  # fmt: skip
    assert code == 0, text
    return str(out)


# -- the parts, in one process -------------------------------------------------------------------


def test_a_state_dict_with_another_head_gets_a_new_seeded_head_and_keeps_every_other_tensor():
    state = pretrained_state()
    lines: list[str] = []
    models = []
    for _ in range(2):
        torch.manual_seed(7)
        model = tv_models.resnet18(num_classes=3)
        fit_state(model, state, "w.pth", lines.append)
        models.append(model)
    loaded = models[0].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if not k.startswith("fc."))
    assert loaded["fc.weight"].shape == (3, 512)
    assert torch.equal(loaded["fc.weight"], models[1].state_dict()["fc.weight"])  # seeded: the same init twice
    assert lines[0] == "new head fc: 3 classes, freshly initialized from --seed (the weights' head has 1000)"


def test_the_stem_takes_the_data_channels_and_a_foreign_state_dict_names_its_first_mismatch():
    state = pretrained_state()
    lines: list[str] = []
    gray = tv_models.resnet18(num_classes=1000)
    gray.conv1 = torch.nn.Conv2d(1, 64, 7, 2, 3, bias=False)
    fit_state(gray, state, "w.pth", lines.append)
    assert torch.equal(gray.conv1.weight, state["conv1.weight"].sum(dim=1, keepdim=True))
    assert lines == ["stem conv1.weight adapted from 3 to 1 input channels (the RGB filters summed)"]
    with pytest.raises(
        Exception, match="first mismatch: layer1.0.conv1.weight is 32x64x3x3 in the file, 64x64x3x3 in the model"
    ):
        bad = dict(state, **{"layer1.0.conv1.weight": torch.zeros(32, 64, 3, 3)})
        fit_state(tv_models.resnet18(), bad, "w.pth")


def test_a_frozen_backbone_keeps_every_tensor_and_a_scaled_backbone_lr_goes_into_its_groups():
    torch.manual_seed(0)
    model = tv_models.resnet18(num_classes=3)
    before = backbone_state(model)
    assert "bn1.running_mean" in before and "fc.weight" not in before
    freeze_backbone(model)
    optimizer = build_optimizer(model.parameters(), "sgd", 0.1, 0.9, 5e-4)
    for _ in range(2):
        model.train()
        loss = model(torch.randn(4, 3, 32, 32)).square().sum()
        loss.backward()
        optimizer.step()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    scaled = build_optimizer(model.parameters(), "sgd", 0.1, 0.9, 5e-4, lr_scale=lr_scales(model, 0.1))
    assert [g["lr"] for g in scaled.param_groups] == [0.1, 0.1, pytest.approx(0.01), pytest.approx(0.01)]
    assert [len(g["params"]) for g in scaled.param_groups[:2]] == [1, 1]  # fc.weight; fc.bias


def test_the_weights_preprocessing_reads_back_and_resizes_and_crops_on_the_device():
    spec = Preprocess.of_transforms(tv_models.ResNet18_Weights.IMAGENET1K_V1.transforms())
    assert str(spec) == PREPROCESS and str(Preprocess.parse(PREPROCESS)) == PREPROCESS

    class Meta:
        mean, std, channels = [1.0, 2.0, 3.0], [1.0, 1.0, 1.0], 3

    transform = BatchTransform.for_run(Meta, PREPROCESS)
    images = torch.randint(0, 256, (2, 3, 32, 40), dtype=torch.uint8)
    x = transform(images, torch.zeros(2, 3, dtype=torch.int64), torch.device("cpu"), torch.float64)
    assert x.shape == (2, 3, 224, 224)
    # torchvision's own eval pipeline on the same uint8 images, in float: Resize(256) + CenterCrop(224) + Normalize
    from torchvision.transforms.v2 import functional as TF

    ref = TF.center_crop(TF.resize(images.double() / 255, [256], antialias=True), [224, 224])
    ref = TF.normalize(ref, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    assert (x - ref).abs().max().item() < 1e-9


@pytest.mark.parametrize("weights, fragments", [
    ("IMAGENET1K_V9", ["--weights: resnet18 has no weights 'IMAGENET1K_V9'; accepted: IMAGENET1K_V1, DEFAULT"]),
    ("ResNet50_Weights.IMAGENET1K_V2", ["--weights: resnet18 has no weights", "(or ResNet18_Weights.NAME)"]),
    ("foreign.pt", ["--weights: ", "foreign.pt fits neither the model nor the model with a new head (fc): first "
                    "mismatch: layer4.1.bn2.num_batches_tracked is missing from the file"]),
])  # fmt: skip
def test_bad_weights_are_one_line_before_ray_starts(
    torch_home, data, tmp_path, capsys, monkeypatch, weights, fragments
):
    monkeypatch.chdir(tmp_path)
    state = pretrained_state()
    del state["layer4.1.bn2.num_batches_tracked"]
    torch.save(state, tmp_path / "foreign.pt")
    storage = tmp_path / "runs"
    argv = ["--data", data, "--global-batch-size", "6", "--storage-path", str(storage)]
    result = run_cli(capsys, "ddp", "--weights", weights, "--no-small-stem", *argv)
    assert_usage_error(result, *fragments)
    assert not storage.exists()


def test_weights_not_in_the_cache_offline_name_the_file_and_where_to_put_it(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty_home"))
    monkeypatch.setattr(tv_models.ResNet18_Weights, "url", property(lambda self: "http://127.0.0.1:9/" + WEIGHTS_FILE))
    argv = ["--data", data, "--global-batch-size", "6", "--storage-path", str(tmp_path / "runs")]
    result = run_cli(capsys, "ddp", "--weights", "IMAGENET1K_V1", *argv)
    where = tmp_path / "empty_home" / "hub" / "checkpoints" / WEIGHTS_FILE
    assert_usage_error(result, "--weights: ResNet18_Weights.IMAGENET1K_V1 is not in torchvision's cache", f"at {where}")
    assert not where.exists()


def test_a_sweep_resolves_the_weights_for_its_trials_as_ddp_does(torch_home, data, tmp_path):
    from raytrain_mp.config import build_config
    from raytrain_mp.tune.config import TuneConfig
    from raytrain_mp.tune.sweep import prepared

    options = {"weights": "DEFAULT", "freeze_backbone": True, "backbone_lr_scale": "0.1", "data": data}
    flags = {"storage_path": str(tmp_path / "runs"), "num_workers": "1", "global_batch_sizes": "6", **options}
    template = prepared(build_config(TuneConfig, flags)).template()
    assert (template.weights, template.preprocess) == (str(cached_path(tv_models.ResNet18_Weights.DEFAULT)), PREPROCESS)
    assert (template.freeze_backbone, template.backbone_lr_scale) == (True, 0.1)


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_fine_tunes_the_head_of_cached_weights_and_eval_and_predict_preprocess_as_it_did(
    ray_session, torch_home, data, tmp_path, capsys
):
    from raytrain_mp.config import build_config
    from raytrain_mp.data import read_meta
    from raytrain_mp.ddp.config import DDPConfig
    from raytrain_mp.epochs import build_run_model

    storage = str(tmp_path / "runs")
    summary = run_cli_json(
        "ddp", "--model", "resnet18", "--weights", "IMAGENET1K_V1", "--data", data, "--seed", "3", "--freeze-backbone",
        "--num-workers", "2", "--epochs", "1", "--global-batch-size", "6", "--base-lr", "0.5", "--storage-path",
        storage, "--name", "tuned", "--log-every", "0",
    )  # fmt: skip
    # What every worker built before its first step, from the run's own config.yaml (seeded as
    # ddp.loop.build_ddp seeds it): the cached file's tensors, unchanged, and a new head.
    cfg = build_config(DDPConfig, {"config": str(Path(summary["checkpoint"]) / "config.yaml")})
    assert (cfg.weights, cfg.preprocess) == (str(torch_home / "hub" / "checkpoints" / WEIGHTS_FILE), PREPROCESS)
    torch.manual_seed(cfg.seed)
    start = build_run_model(cfg, read_meta(data)).state_dict()
    pretrained = pretrained_state()
    assert all(torch.equal(start[k], v) for k, v in pretrained.items() if not k.startswith("fc."))
    assert start["fc.weight"].shape == (3, 512)
    trained = torch.load(summary["model"], weights_only=True)
    assert all(torch.equal(trained[k], v) for k, v in pretrained.items() if not k.startswith("fc."))  # frozen
    assert not torch.equal(trained["fc.weight"], start["fc.weight"])  # the head trained
    run, model = load_run(summary["run"])
    assert run.preprocess == PREPROCESS and run.input_shape == (224, 224, 3)
    tv_models.resnet18(num_classes=3).load_state_dict(trained, strict=True)  # the plain torchvision model

    evaluation = run_cli_json(
        "eval", "--checkpoint", summary["run"], "--num-workers", "1", "--out", str(tmp_path / "e")
    )
    assert (evaluation["accuracy"], evaluation["count"]) == (summary["val_accuracy"], summary["val_count"])
    image = Path(data).parent / "tree" / "class1" / "0.png"
    predicted = run_cli_json("predict", "--checkpoint", summary["run"], str(image), "--top-k", "3")
    # predict: the model on the file as the val split holds it (32 px), resized, cropped and normalized as weights say
    from raytrain_mp.inference.images import load_image

    x = run.transform()(load_image(image, run.meta)[None], torch.zeros(1, 3, dtype=torch.int64), "cpu", torch.float32)
    assert x.shape == (1, 3, 224, 224)
    expected = torch.softmax(model(x).double(), dim=1)[0]
    assert predicted["predictions"][0]["probabilities"] == pytest.approx(
        expected.sort(descending=True).values.tolist(), abs=1e-6
    )


SMALL = "resize=40,crop=32,interpolation=bicubic,mean=0.485:0.456:0.406,std=0.229:0.224:0.225"


@pytest.mark.slow
def test_the_pipeline_loads_the_same_backbone_and_puts_the_new_head_on_its_last_stage(
    ray_session, torch_home, data, tmp_path, capsys
):
    """Through two stage actors, on a small explicit ``--preprocess`` (the weights' 224 px costs the
    ddp test's compute once; here the stages train the whole model)."""
    from raytrain_mp.data import read_meta
    from raytrain_mp.epochs import build_run_model
    from raytrain_mp.pipeline.config import PipelineConfig
    from raytrain_mp.pipeline.run import with_checked_inputs

    storage = str(tmp_path / "runs")
    options = {"model": "resnet18", "weights": "ResNet18_Weights.IMAGENET1K_V1", "preprocess": SMALL}
    # What the driver builds and cuts into stages (seeded as run_pipeline seeds it): the backbone unchanged.
    cfg = with_checked_inputs(
        PipelineConfig(**options, small_stem=False, data=data, global_batch_size=6, storage_path=storage)
    )
    torch.manual_seed(cfg.seed)
    start = build_run_model(cfg, read_meta(data)).state_dict()
    pretrained = pretrained_state()
    assert all(torch.equal(start[k], v) for k, v in pretrained.items() if not k.startswith("fc."))
    assert start["fc.weight"].shape == (3, 512)
    capsys.readouterr()
    result = run_cli(
        capsys, "pipeline", *(f"--{k}={v}" for k, v in options.items()), "--no-small-stem", "--data", data,
        "--stages", "2", "--microbatches", "2", "--balance", "params", "--epochs", "1", "--global-batch-size", "6",
        "--storage-path", storage, "--name", "piped", "--log-every", "0", "--json",
    )  # fmt: skip
    assert result.code == 0, result
    assert "new head fc: 3 classes, freshly initialized from --seed (the weights' head has 1000)" in result.out
    summary = result.last_json
    assert summary["stages"][-1]["blocks"][-1] == "head"  # avgpool, flatten and fc: the last stage's
    trained = torch.load(summary["model"], weights_only=True)
    tv_models.resnet18(num_classes=3).load_state_dict(trained, strict=True)
    run, _ = load_run(summary["run"])
    assert run.preprocess == SMALL and run.input_shape == (32, 32, 3)
