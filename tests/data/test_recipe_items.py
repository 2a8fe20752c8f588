"""The recipe in the data set (``ParquetImageDataset(recipe=...)``): auto-augment on the uint8
image, the erasing box in ``params``, every item paired with its partner when the run mixes; each
item a function of (seed, epoch, index) alone, in loader processes too."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from raytrain_mp.data import ParquetImageDataset
from raytrain_mp.data.augment import PARAMS
from raytrain_mp.data.loader import EpochKeys, make_loader
from raytrain_mp.data.prepare import write_dataset
from raytrain_mp.data.recipe_draws import Recipe, augmented, auto_augment, erase, partner, step_mix
from raytrain_mp.data.sources import make_synthetic_source

CPU = torch.device("cpu")
RECIPE = Recipe(auto_augment="ta_wide", random_erase=0.5, mixup_alpha=0.2, cutmix_alpha=1.0)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("syn") / "d"
    write_dataset(make_synthetic_source(60, 12, 3, 3, 0.2, 4), out)
    return str(out)


def test_an_item_is_the_sample_and_its_partner_each_as_its_own_draws_make_it(synthetic):
    ds = ParquetImageDataset(synthetic, "train", augment=True, seed=4, recipe=RECIPE)
    plain = ParquetImageDataset(synthetic, "train", augment=True, seed=4)
    for index in range(6):
        images, labels, params = ds[(2, index)]
        assert images.shape == (2, 3, 12, 12) and images.dtype == torch.uint8 and params.shape == (2, PARAMS)
        mate = partner(4, 2, index, len(ds))
        assert labels.tolist() == [int(ds.labels[index]), int(ds.labels[mate])]
        for row, i in ((0, index), (1, mate)):
            stored, _, crop = plain[(2, i)]
            assert torch.equal(params[row, :3], crop[:3])  # the crop and flip draws are unchanged by the recipe
            assert torch.equal(images[row], augmented(auto_augment("ta_wide"), stored, 4, 2, i))
    boxes = torch.stack([ds[(2, i)][2][0, 3:] for i in range(len(ds))])
    assert 0 < int((boxes[:, 2] > 0).sum()) < len(ds)  # p = 0.5: some erased, some not


def test_the_batch_transform_erases_each_box_after_normalization(synthetic):
    ds = ParquetImageDataset(synthetic, "train", augment=True, seed=4, recipe=Recipe(random_erase=1.0))
    images, _, params = ds.batch((0, i) for i in range(8))
    assert ds.transform.erase and int((params[:, 5] > 0).sum()) == 8
    kept = ParquetImageDataset(synthetic, "train", augment=True, seed=4).transform
    expected = erase(kept(images, params[:, :3], CPU, torch.float64), params[:, 3:])
    assert torch.equal(ds.transform(images, params, CPU, torch.float64), expected)


def test_loader_processes_and_ranks_give_the_items_of_one_process(synthetic):
    ds = ParquetImageDataset(synthetic, "train", augment=True, seed=2, recipe=RECIPE)
    sampler = EpochKeys(DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=2))
    loader = make_loader(ds, 8, sampler, 2, prefetch=2)
    sampler.set_epoch(1)
    for keys, (images, labels, params) in zip(batched(list(sampler), 8), loader):
        inline = ds.batch(keys)
        assert torch.equal(images, inline[0]) and torch.equal(labels, inline[1]) and torch.equal(params, inline[2])


def batched(keys: list, size: int) -> list[list]:
    return [keys[i : i + size] for i in range(0, len(keys) - size + 1, size)]


def test_a_steps_mixing_is_one_draw_whatever_the_batch():
    x, other = torch.rand(6, 3, 12, 12, dtype=torch.float64), torch.rand(6, 3, 12, 12, dtype=torch.float64)
    mix = step_mix(0.2, 1.0, (12, 12), 4, 1, 9)
    whole = mix.images(x, other)
    halves = torch.cat([mix.images(x[:3], other[:3]), mix.images(x[3:], other[3:])])
    assert torch.equal(whole, halves)  # a sample's mix does not depend on the rest of its batch
