"""Measuring the seconds a rank's device computes (its busy time), without stalling the device.

Job: time the regions of a step in which a rank computes (its forwards, backwards and update) on
the device that runs them, and hand over the step's seconds per kind of region once, at the
step's end (``collect``). ``busy_clock(device)`` picks the implementation; both share one
interface (``BusyClock``):

- CUDA (``CudaBusyClock``): a pair of ``torch.cuda.Event(enable_timing=True)`` recorded on the
  current stream around each region. The GPU stamps an event when the stream reaches it, so a
  region starts when its kernels may start: after the waits torch's schedule put on the stream
  for a receive, so time spent waiting for a peer is not counted. A stream the host starves
  inside a region counts as busy.
- CPU (``CpuBusyClock``): ``time.perf_counter`` around each region. CPU ops run synchronously, so a
  region's wall time is its compute.

Invariants:
- Never a device-wide ``torch.cuda.synchronize``: it would wait for NCCL sends still waiting for
  their peer (counting waiting as compute) and keep the next region's kernels from overlapping
  communication. ``collect`` waits for the last recorded event only.
- A clock's regions run on one stream (the rank's compute stream), so once its last event is done
  every earlier one is.
- Regions do not nest (their seconds would count twice); a region that raises records nothing.
  ``collect`` returns the regions since the last ``collect`` or ``discard``, and forgets them.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class BusyClock(ABC):
    """Sums the seconds of timed regions by kind (``"forward"``, ``"backward"``, ``"update"``)."""

    def __init__(self) -> None:
        self._regions: list[tuple[str, Any, Any]] = []  # (kind, start mark, stop mark)
        self._open = False

    @contextmanager
    def region(self, kind: str) -> Iterator[None]:
        """Count the body's compute as ``kind``."""
        if self._open:
            raise RuntimeError("BusyClock: regions do not nest")
        self._open = True
        try:
            start = self._mark()
            yield
            self._regions.append((kind, start, self._mark()))
        finally:
            self._open = False

    def collect(self) -> dict[str, float]:
        """Seconds per kind of the regions since the last ``collect`` or ``discard`` (waiting, on a
        GPU, for the last region's kernels to finish); forgets them."""
        regions, self._regions = self._regions, []
        if regions:
            self._wait(regions[-1][2])
        seconds: dict[str, float] = {}
        for kind, start, stop in regions:
            seconds[kind] = seconds.get(kind, 0.0) + self._seconds(start, stop)
        return seconds

    def discard(self) -> None:
        """Forget the regions since the last ``collect`` unread (a failed step's, on a device that
        may not answer any more)."""
        self._regions = []

    @abstractmethod
    def _mark(self) -> Any:
        """A point in the device's time, taken when the device's work reaches it."""

    @abstractmethod
    def _wait(self, mark: Any) -> None:
        """Return once the device's work has reached ``mark``."""

    @abstractmethod
    def _seconds(self, start: Any, stop: Any) -> float:
        """Seconds from ``start`` to ``stop``, both reached."""


class CpuBusyClock(BusyClock):
    """Wall time: on the CPU an op has finished when its call returns."""

    def _mark(self) -> float:
        return time.perf_counter()

    def _wait(self, mark: float) -> None:
        pass  # nothing is still running

    def _seconds(self, start: float, stop: float) -> float:
        return stop - start


class CudaBusyClock(BusyClock):
    """Timing events on the current stream of ``device``, read at ``collect``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def _mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()

    def _seconds(self, start: torch.cuda.Event, stop: torch.cuda.Event) -> float:
        return start.elapsed_time(stop) / 1000.0  # milliseconds


def busy_clock(device: torch.device) -> BusyClock:
    """The clock for ``device``: CUDA events on a GPU, wall time on the CPU."""
    if device.type == "cuda":
        return CudaBusyClock(device)
    if device.type == "cpu":
        return CpuBusyClock()
    raise ValueError(f"busy_clock: no clock for device type {device.type!r}; accepted: cuda, cpu")
