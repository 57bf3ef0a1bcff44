"""Group the compute nodes of a traced graph into ordered, contiguous units.

Only *body* nodes (``call_function``, ``call_method``, ``call_module``) are grouped;
`hetpipe.partitioner.capture.capture` attaches placeholders to the first unit, ``get_attr``
nodes to the first unit that uses them and the output to the last.  Every grouping
below cuts the body, which is in fx graph order (a topological order), into
consecutive runs, so a cut between unit i and i+1 is always a valid pipeline cut.

Granularities:

* ``"block"``: one unit per repeated block.  Blocks are found structurally, not by
  name: siblings of the same class that have children of their own (transformer
  layers, ResNet bottlenecks, UNet down/up stages), taking the finest such level (a
  repeated ResNet stage whose bottlenecks repeat gives the bottlenecks).  Models with
  no repeated composite module fall back to repeated sibling leaves that hold
  parameters (a stack of Linear layers).  Nodes outside every block form the
  embedding/stem and head units; parameter-free glue between blocks (a residual add or
  concat in the root's forward) joins the next unit.
* ``"node"``: one unit per compute node (a node that launches a kernel or calls a
  leaf module); views, getitems and other kernel-free nodes join the unit before them.
* an int N: ``"block"`` units (or ``"node"`` units when N exceeds them) merged into
  about N consecutive groups of balanced forward FLOPs (minimise the largest group).
* ``split_points``: module names; a new unit starts at the first node of each, on top
  of the granularity's units.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2)))
    >>> find_blocks(net)
    ['1', '2']
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hetpipe.errors import ConfigError

#: Name of a unit made of nodes traced in the root module's own forward.
ROOT_NAME = "root"


@dataclass(frozen=True)
class NodeInfo:
    """What grouping needs to know about one body node.

    Attributes:
        name: fx node name.
        module_path: qualified name of the innermost module the node ran in ("" = root).
        fwd_flops: forward FLOPs of the node.
        kernels: kernels the node launched (0 for views, getitems, shape queries).
        has_params: the node reads a parameter (or calls a module that holds one).
        is_module_call: the node is a ``call_module`` (a leaf module).
    """

    name: str
    module_path: str
    fwd_flops: int = 0
    kernels: int = 0
    has_params: bool = False
    is_module_call: bool = False


@dataclass(frozen=True)
class Group:
    """A unit in the making: a name and the indices of its body nodes (consecutive)."""

    name: str
    members: tuple[int, ...]


def _blocks_under(module: nn.Module, prefix: str, allow_leaves: bool) -> list[str]:
    """Finest level of repeated sibling modules under ``module`` (see module doc)."""
    children = list(module.named_children())

    def eligible(child: nn.Module) -> bool:
        has_children = next(child.children(), None) is not None
        has_params = next(child.parameters(), None) is not None
        return has_children or (allow_leaves and has_params)

    counts: dict[type, int] = {}
    for _, child in children:
        if eligible(child):
            counts[type(child)] = counts.get(type(child), 0) + 1
    found: list[str] = []
    for name, child in children:
        fqn = f"{prefix}.{name}" if prefix else name
        inner = _blocks_under(child, fqn, allow_leaves)
        repeated = eligible(child) and counts.get(type(child), 0) >= 2
        found.extend(inner if inner or not repeated else [fqn])
    return found


def find_blocks(root: nn.Module) -> list[str]:
    """Qualified names of the repeated blocks of ``root``, in definition order."""
    return _blocks_under(root, "", False) or _blocks_under(root, "", True)


def block_of(path: str, blocks: frozenset[str]) -> str | None:
    """The block whose subtree holds module ``path``, or None.

    Example:
        >>> block_of("h.3.attn.c_attn", frozenset({"h.3", "h.4"}))
        'h.3'
    """
    parts = path.split(".") if path else []
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        if candidate in blocks:
            return candidate
    return None


def _describe(paths: Sequence[str]) -> str:
    """A unit name from the module paths of its nodes: ``first..last``."""
    distinct = list(dict.fromkeys(p for p in paths if p))
    if not distinct:
        return ROOT_NAME
    return distinct[0] if len(distinct) == 1 else f"{distinct[0]}..{distinct[-1]}"


def _unique(groups: list[Group]) -> list[Group]:
    """Suffix repeated names with ``#k`` so unit names are unique."""
    seen: dict[str, int] = {}
    out = []
    for g in groups:
        seen[g.name] = seen.get(g.name, 0) + 1
        out.append(g if seen[g.name] == 1 else Group(f"{g.name}#{seen[g.name]}", g.members))
    return out


def group_by_blocks(body: Sequence[NodeInfo], blocks: Sequence[str]) -> list[Group]:
    """``"block"`` granularity over the body nodes."""
    block_set = frozenset(blocks)
    runs: list[tuple[str | None, list[int]]] = []
    for i, info in enumerate(body):
        key = block_of(info.module_path, block_set)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(i)
        else:
            runs.append((key, [i]))
    # parameter-free glue outside every block joins the next run (the last joins the previous)
    merged: list[tuple[str | None, list[int]]] = []
    pending: list[int] = []
    for key, members in runs:
        glue = key is None and not any(body[i].has_params for i in members)
        if glue:
            pending.extend(members)
            continue
        members = pending + members
        pending = []
        if merged and merged[-1][0] == key:  # a block interrupted by glue
            merged[-1][1].extend(members)
        else:
            merged.append((key, members))
    if pending:
        if merged:
            merged[-1][1].extend(pending)
        else:
            merged.append((None, pending))
    groups = [Group(key or _describe([body[i].module_path for i in m]), tuple(m))
              for key, m in merged]
    return _unique(groups)


