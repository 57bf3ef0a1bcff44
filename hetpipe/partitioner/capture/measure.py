"""Measure a traced graph on the meta device: per-node forward costs, per-unit training costs.

Two passes over a ``torch.fx.GraphModule`` whose parameters live on the meta device
(nothing is computed, nothing is allocated):

* `measure_forward` runs the graph node by node under `CostCounter` and records, per
  node, the forward FLOPs, memory traffic and kernel launches and the shapes/dtypes of
  what the node returns.  `capture` groups nodes into units from these numbers.
* `measure_training` runs the graph again with every value that crosses a unit
  boundary replaced, in the consuming unit, by a fresh autograd leaf (a clone of a
  detached copy, made outside the meters and counters).  Each unit's autograd graph is
  then separate, so per unit it measures

  - *held activations*: the storages one micro-batch keeps for its backward -- what
    autograd saves while the nodes run, and the model's inputs -- each counted once, in
    the unit that produced it, with every leaf copy mapped back to the storage it stands
    for (`hetpipe.partitioner.capture.storages.StorageTracker`; parameters and buffers
    excluded), and per node the held bytes of its outputs (the held share of a cut);
  - *backward FLOPs*: ``torch.autograd.backward`` from the unit's outputs (every tensor
    it passes to a later unit or to the model output) with an arbitrary meta gradient,
    run under `CostCounter`.  This measures what autograd really runs: input gradients
    of the unit's boundary inputs that require grad, weight gradients of its
    parameters, and the accumulation of a tied parameter's second gradient.  The loss
    and its gradient are outside the graph and not counted.

Scaled-dot-product attention is replayed with `fused_sdpa` in both passes: the meta
device would take the math path and save the b·a·s² probabilities, which the fused GPU
kernels a plan targets do not (see `hetpipe.cost_models.activations`).

Example:
    >>> import torch, torch.fx as fx
    >>> net = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()).to("meta"))
    >>> x = torch.empty(2, 4, device="meta")
    >>> fwd = measure_forward(net, (x,), precision="fp32")
    >>> fwd["_0"].flops, fwd["_1"].flops, fwd["_1"].shapes
    (128, 16, (((2, 8), 'float32'),))
    >>> train = measure_training(net, (x,), unit_of={"input_1": 0, "_0": 0, "_1": 1, "output": 1},
    ...                          num_units=2, precision="fp32")
    >>> train.activation_bytes     # Linear saves its input (2x4 floats), tanh its output (2x8)
    (32, 64)
    >>> train.bwd_flops[0]         # weight gradient 2*2*4*8 + bias gradient (sum of 2x8); none for x
    144
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map

from hetpipe.cost_models.activations import SDPA_TARGETS, fused_sdpa, storage_bytes, storage_key
from hetpipe.cost_models.flops import CostCounter
from hetpipe.cost_models.memory import tensor_bytes
from hetpipe.cost_models.work import PassWork
from hetpipe.errors import CaptureError
from hetpipe.partitioner.capture.storages import StorageTracker
from hetpipe.partitioner.capture.transients import BackwardPeak
from hetpipe.partitioner.capture.weight_grads import unit_weight_grad_bytes

CALL_OPS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class NodeCost:
    """What one node does in the forward, per micro-batch.

    Attributes:
        flops: forward FLOPs.
        traffic_bytes: bytes read + written by its memory-bound ops.
        kernels: kernels launched (0 for views and Python-level getitems).
        out_bytes: bytes of the tensors it returns (in the training precision).
        shapes: ``(shape, dtype)`` of every tensor it returns, in pytree order.
        is_tensor: it returns a single tensor (only such values can cross a pipeline cut).
    """

    flops: int
    traffic_bytes: int
    kernels: int
    out_bytes: int
    shapes: tuple[tuple[tuple[int, ...], str], ...]
    is_tensor: bool
    work: PassWork = PassWork()  # the same counts with the per-op table (`hetpipe.cost_models.work`)


def module_path_of(node: fx.Node) -> str:
    """Qualified name of the innermost module a node ran in (``""`` for the root).

    Example:
        >>> g = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(1, 1))).graph
        >>> [module_path_of(n) for n in g.nodes]
        ['', '0', '']
    """
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        return str(path)
    return str(node.target) if node.op == "call_module" else ""


def _describe(value: Any, precision: str) -> tuple[int, tuple[tuple[tuple[int, ...], str], ...]]:
    tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    shapes = tuple((tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors)
    return sum(tensor_bytes(t, precision) for t in tensors), shapes


def _where(node: fx.Node) -> str:
    path = module_path_of(node)
    return f"node {node.name!r} ({node.op} {node.target}) in module {path or '<root>'!r}"


def _on_meta(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Devices baked into a graph (an export of a CPU model records ``device=cpu``) -> meta."""
    def fix(a: Any) -> Any:
        return _META if isinstance(a, torch.device) else a
    kwargs = dict(tree_map(fix, kwargs))
    if isinstance(kwargs.get("device"), str):
        kwargs["device"] = _META
    return tree_map(fix, args), kwargs


