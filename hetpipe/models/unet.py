"""A small U-Net (Ronneberger et al. 2015) for skip-connection tests.

An encoder of ``depth`` levels (two 3x3 conv + ReLU, then 2x2 max-pool), a
bottleneck, and a mirrored decoder (2x2 transposed conv that doubles the
resolution, concatenation with the encoder output of the same resolution, two
3x3 conv + ReLU), then a 1x1 conv to ``out_channels``.  Convolutions are padded
so every level keeps its size and the output has the input's spatial shape
(the paper's unpadded convolutions crop the skips instead).  There is no
normalisation layer: BatchNorm would make a pipelined run depend on how the
batch is split into micro-batches.

The skip tensors are what make this model interesting to a partitioner: a
stage boundary inside the U carries the current activation *and* every skip
still waiting for its decoder level.

Example:
    >>> import torch
    >>> net = UNet(UNetConfig(in_channels=3, out_channels=3, base_width=4, depth=2))
    >>> net(torch.zeros(2, 3, 16, 16)).shape
    torch.Size([2, 3, 16, 16])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class UNetConfig:
    """Shape of a U-Net.

    Attributes:
        in_channels: input image channels.
        out_channels: output channels (equal to ``in_channels`` for the image-to-image regression task).
        base_width: channels of the first level; each deeper level doubles them.
        depth: number of down-sampling steps; inputs must be divisible by ``2**depth``.
        image_size: the input height and width the model is meant for.

    Example:
        >>> UNetConfig(base_width=8, depth=2).widths
        (8, 16, 32)
    """

    in_channels: int = 3
    out_channels: int = 3
    base_width: int = 8
    depth: int = 2
    image_size: int = 32

    def __post_init__(self) -> None:
        if self.image_size % 2**self.depth != 0:
            raise ValueError(f"image_size={self.image_size} is not divisible by 2**depth={2**self.depth}")

    @property
    def widths(self) -> tuple[int, ...]:
        """Channels per level, encoder top to bottleneck."""
        return tuple(self.base_width * 2**i for i in range(self.depth + 1))


class DoubleConv(nn.Module):
    """``relu(conv3x3(relu(conv3x3(x))))`` keeping height and width.

    Example:
        >>> DoubleConv(3, 5)(torch.zeros(1, 3, 6, 6)).shape
        torch.Size([1, 5, 6, 6])
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv2(self.relu(self.conv1(x))))


class UpBlock(nn.Module):
    """Up-sample 2x, concatenate the skip along channels, then a `DoubleConv`.

    Example:
        >>> up = UpBlock(8, 4)
        >>> up(torch.zeros(1, 8, 4, 4), torch.zeros(1, 4, 8, 8)).shape
        torch.Size([1, 4, 8, 8])
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, out_channels, 2, stride=2)
        self.conv = DoubleConv(2 * out_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat((self.up(x), skip), dim=1))


class UNet(nn.Module):
    """Images ``(batch, in_channels, H, W)`` -> ``(batch, out_channels, H, W)``.

    Example:
        >>> net = UNet(UNetConfig(base_width=4, depth=1, image_size=8))
        >>> [name for name, _ in net.named_children()]
        ['down', 'pool', 'bottleneck', 'up', 'head']
    """

    def __init__(self, cfg: UNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.widths
        channels_in = (cfg.in_channels,) + w[:-2]
        self.down = nn.ModuleList(DoubleConv(c_in, c_out) for c_in, c_out in zip(channels_in, w[:-1]))
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = DoubleConv(w[-2], w[-1])
        # up[i] goes from level depth-i to level depth-i-1
        self.up = nn.ModuleList(UpBlock(w[i], w[i - 1]) for i in range(cfg.depth, 0, -1))
        self.head = nn.Conv2d(w[0], cfg.out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips: list[torch.Tensor] = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return self.head(x)