def group_by_nodes(body: Sequence[NodeInfo]) -> list[Group]:
    """``"node"`` granularity: one unit per kernel-launching node plus trailing views."""
    groups: list[list[int]] = []
    leading: list[int] = []
    for i, info in enumerate(body):
        if info.kernels > 0 or info.is_module_call:
            groups.append(leading + [i])
            leading = []
        elif groups:
            groups[-1].append(i)
        else:
            leading.append(i)
    if leading:
        groups.append(leading)

    def name(members: list[int]) -> str:
        head = next((body[i] for i in members if body[i].kernels > 0 or body[i].is_module_call),
                    body[members[0]])
        return f"{head.module_path}/{head.name}" if head.module_path else head.name

    return _unique([Group(name(m), tuple(m)) for m in groups])


def _greedy_count(weights: Sequence[int], cap: int) -> int:
    """Groups a left-to-right greedy packing needs with at most ``cap`` per group."""
    count, current = 1, 0
    for w in weights:
        if current + w > cap and current > 0:
            count, current = count + 1, 0
        current += w
    return count


def split_bounds(weights: Sequence[int], n: int) -> list[tuple[int, int]]:
    """[start, end) ranges of exactly min(n, len) groups minimising the largest sum."""
    n = min(n, len(weights))
    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:  # smallest cap a greedy packing fits into n groups
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _greedy_count(weights, mid) <= n else (mid + 1, hi)
    bounds: list[tuple[int, int]] = []
    start, current = 0, 0
    for i, w in enumerate(weights):
        if current + w > lo and current > 0:
            bounds.append((start, i))
            start, current = i, 0
        current += w
    bounds.append((start, len(weights)))
    while len(bounds) < n:  # split the heaviest multi-atom group at its best point
        multi = [b for b in bounds if b[1] - b[0] > 1]
        s, e = max(multi, key=lambda b: (sum(weights[b[0]:b[1]]), b[1] - b[0]))
        cut = min(range(s + 1, e), key=lambda c: (max(sum(weights[s:c]), sum(weights[c:e])),
                                                   abs((c - s) - (e - c))))
        k = bounds.index((s, e))
        bounds[k:k + 1] = [(s, cut), (cut, e)]
    return bounds


def merge_balanced(atoms: Sequence[Group], flops: Sequence[int], n: int) -> list[Group]:
    """Merge consecutive ``atoms`` into ``min(n, len(atoms))`` groups of balanced FLOPs.

    Example:
        >>> atoms = [Group(str(i), (i,)) for i in range(4)]
        >>> [g.name for g in merge_balanced(atoms, [5, 1, 1, 5], 2)]
        ['0..1', '2..3']
    """
    out = []
    for s, e in split_bounds(list(flops), n):
        names = [a.name for a in atoms[s:e]]
        name = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        out.append(Group(name, tuple(m for a in atoms[s:e] for m in a.members)))
    return _unique(out)


def _first_node_of(module_name: str, body: Sequence[NodeInfo], known: Sequence[str]) -> int:
    """Index of the first body node that ran in ``module_name`` (ConfigError if none)."""
    for i, info in enumerate(body):
        p = info.module_path
        if p == module_name or p.startswith(module_name + "."):
            return i
    close = difflib.get_close_matches(module_name, list(known), n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    raise ConfigError(
        f"split point {module_name!r} is not a module that runs in the model's forward{hint} "
        "(give qualified names as in model.named_modules())"
    )


def apply_split_points(groups: Sequence[Group], body: Sequence[NodeInfo],
                       split_points: Sequence[str], known: Sequence[str]) -> list[Group]:
    """Start a new unit at the first node of each module in ``split_points``."""
    cuts = {_first_node_of(sp, body, known): sp for sp in split_points}
    out: list[Group] = []
    for g in groups:
        current: list[int] = []
        name = g.name
        for m in g.members:
            if m in cuts and current:
                out.append(Group(name, tuple(current)))
                current, name = [], cuts[m]
            elif m in cuts:
                name = cuts[m]
            current.append(m)
        out.append(Group(name, tuple(current)))
    return _unique(out)


def cut_bytes(num_units: int, values: Sequence[tuple[int, int, int]]) -> list[int]:
    """Bytes crossing the cut after each unit.

    ``values`` holds (producer unit, last consumer unit, bytes) per distinct value; a
    value crosses the cuts after units producer..last-1.  The last unit's cut is 0.

    Example:
        >>> cut_bytes(3, [(0, 2, 10), (1, 2, 5), (0, 0, 7)])
        [10, 15, 0]
    """
    diff = [0] * (num_units + 1)
    for producer, consumer, nbytes in values:
        if consumer > producer:
            diff[producer] += nbytes
            diff[consumer] -= nbytes
    out, running = [], 0
    for i in range(num_units):
        running += diff[i]
        out.append(running)
    out[-1] = 0
    return out
