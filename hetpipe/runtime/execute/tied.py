"""The step's gradient all-reduce of tied parameters (GPT-2's wte = lm_head) between the stages holding them.

Every stage holding a replica of a tied parameter adds its gradient in one all-reduce per
parameter (one process group each), so every replica steps with the whole gradient.  A rank
holding only some rows of it (a tensor-parallel member's vocabulary rows, `runtime/tp_vocab.py`)
adds its rows into a zero buffer of the whole parameter's shape; the members' rows are disjoint,
so the sum is the same whole gradient, and each member keeps its rows of it.

Example (no process group: a rank alone keeps its gradient):
    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(2, 3)); p.grad = torch.ones(2, 3)
    >>> whole_grad(p.grad, (1, 4)).sum(dim=1).tolist()
    [0.0, 3.0, 3.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist


def whole_grad(grad: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """``grad`` itself, or for rows ``(first, whole)``: a (whole, ...) zero buffer holding it from ``first``."""
    if rows is None:
        return grad
    out = grad.new_zeros((rows[1], *grad.shape[1:]))
    out.narrow(0, rows[0], grad.shape[0]).copy_(grad)
    return out


def reduce_tied(tied: Sequence[tuple[Any, torch.nn.Parameter, str, tuple[int, ...]]], *,
                rows: Mapping[int, tuple[int, int]], wait: Callable[[Any, str, Sequence[int]], None]) -> None:
    """Sum each tied parameter's gradient over its process group (module docstring).

    ``tied``: (process group, local parameter, name, ranks); ``rows``: parameter id -> (first row,
    whole rows) for a parameter held as rows; ``wait(work, what, ranks)`` waits for a collective.
    """
    for handle, param, name, ranks in tied:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        part = rows.get(id(param))
        grad = whole_grad(param.grad, part)
        work = dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=handle, async_op=True)
        wait(work, f"the gradient all-reduce of tied parameter {name!r}", ranks)
        if part is not None:
            param.grad.copy_(grad.narrow(0, part[0], param.shape[0]))
