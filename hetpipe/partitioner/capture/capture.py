"""`capture`: trace a model on the meta device into ordered, costed units (a `UnitGraph`).

Steps:

1. **Trace.**  ``torch.fx.symbolic_trace`` semantics (a `torch.fx.Tracer` that keeps the
   modules named in ``leaf_modules`` opaque and proxies buffer attributes, so a sliced
   mask buffer traces); if that fails, ``torch.export.export(model, args, strict=False)``
   and its unlifted ``.module()`` (Hugging Face transformers 5.x models need this).  If
   both fail, `CaptureError` names the module and source line where tracing stopped.
2. **Measure the forward** node by node on the meta device under `CostCounter`
   (`hetpipe.partitioner.capture.measure.measure_forward`); a model on a real device is copied
   to meta first (ties kept), so no weights are read or allocated.
3. **Group** the compute nodes into units (`hetpipe.partitioner.capture.units`): placeholders
   join the first unit, each ``get_attr`` the first unit that reads it, the output the
   last, so every fx node belongs to exactly one unit's ``node_names``.
4. **Measure training costs per unit** (`measure_training`): held activations and backward
   FLOPs by running autograd on meta, attention replayed as a fused kernel.
5. **Parameters**: counted by object identity, so a tied parameter (GPT-2's ``wte`` and
   ``lm_head``) counts once, in the first unit that uses it, and is reported as a
   `TiedParameter` with every name it has and every unit that uses it.
6. **Boundaries**: the bytes crossing the cut after unit i are all tensors produced at or
   before i and read after i (skip connections included; `units.cut_bytes`), exactly what
   `hetpipe.runtime.stage.build.split_stages` sends; ``boundary_held_bytes``: their share also
   held for backward, ``boundary_grad_bytes``: the share sent back as gradients (`storages`).

Approximations (also see `hetpipe.partitioner.capture.measure`): attention is costed as the fused
kernel (grouped-query attention with k, v expanded); parameters the forward never reads are left
out (with a warning); frozen parameters (``requires_grad=False``) cost their weight bytes only, and
so do parameters the loss's gradient never reaches (`liveness`); buffers count in the state of the
first unit that reads them.  The returned ``module`` is all meta, buffers included; each stage
gets its buffers from the weights or the model's own init (`hetpipe.runtime.stage.buffers`).

The fingerprint is a sha256 over every node's op, target, arguments and output shapes
and dtypes (no object addresses, no devices), so it is equal across processes and runs
and independent of ``granularity``: the runtime re-captures with default options.

Example:
    >>> import torch
    >>> from hetpipe.models import build
    >>> model, inputs = build("gpt-tiny", device="meta", batch=2, seq=16)
    >>> g = capture(model, inputs, name="gpt-tiny")
    >>> g.num_units, g.param_count, g.tracer, g.micro_batch_size
    (6, 220544, 'symbolic_trace', 2)
    >>> [u.name for u in g.units][1:3]
    ['transformer.h.0', 'transformer.h.1']
    >>> g.tied[0].qualified_names, g.tied[0].unit_indices
    (('transformer.wte.weight', 'lm_head.weight'), (0, 5))
    >>> g.units[-1].boundary_bytes, g.units[0].boundary_bytes == 2 * 16 * 64 * 4
    (0, True)
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import linecache
import logging
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn

from hetpipe.cost_models.memory import (
    check_optimizer, check_precision, grad_bytes_per_param, state_bytes_per_param, weight_bytes_per_param)
from hetpipe.cost_models.step_transient import STEP_VALUE_BYTES
from hetpipe.cost_models.work import total_work
from hetpipe.errors import CaptureError, ConfigError
from hetpipe.partitioner.capture.export import export_for_training
from hetpipe.partitioner.capture.graph import TiedParameter, Unit, UnitGraph
from hetpipe.partitioner.capture.storages import unit_buffer_bytes
from hetpipe.partitioner.capture.tensor_parallel import with_tensor_parallel
from hetpipe.partitioner.capture.liveness import dead_parameters, with_loss
from hetpipe.partitioner.capture.vocab_parallel import with_vocab_parallel
from hetpipe.partitioner.capture.measure import (
    CALL_OPS, LossCosts, NodeCost, TrainingCosts, measure_forward, measure_loss, measure_training, module_path_of)
from hetpipe.partitioner.capture.units import (
    Group,
    NodeInfo,
    apply_split_points,
    cut_bytes,
    find_blocks,
    group_by_blocks,
    group_by_nodes,
    merge_balanced,
)

log = logging.getLogger(__name__)

_TORCH_DIR, _THIS_DIR = os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__))


def capture(model: nn.Module, example_inputs: Any, *, name: str | None = None, granularity: str | int = "block",
            optimizer: str = "adam", precision: str = "fp32", split_points: Sequence[str] = (),
            leaf_modules: Sequence[str | type] = (), loss_fn: Callable[[Any, Any], Any] | None = None,
            targets: Any = None) -> UnitGraph:
    """Trace ``model`` into a `UnitGraph` with per-unit, per-micro-batch costs.

    Args:
        model: the model, ideally built on the meta device (any device works; it is not modified).
        example_inputs: ONE micro-batch: a tensor or a tuple of tensors; the batch dimension of
            the first is the micro-batch size.
        name: the model's display name (default: its class name).
        granularity: ``"block"`` (one unit per repeated block, embedding and head apart),
            ``"node"`` (one unit per kernel), or an int N (about N units of balanced FLOPs).
        optimizer, precision: what ``state_bytes`` and activation bytes assume
            (see `hetpipe.cost_models.memory`).
        split_points: module names where a new unit must start.
        leaf_modules: module names or classes ``torch.fx`` must not trace into.
        loss_fn, targets: the training loss ``loss_fn(output, targets)`` and one micro-batch of
            targets; what the loss saves for backward and its FLOPs are added to the last unit
            (`measure.measure_loss`).  Without them the loss is not costed.
    Raises:
        CaptureError: the model cannot be traced or run on the meta device.
        ConfigError: a bad option (granularity, optimizer, split point...) or a non-Module model.
    """
    check_optimizer(optimizer)
    check_precision(precision)
    _check_granularity(granularity)
    inputs = _as_inputs(model, example_inputs)
    traced, tracer = trace(model, inputs, leaf_modules=leaf_modules)
    gm = _meta_copy(traced)
    meta_inputs = tuple(torch.empty_like(x, device="meta") for x in inputs)
    costs = measure_forward(gm, meta_inputs, precision=precision)
    body_nodes = [n for n in gm.graph.nodes if n.op in CALL_OPS]
    if not body_nodes:
        raise CaptureError(f"{type(model).__name__} traced to a graph without compute nodes; "
                           "there is nothing to partition")
    body = [_node_info(gm, n, costs[n.name]) for n in body_nodes]
    known = [qual for qual, _ in model.named_modules() if qual]
    groups = _groups(model, body, granularity=granularity, split_points=split_points, known=known)
    unit_of = _assign_units(gm.graph, body_nodes, groups)
    loss = _measure_loss(gm, meta_inputs, loss_fn, targets, precision=precision) if loss_fn is not None else None
    train = measure_training(gm, meta_inputs, unit_of=unit_of, num_units=len(groups), precision=precision,
                             saved_outputs=loss.saved_outputs if loss else ())
    units, tied, total = _build_units(gm, groups, unit_of, costs=costs, train=train, optimizer=optimizer,
                                       precision=precision, dead=dead_parameters(gm, loss.live) if loss else set())
    units = with_loss(units, loss) if loss else units
    units = with_tensor_parallel(gm, units, unit_of, costs, held=train.held_output_storages)
    units = with_vocab_parallel(gm, units, unit_of, costs, tied=tied, loss=loss)
    graph = UnitGraph(
        model_name=name or type(model).__name__, fingerprint=fingerprint(gm, costs), units=units,
        param_count=total, micro_batch_size=_micro_batch(inputs), optimizer=optimizer, precision=precision,
        tied=tied, tracer=tracer, graph=_node_graph(gm, unit_of, costs), module=gm)
    log.info("captured %s with %s: %d nodes, %d units, %d parameters", graph.model_name, tracer,
             len(gm.graph.nodes), len(units), total)
    return graph


def _measure_loss(gm: fx.GraphModule, inputs: Sequence[torch.Tensor], loss_fn: Any, targets: Any, *,
                  precision: str) -> LossCosts:
    with torch.no_grad():
        output = gm(*inputs)
    return measure_loss(output, targets, loss_fn, precision=precision)


# ----------------------------------------------------------------------------- options and inputs


def _check_granularity(granularity: Any) -> None:
    if isinstance(granularity, bool) or not (granularity in ("block", "node")
                                             or isinstance(granularity, int) and granularity >= 1):
        raise ConfigError(f"unknown granularity {granularity!r}; use 'block', 'node' or a positive int "
                          "(the number of units)")


def _as_inputs(model: Any, example_inputs: Any) -> tuple[torch.Tensor, ...]:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: expected a torch.nn.Module, got {type(model).__name__}; pass the module itself")
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs or ()) if (
        isinstance(example_inputs, (tuple, list))) else ()
    bad = [type(x).__name__ for x in inputs if not isinstance(x, torch.Tensor)]
    if not inputs or bad:
        raise ConfigError(f"example_inputs must be one micro-batch: a tensor or a tuple of tensors, got "
                          f"{type(example_inputs).__name__}{' holding ' + ', '.join(bad) if bad else ''}")
    return inputs


def _micro_batch(inputs: Sequence[torch.Tensor]) -> int:
    return int(inputs[0].shape[0]) if inputs[0].dim() > 0 else 1


# ----------------------------------------------------------------------------- tracing


class _LeafTracer(fx.Tracer):
    """`fx.Tracer` that also treats the named modules / classes as leaves."""

    proxy_buffer_attributes = True  # a sliced buffer (a causal-mask table) becomes a get_attr, not a failure

    def __init__(self, names: frozenset[str], types: tuple[type, ...]) -> None:
        super().__init__()
        self.leaf_names = names
        self.leaf_types = types

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (module_qualified_name in self.leaf_names or isinstance(m, self.leaf_types)
                or super().is_leaf_module(m, module_qualified_name))


def _leaf_spec(model: nn.Module, leaf_modules: Sequence[str | type]) -> tuple[frozenset[str], tuple[type, ...]]:
    names = [x for x in leaf_modules if isinstance(x, str)]
    types = tuple(x for x in leaf_modules if isinstance(x, type) and issubclass(x, nn.Module))
    if len(names) + len(types) != len(leaf_modules):
        raise ConfigError(f"leaf_modules must hold module names or nn.Module subclasses, got {list(leaf_modules)!r}")
    known = dict(model.named_modules())
    for n in names:
        if n not in known or not n:
            close = difflib.get_close_matches(n, list(known), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConfigError(f"leaf module {n!r} is not a submodule of {type(model).__name__}{hint} "
                              "(give qualified names as in model.named_modules())")
    return frozenset(names), types


def trace(model: nn.Module, inputs: Sequence[torch.Tensor], *,
          leaf_modules: Sequence[str | type] = ()) -> tuple[fx.GraphModule, str]:
    """(GraphModule, tracer name): symbolic tracing, else ``torch.export`` (see the module docstring).

    Example:
        >>> gm, how = trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), (torch.zeros(1, 2),))
        >>> how, [n.op for n in gm.graph.nodes]
        ('symbolic_trace', ['placeholder', 'call_module', 'call_module', 'output'])
    """
    names, types = _leaf_spec(model, leaf_modules)
    try:
        tracer = _LeafTracer(names, types)
        graph = tracer.trace(model)
        return fx.GraphModule(tracer.root, graph, type(model).__name__), "symbolic_trace"
    except Exception as sym_err:  # fx raises TraceError, TypeError, AttributeError, ... for untraceable code
        log.info("symbolic_trace failed (%s: %s); trying torch.export", type(sym_err).__name__,
                 _first_line(sym_err))
        if names or types:
            log.warning("torch.export ignores leaf_modules=%s", list(leaf_modules))
        try:
            return export_for_training(model, inputs), "export"
        except Exception as exp_err:  # export raises many types (UserError, GuardOnDataDependentSymNode, ...)
            raise CaptureError(_trace_failure(model, sym_err, exp_err)) from exp_err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _user_frame(err: BaseException) -> tuple[Any, str] | None:
    """(frame, 'file:line `code`') of the innermost traceback frame outside torch and hetpipe's capture."""
    found = None
    tb = err.__traceback__
    while tb is not None:
        filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not filename.startswith((_TORCH_DIR, _THIS_DIR)) and "<" not in filename:
            code = linecache.getline(filename, tb.tb_lineno).strip()
            found = (tb.tb_frame, f"{filename}:{tb.tb_lineno} `{code}`")
        tb = tb.tb_next
    return found