_META = torch.device("meta")


class _MetaInterpreter(fx.Interpreter):
    """Runs a graph on meta tensors, replaying SDPA as a fused kernel."""

    def __init__(self, gm: fx.GraphModule, garbage_collect_values: bool = True) -> None:
        super().__init__(gm, garbage_collect_values=garbage_collect_values)
        self.extra_traceback = False  # our CaptureError already names the node

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in SDPA_TARGETS:
            target = fused_sdpa
        return super().call_function(target, *_on_meta(args, kwargs))

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_method(target, *_on_meta(args, kwargs))

    def _run_checked(self, n: fx.Node, args: Any, kwargs: Any) -> Any:
        try:
            return getattr(self, n.op)(n.target, args, kwargs)
        except CaptureError:
            raise
        except Exception as err:  # an op without a meta kernel, .item(), data-dependent Python
            raise CaptureError(
                f"cannot run {_where(n)} on the meta device: {type(err).__name__}: {str(err).splitlines()[0]}; "
                "costs are measured without real data, so the forward must not read tensor values "
                "(.item(), `if tensor:`); rewrite that code with torch.where/torch.cond, or pass a model "
                "whose every op has a meta kernel") from err


class _ForwardPass(_MetaInterpreter):
    def __init__(self, gm: fx.GraphModule, precision: str) -> None:
        super().__init__(gm)
        self.precision = precision
        self.counter = CostCounter(precision)
        self.costs: dict[str, NodeCost] = {}

    def run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        before = self.counter.work()
        out = self._run_checked(n, args, kwargs)
        work = self.counter.work().minus(before)
        out_bytes, shapes = _describe(out, self.precision)
        self.costs[n.name] = NodeCost(
            flops=work.flops, traffic_bytes=work.traffic_bytes, kernels=work.kernels, out_bytes=out_bytes,
            shapes=shapes, is_tensor=isinstance(out, torch.Tensor), work=work)
        return out


def measure_forward(gm: fx.GraphModule, inputs: Sequence[Any], *, precision: str) -> dict[str, NodeCost]:
    """Per-node forward costs of ``gm`` on meta ``inputs`` (see the module docstring)."""
    run = _ForwardPass(gm, precision)
    with torch.enable_grad(), run.counter:
        run.run(*inputs)
    return run.costs


@dataclass(frozen=True)
class TrainingCosts:
    """Per-unit results of `measure_training`.

    ``activation_bytes[u]``: bytes of the held storages unit u produces (module docstring);
    ``held_output_bytes[node]``: bytes of the node's outputs whose storage is held;
    ``grad_output_bytes[node]``: bytes of the node's outputs that require grad.
    """

    activation_bytes: tuple[int, ...]
    bwd_flops: tuple[int, ...]
    held_output_bytes: Mapping[str, int] = field(default_factory=dict)
    grad_output_bytes: Mapping[str, int] = field(default_factory=dict)
    recompute_bytes: tuple[int, ...] = ()  # per unit: the storages it makes and saves itself
    # node -> (storage, bytes) of its held outputs; storage keys are unique within one capture
    held_output_storages: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    weight_grad_bytes: tuple[int, ...] = ()  # per unit: what a split backward keeps from B to W (`weight_grads`)
    bwd_work: tuple[PassWork, ...] = ()  # per unit: the backward's counts with the per-op table (`cost_models.work`)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _leaf(value: Any) -> Any:
    """A fresh autograd leaf standing in for a value received from another unit."""
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t.detach().requires_grad_(True).clone()  # clone: in-place ops on it stay legal
        return t
    return tree_map(one, value)


