"""Activation recomputation in a built stage: the plan's chosen units run under ``torch.utils.checkpoint``.

`apply_recompute` rewrites a stage's ``GraphModule`` in place: the compute nodes of each
recomputed plan unit become one call of a `RecomputedUnit`, which runs them (a small
``GraphModule`` sharing the stage's parameters and buffers, not registered as a submodule,
so parameter names, the state dict and the optimizer are untouched) through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.  One checkpoint region per
unit, as the cost model prices it: a recomputed unit keeps only its inputs for the backward,
and the backward of one micro-batch re-runs one unit at a time.

* **RNG**: checkpoint's ``preserve_rng_state`` (its default) replays the forward's CPU and
  device RNG state, so dropout draws the same mask on recompute and the stream after the
  backward is unchanged.
* **Buffers**: a unit that updates buffers in its forward (BatchNorm's running statistics and
  ``num_batches_tracked``) would update them again when eager torch recomputes it.  The first
  forward of each unit finds which buffers it mutates (version counter or value changed); every
  recompute then runs under `RestoredBuffers`, which copies those buffers back afterwards, so
  the statistics update once per micro-batch, exactly as without recomputation.  The unit's
  output must not depend on buffers that later forwards change (true of BatchNorm in training
  mode: it normalises with the batch's statistics).
* **Memory**: ``saved_bytes`` is what autograd saves inside the unit beyond its inputs and its
  parameters and buffers (unique storages), measured once, on the unit's first forward, by a
  dry run with the RNG and the mutated buffers restored.  It is what a recompute allocates
  again in the backward; the executor's ledger adds it at the backward (cost model: the peak
  adds max over recomputed units of their activation bytes, once).

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    >>> gm = torch.fx.symbolic_trace(net)
    >>> (unit,) = apply_recompute(gm, {1: ("_1",)}, stage=0)
    >>> x = torch.randn(3, 4)
    >>> torch.allclose(gm(x), net(x)), unit.unit, unit.saved_bytes    # tanh's 3x8 output, measured once
    (True, 1, 96)
"""

from __future__ import annotations

import contextlib
import logging
import operator
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from hetpipe.errors import ScheduleError

log = logging.getLogger(__name__)

_CALL_OPS = ("call_function", "call_method", "call_module")


class RestoredBuffers(contextlib.AbstractContextManager):
    """Copies ``buffers`` on entry and writes the copies back on exit (also when an exception ends it).

    Example:
        >>> b = torch.zeros(2)
        >>> with RestoredBuffers((b,)):
        ...     _ = b.add_(1)
        >>> b.tolist()
        [0.0, 0.0]
    """

    def __init__(self, buffers: Sequence[torch.Tensor]) -> None:
        self._buffers = tuple(buffers)
        self._copies: tuple[torch.Tensor, ...] = ()

    def __enter__(self) -> "RestoredBuffers":
        self._copies = tuple(b.detach().clone() for b in self._buffers)
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for b, c in zip(self._buffers, self._copies):
                b.copy_(c)
        self._copies = ()


