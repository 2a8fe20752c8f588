"""Elastic DDP's pure rules (``ddp.elastic``), checked exhaustively without Ray: the worker range,
the world sizes a batch admits, and that skipping ``items_to_skip`` items of every rank's
``DistributedSampler`` list resumes on the same global samples for any world size."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DistributedSampler

from raytrain_mp.checkpointing import resume_position
from raytrain_mp.data.loader import EpochKeys
from raytrain_mp.ddp.elastic import check_world_sizes, items_to_skip, parse_worker_range
from raytrain_mp.errors import UsageError


@pytest.mark.parametrize(
    ("text", "expected"), [("2", (2, 2)), (3, (3, 3)), ("1-2", (1, 2)), (" 2-8 ", (2, 8)), ("4-4", (4, 4))]
)
def test_parse_worker_range(text, expected):
    assert parse_worker_range(text) == expected


@pytest.mark.parametrize("text", ["", "-", "1-", "-2", "1-2-3", "a-b", "1.5", "2..4"])
def test_parse_worker_range_refuses_what_is_not_a_count_or_range(text):
    with pytest.raises(UsageError, match="expected a worker count or a range MIN-MAX"):
        parse_worker_range(text)


def test_check_world_sizes_agrees_with_arithmetic():
    """For every batch, accumulation and range: accepted exactly when every size gives whole micro-batches."""
    for batch, accum, low in itertools.product(range(1, 49), (1, 2, 3), range(1, 7)):
        for high in range(low, 8):
            whole = all(batch % (w * accum) == 0 for w in range(low, high + 1))
            try:
                check_world_sizes(batch, accum, low, high)
                accepted = True
            except UsageError as exc:
                accepted = False
                first_bad = next(w for w in range(low, high + 1) if batch % (w * accum))
                assert str(exc).startswith(
                    "--global-batch-size" if low == high or batch % accum else f"--num-workers: {first_bad} workers"
                )
            assert accepted == whole, (batch, accum, low, high)


@pytest.mark.parametrize(("accum", "length"), [(1, 101), (2, 96), (4, 130)])
def test_resuming_at_any_step_with_any_world_size_reads_the_same_global_samples(accum, length):
    """Micro-step i of step s holds the same set of samples whether the epoch ran at W all along or
    a group of W' resumed at s by skipping ``items_to_skip`` of each rank's list."""
    batch, epoch, seed = 24, 3, 7

    def micro_steps(world: int, start: int) -> list[frozenset[int]]:
        per_rank = batch // (world * accum)
        lists = []
        for rank in range(world):
            keys = EpochKeys(DistributedSampler(range(length), num_replicas=world, rank=rank, shuffle=True, seed=seed))
            keys.set_epoch(epoch, skip=items_to_skip(start, batch, world))
            assert len(keys) == len(list(keys))
            lists.append([index for e, index in keys if e == epoch])
        steps = length // batch
        return [
            frozenset(i for items in lists for i in items[m * per_rank : (m + 1) * per_rank])
            for m in range((steps - start) * accum)
        ]

    steps = length // batch
    for world, start in itertools.product((1, 2, 3, 6), range(steps)):
        if batch % (world * accum):
            continue
        assert micro_steps(world, start) == micro_steps(1, 0)[start * accum :], (world, start)


def test_resume_position():
    assert resume_position(-1, 0, 5) == (0, 0)  # nothing done
    assert resume_position(0, 0, 5) == (1, 0)  # after epoch 1
    assert resume_position(0, 3, 5) == (1, 3)  # 3 steps into epoch 2
    assert resume_position(0, 5, 5) == (2, 0)  # a position past the epoch (a smaller data set): the next epoch