class _TrainingPass(_MetaInterpreter):
    def __init__(self, gm: fx.GraphModule, *, unit_of: Mapping[str, int], num_units: int, precision: str,
                 saved_outputs: Sequence[bool] = ()) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.unit_of, self.saved_outputs = unit_of, tuple(saved_outputs)
        keys = {storage_key(t) for t in [*gm.parameters(), *gm.buffers()]}
        keys |= {storage_key(t) for n in gm.graph.nodes if n.op == "get_attr"
                 for t in [self.fetch_attr(n.target)] if isinstance(t, torch.Tensor)}
        self.tracker = StorageTracker(keys, precision)
        self._unit = 0  # the unit whose node runs now: autograd's saves are charged to it
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)
        self.leaves: dict[str, Any] = {}
        self.outputs: list[list[torch.Tensor]] = [[] for _ in range(num_units)]
        self.inputs: list[list[torch.Tensor]] = [[] for _ in range(num_units)]  # the leaves each unit reads

    def _load(self, p: fx.Node, unit: int) -> Any:
        value = self.env[p]
        if p.op == "get_attr" or self.unit_of[p.name] == unit:
            return value
        if p.name not in self.leaves:
            self.leaves[p.name] = _leaf(value)
            self.tracker.alias(self.leaves[p.name], value)
        self.inputs[unit].extend(t for t in tree_leaves(self.leaves[p.name]) if isinstance(t, torch.Tensor))
        return self.leaves[p.name]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.tracker.saved(self._unit, t)
        return t

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "output":  # what the loss saves of the output is held where it is made
            out = super().run_node(n)
            tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            for t, keep in zip(tensors, self.saved_outputs if len(self.saved_outputs) == len(tensors) else ()):
                if keep:
                    self.tracker.hold(self.unit_of[n.name], t)
            return out
        if n.op == "placeholder":  # the first stage keeps the micro-batch's inputs until its backward
            out = super().run_node(n)
            self.tracker.produced(self.unit_of[n.name], n.name, out)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.tracker.hold(self.unit_of[n.name], t)
            return out
        if n.op not in CALL_OPS:
            return super().run_node(n)
        unit = self._unit = self.unit_of[n.name]
        args = fx.node.map_arg(n.args, lambda p: self._load(p, unit))
        kwargs = fx.node.map_arg(n.kwargs, lambda p: self._load(p, unit))
        with self._hooks:
            out = self._run_checked(n, args, kwargs)
        self.tracker.produced(unit, n.name, out)
        # the unit's outputs: what a later unit or the model output reads
        if any(u.op == "output" or self.unit_of[u.name] != unit for u in n.users):
            self.outputs[unit].extend(t for t in tree_leaves(out)
                                      if isinstance(t, torch.Tensor) and t.grad_fn is not None)
        return out


