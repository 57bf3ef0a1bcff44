"""A sharded optimizer's state as whole tensors per parameter, and back (checkpoints of replica plans).

`ShardedOptimizer` (ZeRO-1) keeps, for each sharded group, the state of this rank's slice of
the group's flattened parameters only.  A checkpoint is keyed by parameter name and must move
to any other plan (other fractions, no sharding, one pipeline), so it holds every parameter's
WHOLE state: `gather_full_state` all-gathers each elementwise state tensor (Adam's ``exp_avg``
and ``exp_avg_sq``, SGD's ``momentum_buffer``) over the group's holders the way the step
all-gathers the updated slices (padded to the longest slice), and takes each parameter's
non-elementwise state (Adam's 0-d ``step``) from a holder whose slice touches it.  The cost of
a save: one all-gather of the group's optimizer state (2 x its parameter bytes for Adam) plus
one small object all-gather per group; every holder takes part, one writer saves.

`load_full_state` is the inverse on a resumed rank: each piece takes its slice of the whole
tensors (0-d and scalar values as they are); unsharded parameters take their state as it is.

Example (one holder owning 0.8 of the 5 elements: no collective):
    >>> import torch
    >>> from hetpipe.runtime.replicas.shard import ShardGroup, ShardedOptimizer
    >>> w = torch.nn.Parameter(torch.ones(5))
    >>> opt = ShardedOptimizer([w], [ShardGroup("units 0-0", [w], None, (0.8, 0.2), 0, (0, 1))],
    ...                        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    >>> w.grad = torch.ones(5); opt.step()
    >>> full = gather_full_state(opt)
    >>> full[w]["momentum_buffer"].tolist()   # the fifth element belongs to the absent holder of 0.2
    [1.0, 1.0, 1.0, 1.0, 0.0]
    >>> load_full_state(opt, full); [tuple(v["momentum_buffer"].shape) for v in opt.state.values()]
    [(4,)]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetpipe.runtime.replicas.shard import ShardedOptimizer, shard_bounds


def is_elementwise(value: Any, param: torch.Tensor) -> bool:
    """A state value with one entry per parameter element (moments, momentum), not a count."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == param.numel()


def gather_full_state(opt: ShardedOptimizer) -> dict[nn.Parameter, dict[str, Any]]:
    """Collective over every sharded group's holders (``opt.groups`` order): parameter -> its whole state."""
    sharded = {id(p) for g in opt.groups for p in g.params}
    out: dict[nn.Parameter, dict[str, Any]] = {p: dict(opt.state[p]) for p in opt.params
                                               if id(p) not in sharded and p in opt.state}
    for g, pieces in zip(opt.groups, opt.pieces):
        out.update(_gather_group(opt, g, pieces))
    return out


def _local_summary(opt: ShardedOptimizer, g: Any, pieces: list[Any]) -> tuple[list[str], dict[int, dict[str, Any]]]:
    """(elementwise state keys, param index -> its non-elementwise state) of this holder's pieces."""
    index = {id(p): i for i, p in enumerate(g.params)}
    keys: set[str] = set()
    scalars: dict[int, dict[str, Any]] = {}
    for p, piece, _, _ in pieces:
        state = opt.state.get(piece, {})
        if state:  # an entry, even empty, says the parameter has state (SGD momentum has no count)
            scalars.setdefault(index[id(p)], {})
        for key, value in state.items():
            if is_elementwise(value, piece):
                keys.add(key)
            else:
                scalars[index[id(p)]][key] = value.clone() if isinstance(value, torch.Tensor) else value
    return sorted(keys), scalars


def _gather_group(opt: ShardedOptimizer, g: Any, pieces: list[Any]) -> dict[nn.Parameter, dict[str, Any]]:
    keys, scalars = _local_summary(opt, g, pieces)
    summaries = [(keys, scalars)]
    if g.group is not None:
        summaries = [None] * len(g.holder_ranks)
        dist.all_gather_object(summaries, (keys, scalars), group=g.group)
    every_key = sorted({k for ks, _ in summaries for k in ks})
    numel = sum(p.numel() for p in g.params)
    bounds = shard_bounds(numel, g.fractions)
    longest = max(b - a for a, b in bounds)
    ref = g.params[0]
    flats: dict[str, torch.Tensor] = {}
    for key in every_key:  # the same sorted keys on every holder: matching collectives
        mine = torch.zeros(longest, dtype=ref.dtype, device=ref.device)
        offset = 0
        for _, piece, _, _ in pieces:
            value = opt.state.get(piece, {}).get(key)
            if value is not None:
                mine[offset:offset + piece.numel()] = value.reshape(-1)
            offset += piece.numel()
        flats[key] = _assemble(mine, g, bounds, numel)
    out: dict[nn.Parameter, dict[str, Any]] = {}
    start = 0
    for i, p in enumerate(g.params):
        found = next((s[i] for _, s in summaries if i in s), None)
        if found is not None:  # a parameter no holder has stepped has no state (as in a plain optimizer)
            out[p] = {**{k: flat[start:start + p.numel()].view_as(p).clone() for k, flat in flats.items()}, **found}
        start += p.numel()
    return out


def _assemble(mine: torch.Tensor, g: Any, bounds: list[tuple[int, int]], numel: int) -> torch.Tensor:
    """The whole flat tensor from every holder's padded slice (this holder's own only when it is alone)."""
    flat = torch.zeros(numel, dtype=mine.dtype, device=mine.device)
    if g.group is None:
        a, b = bounds[g.replica]
        flat[a:b] = mine[:b - a]
        return flat
    order = sorted(g.holder_ranks)  # the process group's ranks ascending: all_gather's output order
    outs = [torch.empty_like(mine) for _ in order]
    dist.all_gather(outs, mine, group=g.group)
    for r, (a, b) in enumerate(bounds):
        flat[a:b] = outs[order.index(g.holder_ranks[r])][:b - a]
    return flat


def load_full_state(opt: ShardedOptimizer, states: Mapping[nn.Parameter, Mapping[str, Any]]) -> None:
    """Give every piece its slice of its parameter's whole state; unsharded parameters their state."""
    sharded = {id(p) for g in opt.groups for p in g.params}
    for p in opt.params:
        if id(p) not in sharded and p in states:
            opt.state[p] = dict(states[p])
    for pieces in opt.pieces:
        for p, piece, a, b in pieces:
            if p not in states:
                continue
            opt.state[piece] = {k: _piece_value(v, p, a, b, piece.device) for k, v in states[p].items()}


def _piece_value(value: Any, param: torch.Tensor, a: int, b: int, device: torch.device) -> Any:
    """A piece's own copy: its slice of an elementwise tensor, else the value (a 0-d ``step`` cloned:
    Adam increments it in place, and two pieces of one parameter must not share it)."""
    if is_elementwise(value, param):
        return value.reshape(-1)[a:b].clone().to(device)
    return value.clone() if isinstance(value, torch.Tensor) else value
