"""A small ResNet-style CNN for synthetic images: the dense workload (every gradient is dense).

GroupNorm instead of BatchNorm: batch statistics would differ between one process and a
data-parallel step over the same global batch, and equivalence with one process is tested.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _groups(channels: int) -> int:
    """Up to 8 groups; GroupNorm needs a divisor of the channels (a width of 5 doubles to 10)."""
    return max(g for g in range(1, 9) if channels % g == 0)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(_groups(cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(_groups(cout), cout)
        self.skip = (nn.Conv2d(cin, cout, 1, stride, bias=False)
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.skip(x))


class SmallResNet(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 16, blocks: int = 2, channels: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, 1, 1, bias=False)
        layers, cin = [], width
        for i in range(blocks):
            cout = width * (2 ** i)
            layers.append(_Block(cin, cout, stride=1 if i == 0 else 2))
            cin = cout
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(images)))
        logits = self.head(x.mean(dim=(2, 3)))
        return F.cross_entropy(logits, labels)