def _trace_failure(model: nn.Module, sym_err: BaseException, exp_err: BaseException) -> str:
    """The CaptureError message: where tracing stopped and what to do about it."""
    where = _user_frame(sym_err) or _user_frame(exp_err)
    qual = None
    if where is not None:
        owner = where[0].f_locals.get("self")
        qual = next((q for q, m in model.named_modules() if m is owner), None)
    module = ("the root module" if qual == "" else f"module {qual!r}") if qual is not None else "the model"
    cls = type(where[0].f_locals.get("self")).__name__ if where is not None and qual is not None else ""
    location = f" at {where[1]}" if where is not None else ""
    fix = ("remove the data-dependent Python there (branch with torch.where or torch.cond, no .item())")
    if qual:
        fix += (f", or keep that module opaque with leaf_modules=[{qual!r}] (its forward must still run on "
                "meta tensors; it then stays inside one unit, so use split_points= to cut around it)")
    return (f"cannot trace {type(model).__name__}: {module}{f' ({cls})' if cls else ''}{location}: "
            f"torch.fx.symbolic_trace failed ({type(sym_err).__name__}: {_first_line(sym_err)}) and "
            f"torch.export.export(strict=False) failed ({type(exp_err).__name__}: {_first_line(exp_err)}); "
            f"fix: {fix}")


