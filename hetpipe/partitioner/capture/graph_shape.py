"""The topology of one micro-batch's autograd graph, and where a split backward cuts it.

`walk` visits the graph below a stage's outputs breadth-first and numbers its nodes in visit
order; the `Topology` it returns is plain integers (each node's children by number with the
output index they feed, which numbers are the stage's parameters and inputs, where the outputs
attach), so two micro-batches of a stage that build the same graph give equal topologies and a
different graph (a data-dependent branch) gives a different one.  `analyse` is a pure function of
a topology: the *frontier* nodes (on a path to an input, with an edge into the part of the graph
that reaches only parameters) and the groups of W (`hetpipe.runtime.execute.split_backward`), all
by number, so its result can be memoised on the topology and applied to any graph that has it.

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(3, 2)
    >>> x = torch.randn(4, 3, requires_grad=True)
    >>> y = torch.relu(lin(x))
    >>> nodes, topo = walk([y], [x], list(lin.parameters()))
    >>> [n.name() for n in nodes][:2]
    ['ReluBackward0', 'AddmmBackward0']
    >>> shape = analyse(topo)
    >>> [nodes[k].name() for k, _ in shape.frontier], shape.groups
    (['AddmmBackward0'], (((0,), (), (0, 1)),))
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch.autograd.graph import Node


@dataclass(frozen=True)
class Topology:
    """A graph by node number (breadth-first from the roots, in root order).

    edges: per node, its children as a flat ``(child, output index, child, output index, ...)``
        (a child's output index is where the node's gradient arrives at it; absent children skipped).
    roots: per root tensor, ``(node, output index)``, or ``(-1, 0)`` for one without a graph.
    targets: the nodes of the inputs whose gradient B computes.
    leaves: ``(node, parameter index)`` per parameter in the graph.
    """

    edges: tuple[tuple[int, ...], ...]
    roots: tuple[tuple[int, int], ...]
    targets: tuple[int, ...]
    leaves: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class GraphShape:
    """Where B and W cut a `Topology`.

    frontier: ``(node, output indices that receive a gradient)`` per frontier node, in node order.
    groups: per autograd call of W, ``(frontier entries, roots, parameters)`` by index (into
        ``frontier``, the roots, the parameters): roots that reach no input join the group of the
        parameters they reach.
    """

    frontier: tuple[tuple[int, tuple[int, ...]], ...]
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]


def _accumulator(t: torch.Tensor) -> Node | None:
    """The autograd node of `t`: its grad_fn, or a leaf's gradient accumulator (made on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


_ACCUMULATE_GRAD = type(_accumulator(torch.zeros((), requires_grad=True)))


def walk(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
         params: Sequence[torch.Tensor]) -> tuple[list[Node], Topology]:
    """The graph's nodes in breadth-first order from `roots` and its `Topology` (module docstring)."""
    nodes: list[Node] = []
    number: dict[int, int] = {}  # id(node) -> number: hashing a Node costs about 1 us, an id 0.05 us
    root_edges = []
    for r in roots:
        node = _accumulator(r)
        if node is None:
            root_edges.append((-1, 0))
            continue
        if id(node) not in number:
            number[id(node)] = len(nodes)
            nodes.append(node)
        root_edges.append((number[id(node)], r.output_nr if r.grad_fn is not None else 0))
    param_at = {id(p): i for i, p in enumerate(params)}
    input_at = {id(x) for x in inputs if x.grad_fn is None}
    edges: list[tuple[int, ...]] = []
    leaves, targets = [], []
    k = 0
    while k < len(nodes):
        node = nodes[k]
        if type(node) is _ACCUMULATE_GRAD:
            var = id(node.variable)
            if var in param_at:
                leaves.append((k, param_at[var]))
            elif var in input_at:
                targets.append(k)
            edges.append(())
            k += 1
            continue
        kids: list[int] = []
        for child, out in node.next_functions:
            if child is None:
                continue
            c = number.get(id(child))
            if c is None:
                c = number[id(child)] = len(nodes)
                nodes.append(child)
            kids += (c, out)
        edges.append(tuple(kids))
        k += 1
    targets += [number[id(x.grad_fn)] for x in inputs if x.grad_fn is not None and id(x.grad_fn) in number]
    return nodes, Topology(tuple(edges), tuple(root_edges), tuple(sorted(targets)), tuple(leaves))


def _reaching(targets: Iterable[int], parents: list[list[int]]) -> set[int]:
    """Every node from which a target is reachable (the targets included)."""
    seen = set(targets)
    todo = deque(seen)
    while todo:
        for parent in parents[todo.popleft()]:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _below(starts: Iterable[int], edges: tuple[tuple[int, ...], ...], skip: set[int]) -> set[int]:
    """Every node reachable from `starts` through nodes not in `skip` (the starts included)."""
    seen = set(starts)
    todo = deque(seen)
    while todo:
        for c in edges[todo.popleft()][0::2]:
            if c not in seen and c not in skip:
                seen.add(c)
                todo.append(c)
    return seen


def analyse(topo: Topology) -> GraphShape:
    """The frontier and W's groups of a graph (module docstring); deterministic in node order."""
    edges = topo.edges
    parents: list[list[int]] = [[] for _ in edges]
    arriving: list[set[int]] = [set() for _ in edges]  # output indices of a node that receive a gradient
    for k, kids in enumerate(edges):
        for c, out in zip(kids[0::2], kids[1::2]):
            parents[c].append(k)
            arriving[c].add(out)
    for node, out in topo.roots:
        if node >= 0:
            arriving[node].add(out)
    leaf_param = dict(topo.leaves)
    to_input = _reaching(topo.targets, parents)
    to_leaf = _reaching(leaf_param, parents)
    frontier = [k for k in range(len(edges)) if k in to_input
                and any(c in to_leaf and c not in to_input for c in edges[k][0::2])]
    sources: list[tuple[str, int, set[int]]] = []  # ("f", frontier entry | "r", root index, parameters)
    for j, k in enumerate(frontier):
        below = _below([c for c in edges[k][0::2] if c not in to_input], edges, to_input)
        sources.append(("f", j, {leaf_param[n] for n in below if n in leaf_param}))
    for r, (node, _) in enumerate(topo.roots):
        if node >= 0 and node not in to_input:  # an output that reaches no input: W's alone
            sources.append(("r", r, {leaf_param[n] for n in _below([node], edges, set()) if n in leaf_param}))
    return GraphShape(tuple((k, tuple(sorted(arriving[k]))) for k in frontier), _merge(sources))


def _merge(sources: list[tuple[str, int, set[int]]]) -> tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]:
    """Sources grouped by the parameters they reach (groups sharing one are merged; none: dropped)."""
    groups: list[tuple[list[int], list[int], set[int]]] = []
    for kind, index, params in sources:
        if not params:
            continue
        merged = [g for g in groups if g[2] & params]
        members: list[int] = [index] if kind == "f" else []
        roots: list[int] = [index] if kind == "r" else []
        for g in merged:
            groups.remove(g)
            members += g[0]
            roots += g[1]
            params |= g[2]
        groups.append((members, roots, params))
    return tuple((tuple(sorted(m)), tuple(sorted(r)), tuple(sorted(p))) for m, r, p in groups)
