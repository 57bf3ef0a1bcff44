"""ZeRO-1 on a running replica plan: each holder keeps and steps only its shard of a group's optimizer state.

A sync group the plan shards (`PlanSyncGroup.shard`, `hetpipe.partitioner.replica_shard`) is
one bucket of `hetpipe.runtime.replicas.sync`: the same parameters, in the same order, on
one rank of every replica.  Flatten them in that order (N elements); replica r's holder
owns the contiguous slice ``shard_bounds(N, fractions)[r]`` (f_r of the elements, by the
plan's fractions).  `ShardedOptimizer` builds the inner optimizer (Adam, ...) over

* every parameter of this rank that no sharded group holds (a tied parameter whose units span
  several groups keeps its whole state: its copies sit on different ranks of a replica), and
* for each sharded group, *pieces*: views of the parameters' storage covering only this
  rank's slice (a parameter split by a shard boundary contributes part of itself); a tied parameter
  all of whose units the group holds is flattened after the group's own parameters,

so the optimizer state it allocates (Adam's moments) is f_r of the group's.  Each step:

1. gradients: the replica sync has already **all-reduced** them (then each rank reads its
   slice: ``piece.grad`` is a view of the summed gradient).  Why not a reduce-scatter:
   gloo has no reduce-scatter of uneven chunks, and the all-reduce keeps the overlapped,
   bucketed exchange of `hetpipe.runtime.replicas.buckets` unchanged; the numbers are the
   same (each slice of the sum), the wire carries the all-reduce's 2 (R-1)/R G instead of
   the reduce-scatter's share; the plan prices exactly this, the all-reduce plus the padded
   all-gather (`cost_models.sharding.shard_sync_s`), and the emulation charges the plan's time,
   `hetpipe.runtime.emulate.replicas`).
2. the inner optimizer steps: the pieces alias the parameters, so the owned slices update
   in place (Adam is elementwise: a slice's update equals the whole tensor's on it).
3. the updated slices are **all-gathered** over the group (gloo all-gathers equal sizes:
   every slice is padded to the largest) and copied into the slices other holders own.

Example (one rank holding the whole group: its slice is everything, no collective):
    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> opt = ShardedOptimizer([w], [ShardGroup("units 0-0", [w], None, (0.7, 0.3), 0, (0, 1))],
    ...                        lambda ps: torch.optim.SGD(ps, lr=0.5))
    >>> [tuple(p.shape) for g in opt.param_groups for p in g["params"]]   # 0.7 of 4 elements -> 3
    [(3,)]
    >>> shard_bounds(10, (0.7, 0.3)), shard_bounds(7, (0.5, 0.25, 0.25))
    ([(0, 7), (7, 10)], [(0, 4), (4, 5), (5, 7)])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetpipe.errors import PlanError
from hetpipe.plan.schema import Plan
from hetpipe.runtime.replicas.sync import ReplicaSync, holder_stage


def shard_bounds(numel: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) of each replica's slice: boundaries at round(N x cumulative f)."""
    edges, acc = [0], 0.0
    for f in fractions[:-1]:
        acc += f
        edges.append(min(numel, max(edges[-1], int(round(numel * acc)))))
    edges.append(numel)
    return [(a, b) for a, b in zip(edges, edges[1:])]


@dataclass
class ShardGroup:
    """One sharded group as this rank runs it: its parameters (bucket order) and the group's layout."""

    label: str
    params: list[nn.Parameter]
    group: Any  # process group over the holders (None: a single holder)
    fractions: tuple[float, ...]  # per replica
    replica: int  # this rank's replica
    holder_ranks: tuple[int, ...]  # global rank of each replica's holder


def _pieces(params: Sequence[nn.Parameter], start: int, end: int) -> list[tuple[nn.Parameter, nn.Parameter, int, int]]:
    """(param, piece aliasing its elements [a, b), a, b) for the flat range [start, end) over `params`."""
    out, offset = [], 0
    for p in params:
        n = p.numel()
        a, b = max(start, offset) - offset, min(end, offset + n) - offset
        if a < b:
            if not p.is_contiguous():
                raise PlanError(f"a sharded parameter of shape {tuple(p.shape)} is not contiguous; "
                                "re-plan without --sharding")
            out.append((p, nn.Parameter(p.detach().view(-1)[a:b]), a, b))
        offset += n
    return out