def _meta_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """Deep copy of ``gm`` with every parameter, buffer and tensor constant on meta (ties kept)."""
    memo: dict[int, Any] = {}
    keep = []  # keep the originals alive so no id() is reused while copying
    constants = [getattr_path(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    for t in [*gm.parameters(), *gm.buffers(), *(c for c in constants if isinstance(c, torch.Tensor))]:
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
            keep.append(t)
    with warnings.catch_warnings():  # torch's own pytree deprecation, raised while copying an export's specs
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        return copy.deepcopy(gm, memo)


def getattr_path(root: Any, target: str) -> Any:
    """``root.a.b.c`` for target ``"a.b.c"``.

    Example:
        >>> getattr_path(nn.Sequential(nn.Linear(2, 3)), "0.weight").shape
        torch.Size([3, 2])
    """
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------- grouping


def _node_info(gm: fx.GraphModule, node: fx.Node, cost: NodeCost) -> NodeInfo:
    if node.op == "call_module":
        has_params = next(gm.get_submodule(node.target).parameters(), None) is not None
    else:
        has_params = any(p.op == "get_attr" and isinstance(getattr_path(gm, p.target), nn.Parameter)
                         for p in node.all_input_nodes)
    return NodeInfo(name=node.name, module_path=module_path_of(node), fwd_flops=cost.flops, kernels=cost.kernels,
                    has_params=has_params, is_module_call=node.op == "call_module")


def _groups(model: nn.Module, body: Sequence[NodeInfo], *, granularity: str | int, split_points: Sequence[str],
            known: Sequence[str]) -> list[Group]:
    if granularity == "node":
        groups = group_by_nodes(body)
    else:
        groups = group_by_blocks(body, find_blocks(model))
        if isinstance(granularity, int):
            atoms = groups if granularity <= len(groups) else group_by_nodes(body)
            flops = [sum(body[i].fwd_flops for i in g.members) for g in atoms]
            groups = merge_balanced(atoms, flops, granularity)
    if split_points:
        groups = apply_split_points(groups, body, list(split_points), known)
    return groups


def _assign_units(graph: fx.Graph, body_nodes: Sequence[fx.Node], groups: Sequence[Group]) -> dict[str, int]:
    """Unit of every node: body nodes by group, placeholders first, get_attrs at first use, output last."""
    unit_of: dict[str, int] = {}
    for k, g in enumerate(groups):
        for i in g.members:
            unit_of[body_nodes[i].name] = k
    last = len(groups) - 1
    for node in graph.nodes:
        if node.op == "placeholder":
            unit_of[node.name] = 0
        elif node.op == "output":
            unit_of[node.name] = last
    for node in graph.nodes:
        if node.op == "get_attr":
            users = [last if u.op == "output" else unit_of[u.name] for u in node.users]
            unit_of[node.name] = min(users, default=0)
    return unit_of


# ----------------------------------------------------------------------------- units


def _param_units(gm: fx.GraphModule, unit_of: dict[str, int]) -> dict[int, tuple[nn.Parameter, set[int]]]:
    """id -> (parameter, units that read it), over every node that reads a parameter."""
    uses: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            params = list(gm.get_submodule(node.target).parameters())
            units = {unit_of[node.name]}
        elif node.op == "get_attr" and isinstance(getattr_path(gm, node.target), nn.Parameter):
            params = [getattr_path(gm, node.target)]
            units = {unit_of[u.name] for u in node.users}
        else:
            continue
        for p in params:
            uses.setdefault(id(p), (p, set()))[1].update(units)
    return uses


def _ties(gm: fx.GraphModule, uses: dict[int, tuple[nn.Parameter, set[int]]]) -> tuple[TiedParameter, ...]:
    names: dict[int, list[str]] = {}
    for qual, p in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(qual)
    unused = [n[0] for key, n in names.items() if key not in uses]
    if unused:
        log.warning("%d parameters are never used by the forward and are not counted: %s", len(unused),
                    ", ".join(unused[:5]))
    return tuple(TiedParameter(tuple(names[key]), tuple(sorted(units)), p.numel())
                 for key, (p, units) in uses.items() if len(units) > 1 or len(names.get(key, ())) > 1)


def _build_units(gm: fx.GraphModule, groups: Sequence[Group], unit_of: dict[str, int], *,
                 costs: dict[str, NodeCost], train: TrainingCosts, optimizer: str, precision: str,
                 dead: set[int]) -> tuple[tuple[Unit, ...], tuple[TiedParameter, ...], int]:
    """(units, tied parameters, total parameters counted once); ``dead`` parameters cost like frozen ones."""
    n = len(groups)
    uses = _param_units(gm, unit_of)
    trainable, frozen, tensors, largest = [0] * n, [0] * n, [0] * n, [0] * n  # largest: trainable tensor's numel
    for p, units in uses.values():
        learns, home = p.requires_grad and id(p) not in dead, min(units)
        (trainable if learns else frozen)[home] += p.numel()
        tensors[home], largest[home] = tensors[home] + learns, max(largest[home], p.numel() * learns)
    members: list[list[str]] = [[] for _ in range(n)]
    for node in gm.graph.nodes:
        members[unit_of[node.name]].append(node.name)
    boundary = cut_bytes(n, _crossing_values(gm.graph, unit_of, {k: c.out_bytes for k, c in costs.items()}, n))
    held_cut, grad_cut = (cut_bytes(n, _crossing_values(gm.graph, unit_of, b, n))
                          for b in (train.held_output_bytes, train.grad_output_bytes))
    per_param, weight_b = state_bytes_per_param(optimizer, precision), weight_bytes_per_param(precision)
    buffers, grad_b = unit_buffer_bytes(gm, unit_of, n), grad_bytes_per_param(precision)
    units = []
    for k, g in enumerate(groups):
        body, count = members[k], trainable[k] + frozen[k]  # body: placeholders, get_attrs and the output cost 0
        units.append(Unit(
            index=k, name=g.name, node_names=tuple(members[k]),
            fwd_flops=sum(costs[b].flops for b in body), bwd_flops=train.bwd_flops[k], param_count=count,
            param_bytes=count * weight_b, grad_bytes=trainable[k] * grad_b,
            state_bytes=int(round(trainable[k] * per_param)) + frozen[k] * weight_b + buffers[k],
            activation_bytes=train.activation_bytes[k], boundary_bytes=boundary[k], boundary_held_bytes=held_cut[k],
            boundary_grad_bytes=grad_cut[k], recompute_bytes=train.recompute_bytes[k], memory_traffic_bytes=sum(costs[b].traffic_bytes for b in body),
            op_count=sum(costs[b].kernels for b in body), weight_grad_bytes=train.weight_grad_bytes[k],
            fwd_work=total_work(costs[b].work for b in body), bwd_work=train.bwd_work[k], param_tensors=tensors[k],
            step_param_bytes=trainable[k] * STEP_VALUE_BYTES, step_tensor_bytes=largest[k] * STEP_VALUE_BYTES))
    return tuple(units), _ties(gm, uses), sum(trainable) + sum(frozen)


def _crossing_values(graph: fx.Graph, unit_of: dict[str, int], node_bytes: Mapping[str, int],
                     num_units: int) -> list[tuple[int, int, int]]:
    """(producer unit, last consumer unit, node_bytes) of every sent value; get_attrs are never sent."""
    values = []
    for node in graph.nodes:
        if node.op in ("get_attr", "output") or not node.users:
            continue
        last = max(num_units - 1 if u.op == "output" else unit_of[u.name] for u in node.users)
        values.append((unit_of[node.name], last, node_bytes.get(node.name, 0)))
    return values

# ----------------------------------------------------------------------------- graph and fingerprint


def _node_graph(gm: fx.GraphModule, unit_of: dict[str, int], costs: dict[str, NodeCost]) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in gm.graph.nodes:
        g.add_node(node.name, unit=unit_of[node.name], op=node.op, target=_target_key(gm, node),
                   bytes=costs[node.name].out_bytes)
        for p in node.all_input_nodes:
            g.add_edge(p.name, node.name)
    return g


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _target_key(gm: fx.GraphModule, node: fx.Node) -> str:
    t = node.target
    if node.op == "call_module":
        return f"{t}:{type(gm.get_submodule(t)).__qualname__}"
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    module = getattr(t, "__module__", None) or ""
    return f"{module}.{getattr(t, '__qualname__', getattr(t, '__name__', type(t).__name__))}"


def _arg_key(a: Any) -> Any:
    """A process-independent description of a node argument."""
    if isinstance(a, fx.Node):
        return "%" + a.name
    if isinstance(a, (list, tuple)):
        return type(a).__name__, tuple(_arg_key(x) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((str(k), _arg_key(v)) for k, v in a.items()))
    if isinstance(a, slice):
        return "slice", _arg_key(a.start), _arg_key(a.stop), _arg_key(a.step)
    if isinstance(a, torch.device):
        return "device"  # meta when captured, cpu/cuda when run: not part of the model's identity
    if isinstance(a, torch.Tensor):
        return "tensor", tuple(a.shape), str(a.dtype)
    if callable(a) and not isinstance(a, type):
        return getattr(a, "__module__", "") or "", getattr(a, "__qualname__", type(a).__name__)
    return _ADDRESS.sub("", repr(a))


def fingerprint(gm: fx.GraphModule, costs: dict[str, NodeCost]) -> str:
    """sha256 over every node's op, target, arguments and output shapes/dtypes (hex).

    Example:
        >>> gm = fx.symbolic_trace(nn.Linear(2, 3))
        >>> costs = measure_forward(_meta_copy(gm), (torch.empty(4, 2, device="meta"),), precision="fp32")
        >>> len(fingerprint(gm, costs))
        64
    """
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        item = (node.op, node.name, _target_key(gm, node), _arg_key(node.args), _arg_key(node.kwargs),
                costs[node.name].shapes)
        h.update(repr(item).encode())
    return h.hexdigest()
