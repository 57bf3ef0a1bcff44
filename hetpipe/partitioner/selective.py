"""The selective recompute level of each unit, derived from a node-granularity capture (issue 14).

Korthikanti et al., MLSys'23, selective recomputation: recompute what is cheap to redo and heavy to
keep.  Inside a unit, a memory-bound node n (a norm, an activation: ``memory_traffic_bytes > 0`` at
node granularity) whose output is held for the backward is dropped and re-run in the backward when

(a) every tensor n reads is held anyway or is a parameter / graph input: re-running it keeps nothing new;
(b) every node reading n's output is compute-bound (a matmul or attention kernel: no memory traffic,
    some flops): it saves n's output for its weight gradient, and that saved copy is what the level
    drops; nothing else in the unit re-runs (the readers are never recomputed).

Per unit: freed = the dropped nodes' output bytes (what the runtime, `runtime/stage/selective.py`,
stops holding: the readers' saved copies, re-made from n's held inputs when the backward unpacks
them; what n saves for its own backward, e.g. a norm's mean and rstd, stays), peak = the dropped
nodes' held bytes (alive again during the unit's backward, their re-run's transients included),
seconds = the dropped nodes' forward times on each kind.  (A unit-wide SAC region,
``torch.utils.checkpoint.create_selective_checkpoint_contexts``, would re-run every op it does not
cache: caching the readers' outputs as well would cost their bytes too; see the runtime module.)  On GPT-2 this drops ln_1, ln_2 and the GELU of every block (not
the residual adds: they read a projection's output, which nothing holds).  `selective_tables` turns
the levels into `cost_models.selective.SelectiveTables` for `Problem.selective`.

Example (a block: ln -> fc -> gelu -> proj; fc and proj are matmuls, ln and gelu memory-bound):
    >>> import networkx as nx
    >>> from hetpipe.partitioner.capture.graph import Unit, UnitGraph
    >>> g = nx.DiGraph([("x", "ln"), ("ln", "fc"), ("fc", "gelu"), ("gelu", "proj")])
    >>> nx.set_node_attributes(g, 8, "bytes"); nx.set_node_attributes(g, "call_module", "op")
    >>> g.nodes["x"]["op"] = "placeholder"
    >>> def unit(i, n, act, traffic, flops, names=None):
    ...     return Unit(index=i, name=n, node_names=names or (n,), fwd_flops=flops, bwd_flops=2 * flops,
    ...                 param_count=0, param_bytes=0, state_bytes=0, activation_bytes=act, boundary_bytes=8,
    ...                 memory_traffic_bytes=traffic)
    >>> nodes = UnitGraph("m", "", (unit(0, "ln", 8, 16, 0), unit(1, "fc", 8, 0, 100), unit(2, "gelu", 8, 16, 0),
    ...                   unit(3, "proj", 0, 0, 100)), 0, 1, "sgd", "fp32", graph=g)
    >>> lv = unit_level(unit(0, "h.0", 24, 32, 200, ("ln", "fc", "gelu", "proj")), nodes)
    >>> lv.nodes, lv.freed_bytes, lv.peak_bytes   # ln's and gelu's outputs, 8 bytes each
    (('ln', 'gelu'), 16, 16)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from hetpipe.cost_models.selective import SelectiveTables
from hetpipe.partitioner.capture.graph import Unit, UnitGraph


@dataclass(frozen=True)
class SelectiveLevel:
    """One unit's selective level: the node-granularity units it drops, bytes freed per micro-batch and its peak."""

    nodes: tuple[str, ...]
    node_units: tuple[int, ...]  # the dropped nodes' indices in the node-granularity graph (for their seconds)
    freed_bytes: int
    peak_bytes: int


def unit_level(unit: Unit, node_graph: UnitGraph) -> SelectiveLevel:
    """The selective level of `unit` (a unit of a coarser capture of the same model) from `node_graph`."""
    inside = set(unit.node_names)
    by_node = {u.node_names[0]: u for u in node_graph.units if u.node_names[0] in inside}
    g = node_graph.graph
    held = {u.node_names[0]: u.activation_bytes > 0 for u in node_graph.units}

    def available(p: str) -> bool:  # held anyway, or a parameter / input of the graph
        return held.get(p, False) or g.nodes[p]["op"] in ("get_attr", "placeholder")

    def compute_bound(c: str) -> bool:
        return c in by_node and by_node[c].memory_traffic_bytes == 0 and by_node[c].fwd_flops > 0

    dropped: list[str] = []
    for n, u in by_node.items():
        readers = [c for c in g.successors(n) if g.nodes[c]["bytes"] > 0]  # not shape reads (x.size())
        if (u.memory_traffic_bytes > 0 and held[n] and all(available(p) for p in g.predecessors(n))
                and readers and all(compute_bound(c) for c in readers)):
            dropped.append(n)
    peak = sum(by_node[n].activation_bytes for n in dropped)
    freed = min(peak, sum(int(g.nodes[n]["bytes"]) for n in dropped))  # the outputs (the runtime's saved copies)
    return SelectiveLevel(tuple(dropped), tuple(by_node[n].index for n in dropped), freed, peak)


def selective_tables(units: Sequence[Unit], node_graph: UnitGraph,
                     node_fwd_s: Mapping[str, Sequence[float]]) -> SelectiveTables:
    """`SelectiveTables` for the units of a capture: each unit's `unit_level`, its seconds per kind the
    dropped nodes' forward times in `node_fwd_s` (kind -> per node-granularity unit, e.g. the `Problem.fwd_s`
    of the node capture); the peak the largest unit's."""
    levels = [unit_level(u, node_graph) for u in units]
    freed = tuple(lv.freed_bytes for lv in levels)
    extra = {k: tuple(sum(float(t[i]) for i in lv.node_units) if lv.freed_bytes > 0 else 0.0 for lv in levels)
             for k, t in node_fwd_s.items()}
    peak = max((lv.peak_bytes for lv in levels if lv.freed_bytes > 0), default=0)
    return SelectiveTables(freed_bytes=freed, peak_bytes=peak, extra_s=extra)
