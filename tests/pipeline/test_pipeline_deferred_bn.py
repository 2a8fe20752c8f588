"""Deferred BatchNorm: per-micro-batch normalization, running statistics of the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrain_mp.pipeline.deferred_bn import DeferredBatchNorm, commit_deferred_batchnorm, convert_deferred_batchnorm


def _batch(dtype: torch.dtype = torch.float64, mean: float = 2.0) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(13, 4, 5, 5, dtype=dtype) * 3 + mean


@pytest.mark.parametrize("m", [1, 2, 4, 13])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_equal_one_pass_over_the_batch(m: int, momentum: float | None) -> None:
    x = _batch()
    reference = nn.BatchNorm2d(4, momentum=momentum).double()
    deferred = DeferredBatchNorm(4, momentum=momentum).double()
    for step in range(2):
        reference(x + step)
        for chunk in (x + step).tensor_split(m):
            deferred(chunk)
        deferred.commit()
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(deferred, key), getattr(reference, key), rtol=1e-12, atol=1e-12)


def test_forward_and_gradients_are_batchnorm_per_microbatch() -> None:
    x = _batch().requires_grad_()
    reference = nn.BatchNorm2d(4).double()
    deferred = convert_deferred_batchnorm(nn.Sequential(nn.BatchNorm2d(4).double()))
    deferred.load_state_dict(nn.Sequential(reference).state_dict())
    for chunk in x.tensor_split(3):
        expected = reference(chunk)
        torch.testing.assert_close(deferred(chunk), expected, rtol=0, atol=0)
        weights = torch.randn_like(expected)
        got = torch.autograd.grad((deferred(chunk) * weights).sum(), [chunk, deferred[0].weight])
        want = torch.autograd.grad((expected * weights).sum(), [chunk, reference.weight])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_float32_statistics_stay_accurate_far_from_zero() -> None:
    x = _batch(torch.float64, mean=1000.0)
    reference = nn.BatchNorm2d(4).double()
    reference(x)
    deferred = DeferredBatchNorm(4)
    for chunk in x.float().tensor_split(5):
        deferred(chunk)
    deferred.commit()
    torch.testing.assert_close(deferred.running_var.double(), reference.running_var, rtol=0, atol=1e-3)
    torch.testing.assert_close(deferred.running_mean.double(), reference.running_mean, rtol=1e-6, atol=0)


def test_conversion_keeps_keys_and_tensors() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(2)))
    keys = list(model.state_dict())
    weight = model[1].weight
    converted = convert_deferred_batchnorm(model)
    assert isinstance(converted[1], DeferredBatchNorm) and isinstance(converted[2][0], DeferredBatchNorm)
    assert converted[1].weight is weight
    assert list(converted.state_dict()) == keys
    nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(2))).load_state_dict(
        converted.state_dict(), strict=True
    )


def test_eval_uses_running_statistics_and_commit_without_data_is_a_no_op() -> None:
    deferred = DeferredBatchNorm(4).double()
    commit_deferred_batchnorm(deferred)
    assert int(deferred.num_batches_tracked) == 0
    deferred.running_mean.fill_(1.0)
    x = _batch()
    expected = nn.BatchNorm2d(4).double().eval()
    expected.running_mean.fill_(1.0)
    torch.testing.assert_close(deferred.eval()(x), expected(x))
