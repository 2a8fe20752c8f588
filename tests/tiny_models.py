"""Small networks the tests train where what a test checks does not need a ResNet's compute: here,
where ``torch.compile`` runs (its compile time grows with the graph).

``--model tests.tiny_models:tiny_net``: importable from the repository root, the working folder of
pytest and of the session's Ray workers (Ray puts the driver's working folder on their path).
"""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """Conv-BN-ReLU, a residual Conv-BN-ReLU, global pooling, a linear head: BatchNorm (synchronized
    across DDP ranks) and a forward that is not a chain, nothing random."""

    def __init__(self, num_classes: int, in_channels: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.body(h) + h, 1), 1))


def tiny_net(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return TinyNet(num_classes, in_channels)
