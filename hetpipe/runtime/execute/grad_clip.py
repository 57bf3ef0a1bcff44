"""Clipping by the global gradient norm over every stage of a pipeline (torch's ``clip_grad_norm_`` formula).

Each rank sums the squares of the gradients it owns (a tied parameter's replicas counted once, on
its owner stage; a tensor-parallel member's replicated parameters on its lead), one all-reduce adds
the ranks' sums, and every gradient is scaled by ``min(1, max_norm / (norm + eps))``.

Example (one rank):
    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
    >>> clip_grads([p], max_norm=1.0, not_owned=set(), device=torch.device("cpu"), all_reduce=None)
    5.0
    >>> [round(g, 4) for g in p.grad.tolist()]
    [0.6, 0.8]
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon, so clipping matches it


def clip_grads(params: Sequence[torch.nn.Parameter], *, max_norm: float, not_owned: set[int], device: torch.device,
               all_reduce: Callable[[torch.Tensor], None] | None) -> float:
    """Scale the gradients of ``params`` in place; returns the global norm before clipping.

    ``not_owned``: ids of parameters another rank counts; ``all_reduce`` sums a tensor over the
    pipeline's ranks in place (None: this rank alone).
    """
    pairs = [(p, p.grad) for p in params if p.grad is not None]  # a parameter without grad: skipped whole
    norms = [torch.linalg.vector_norm(g, 2.0) for p, g in pairs if id(p) not in not_owned]
    squared = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), device=device)
    if all_reduce is not None:
        all_reduce(squared)
    total = squared.sqrt()
    coef = torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0)
    for _, g in pairs:
        g.mul_(coef.to(g.dtype))
    return float(total)
