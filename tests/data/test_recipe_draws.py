"""``data.recipe_draws``: each recipe operation equals torchvision's ``transforms.v2`` given the same
draw, and each draw is a function of its key alone (not of the generator state it is called in)."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2

from raytrain_mp.data.augment import POLICIES
from raytrain_mp.data.recipe_draws import (
    AUTO_AUGMENT,
    ERASE,
    MIX,
    augmented,
    auto_augment,
    erase,
    erase_box,
    key,
    partner,
    step_mix,
)


def image(seed: int, shape=(3, 32, 32)) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_is_torchvisions_with_the_keyed_draw(policy):
    transform = auto_augment(policy, magnitude=7, severity=2)
    x = image(0)
    torch.manual_seed(key(5, 2, 17, AUTO_AUGMENT))
    expected = transform(x)
    before = torch.manual_seed(123).get_state()  # any state of the caller's generator: the draw is the key's
    ours = augmented(transform, x, 5, 2, 17)
    assert torch.equal(ours, expected)
    assert torch.equal(torch.get_rng_state(), before)  # left as it was
    others = [augmented(transform, x, 5, epoch, 17) for epoch in range(3, 9)]
    assert any(not torch.equal(o, ours) for o in others)  # another epoch, another draw


def test_policies_carry_the_reference_options():
    assert auto_augment("ra", magnitude=7).magnitude == 7
    assert auto_augment("augmix", severity=2).severity == 2
    assert auto_augment("cifar10").policy == v2.AutoAugmentPolicy.CIFAR10


@pytest.mark.parametrize("index", range(8))
def test_random_erasing_is_torchvisions_with_the_same_box(index):
    x = torch.randn(3, 24, 20, generator=torch.Generator().manual_seed(index), dtype=torch.float64)
    box = erase_box(0.5, (3, 24, 20), 1, 0, index)
    torch.manual_seed(key(1, 0, index, ERASE))
    expected = v2.RandomErasing(p=0.5, value=0)(x)
    ours = erase(x.clone()[None], torch.tensor([box]))[0]
    assert torch.equal(ours, expected)
    assert (box[2] == 0) == torch.equal(expected, x)  # no box exactly where torchvision erased nothing


def test_some_samples_are_erased_and_some_not():
    boxes = [erase_box(0.5, (3, 24, 20), 1, 0, i) for i in range(40)]
    assert 5 < sum(b[2] > 0 for b in boxes) < 35


def test_partners_are_other_samples_and_cover_the_set():
    n = 50
    partners = [partner(3, 1, i, n) for i in range(n)]
    assert all(p != i and 0 <= p < n for i, p in enumerate(partners))
    assert len(set(partners)) > n // 3
    assert partners != [partner(3, 2, i, n) for i in range(n)]


@pytest.mark.parametrize(
    ("mixup", "cutmix", "reference"),
    [
        (0.2, 0.0, lambda: v2.MixUp(alpha=0.2, num_classes=5)),
        (0.0, 1.0, lambda: v2.CutMix(alpha=1.0, num_classes=5)),
        (0.2, 1.0, lambda: v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=5), v2.CutMix(alpha=1.0, num_classes=5)])),
    ],
    ids=["mixup", "cutmix", "both"],
)
@pytest.mark.parametrize("step", range(6))
def test_mixing_is_torchvisions_for_a_sample_and_its_partner(mixup, cutmix, reference, step):
    x, other = image(1).double(), image(2).double()
    y, other_y = torch.tensor([3]), torch.tensor([1])
    # torchvision mixes sample 1 of a batch with sample 0 (its roll(1) neighbour)
    torch.manual_seed(key(7, 1, step, MIX))
    images, labels = reference()(torch.stack([other, x]), torch.cat([other_y, y]))
    mix = step_mix(mixup, cutmix, (32, 32), 7, 1, step)
    assert torch.equal(mix.images(x[None], other[None])[0], images[1])
    assert torch.allclose(mix.targets(y, other_y, 5, torch.float32)[0], labels[1], rtol=0, atol=1e-7)
    if not mixup:
        assert mix.box is not None
    if not cutmix:
        assert mix.box is None


def test_both_draw_each_kind_about_half_the_time():
    kinds = [step_mix(0.2, 1.0, (32, 32), 0, 0, step).box is None for step in range(60)]
    assert 15 < sum(kinds) < 45
