"""A plain deep MLP for fast runtime tests: ``n_layer`` blocks of Linear(dim, dim) + ReLU.

The last block has no activation so the output is an unconstrained regression
target of the input's shape.  Each block is its own module in an
``nn.ModuleList``, so capture sees one unit per layer.

Example:
    >>> import torch
    >>> mlp = MLP(MLPConfig(dim=16, n_layer=3))
    >>> mlp(torch.zeros(4, 16)).shape
    torch.Size([4, 16])
    >>> len(mlp.layers)
    3
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    """Shape of the MLP.

    Attributes:
        dim: width of every layer (input and output too).
        n_layer: number of Linear layers.

    Example:
        >>> MLPConfig(dim=64, n_layer=8).param_count()
        33280
    """

    dim: int = 64
    n_layer: int = 8

    def param_count(self) -> int:
        """``n_layer * (dim^2 + dim)``."""
        return self.n_layer * (self.dim * self.dim + self.dim)


class MLPBlock(nn.Module):
    """``relu(linear(x))``, or just ``linear(x)`` when ``activation`` is False.

    Example:
        >>> MLPBlock(4, activation=True)(-torch.ones(1, 4)).shape
        torch.Size([1, 4])
    """

    def __init__(self, dim: int, *, activation: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.act: nn.Module = nn.ReLU() if activation else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class MLP(nn.Module):
    """``(batch, dim) -> (batch, dim)`` through ``n_layer`` `MLPBlock` s.

    Example:
        >>> sum(p.numel() for p in MLP(MLPConfig(dim=8, n_layer=2)).parameters())
        144
    """

    def __init__(self, cfg: MLPConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or MLPConfig()
        self.cfg = cfg
        self.layers = nn.ModuleList(
            MLPBlock(cfg.dim, activation=i < cfg.n_layer - 1) for i in range(cfg.n_layer)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
