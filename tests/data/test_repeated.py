"""Repeated augmentation (``data.repeated``, ``--ra-sampler``): the epoch's slots, dealt to ranks
so that a global batch does not depend on the worker count, and read by the data set as the same
sample augmented apart."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from raytrain_mp.data import ParquetImageDataset
from raytrain_mp.data.prepare import write_dataset
from raytrain_mp.data.recipe_draws import Recipe
from raytrain_mp.data.repeated import RepeatedSampler, repeated
from raytrain_mp.data.sources import make_synthetic_source
from raytrain_mp.pipeline.feed import epoch_batches

N = 30


class _Sized:
    def __len__(self) -> int:
        return N


@pytest.mark.parametrize("reps", [1, 2, 3, 4])
def test_an_epoch_holds_n_slots_each_sample_then_its_copies(reps: int) -> None:
    order = torch.randperm(N, generator=torch.Generator().manual_seed(5))
    slots = repeated(order, reps).tolist()
    assert len(slots) == len(set(slots)) == N  # n slots, none twice
    kept = -(-N // reps)  # the first ceil(n / reps) samples of the permutation
    expected = [int(i) + N * r for i in order[:kept] for r in range(reps)][:N]
    assert slots == expected
    samples = [slot % N for slot in slots]
    assert all(samples.count(int(i)) == reps for i in order[: N // reps])


@pytest.mark.parametrize("reps", [1, 3])
def test_global_batches_are_the_same_for_any_worker_count(reps: int) -> None:
    batch = 12
    for epoch in (0, 2):
        generator = torch.Generator().manual_seed(7 + epoch)  # DistributedSampler's seed + epoch
        slots = repeated(torch.randperm(N, generator=generator), reps).tolist()
        for world in (1, 2, 3, 4):
            shares = []
            for rank in range(world):
                sampler = RepeatedSampler(_Sized(), reps, num_replicas=world, rank=rank, seed=7)
                sampler.set_epoch(epoch)
                shares.append(list(sampler))
                if reps == 1:  # the plain order is DistributedSampler's, to the padding
                    plain = DistributedSampler(_Sized(), num_replicas=world, rank=rank, shuffle=True, seed=7)
                    plain.set_epoch(epoch)
                    assert shares[-1] == list(plain)
            micro = batch // world
            for step in range(N // batch):
                got = sorted(i for share in shares for i in share[step * micro : (step + 1) * micro])
                assert got == sorted(slots[step * batch : (step + 1) * batch]), (world, step)


def test_the_pipelines_epoch_order_is_the_same_kind_of_order() -> None:
    plain, again = epoch_batches(N, 8, 3, 1), epoch_batches(N, 8, 3, 1, reps=2)
    order = torch.cat(plain + [torch.tensor([], dtype=torch.int64)])
    assert len(again) == len(plain) == 3
    first = torch.randperm(N, generator=torch.Generator().manual_seed(3 * 100_003 + 1))
    assert torch.equal(order, first[:24]) and torch.equal(torch.cat(again), repeated(first, 2)[:24])


def test_a_slots_copy_is_its_sample_augmented_apart(tmp_path) -> None:
    root = tmp_path / "d"
    write_dataset(make_synthetic_source(N + 10, 16, 3, 3, 0.25, 2), root)
    recipe = Recipe(auto_augment="ta_wide", random_erase=0.5)
    train = ParquetImageDataset(str(root), "train", augment=True, seed=4, recipe=recipe)
    unaugmented = ParquetImageDataset(str(root), "train", seed=4)
    n = len(train)
    differ = 0
    for index in range(0, n, 5):
        first, copy = train[(1, index)], train[(1, index + 2 * n)]
        assert first[1] == copy[1] == int(train.labels[index])
        assert torch.equal(unaugmented[(1, index)][0], unaugmented[(1, index + 2 * n)][0])  # the same sample read
        differ += not torch.equal(first[0], copy[0]) or not torch.equal(first[2], copy[2])
    assert differ == len(range(0, n, 5))  # every copy drew its own crop, flip, policy and box
