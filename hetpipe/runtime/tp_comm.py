"""The two communication operators of a tensor-parallel block (Megatron-LM §3, Fig. 3).

Every member of a group holds some heads / hidden columns of a block.  Before the
column-parallel layers the block's input is the same on every member, but each member's
shard contributes only part of its gradient: `copy_to_group` is the identity forward and
sums the gradient over the group backward.  After the row-parallel layer each member holds
a partial sum of the output: `reduce_from_group` sums it over the group forward and passes
the (already replicated) gradient through backward.  One of each per block, so a
transformer block costs two all-reduces forward and two backward
(`hetpipe.cost_models.tensor_parallel.ALLREDUCES_PER_BLOCK`).

Example (a group of one: both are the identity):
    >>> import torch, torch.distributed as dist
    >>> dist.is_initialized()
    False
    >>> x = torch.ones(2, requires_grad=True)
    >>> reduce_from_group(copy_to_group(x, None), None).sum().backward()
    >>> x.grad
    tensor([1., 1.])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def all_reduce_in_place(t: torch.Tensor, group: Any, op: Any = None) -> None:
    """All-reduce `t` in place over `group` (sum unless `op`); nothing without a group of two or more."""
    if _group_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    out = t.clone()  # never reduce in place into a tensor autograd saved
    all_reduce_in_place(out, group)
    return out


class CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The block input as seen by this member's column-parallel shard (see module docstring)."""
    return CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of every member's row-parallel partial output (see module docstring)."""
    return ReduceFromGroup.apply(x, group)
