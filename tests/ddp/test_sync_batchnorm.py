"""PortableSyncBatchNorm against one nn.BatchNorm over the global batch, on real gloo groups.

Three gloo processes, spawned once for the module, hold uneven slices (2, 5 and 9 samples) of
seeded global batches and run every distributed scenario (single layers in float32 and float64,
float32 stability at mean 1000, two DDP training steps); each rank saves its tensors and the parent
compares them with plain BatchNorm over the concatenated batch in one process.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torchvision.models import resnet18

from raytrain_mp.ddp.sync_batchnorm import PortableSyncBatchNorm, convert_sync_batchnorm

SIZES = (2, 5, 9)
WORLD_SIZE = len(SIZES)

# name -> (reference BatchNorm class, per-sample shape (C, ...), dtype, momentum, rank batch sizes)
Case = tuple[type[nn.Module], tuple[int, ...], torch.dtype, float | None, tuple[int, ...]]
CASES: dict[str, Case] = {
    "2d-fp32": (nn.BatchNorm2d, (4, 3, 3), torch.float32, 0.1, SIZES),
    "1d-fp32": (nn.BatchNorm1d, (6,), torch.float32, 0.1, SIZES),
    "1d-seq-fp32": (nn.BatchNorm1d, (6, 5), torch.float32, 0.1, SIZES),
    "2d-fp64": (nn.BatchNorm2d, (4, 3, 3), torch.float64, 0.1, SIZES),
    "1d-fp64": (nn.BatchNorm1d, (6,), torch.float64, 0.1, SIZES),
    "1d-seq-fp64": (nn.BatchNorm1d, (6, 5), torch.float64, 0.1, SIZES),
    "2d-cumulative-average": (nn.BatchNorm2d, (4, 3, 3), torch.float32, None, SIZES),
    "2d-empty-rank": (nn.BatchNorm2d, (4, 3, 3), torch.float32, 0.1, (0, 7, 9)),
    "2d-all-empty": (nn.BatchNorm2d, (4, 3, 3), torch.float32, 0.1, (0, 0, 0)),
}
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}

# Mean 1000, std 1 in float32: E[x^2] ~ 1e6 where float32 spacing is 0.0625.
STABILITY_SHAPE = (16, 3, 8, 8)


def _case_data(name: str) -> dict[str, Tensor]:
    """Seeded global inputs, upstream gradients and affine parameters of one case."""
    _, shape, dtype, _, sizes = CASES[name]
    gen = torch.Generator().manual_seed(list(CASES).index(name))
    n = sum(sizes)
    data = {key: torch.randn(n, *shape, generator=gen) for key in ("x1", "x2", "g1", "g2")}
    data["x1"] = data["x1"] * 3 + 2
    data["x2"] = data["x2"] * 0.5 - 1
    data["weight"] = torch.randn(shape[0], generator=gen)
    data["bias"] = torch.randn(shape[0], generator=gen)
    return {key: value.to(dtype) for key, value in data.items()}


def _stability_data() -> Tensor:
    gen = torch.Generator().manual_seed(1234)
    return (1000 + torch.randn(*STABILITY_SHAPE, generator=gen, dtype=torch.float64)).float()


def _rank_slice(sizes: tuple[int, ...], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _two_steps(bn: nn.Module, data: dict[str, Tensor], rows: slice) -> dict[str, Tensor]:
    """Two training forwards (momentum acts twice), one backward of sum(out * g) over both."""
    with torch.no_grad():
        bn.weight.copy_(data["weight"])
        bn.bias.copy_(data["bias"])
    bn.train()
    x1 = data["x1"][rows].clone().requires_grad_()
    x2 = data["x2"][rows].clone().requires_grad_()
    out1 = bn(x1)
    out2 = bn(x2)
    ((out1 * data["g1"][rows]).sum() + (out2 * data["g2"][rows]).sum()).backward()
    return {
        "out1": out1.detach(),
        "out2": out2.detach(),
        "grad_x1": x1.grad,
        "grad_x2": x2.grad,
        "grad_weight": bn.weight.grad,
        "grad_bias": bn.bias.grad,
        "running_mean": bn.running_mean.clone(),
        "running_var": bn.running_var.clone(),
        "num_batches_tracked": bn.num_batches_tracked.clone(),
    }


def _small_net(norm: type[nn.Module]) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 4, 3), norm(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5)).double()


def _ddp_data() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(sum(SIZES), 3, 6, 6, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 5, (sum(SIZES),), generator=gen)


def _sgd_steps(model: nn.Module, x: Tensor, y: Tensor, loss_scale: float) -> dict[str, Tensor]:
    """Two SGD steps on ``sum of per-sample losses * loss_scale``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum") * loss_scale
        loss.backward()
        optimizer.step()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    results: dict[str, Any] = {}
    for name, (_, shape, dtype, momentum, sizes) in CASES.items():
        bn = PortableSyncBatchNorm(shape[0], momentum=momentum, dtype=dtype)
        results[name] = _two_steps(bn, _case_data(name), _rank_slice(sizes, rank))

    bn = PortableSyncBatchNorm(STABILITY_SHAPE[1], momentum=1.0)
    results["stability"] = {
        "out": bn(_stability_data()[_rank_slice(SIZES, rank)]).detach(),
        "running_mean": bn.running_mean.clone(),
        "running_var": bn.running_var.clone(),
    }

    # DDP averages gradients over ranks, so each rank scales its summed loss by W / N_global.
    ddp = nn.parallel.DistributedDataParallel(_small_net(PortableSyncBatchNorm))
    x, y = _ddp_data()
    rows = _rank_slice(SIZES, rank)
    state = _sgd_steps(ddp, x[rows], y[rows], WORLD_SIZE / sum(SIZES))
    results["ddp"] = {key.removeprefix("module."): value for key, value in state.items()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of every distributed scenario, from one spawn of 3 processes."""
    tmp = tmp_path_factory.mktemp("gloo")
    mp.spawn(_worker, args=(str(tmp / "rendezvous"), str(tmp)), nprocs=WORLD_SIZE, join=True)
    return [torch.load(tmp / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_batchnorm_over_the_global_batch(gloo_results: list[dict[str, Any]], name: str) -> None:
    bn_class, shape, dtype, momentum, sizes = CASES[name]
    data = _case_data(name)
    ref = _two_steps(bn_class(shape[0], momentum=momentum, dtype=dtype), data, slice(None))
    tol = TOLERANCE[dtype]

    def close(actual: Tensor, expected: Tensor, what: str) -> None:
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")

    for rank, result in enumerate(gloo_results):
        got = result[name]
        rows = _rank_slice(sizes, rank)
        for key in ("out1", "out2", "grad_x1", "grad_x2"):
            close(got[key], ref[key][rows], f"rank {rank} {key}")
        for key in ("running_mean", "running_var"):
            close(got[key], ref[key], f"rank {rank} {key}")
        assert int(got["num_batches_tracked"]) == 2
    for key in ("grad_weight", "grad_bias"):
        summed = torch.stack([result[name][key] for result in gloo_results]).sum(dim=0)
        close(summed, ref[key], f"sum over ranks of {key}")


def test_statistics_are_stable_in_float32(gloo_results: list[dict[str, Any]]) -> None:
    x = _stability_data()
    dims = (0, 2, 3)
    n = x.numel() // x.shape[1]
    channels = x.shape[1]

    exact = nn.BatchNorm2d(channels, momentum=1.0, dtype=torch.float64)
    exact_out = exact(x.double())
    torch_fp32 = nn.BatchNorm2d(channels, momentum=1.0)
    torch_out = torch_fp32(x).detach()

    ours_out = torch.cat([result["stability"]["out"] for result in gloo_results])
    ours_var = gloo_results[0]["stability"]["running_var"]
    ours_mean = gloo_results[0]["stability"]["running_mean"]

    def err(a: Tensor, b: Tensor) -> float:
        return (a.double() - b.double()).abs().max().item()

    out_err, torch_out_err = err(ours_out, exact_out), err(torch_out, exact_out)
    var_err = err(ours_var, exact.running_var)
    torch_var_err = err(torch_fp32.running_var, exact.running_var)
    naive_var = (x.square().mean(dims) - x.mean(dims).square()) * n / (n - 1)
    naive_var_err = err(naive_var, exact.running_var)
    print(
        f"max abs error vs float64: output ours {out_err:.3g} torch-fp32 {torch_out_err:.3g}; "
        f"running_var ours {var_err:.3g} torch-fp32 {torch_var_err:.3g} "
        f"naive E[x^2]-E[x]^2 {naive_var_err:.3g}"
    )

    assert out_err <= 4 * torch_out_err + 1e-6
    assert var_err <= 4 * torch_var_err + 1e-6
    torch_mean_err = err(torch_fp32.running_mean, exact.running_mean)
    assert err(ours_mean, exact.running_mean) <= 4 * torch_mean_err + 1e-6
    # The formula the module avoids: off by far more than the whole float32 error budget.
    assert naive_var_err > 100 * max(var_err, torch_var_err, 1e-6)


def test_ddp_steps_match_one_process_on_the_global_batch(
    gloo_results: list[dict[str, Any]],
) -> None:
    x, y = _ddp_data()
    expected = _sgd_steps(_small_net(nn.BatchNorm2d), x, y, 1 / sum(SIZES))
    for rank, result in enumerate(gloo_results):
        assert list(result["ddp"]) == list(expected)
        for key, value in expected.items():
            torch.testing.assert_close(
                result["ddp"][key],
                value,
                atol=1e-10,
                rtol=1e-10,
                msg=lambda m: f"rank {rank} {key}: {m}",
            )


@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_process_group_is_plain_batchnorm(momentum: float | None) -> None:
    assert not (dist.is_available() and dist.is_initialized())
    gen = torch.Generator().manual_seed(7)
    data = {
        "x1": torch.randn(8, 4, 5, 5, generator=gen) * 2 + 1,
        "x2": torch.randn(8, 4, 5, 5, generator=gen),
        "g1": torch.randn(8, 4, 5, 5, generator=gen),
        "g2": torch.randn(8, 4, 5, 5, generator=gen),
        "weight": torch.randn(4, generator=gen),
        "bias": torch.randn(4, generator=gen),
    }
    ours_bn = PortableSyncBatchNorm(4, momentum=momentum)
    ref_bn = nn.BatchNorm2d(4, momentum=momentum)
    ours = _two_steps(ours_bn, data, slice(None))
    ref = _two_steps(ref_bn, data, slice(None))
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")

    ours_bn.eval()
    ref_bn.eval()
    x = torch.randn(3, 4, 5, 5, generator=gen)
    torch.testing.assert_close(ours_bn(x), ref_bn(x), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="at least 2D"):
        ours_bn(torch.randn(4))


def _batchnorms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _perturbed_resnet18() -> nn.Module:
    """ResNet-18 whose BatchNorm state differs from the defaults, so copying is observable."""
    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    gen = torch.Generator().manual_seed(1)
    for i, bn in enumerate(_batchnorms(model)):
        with torch.no_grad():
            bn.weight.copy_(1 + 0.1 * torch.randn(bn.num_features, generator=gen))
            bn.bias.copy_(0.1 * torch.randn(bn.num_features, generator=gen))
            bn.running_mean.copy_(torch.randn(bn.num_features, generator=gen))
            bn.running_var.copy_(torch.rand(bn.num_features, generator=gen) + 0.5)
            bn.num_batches_tracked.fill_(i + 3)
    model.bn1.weight.requires_grad_(False)
    return model


def test_convert_resnet18_keeps_state_dict_interchangeable() -> None:
    model = _perturbed_resnet18()
    reference = copy.deepcopy(model)
    converted = convert_sync_batchnorm(model)

    plain_bns, converted_bns = _batchnorms(reference), _batchnorms(converted)
    assert len(plain_bns) == 20
    assert len(converted_bns) == len(plain_bns)
    assert all(type(m) is PortableSyncBatchNorm for m in converted_bns)
    assert not converted.bn1.weight.requires_grad
    assert converted.layer1[0].bn1.weight.requires_grad

    converted_sd, reference_sd = converted.state_dict(), reference.state_dict()
    assert list(converted_sd) == list(reference_sd)
    for key, value in reference_sd.items():
        assert torch.equal(converted_sd[key], value), key

    fresh_plain = resnet18(num_classes=10)
    fresh_plain.load_state_dict(converted_sd, strict=True)
    for key, value in fresh_plain.state_dict().items():
        assert torch.equal(value, reference_sd[key]), key
    fresh_converted = convert_sync_batchnorm(resnet18(num_classes=10))
    fresh_converted.load_state_dict(reference_sd, strict=True)
    for key, value in fresh_converted.state_dict().items():
        assert torch.equal(value, reference_sd[key]), key

    # Without a process group the converted network computes what the original did.
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    reference.train()
    converted.train()
    torch.testing.assert_close(converted(x), reference(x), atol=1e-6, rtol=0)
    reference.eval()
    converted.eval()
    torch.testing.assert_close(converted(x), reference(x), atol=1e-6, rtol=0)


def test_convert_picks_native_layer_for_cuda_and_portable_elsewhere() -> None:
    # nn.SyncBatchNorm is constructible without CUDA; only its training forward needs a GPU.
    def net() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))

    assert type(convert_sync_batchnorm(net(), device="cuda")[1]) is nn.SyncBatchNorm
    assert type(convert_sync_batchnorm(net(), device="cpu")[1]) is PortableSyncBatchNorm
    # A bare BatchNorm comes back as a new layer; an already converted one is left as it is.
    bare = convert_sync_batchnorm(nn.BatchNorm1d(5))
    assert type(bare) is PortableSyncBatchNorm
    assert convert_sync_batchnorm(bare) is bare


@pytest.mark.gpu(1)
def test_cuda_model_gets_native_sync_batchnorm(no_tf32) -> None:
    model = _perturbed_resnet18().cuda()
    reference = copy.deepcopy(model)
    converted = convert_sync_batchnorm(model)
    bns = _batchnorms(converted)
    assert bns and all(type(m) is nn.SyncBatchNorm for m in bns)
    assert list(converted.state_dict()) == list(reference.state_dict())
    # No process group: the native layer falls back to plain BatchNorm.
    x = torch.randn(2, 3, 32, 32, device="cuda")
    torch.testing.assert_close(converted(x), reference(x), atol=1e-5, rtol=1e-5)
