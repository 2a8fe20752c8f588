"""Elastic DDP's pure rules: the worker range, which world sizes a batch admits, and where a
restarted worker group resumes in the epoch's sample order.

Pure: no Ray, no torch. Invariants that make an elastic run train the model an uninterrupted
fixed-size run trains:

- Every world size W of the range takes the same global batch G and the same BatchNorm batch G / a
  (a = ``--grad-accum-steps``): each rank takes G / (W * a) samples per micro-step, so every W in
  MIN..MAX must divide G / a (``check_world_sizes``, before anything starts).
- ``DistributedSampler`` gives rank r the items r, r + W, r + 2W, ... of one seeded permutation of
  the epoch (the same permutation for every W). Rank r's items j in [s * G / W, (s + 1) * G / W)
  are exactly the permutation's positions [s * G, (s + 1) * G): so a group of any W resumes at
  global step s of the epoch by skipping the first s * G / W items of each rank's list
  (``items_to_skip``), and micro-step i of that step covers positions
  [s * G + i * G / a, s * G + (i + 1) * G / a) whatever W is.
"""

from __future__ import annotations

from raytrain_mp.errors import UsageError


def parse_worker_range(value: str | int) -> tuple[int, int]:
    """``(min, max)`` of ``--num-workers``: ``N`` (fixed, min = max) or ``MIN-MAX``."""
    text = str(value).strip()
    parts = text.split("-")
    if len(parts) > 2 or not all(part.strip().isdigit() for part in parts):
        raise UsageError(f"--num-workers: expected a worker count or a range MIN-MAX (e.g. 2 or 2-8), got {text!r}")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise UsageError(f"--num-workers: must be >= 1, got {text}")
    if low > high:
        raise UsageError(
            f"--num-workers: MIN {low} is larger than MAX {high} in {text}; accepted: MIN-MAX with 1 <= MIN <= MAX"
        )
    return low, high


def check_world_sizes(global_batch: int, accum: int, low: int, high: int, option: str = "--global-batch-size") -> None:
    """Every world size in ``low..high`` gives each rank whole micro-batches of ``global_batch``
    (the value of ``option``: tune checks each batch size of its grid)."""
    if low == high:
        if global_batch % (low * accum):
            raise UsageError(
                f"{option}: {global_batch} is not divisible by --num-workers {low}"
                + (f" x --grad-accum-steps {accum}" if accum > 1 else "")
                + f"; accepted: a multiple of {low * accum}"
            )
        return
    if global_batch % accum:
        raise UsageError(
            f"--global-batch-size: {global_batch} is not divisible by --grad-accum-steps {accum}; accepted: a multiple "
            f"of {accum}"
        )
    micro = global_batch // accum
    bad = next((w for w in range(low, high + 1) if micro % w), None)
    if bad is not None:
        fits = [w for w in range(low, high + 1) if micro % w == 0]
        raise UsageError(
            f"--num-workers: {bad} workers (in {low}-{high}) cannot split --global-batch-size {global_batch}"
            + (f" / --grad-accum-steps {accum}" if accum > 1 else "")
            + f" = {micro} samples a micro-step into whole per-rank batches; every size of the range must divide "
            f"{micro} "
            f"(of {low}-{high}, these do: {', '.join(map(str, fits)) or 'none'})"
        )


def items_to_skip(step_in_epoch: int, global_batch: int, world: int) -> int:
    """How many items of its ``DistributedSampler`` list a rank skips to resume at ``step_in_epoch``."""
    return step_in_epoch * global_batch // world
