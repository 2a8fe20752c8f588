"""The busy clock (``pipeline.busy_clock``): what a region counts, what it does not, on each device.

Bounds hold on a loaded machine: a region around a sleep counts at least the sleep; an empty
region after 0.2 s of work or waiting outside it counts under 50 ms."""

from __future__ import annotations

import time

import pytest
import torch

from raytrain_mp.pipeline.busy_clock import BusyClock, CpuBusyClock, CudaBusyClock, busy_clock

DEVICES = [
    pytest.param(torch.device("cpu"), id="cpu"),
    pytest.param(torch.device("cuda", 0), id="cuda", marks=pytest.mark.gpu(1)),
]


def _spin(device: torch.device, seconds: float) -> None:
    """Work that keeps ``device`` computing for at least ``seconds``: a host sleep on the CPU
    (wall time is what the CPU clock counts), a kernel that spins on the GPU."""
    if device.type == "cuda":
        torch.cuda._sleep(int(seconds * 2e9))  # cycles; at most 2 GHz, so at least ``seconds``
    else:
        time.sleep(seconds)


def test_factory_picks_the_clock_of_the_device() -> None:
    assert type(busy_clock(torch.device("cpu"))) is CpuBusyClock
    assert type(busy_clock(torch.device("cuda", 0))) is CudaBusyClock  # built lazily: no GPU needed
    with pytest.raises(ValueError, match="no clock for device type 'meta'"):
        busy_clock(torch.device("meta"))


@pytest.mark.parametrize("device", DEVICES)
def test_regions_count_by_kind_and_collect_forgets_them(device: torch.device) -> None:
    clock: BusyClock = busy_clock(device)
    assert clock.collect() == {}
    with clock.region("forward"):
        _spin(device, 0.05)
    with clock.region("backward"):
        _spin(device, 0.1)
    with clock.region("forward"):
        _spin(device, 0.05)
    seconds = clock.collect()
    assert set(seconds) == {"forward", "backward"}
    assert seconds["forward"] >= 0.1 and seconds["backward"] >= 0.1
    assert clock.collect() == {}


@pytest.mark.parametrize("device", DEVICES)
def test_work_and_waiting_outside_regions_do_not_count(device: torch.device) -> None:
    clock = busy_clock(device)
    # On a GPU the spin is still queued ahead of the region, as a receive the stream waits for is:
    # the region starts when the stream reaches it.
    _spin(device, 0.2)
    with clock.region("update"):
        pass
    time.sleep(0.2)
    assert 0 <= clock.collect()["update"] < 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_a_region_that_raises_records_nothing_and_discard_forgets(device: torch.device) -> None:
    clock = busy_clock(device)
    with pytest.raises(ZeroDivisionError):
        with clock.region("forward"):
            _spin(device, 0.01)
            1 / 0
    with clock.region("backward"):
        _spin(device, 0.01)
    clock.discard()
    assert clock.collect() == {}
    with clock.region("backward"):  # the failed region closed: a new one may open
        _spin(device, 0.01)
    assert set(clock.collect()) == {"backward"}


def test_regions_do_not_nest() -> None:
    clock = busy_clock(torch.device("cpu"))
    with clock.region("forward"):
        with pytest.raises(RuntimeError, match="regions do not nest"):
            with clock.region("backward"):
                pass
    assert set(clock.collect()) == {"forward"}


@pytest.mark.gpu(1)
def test_cuda_regions_time_kernels_not_their_launch() -> None:
    """A kernel launch returns at once; the region still counts the kernel, read at collect."""
    device = torch.device("cuda", 0)
    clock = busy_clock(device)
    with clock.region("forward"):
        started = time.perf_counter()
        _spin(device, 0.1)
        launched = time.perf_counter() - started
    assert launched < 0.05  # asynchronous: the host did not wait for the kernel
    assert clock.collect()["forward"] >= 0.1
