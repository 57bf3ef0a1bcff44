"""A backward in two halves: B (the stage inputs' gradient, sent upstream at once) and W (the weights').

Zero-bubble schedules (`hetpipe.schedule.builders.zb_h1`) run W later than B.  `backward_input`
runs autograd from the stage's outputs to its inputs only (``retain_graph``: W needs the
graph), so a layer ``Y = X W`` computes ``dX`` but not ``dW``.  The same call also returns the
gradient arriving at every *frontier* node (asked for as a `GradientEdge` output, no hooks): a
node on a path to an input that also has an edge into the part of the graph that reaches only
parameters (for a Linear, the ``addmm``/``mm`` node whose other edge leads to the weight).
`backward_weight` starts autograd at those nodes with the recorded gradients and asks for the
parameters only; a frontier node reached again from another frontier node of the same call gets
its recorded gradient back (a pre-hook replaces what arrives), so nothing is counted twice.  The
idea is torch.distributed.pipelining's ``stage_backward_input`` / ``stage_backward_weight``; this
is a separate, smaller implementation.

Each call to autograd in W asks only for the parameters reachable from its frontier nodes
without passing another input path (a *group*; groups sharing a parameter are merged, and so are
outputs that reach no input), so W does not recompute the input-gradient chain between layers.
W accumulates into ``.grad`` the way a plain backward does (``torch.autograd.backward(...,
inputs=)``: in place after the first micro-batch, each parameter once per W, post-accumulate
hooks fire).

The graph analysis (which nodes are frontier, which parameters each group reaches) depends only
on the graph's topology, and a stage builds the same graph every micro-batch: the analysis is
memoised on the topology itself (every node's edges by position in a breadth-first walk, and
which positions are the parameters and the inputs), so a micro-batch whose graph differs
(a data-dependent branch) gets its own analysis, never another's (`analysis_cache_info`).

Kept from B to W: the graph's saved tensors (what the forward saved) and the frontier
gradients (one output-sized tensor per parameterised layer: `PendingWeight.held_tensors`; the
memory model prices the micro-batch's activations until W, `hetpipe.schedule.held`, and these as
`hetpipe.partitioner.capture.weight_grads` measures them at capture).  A stage
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

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

from hetpipe.partitioner.capture.graph_shape import GraphShape, Topology, analyse, walk

#: Distinct graph topologies remembered (a stage has one; a data-dependent one a few).
CACHE_SIZE = 64


@dataclass
class PendingWeight:
    """What `backward_input` leaves for `backward_weight`: one autograd call per group, each as
    (frontier nodes with the gradients recorded at them, roots with their gradients, parameters);
    and the roots W runs alone with every parameter (all of them when the stage had no input
    gradient to compute)."""

    groups: list[tuple[list[tuple[Node, dict[int, torch.Tensor]]], list[tuple[torch.Tensor, torch.Tensor | None]],
                       list[torch.Tensor]]] = field(default_factory=list)
    roots: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] | None = None

    def held_tensors(self) -> list[torch.Tensor]:
        """The gradients kept for W (the memory ledger counts them until W; the graph's saved
        tensors are the micro-batch's activations already): the recorded frontier gradients, the
        roots' gradients W runs alone, and a first stage's received gradients."""
        kept = [g for members, _, _ in self.groups for _, rec in members for g in rec.values()]
        kept += [g for _, roots, _ in self.groups for _, g in roots if g is not None]
        return kept + list(self.grads or ())


@functools.lru_cache(maxsize=CACHE_SIZE)
def _cached(topology: Topology) -> GraphShape:
    return analyse(topology)


def analysis_cache_info() -> Any:
    """``functools`` cache statistics of the graph analysis (hits: micro-batches that reused one).

    Example:
        >>> analysis_cache_info().maxsize == CACHE_SIZE
        True
    """
    return _cached.cache_info()


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                   inputs: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor | None, ...], PendingWeight]:
    """B: the gradient of each of `inputs` (None where it needs none) and the `PendingWeight` for W.

    `grads` are the gradients of `roots` (None for a scalar loss); `params` the stage's parameters.
    """
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    roots = list(roots)
    if not wanted or not any(r.requires_grad for r in roots):  # nothing to send upstream: W does it all
        return tuple(None for _ in inputs), PendingWeight(roots=roots, grads=None if grads is None else list(grads))
    nodes, topology = walk(roots, wanted, params)
    shape = _cached(topology)
    captures = [GradientEdge(nodes[k], i) for k, outs in shape.frontier for i in outs]
    got = torch.autograd.grad(roots, [*wanted, *captures], grad_outputs=None if grads is None else list(grads),
                              retain_graph=True, allow_unused=True)
    recorded: list[dict[int, torch.Tensor]] = []
    at = len(wanted)
    for _, outs in shape.frontier:
        recorded.append({i: g for i, g in zip(outs, got[at:at + len(outs)]) if g is not None})
        at += len(outs)
    root_grads = list(grads) if grads is not None else [None] * len(roots)
    pending = PendingWeight()
    for members, root_ids, param_ids in shape.groups:
        pending.groups.append(([(nodes[shape.frontier[j][0]], recorded[j]) for j in members],
                               [(roots[r], root_grads[r]) for r in root_ids], [params[p] for p in param_ids]))
    by_id = {id(x): g for x, g in zip(wanted, got)}
    return tuple(by_id.get(id(x)) if isinstance(x, torch.Tensor) else None for x in inputs), pending


def backward_weight(pending: PendingWeight, params: Sequence[torch.Tensor]) -> None:
    """W: accumulate the parameters' gradients (``.grad``) from what `backward_input` recorded."""
    for members, roots, group in pending.groups:
        edges: list[Any] = [GradientEdge(n, i) for n, rec in members for i in rec]
        grads: list[Any] = [g for _, rec in members for g in rec.values()]
        edges += [r for r, _ in roots]
        grads += [g if g is not None else torch.ones_like(r) for r, g in roots]
        if edges:
            _accumulate(edges, grads, group, clamp=[(n, rec) for n, rec in members if rec])
    if pending.roots:  # the whole backward: the stage had no input gradient to compute
        wanted = [p for p in params if p.requires_grad]
        if wanted:
            grads = (list(pending.grads) if pending.grads is not None
                     else [torch.ones_like(r) for r in pending.roots])
            torch.autograd.backward(pending.roots, grads, inputs=wanted)
    pending.groups.clear()
    pending.roots.clear()


def _accumulate(edges: list[Any], grads: list[torch.Tensor], params: list[torch.Tensor], *,
                clamp: list[tuple[Node, dict[int, torch.Tensor]]]) -> None:
    # a frontier node reached again from another of its group gets exactly its recorded gradient back
    handles = ([n.register_prehook(functools.partial(_clamped, rec)) for n, rec in clamp]
               if len(clamp) > 1 else [])
    try:
        torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
    finally:
        for h in handles:
            h.remove()


def _clamped(recorded: dict[int, torch.Tensor], arrived: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
    return tuple(recorded.get(i) for i in range(len(arrived)))
