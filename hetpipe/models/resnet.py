"""Bottleneck ResNets, written from He et al. 2016 ("Deep Residual Learning", table 1).

A ResNet here is a stem, four stages of bottleneck blocks and a classifier.  A
bottleneck is ``1x1 (width) -> 3x3 (width, stride) -> 1x1 (4 * width)``, each
followed by BatchNorm, ReLU after the first two and after the residual sum; the
shortcut is a strided ``1x1`` conv + BatchNorm whenever shape changes.  The
stride sits on the 3x3 conv ("ResNet v1.5", the variant torchvision ships), and
module names follow torchvision's (``layer3.2.conv2``), so a ResNet-50 here has
torchvision's 25,557,032 parameters and its state-dict keys.

Two stems: ``"imagenet"`` (7x7/2 conv + 3x3/2 max-pool, for 224x224 inputs) and
``"cifar"`` (one 3x3/1 conv, no pooling, for 32x32 inputs).

Example:
    >>> import torch
    >>> cfg = ResNetConfig(blocks=(1, 1, 1, 1), base_width=8, num_classes=10, stem="cifar", image_size=32)
    >>> ResNet(cfg)(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Channels out of a bottleneck are EXPANSION x its width (He et al. 2016, table 1).
EXPANSION = 4


@dataclass(frozen=True)
class ResNetConfig:
    """Shape of a bottleneck ResNet.

    Attributes:
        blocks: bottlenecks per stage (ResNet-50: ``(3, 4, 6, 3)``).
        base_width: width of the first stage (64); each later stage doubles it.
        num_classes: classifier outputs.
        stem: ``"imagenet"`` or ``"cifar"`` (see the module docstring).
        image_size: the input's height and width the model is meant for.

    Example:
        >>> ResNetConfig(blocks=(3, 4, 6, 3)).widths
        (64, 128, 256, 512)
    """

    blocks: tuple[int, ...]
    base_width: int = 64
    num_classes: int = 1000
    stem: str = "imagenet"
    image_size: int = 224

    def __post_init__(self) -> None:
        if self.stem not in ("imagenet", "cifar"):
            raise ValueError(f"stem must be 'imagenet' or 'cifar', not {self.stem!r}")

    @property
    def widths(self) -> tuple[int, ...]:
        """Bottleneck width of each stage."""
        return tuple(self.base_width * 2**i for i in range(len(self.blocks)))


class Bottleneck(nn.Module):
    """``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + shortcut(x))``.

    Example:
        >>> Bottleneck(16, 8, stride=2)(torch.zeros(1, 16, 8, 8)).shape
        torch.Size([1, 32, 4, 4])
    """

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=False)  # in-place ops would complicate saved-activation accounting
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _stage(in_channels: int, width: int, count: int, stride: int) -> nn.Sequential:
    """``count`` bottlenecks; the first carries the stride and the channel change."""
    blocks = [Bottleneck(in_channels, width, stride)]
    blocks += [Bottleneck(width * EXPANSION, width) for _ in range(count - 1)]
    return nn.Sequential(*blocks)


class ResNet(nn.Module):
    """Images ``(batch, 3, H, W)`` -> class logits ``(batch, num_classes)``.

    Example:
        >>> with torch.device("meta"):
        ...     m = ResNet(ResNetConfig(blocks=(3, 4, 6, 3)))
        >>> sum(p.numel() for p in m.parameters())
        25557032
    """

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w0 = cfg.base_width
        if cfg.stem == "imagenet":
            self.conv1 = nn.Conv2d(3, w0, 7, stride=2, padding=3, bias=False)
        else:
            self.conv1 = nn.Conv2d(3, w0, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(w0)
        self.relu = nn.ReLU(inplace=False)
        self.maxpool: nn.Module = (
            nn.MaxPool2d(3, stride=2, padding=1) if cfg.stem == "imagenet" else nn.Identity()
        )
        in_channels = w0
        for i, (width, count) in enumerate(zip(cfg.widths, cfg.blocks)):
            setattr(self, f"layer{i + 1}", _stage(in_channels, width, count, stride=1 if i == 0 else 2))
            in_channels = width * EXPANSION
        self.num_stages = len(cfg.blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, cfg.num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He (fan-out) init for convs, BatchNorm to identity (He et al. 2015, "Delving deep").

        Example:
            >>> m = ResNet(ResNetConfig(blocks=(1,), base_width=4, num_classes=2, stem="cifar", image_size=8))
            >>> m.reset_parameters()
            >>> m.bn1.weight.detach().sum().item()
            4.0
        """
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))
