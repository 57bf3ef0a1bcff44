"""Model factories for `hetpipe plan package.module:factory` tests (importable by name)."""

from __future__ import annotations

import torch
from torch import nn


def stack_of_linears() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Four Linear(16, 16) layers and one micro-batch of 2."""
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]), (torch.zeros(2, 16),)


def module_only() -> nn.Module:
    """A factory that forgets the example inputs."""
    return nn.Linear(4, 4)
