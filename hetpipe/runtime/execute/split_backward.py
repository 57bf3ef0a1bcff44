"""A backward in two halves: B (the stage inputs' gradient, sent upstream at once) and W (the weights').

Zero-bubble schedules (`hetpipe.schedule.builders.zb_h1`) run W later than B.  `backward_input`
runs autograd from the stage's outputs to its inputs only (``retain_graph``: W needs the
graph), so a layer ``Y = X W`` computes ``dX`` but not ``dW``.  On the way it records, with node
pre-hooks, the gradient arriving at every *frontier* node: a node on a path to an input that
also has an edge into the part of the graph that reaches only parameters (for a Linear, the
``addmm``/``mm`` node whose other edge leads to the weight).  `backward_weight` starts autograd
at those nodes with the recorded gradients and asks for the parameters only; a frontier node
reached again from another frontier node gets its recorded gradient back (a pre-hook replaces
what arrives), so nothing is counted twice.  The idea is torch.distributed.pipelining's
``stage_backward_input`` / ``stage_backward_weight``; this is a separate, smaller
implementation.  Each call to autograd in W asks only for the parameters reachable from its
frontier nodes without passing another input path (a *group*; groups sharing a parameter are
merged), so W does not recompute the input-gradient chain between layers.

Kept from B to W: the graph's saved tensors (what the forward saved) and the frontier
gradients (about one output-sized tensor per parameterised layer; the memory model prices the
micro-batch's activations and received gradient until W, `hetpipe.schedule.held`).  A stage
whose inputs need no gradient (the first) has nothing to send: its B does nothing and its W is
the whole backward.

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(3, 2)
    >>> x = torch.randn(4, 3, requires_grad=True)
    >>> y = torch.tanh(lin(x))
    >>> g = torch.ones_like(y)
    >>> dx, pending = backward_input([y], [g], [x], list(lin.parameters()))
    >>> lin.weight.grad is None
    True
    >>> backward_weight(pending, list(lin.parameters()))
    >>> ref = torch.nn.Linear(3, 2); ref.load_state_dict(lin.state_dict()); x2 = x.detach().requires_grad_()
    <All keys matched successfully>
    >>> torch.tanh(ref(x2)).backward(g)
    >>> torch.allclose(dx[0], x2.grad), torch.allclose(lin.weight.grad, ref.weight.grad)
    (True, True)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class PendingWeight:
    """What `backward_input` leaves for `backward_weight`: per group, its frontier nodes and its
    parameters; the gradients recorded at every frontier node; and the roots W runs alone (all of
    them when the stage had no input gradient to compute)."""

    groups: list[tuple[list[Node], list[torch.Tensor]]] = field(default_factory=list)
    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    roots: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] | None = None


def _node(t: torch.Tensor) -> Node | None:
    """The autograd node of `t`: its grad_fn, or a leaf's gradient accumulator (made on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _parents(roots: Sequence[Node]) -> tuple[dict[int, list[int]], dict[int, Node]]:
    """id(node) -> ids of the nodes whose next_functions include it, over the graph below `roots`
    (roots: []), and id -> node.  Keyed by id: hashing a Node costs about 1 us, an id 0.05 us."""
    parents: dict[int, list[int]] = {id(n): [] for n in roots}
    nodes = {id(n): n for n in roots}
    todo = deque(roots)
    while todo:
        node = todo.popleft()
        key = id(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            ck = id(child)
            if ck not in parents:
                parents[ck] = []
                nodes[ck] = child
                todo.append(child)
            parents[ck].append(key)
    return parents, nodes


def _reaching(targets: Iterable[int], parents: dict[int, list[int]]) -> set[int]:
    """Ids of every node of the graph from which a target is reachable (the targets included)."""
    seen = {t for t in targets if t in parents}
    todo = deque(seen)
    while todo:
        for parent in parents[todo.popleft()]:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _params_below(node: Node, to_input: set[int], leaves: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """The parameters reachable from `node` through children that lead to no input."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = deque(c for c, _ in node.next_functions if c is not None and id(c) not in to_input)
    while todo:
        n = todo.popleft()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if id(n) in leaves:
            found[id(n)] = leaves[id(n)]
        todo.extend(c for c, _ in n.next_functions if c is not None and id(c) not in to_input)
    return list(found.values())


def _groups(frontier: list[Node], to_input: set[int],
            leaves: dict[int, torch.Tensor]) -> list[tuple[list[Node], list[torch.Tensor]]]:
    """Frontier nodes grouped by the parameters they reach (groups sharing one are merged)."""
    groups: list[tuple[list[Node], dict[int, torch.Tensor]]] = []
    for node in frontier:
        params = {id(p): p for p in _params_below(node, to_input, leaves)}
        if not params:
            continue
        merged = [g for g in groups if g[1].keys() & params.keys()]
        members = [node]
        for g in merged:
            groups.remove(g)
            members += g[0]
            params.update(g[1])
        groups.append((members, params))
    return [(members, list(params.values())) for members, params in groups]


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                   inputs: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor | None, ...], PendingWeight]:
    """B: the gradient of each of `inputs` (None where it needs none) and the `PendingWeight` for W.

    `grads` are the gradients of `roots` (None for a scalar loss); `params` the stage's parameters.
    """
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    root_nodes = [n for n in (_node(r) for r in roots) if n is not None]
    if not wanted or not root_nodes:  # nothing to send upstream: W does the whole backward
        return tuple(None for _ in inputs), PendingWeight(roots=list(roots), grads=None if grads is None else list(grads))
    parents, nodes = _parents(root_nodes)
    to_input = _reaching([id(n) for n in map(_node, wanted) if n is not None], parents)
    leaves = {id(n): p for p in params if p.requires_grad for n in [_node(p)] if n is not None and id(n) in parents}
    to_leaf = _reaching(leaves, parents)
    frontier = [nodes[k] for k in parents if k in to_input  # graph order: groups and sums are deterministic
                and any(c is not None and id(c) in to_leaf and id(c) not in to_input for c, _ in nodes[k].next_functions)]
    pending = PendingWeight(groups=_groups(frontier, to_input, leaves))
    handles = [node.register_prehook(_recorder(pending, node)) for nodes, _ in pending.groups for node in nodes]
    try:
        got = torch.autograd.grad(list(roots), wanted, grad_outputs=None if grads is None else list(grads),
                                  retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    # roots whose graph never reaches an input are W's alone
    extra = [(r, g) for r, g in zip(roots, grads or [None] * len(roots)) if id(_node(r)) not in to_input]
    pending.roots = [r for r, _ in extra]
    pending.grads = None if grads is None else [g for _, g in extra]
    by_id = {id(x): g for x, g in zip(wanted, got)}
    return tuple(by_id.get(id(x)) if isinstance(x, torch.Tensor) else None for x in inputs), pending


def _recorder(pending: PendingWeight, node: Node) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        pending.recorded[node] = tuple(grad_outputs)
    return hook


def backward_weight(pending: PendingWeight, params: Sequence[torch.Tensor]) -> None:
    """W: accumulate the parameters' gradients (``.grad``) from what `backward_input` recorded."""
    runs = [(nodes, group) for nodes, group in pending.groups]
    if pending.roots:  # the whole backward, or the roots that never reach an input
        runs.append(([], [p for p in params if p.requires_grad]))
    for nodes, group in runs:
        edges: list[Any] = [GradientEdge(n, i) for n in nodes for i, g in enumerate(pending.recorded.get(n, ()))
                            if g is not None]
        grads = [g for n in nodes for g in pending.recorded.get(n, ()) if g is not None]
        if not nodes:
            edges += pending.roots
            grads += (list(pending.grads) if pending.grads is not None
                      else [torch.ones_like(r) for r in pending.roots])
        if edges and group:
            _accumulate(edges, grads, group, clamp=[n for n in nodes if n in pending.recorded], pending=pending)
    pending.recorded.clear()
    pending.groups.clear()


def _accumulate(edges: list[Any], grads: list[torch.Tensor], params: list[torch.Tensor], *, clamp: list[Node],
                pending: PendingWeight) -> None:
    # a frontier node reached again from another of its group gets exactly its recorded gradient back
    handles = [n.register_prehook(lambda _g, saved=pending.recorded[n]: saved) for n in clamp] if len(clamp) > 1 else []
    try:
        got = torch.autograd.grad(edges, params, grad_outputs=grads, allow_unused=True, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    for p, g in zip(params, got):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g