def measure_training(gm: fx.GraphModule, inputs: Sequence[Any], *, unit_of: Mapping[str, int], num_units: int,
                     precision: str, saved_outputs: Sequence[bool] = ()) -> TrainingCosts:
    """Saved-activation bytes and backward FLOPs of each unit (see the module docstring).

    ``unit_of`` maps every node name of ``gm`` to its unit; units must follow the data flow.
    ``saved_outputs``: per output tensor, the loss saves it (`LossCosts.saved_outputs`).
    """
    run = _TrainingPass(gm, unit_of=unit_of, num_units=num_units, precision=precision, saved_outputs=saved_outputs)
    with torch.enable_grad():
        run.run(*inputs)
        kept = tuple(unit_weight_grad_bytes(outs, ins, list(gm.parameters()), precision=precision)
                     for outs, ins in zip(run.outputs, run.inputs))
        bwd: list[PassWork] = []
        counter = CostCounter(precision)
        with counter:
            for outs in run.outputs:
                before = counter.work()
                if outs:
                    torch.autograd.backward(outs, [torch.empty_like(t) for t in outs])
                bwd.append(counter.work().minus(before))
    for p in gm.parameters():
        p.grad = None
    held = {n.name: run.tracker.node_held_bytes(n.name) for n in gm.graph.nodes}
    grad = {n.name: run.tracker.node_grad_bytes(n.name) for n in gm.graph.nodes}
    return TrainingCosts(activation_bytes=run.tracker.held_bytes(num_units), bwd_flops=tuple(w.flops for w in bwd),
                         bwd_work=tuple(bwd),
                         held_output_bytes=held, grad_output_bytes=grad,
                         recompute_bytes=run.tracker.own_saved_bytes(num_units),
                         held_output_storages={n.name: run.tracker.node_held_storages(n.name) for n in gm.graph.nodes},
                         weight_grad_bytes=kept)


@dataclass(frozen=True)
class LossCosts:
    """What the loss adds to the last stage per micro-batch: saved bytes, forward and backward FLOPs;
    ``live``: per tensor of the model output (pytree order), whether the loss's gradient reaches it."""

    activation_bytes: int
    fwd_flops: int
    bwd_flops: int
    live: tuple[bool, ...] = ()
    saved_outputs: tuple[bool, ...] = ()  # per output tensor: the loss saves it (counted by measure_training)
    fwd_work: PassWork = PassWork()  # forward and backward counts with the per-op table (`cost_models.work`)
    bwd_work: PassWork = PassWork()
    # the most bytes the loss's backward allocates at once beyond the ledger (`transients.BackwardPeak`)
    transient_bwd_bytes: int = 0


def measure_loss(output: Any, targets: Any, loss_fn: Any, *, precision: str) -> LossCosts:
    """Run ``loss_fn(output, targets)`` and its backward on meta stand-ins of the model output.

    The loss runs on the last stage after the model's graph; what it saves for backward
    (cross-entropy keeps the b·s·V log-probabilities of a language model) lives in that
    stage's memory for every in-flight micro-batch, like the graph's own activations.

    Example:
        >>> import torch.nn.functional as F
        >>> logits = torch.empty(2, 5, device="meta")
        >>> measure_loss(logits, torch.zeros(2, dtype=torch.long, device="meta"), F.cross_entropy,
        ...              precision="fp32").activation_bytes   # log-probs 2x5 fp32, targets 2 int64, total weight
        60
    """
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    stand_in = tree_map(lambda t: torch.empty_like(t, device="meta").requires_grad_(t.is_floating_point())
                        if isinstance(t, torch.Tensor) else t, output)
    meta_targets = tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t,
                            targets)
    if not leaves:
        raise CaptureError("the model returned no tensor; a loss cannot be measured on its output")
    outs = [t for t in tree_leaves(stand_in) if isinstance(t, torch.Tensor)]
    # a model output the loss saves is the model's own storage, held where it is made (measure_training)
    out_keys = {storage_key(t): i for i, t in enumerate(outs)}
    saved: dict[int, tuple[torch.UntypedStorage, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(storage_key(t), (t.untyped_storage(), storage_bytes(t, precision)))
        return t

    counter = CostCounter(precision)
    with torch.enable_grad(), counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
            loss = loss_fn(stand_in, meta_targets)
        fwd = counter.work()
        with BackwardPeak(precision) as peak:
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
        bwd = counter.work().minus(fwd)
    return LossCosts(activation_bytes=sum(b for k, (_, b) in saved.items() if k not in out_keys), fwd_flops=fwd.flops,
                     bwd_flops=bwd.flops, live=tuple(t.grad is not None for t in outs),
                     saved_outputs=tuple(k in saved for k in out_keys), fwd_work=fwd, bwd_work=bwd,
                     transient_bwd_bytes=peak.peak_bytes)
