"""Torch's ``PipelineStage`` as a rank runs it: timed on the rank's busy clock, with receives posted
ahead and the last backward split.

Job: ``TimedStage`` adds to torch's runtime what ``stage`` needs of it (``Schedule.post_ahead``,
``Schedule.split_last_backward``):

- The seconds a rank computes: its forwards and backwards, timed on its device (``busy_clock``:
  CUDA events on the compute stream, read once at the step's end; regions ``forward`` and
  ``backward``), never with a device-wide synchronize, which would count a send that waits for its
  peer as compute and keep computing from overlapping communication.
- Receives posted ahead (gloo only; GPipe, 1F1B): at the start of a step a rank posts the step's
  receives into torch's per-micro-batch buffers, and waits on each just before the forward or
  backward that reads it. Torch posts each receive only when its schedule reaches it, and on gloo
  a message that arrived before then costs another exchange between the ranks (figures:
  docs/performance.md).
- The last backward split (GPipe, 1F1B): a rank's backward of the step's last micro-batch
  computes the gradients of its input first, which the schedule sends at once, and the gradients
  of its weights at the schedule's end, while the previous rank runs that micro-batch's backward.
  That backward is the step's tail, which torch's schedules run one whole backward after another,
  rank by rank; zero-bubble schedules split it the same way. The first stage sends no gradients
  and keeps its whole backward; the interleaved schedules order their own.

Invariant: a failed step's pending weight gradients are dropped (``drop_weight_gradients``), never
applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.pipelining import PipelineStage

from raytrain_mp.pipeline.busy_clock import BusyClock


class TimedStage(PipelineStage):
    """``PipelineStage`` that times its forwards and backwards on the rank's ``clock`` (regions
    ``forward`` and ``backward``), can take a step's receives posted ahead of it
    (``post_receives``), and can split its last backward (``split_last_backward``)."""

    split_backwards = 0  # backwards run split in this step
    # The last micro-batch's backward computes the input gradients only, which the schedule then
    # sends, and ``perform_reduce_grad`` the weight gradients at the schedule's end (see the module
    # docstring). Not on the first stage: it sends no gradients.
    split_last_backward = False

    def __init__(self, *args: Any, clock: BusyClock, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self._posted: dict[tuple[str, int], list[dist.Work]] = {}  # (direction, micro-batch) -> receives
        self._weights_pending: list[int] = []  # micro-batches whose weight gradients wait (split_last_backward)

    def post_receives(self, num_microbatches: int, directions: Sequence[str]) -> int:
        """Post the coming step's receives of ``directions`` now, each micro-batch's into its own
        buffer: ``forward``, the activations from the previous rank; ``backward``, the gradients
        from the next (see ``Schedule.post_ahead`` for why). Until the first step has built the
        buffers, nothing is posted and torch posts as usual. Returns how many receives it posted."""
        if 0 not in self.args_recv_info:
            return 0
        receives = {"forward": super().get_fwd_recv_ops, "backward": super().get_bwd_recv_ops}
        posted = 0
        for direction in directions:
            for i in range(num_microbatches):
                self._posted[direction, i] = post(receives[direction](i))
                posted += len(self._posted[direction, i])
        return posted

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return [] if ("forward", fwd_chunk_id) in self._posted else super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return [] if ("backward", bwd_chunk_id) in self._posted else super().get_bwd_recv_ops(bwd_chunk_id)

    def _received(self, direction: str, chunk: int) -> None:
        # Waited on here, where the data is first read, not where torch's schedule would have
        # posted the receive: there it may still hold sends of its own that the peer waits for.
        for work in self._posted.pop((direction, chunk), ()):
            work.wait()

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self._received("forward", fwd_chunk_id)
        with self.clock.region("forward"):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Tensor | None = None, full_backward: bool = True, last_backward: bool = False
    ) -> Any:
        self._received("backward", bwd_chunk_id)
        if self.split_last_backward and last_backward and not self.is_first:
            full_backward = False
            self._weights_pending.append(bwd_chunk_id)
        with self.clock.region("backward"):
            return super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # Torch's GPipe and 1F1B call this once the step's backwards are done and their sends
        # waited on: the weight gradients left pending go first, as a reduction needs them.
        while self._weights_pending:
            self.backward_weight_one_chunk(self._weights_pending.pop(0), last_backward=True)
            self.split_backwards += 1
        super().perform_reduce_grad(grad_scale_factor)

    def drop_weight_gradients(self) -> None:
        """Forget what a failed step left pending, with the graph torch kept for it."""
        for chunk in self._weights_pending:
            self.dw_runner.pop(chunk, None)
            self.backward_state.pop(chunk, None)
        self._weights_pending.clear()

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.region("backward"):
            return super().backward_weight_one_chunk(*args, **kwargs)


def post(ops: Sequence[dist.P2POp]) -> list[dist.Work]:
    return [dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer) for op in ops]