class ShardedOptimizer:
    """An optimizer that steps only this rank's shard of each sharded group (module docstring).

    Looks like the inner optimizer where the runtime needs it: ``state`` (the memory ledger counts
    only the shard's moments), ``param_groups`` (learning-rate schedules), ``step``, ``zero_grad``.
    """

    def __init__(self, params: Sequence[nn.Parameter], groups: Sequence[ShardGroup],
                 factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.groups = list(groups)
        self.params = list(params)
        sharded = {id(p) for g in self.groups for p in g.params}
        self._pieces = []
        for g in self.groups:
            numel = sum(p.numel() for p in g.params)
            start, end = shard_bounds(numel, g.fractions)[g.replica]
            self._pieces.append(_pieces(g.params, start, end))
        own = [p for p in self.params if id(p) not in sharded]
        self.inner = factory(own + [piece for ps in self._pieces for _, piece, _, _ in ps])

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def pieces(self) -> list[list[tuple[nn.Parameter, nn.Parameter, int, int]]]:
        """Per sharded group (``groups`` order): (param, piece, a, b), the piece aliasing param's elements [a, b)."""
        return self._pieces

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none or p.grad is None else p.grad.zero_()
        for ps in self._pieces:
            for _, piece, _, _ in ps:
                piece.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Step this rank's slices (and its unsharded parameters), then all-gather every group's slices."""
        for ps in self._pieces:
            for p, piece, a, b in ps:
                piece.grad = None if p.grad is None else p.grad.reshape(-1)[a:b]
        self.inner.step()
        for g in self.groups:  # the plan's group order: the same on every holder (matching collectives)
            self._gather(g)

    def _gather(self, g: ShardGroup) -> None:
        if g.group is None:
            return
        numel = sum(p.numel() for p in g.params)
        bounds = shard_bounds(numel, g.fractions)
        longest = max(b - a for a, b in bounds)
        flat = torch.cat([p.detach().reshape(-1) for p in g.params])
        a, b = bounds[g.replica]
        mine = torch.zeros(longest, dtype=flat.dtype, device=flat.device)
        mine[:b - a] = flat[a:b]
        order = sorted(g.holder_ranks)  # the process group's ranks, ascending: all_gather's output order
        outs = [torch.empty_like(mine) for _ in order]
        dist.all_gather(outs, mine, group=g.group)
        for r, (start, end) in enumerate(bounds):
            flat[start:end] = outs[order.index(g.holder_ranks[r])][:end - start]
        offset = 0
        for p in g.params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def shard_groups(plan: Plan, sync: ReplicaSync, *, replica: int, stage_ranks: Sequence[int]) -> list[ShardGroup]:
    """This rank's sharded groups, in the plan's group order (empty when the plan shards nothing here)."""
    assert plan.sync is not None
    out = []
    for g in plan.sync.groups:
        if g.shard is None:
            continue
        held = sync.held(f"units {g.first_unit}-{g.last_unit}")
        if held is None:
            continue
        if len(g.shard.fractions) != len(plan.replicas) or abs(sum(g.shard.fractions) - 1.0) > 1e-9:
            raise PlanError(f"sync group of units {g.first_unit}-{g.last_unit}: shard fractions "
                            f"{list(g.shard.fractions)} must be one per replica and sum to 1; re-plan it")
        holders = tuple(stage_ranks[holder_stage(plan, r, g.first_unit)] for r in range(len(plan.replicas)))
        out.append(ShardGroup(f"units {g.first_unit}-{g.last_unit}", held[0] + _tied_within(plan, sync, g),
                              held[1], g.shard.fractions, replica, holders))
    return out


def _tied_within(plan: Plan, sync: ReplicaSync, group: Any) -> list[nn.Parameter]:
    """The tied parameters all of whose units `group` holds, in the plan's tied order (the same on every
    holder): their state shards with the group's (`partitioner.replica_shard.group_optimizer_bytes`)."""
    out: list[nn.Parameter] = []
    for t in plan.model.tied:
        if group.first_unit <= min(t.units) and max(t.units) <= group.last_unit:
            held = sync.held(f"tied {t.names[0]}", tied=True)
            out += held[0] if held is not None else []
    return out
