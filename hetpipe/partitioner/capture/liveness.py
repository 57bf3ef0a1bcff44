"""Which parameters the loss's gradient never reaches (a base model's unused pooler).

`hetpipe.partitioner.capture.measure.measure_loss` reports, per tensor of the model output,
whether the loss's gradient reaches it.  A parameter read only by nodes from which no such
live output can be reached gets no gradient: the runtime's optimizer then keeps neither a
gradient nor optimizer state for it (``zero_grad(set_to_none=True)``, and Adam skips
parameters without one), so the capture costs it like a frozen parameter (its weight only).

Reachability over the graph is an over-approximation of gradient flow (an integer or
detached path counts as live), so the cost stays an upper bound.

Example:
    >>> import torch, torch.fx as fx
    >>> class TwoHeads(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         return self.a(x), self.b(x)
    >>> gm = fx.symbolic_trace(TwoHeads())
    >>> dead = dead_parameters(gm, (True, False))     # the loss reads the first output only
    >>> sorted(n for n, p in gm.named_parameters() if id(p) in dead)
    ['b.bias', 'b.weight']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch.fx as fx
from torch.utils._pytree import tree_leaves

from hetpipe.partitioner.capture.graph import Unit
from hetpipe.partitioner.capture.measure import LossCosts


def dead_parameters(gm: fx.GraphModule, live: Sequence[bool]) -> set[int]:
    """ids of the parameters no live output depends on (empty if every output is live or unknown)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    nodes = [x for x in tree_leaves(output.args[0]) if isinstance(x, fx.Node)]
    if all(live) or len(nodes) != len(live):
        return set()
    reached: set[fx.Node] = set()
    todo = [n for n, keep in zip(nodes, live) if keep]
    while todo:
        node = todo.pop()
        if node not in reached:
            reached.add(node)
            todo.extend(node.all_input_nodes)
    used = set()
    for node in reached:
        if node.op == "call_module":
            used |= {id(p) for p in gm.get_submodule(node.target).parameters()}
        elif node.op == "get_attr":
            used.add(id(_attr(gm, str(node.target))))
    return {id(p) for p in gm.parameters() if p.requires_grad and id(p) not in used}


def _attr(gm: fx.GraphModule, target: str) -> object:
    value: object = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def with_loss(units: tuple[Unit, ...], loss: LossCosts) -> tuple[Unit, ...]:
    """`units` with the loss's saved bytes and FLOPs added to the last one (it runs on the last stage)."""
    last = units[-1]
    return (*units[:-1], dataclasses.replace(
        last, activation_bytes=last.activation_bytes + loss.activation_bytes,
        fwd_flops=last.fwd_flops + loss.fwd_flops, bwd_flops=last.bwd_flops + loss.bwd_flops,
        transient_bwd_bytes=max(last.transient_bwd_bytes, loss.transient_bwd_bytes),
        fwd_work=None if last.fwd_work is None else last.fwd_work.plus(loss.fwd_work),
        bwd_work=None if last.bwd_work is None else last.bwd_work.plus(loss.bwd_work)))