class RecomputedUnit:
    """One plan unit of a stage, called from the stage graph and run through checkpoint.

    Attributes:
        unit: the plan's global unit index.
        region: the unit's nodes as a ``GraphModule``: takes the unit's inputs, returns the
            tuple of its values used outside it; shares the stage's tensors.
        saved_bytes: bytes autograd saves inside the unit beyond its inputs (None until the
            first forward with autograd on).
        mutated_buffers: buffers its forward updates in place (restored after each recompute).
    """

    def __init__(self, unit: int, region: fx.GraphModule) -> None:
        self.unit, self.region = unit, region
        self.saved_bytes: int | None = None
        self.mutated_buffers: tuple[torch.Tensor, ...] = ()
        # torch.fx writes a call_function target into the generated code by its qualified name
        self.__name__ = f"recompute_unit_{unit}"
        self.__module__ = __name__

    def __call__(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved without autograd: nothing to recompute
            return self.region(*args)
        if self.saved_bytes is None:
            self._measure(args)
        return checkpoint(self.region, *args, use_reentrant=False, context_fn=self._contexts)

    def _contexts(self) -> tuple[Any, Any]:
        """(forward context, recompute context) for checkpoint's ``context_fn``."""
        return contextlib.nullcontext(), RestoredBuffers(self.mutated_buffers)

    def _measure(self, args: Sequence[Any]) -> None:
        """Dry run without checkpoint: the bytes autograd saves, and the buffers the forward mutates."""
        buffers = list({id(b): b for b in self.region.buffers()}.values())
        before = [(b._version, b.detach().clone()) for b in buffers]
        skip = {_storage(t) for t in [*self.region.parameters(), *buffers, *args] if isinstance(t, torch.Tensor)}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage(t)
            if key is not None and key not in skip:
                saved[key] = t.untyped_storage().nbytes()
            return t

        devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
        with torch.random.fork_rng(devices=devices, device_type="cuda"):  # the dry run draws no random numbers
            with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
                self.region(*args)
        # native batch_norm writes its running statistics without bumping their version: compare values too
        changed = [(b, c) for b, (v, c) in zip(buffers, before) if b._version != v or not torch.equal(b, c)]
        with torch.no_grad():  # undo only those: a buffer an earlier unit saved keeps its version counter
            for b, c in changed:
                b.copy_(c)
        self.mutated_buffers = tuple(b for b, _ in changed)
        self.saved_bytes = sum(saved.values())
        log.debug("recomputed unit %d saves %d bytes per micro-batch; mutates %d buffers", self.unit,
                  self.saved_bytes, len(self.mutated_buffers))


def apply_recompute(module: fx.GraphModule, units: Mapping[int, Sequence[str]], *,
                    stage: int) -> tuple[RecomputedUnit, ...]:
    """Run each unit of ``units`` (global unit index -> its fx node names) through checkpoint.

    ``module`` is a built stage (its tensors materialised); it is rewritten in place and
    recompiled.  Raises `ScheduleError` naming the unit if it has no compute node on this
    stage or its nodes cannot be called as one region.
    """
    found = []
    for unit, names in sorted(units.items()):
        wanted = set(names)
        nodes = [n for n in module.graph.nodes if n.name in wanted and n.op in _CALL_OPS]
        if not nodes:
            raise ScheduleError(f"stage {stage}: recompute_units lists unit {unit}, which has no compute node on "
                                "this stage; list only units in the stage's [first_unit, last_unit]")
        found.append(_outline(module, unit, nodes, stage=stage))
    module.graph.lint()
    module.recompile()
    return tuple(found)


def _outline(module: fx.GraphModule, unit: int, nodes: list[fx.Node], *, stage: int) -> RecomputedUnit:
    """Replace ``nodes`` (graph order) by one call of a `RecomputedUnit` and getitems of its outputs."""
    graph, inside = module.graph, set(nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = list(dict.fromkeys(p for n in nodes for p in n.all_input_nodes if p not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    last = nodes[-1]
    late = [u.name for o in outputs for u in o.users if u not in inside and order[u] < order[last]]
    if late:
        raise ScheduleError(f"stage {stage}: unit {unit} cannot be recomputed as one region: node {late[0]!r} "
                            f"outside it uses its values before its last node {last.name!r}; re-plan without "
                            f"recomputing unit {unit}")
    region = RecomputedUnit(unit, fx.GraphModule(module, _region_graph(inputs, nodes, outputs, inside),
                                                 class_name=f"RecomputeUnit{unit}"))
    with graph.inserting_after(last):
        call = graph.call_function(region, tuple(i for i in inputs if i.op != "get_attr"))
    anchor = call
    for k, out in enumerate(outputs):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (call, k))
        out.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in inside)
    for n in reversed(nodes):
        graph.erase_node(n)
    for attr in inputs:
        if attr.op == "get_attr" and not attr.users:
            graph.erase_node(attr)
    return region


def _region_graph(inputs: list[fx.Node], nodes: list[fx.Node], outputs: list[fx.Node],
                  inside: set[fx.Node]) -> fx.Graph:
    """The unit's own graph: placeholders for its outside values, its get_attrs, its nodes, its outputs."""
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for p in inputs:
        if p.op != "get_attr":
            env[p] = g.placeholder(p.name)
    for p in inputs:
        if p.op == "get_attr":  # parameters and buffers are read in place, never passed
            env[p] = g.node_copy(p)
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in outputs))
    g.lint()
    return g


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse / nested tensors have no plain storage
        return None


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
