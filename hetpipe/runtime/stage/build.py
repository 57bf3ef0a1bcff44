"""Split a traced model into pipeline stages and build one stage's module on its rank.

`split_stages` turns a ``torch.fx.GraphModule`` plus a node -> stage mapping into
a `StagedProgram`: one meta-device ``GraphModule`` per stage and, for every cut
``k`` (between stage ``k`` and ``k + 1``), the exact list of values crossing it
with their per-micro-batch shape and dtype (propagated on the meta device from
the example micro-batch, so no weights are touched).

Conventions (the executor and the wire protocol rely on them):

* **Inputs** enter at stage 0: every placeholder belongs to stage 0.
* **Values that skip stages are forwarded.**  Cut ``k`` carries every tensor
  produced on a stage ``<= k`` and used on a stage ``> k``, so a skip connection
  from stage 0 to stage 3 travels through stages 1 and 2 (a pass-through output
  of those stages).  Schedules only talk to neighbours (`Op.SEND_F` goes to
  ``stage + 1``), and forwarding keeps that true; the gradient of a forwarded
  value flows back along the same path and is summed with any local use.
* **Non-tensor values** (``x.size(0)``, Python numbers, dtypes) crossing a cut
  are baked into the consuming stage as constants of the example micro-batch and
  listed in `CutSpec.baked`; other non-tensor values (devices, tuples holding
  tensors, modules) are rejected with a `ScheduleError` that names the node.
* **get_attr nodes** (parameters, buffers, tensor constants) are never sent: each
  stage that reads one gets its own copy.  A parameter read by several stages
  (GPT-2's ``wte`` and tied LM head) is a `TiedGroup`; the executor sums its
  gradients between those stages before the optimizer step.
* Parameters keep their **original qualified names** inside each stage module,
  so `build_stage` loads ``transformer.h.3.attn.c_attn.weight`` straight from the
  full model's state dict (or any lazy mapping, e.g. safetensors) and touches
  only the keys of its own stage.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> gm = torch.fx.symbolic_trace(net)
    >>> prog = split_stages(gm, {"_0": 0, "_1": 1, "_2": 1}, example_inputs=(torch.zeros(3, 4),))
    >>> prog.cuts[0].tensors
    (TensorSpec(name='_0', shape=(3, 8), dtype=torch.float32, requires_grad=True),)
    >>> stage1 = build_stage(prog, 1, state_dict=net.state_dict(), device="cpu")
    >>> [name for name, _ in stage1.named_parameters()]
    ['2.weight', '2.bias']
    >>> x = torch.randn(3, 4)
    >>> stage0 = build_stage(prog, 0, state_dict=net.state_dict(), device="cpu")
    >>> torch.allclose(stage1(*stage0(x)), net(x))
    True
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
import zlib
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from hetpipe.errors import CaptureError, RuntimeFailure, ScheduleError
from hetpipe.partitioner.capture.devices import retarget_devices
from hetpipe.runtime.stage.outputs import keep_output_structure
from hetpipe.runtime.stage.recompute import apply_recompute
from hetpipe.runtime.stage.selective import apply_selective
from hetpipe.runtime.stage.types import (  # noqa: F401 - re-exported: the runtime imports them from here
    CutSpec,
    StagedProgram,
    StageModule,
    TensorSpec,
    TiedGroup,
)

log = logging.getLogger(__name__)

_CALL_OPS = ("call_function", "call_method", "call_module")
# Python values that may be baked into a later stage as constants of the example micro-batch.
_BAKEABLE = (int, float, bool, str, type(None), torch.dtype, torch.Size, slice, type(Ellipsis))
_MAX_LISTED = 5  # names listed in one error message


# ----------------------------------------------------------------------------- split


def split_stages(gm: fx.GraphModule, node_to_stage: Mapping[str, int], *, example_inputs: Sequence[Any],
                 num_stages: int | None = None, tied: Sequence[Any] = ()) -> StagedProgram:
    """Split ``gm`` so stage k holds exactly the nodes mapped to k (see the module docstring).

    ``example_inputs`` is one micro-batch (real or meta tensors); compute nodes missing
    from ``node_to_stage`` go to the latest stage of their inputs (the earliest stage
    of their users if they have no inputs).  ``gm`` is not modified and its weights
    are not read.

    Ties are found by identity (one Parameter object under several names).  A model
    moved to meta with ``Module.to``/``to_empty`` has lost that identity: pass
    ``tied`` -- `TiedParameter`s (``UnitGraph.tied``) or tuples of qualified names --
    to tie those names again.

    Example:
        >>> import torch
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()))
        >>> split_stages(gm, {"_0": 0, "_1": 2}, example_inputs=(torch.zeros(1, 2),)).num_stages
        3
    """
    meta_gm = _meta_copy(gm)
    _retie(meta_gm, tied)
    values = _propagate(meta_gm, example_inputs)
    stage_of = _assign_stages(meta_gm.graph, node_to_stage, num_stages)
    count = max(num_stages or 0, max(stage_of.values(), default=0) + 1)
    cuts = _cut_specs(meta_gm.graph, stage_of, values, count)
    modules = tuple(
        fx.GraphModule(meta_gm, _stage_graph(meta_gm.graph, k, stage_of, cuts, values), class_name=f"Stage{k}")
        for k in range(count))
    keep_output_structure(modules[-1], meta_gm)  # the last stage returns what the model returns
    placeholders = [n for n in meta_gm.graph.nodes if n.op == "placeholder"]
    return StagedProgram(
        num_stages=count, modules=modules,
        input_specs=tuple(_tensor_spec(n.name, values[n.name], "model input") for n in placeholders),
        cuts=cuts, tied=_tied_groups(modules), node_stages=MappingProxyType(dict(stage_of)),
        aliases=MappingProxyType(_aliases(meta_gm)), fallback_tensors=MappingProxyType(_fallbacks(gm)))


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(t, device="meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


def _get_attr_tensors(gm: fx.GraphModule) -> Iterator[tuple[str, torch.Tensor]]:
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj = _fetch(gm, node.target)
            if isinstance(obj, torch.Tensor):
                yield node.target, obj


def _meta_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """Deep copy of ``gm`` whose tensors are meta; ties survive (the memo maps each tensor once)."""
    memo: dict[int, Any] = {}
    keep = []  # keeps the originals alive so no id is reused while copying
    for t in [*gm.parameters(), *gm.buffers(), *(t for _, t in _get_attr_tensors(gm))]:
        if id(t) not in memo:
            memo[id(t)] = _to_meta(t)
            keep.append(t)
    with warnings.catch_warnings():  # torch's own pytree deprecation, raised while copying an export's specs
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        return copy.deepcopy(gm, memo)


def _retie(meta_gm: fx.GraphModule, tied: Sequence[Any]) -> None:
    """Make every name of each tied group point at the group's first parameter object."""
    for group in tied:
        names = tuple(getattr(group, "qualified_names", group))
        try:
            first = _fetch(meta_gm, names[0])
            for name in names[1:]:
                owner, _, attr = name.rpartition(".")
                module = meta_gm.get_submodule(owner) if owner else meta_gm
                if not isinstance(getattr(module, attr), nn.Parameter):
                    raise AttributeError(f"{name} is not a parameter")
                if tuple(getattr(module, attr).shape) != tuple(first.shape):
                    raise AttributeError(f"{name} has shape {tuple(getattr(module, attr).shape)}, {names[0]} "
                                         f"{tuple(first.shape)}")
                setattr(module, attr, first)
        except AttributeError as err:
            raise CaptureError(f"cannot tie {names}: {err}; pass qualified parameter names of this model") from err


def _fallbacks(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    found = {name: t for name, t in gm.named_buffers(remove_duplicate=False)}
    found.update(_get_attr_tensors(gm))
    params = {id(p) for p in gm.parameters()}
    return {k: t.detach() for k, t in found.items() if t.device.type != "meta" and id(t) not in params}


class _Recorder(fx.Interpreter):
    """Runs the graph on meta tensors and keeps every node's value."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            out = super().run_node(n)
        except Exception as err:  # any op that has no meta kernel or is data-dependent
            raise CaptureError(
                f"cannot propagate shapes through node {n.name!r} ({n.op} {n.target}) on the meta device: {err}; "
                "make the model traceable without real data (no .item()/data-dependent control flow)") from err
        self.values[n.name] = out
        return out


def _propagate(meta_gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, Any]:
    names = [n.name for n in meta_gm.graph.nodes if n.op == "placeholder"]
    if len(names) != len(example_inputs):
        raise CaptureError(f"the model takes {len(names)} inputs ({', '.join(names)}), example_inputs has "
                           f"{len(example_inputs)}; pass one micro-batch of every input")
    for name, x in zip(names, example_inputs):
        _tensor_spec(name, x, "model input")
    args = [torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in example_inputs]
    recorder = _Recorder(meta_gm)
    with torch.enable_grad():
        recorder.run(*args)
    return recorder.values


def _assign_stages(graph: fx.Graph, node_to_stage: Mapping[str, int], num_stages: int | None) -> dict[str, int]:
    names = {n.name for n in graph.nodes}
    unknown = sorted(set(node_to_stage) - names)
    if unknown:
        raise ScheduleError(f"node_to_stage names {len(unknown)} nodes the graph does not have "
                            f"({', '.join(map(repr, unknown[:_MAX_LISTED]))}); build the mapping from this graph")
    bad = {k: v for k, v in node_to_stage.items() if not isinstance(v, int) or v < 0
           or (num_stages is not None and v >= num_stages)}
    if bad:
        k, v = next(iter(bad.items()))
        raise ScheduleError(f"node {k!r} is mapped to stage {v!r}; stages are integers 0..{(num_stages or 1) - 1}")
    stage_of: dict[str, int] = {}
    pending: list[fx.Node] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            stage_of[node.name] = 0
        elif node.op in _CALL_OPS:
            if node.name in node_to_stage:
                stage_of[node.name] = node_to_stage[node.name]
                continue
            producers = [stage_of[p.name] for p in node.all_input_nodes if p.name in stage_of]
            if producers:
                stage_of[node.name] = max(producers)
            else:
                pending.append(node)
    last = max(max(stage_of.values(), default=0), (num_stages or 1) - 1)
    for node in reversed(pending):  # nodes without inputs (torch.arange(8), ...) join their first user
        users = [last if u.op == "output" else stage_of.get(u.name, last) for u in node.users]
        stage_of[node.name] = min(users, default=0)
    _check_data_flow(graph, stage_of)
    return stage_of


def _check_data_flow(graph: fx.Graph, stage_of: Mapping[str, int]) -> None:
    for node in graph.nodes:
        if node.name not in stage_of or node.op == "placeholder":
            continue
        for p in node.all_input_nodes:
            if stage_of.get(p.name, -1) > stage_of[node.name]:
                raise ScheduleError(
                    f"node {node.name!r} is on stage {stage_of[node.name]} but uses {p.name!r} from the later stage "
                    f"{stage_of[p.name]}; stages must follow the data flow: move {node.name!r} to stage "
                    f">= {stage_of[p.name]} or {p.name!r} to stage <= {stage_of[node.name]}")


def _consumer_stages(graph: fx.Graph, stage_of: Mapping[str, int], num_stages: int) -> dict[str, int]:
    """Latest stage using each value (the output node counts as the last stage)."""
    last_use: dict[str, int] = {}
    for node in graph.nodes:
        at = num_stages - 1 if node.op == "output" else stage_of.get(node.name)
        if at is None:
            continue
        for p in node.all_input_nodes:
            last_use[p.name] = max(last_use.get(p.name, -1), at)
    return last_use


def _bakeable(value: Any) -> bool:
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return all(_bakeable(v) for v in value)
    return isinstance(value, _BAKEABLE)


def _cut_specs(graph: fx.Graph, stage_of: Mapping[str, int], values: Mapping[str, Any],
               num_stages: int) -> tuple[CutSpec, ...]:
    last_use = _consumer_stages(graph, stage_of, num_stages)
    tensors: list[list[TensorSpec]] = [[] for _ in range(num_stages - 1)]
    baked: list[list[tuple[str, str]]] = [[] for _ in range(num_stages - 1)]
    for node in graph.nodes:
        if node.name not in stage_of or last_use.get(node.name, -1) <= stage_of[node.name]:
            continue
        value = values[node.name]
        crossed = range(stage_of[node.name], last_use[node.name])
        if isinstance(value, torch.Tensor):
            spec = _tensor_spec(node.name, value, f"value crossing cut {crossed[0]}")
            for k in crossed:
                tensors[k].append(spec)
        elif _bakeable(value):
            log.info("baking %s = %r (stage %d) into later stages; the program is specialised to the example "
                     "micro-batch", node.name, value, stage_of[node.name])
            for k in crossed:
                baked[k].append((node.name, repr(value)))
        else:
            raise ScheduleError(
                f"node {node.name!r} (stage {stage_of[node.name]}) produces a {type(value).__name__}, which cannot "
                f"cross to stage {last_use[node.name]}: only tensors travel and only plain constants can be baked; "
                f"put {node.name!r} and its users on the same stage")
    return tuple(CutSpec(k, tuple(tensors[k]), tuple(baked[k])) for k in range(num_stages - 1))


def _tensor_spec(name: str, value: Any, what: str) -> TensorSpec:
    if not isinstance(value, torch.Tensor):
        raise CaptureError(f"{what} {name!r} is a {type(value).__name__}, not a tensor; only tensors can be fed per "
                           "micro-batch (fix non-tensor arguments with concrete_args when tracing)")
    return TensorSpec(name, tuple(int(d) for d in value.shape), value.dtype, bool(value.requires_grad))


def _stage_graph(src: fx.Graph, k: int, stage_of: Mapping[str, int], cuts: Sequence[CutSpec],
                 values: Mapping[str, Any]) -> fx.Graph:
    """Stage k's graph: cut k-1 in, its own nodes (plus the get_attrs they read), cut k out."""
    num_stages = len(cuts) + 1
    by_name = {n.name: n for n in src.nodes}
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    if k == 0:
        for node in src.nodes:
            if node.op == "placeholder":
                env[node] = g.node_copy(node)
    else:
        for spec in cuts[k - 1].tensors:
            env[by_name[spec.name]] = g.placeholder(spec.name)
        for name, _ in cuts[k - 1].baked:
            env[by_name[name]] = values[name]

    def used_here(node: fx.Node) -> bool:
        return any(stage_of.get(u.name) == k or (u.op == "output" and k == num_stages - 1) for u in node.users)

    for node in src.nodes:
        if node.op == "get_attr" and used_here(node):
            env[node] = g.node_copy(node)
        elif node.op in _CALL_OPS and stage_of[node.name] == k:
            env[node] = g.node_copy(node, lambda n: env[n])
        elif node.op == "output":
            if k == num_stages - 1:
                g.output(fx.map_arg(node.args[0], lambda n: env[n]))
            else:
                g.output(tuple(env[by_name[s.name]] for s in cuts[k].tensors))
    g.lint()
    return g


def _fetch(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _aliases(meta_gm: fx.GraphModule) -> dict[str, tuple[str, ...]]:
    by_id: dict[int, list[str]] = {}
    for name, t in [*meta_gm.named_parameters(remove_duplicate=False), *meta_gm.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(t), []).append(name)
    return {name: tuple(names) for names in by_id.values() for name in names}


def _tied_groups(modules: Sequence[fx.GraphModule]) -> tuple[TiedGroup, ...]:
    """Parameters (same meta object) present in more than one stage module."""
    members: dict[int, list[tuple[int, str]]] = {}
    for k, module in enumerate(modules):
        for name, p in module.named_parameters():
            members.setdefault(id(p), []).append((k, name))
    return tuple(TiedGroup(m[0][1], tuple(m)) for m in members.values() if len(m) > 1)


# ----------------------------------------------------------------------------- build


def build_stage(program: StagedProgram, stage: int, *, state_dict: Mapping[str, torch.Tensor] | None,
                device: torch.device | str, seed: int = 0,
                buffers: Mapping[str, torch.Tensor] | None = None,
                recompute: Mapping[int, Sequence[str]] | None = None,
                selective: Mapping[int, Sequence[str]] | None = None) -> StageModule:
    """Materialise stage ``stage`` on ``device``: only its own parameters and buffers are allocated.

    Tensors come from ``state_dict`` by their original qualified names (any alias of a
    tied parameter works); only this stage's keys are read.  With ``state_dict=None``
    parameters get `seeded_init` (identical on every stage holding a tied replica and
    independent of the partition).  Buffers missing from ``state_dict`` come from ``buffers``
    (`hetpipe.runtime.stage.buffers.ModelBuffers`: the model's own initialisation), else from
    the traced module.  Device constants in the graph are rewritten to ``device``.
    ``recompute`` (plan unit index -> its fx node names) lists the units whose forward the
    backward recomputes (`hetpipe.runtime.stage.recompute.apply_recompute`); ``selective`` (unit -> the
    fx nodes it drops) the selective level (`hetpipe.runtime.stage.selective.apply_selective`).

    Example:
        >>> import torch
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)))
        >>> prog = split_stages(gm, {"_0": 0, "_1": 1}, example_inputs=(torch.zeros(5, 2),))
        >>> s = build_stage(prog, 1, state_dict=None, device="cpu", seed=7)
        >>> s.in_cut.tensors[0].shape, s.out_cut, [p.shape for p in s.parameters()]
        ((5, 3), None, [torch.Size([1, 3]), torch.Size([1])])
    """
    if not 0 <= stage < program.num_stages:
        raise ScheduleError(f"stage {stage} is not a stage of this {program.num_stages}-stage program; "
                            f"use 0..{program.num_stages - 1}")
    device = torch.device(device)
    with warnings.catch_warnings():  # torch's own pytree deprecation, raised while copying an export's out spec
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        module = copy.deepcopy(program.modules[stage])  # meta: no weight memory
    retarget_devices(module, device)
    _materialise(module, device)
    _load(module, stage=stage, program=program, state_dict=state_dict, seed=seed, device=device,
          buffers=buffers or {})
    last = stage == program.num_stages - 1
    levels = apply_selective(module, {u: n for u, n in (selective or {}).items() if u not in (recompute or {})},
                             stage=stage) if selective else ()
    recomputed = apply_recompute(module, recompute, stage=stage) if recompute else ()
    return StageModule(
        module=module, stage=stage, num_stages=program.num_stages,
        in_cut=program.cuts[stage - 1] if stage > 0 else None, out_cut=None if last else program.cuts[stage],
        input_specs=program.stage_inputs(stage), tied_groups=program.tied, device=device, recomputed=recomputed,
        selective=levels)


def build_chunks(program: StagedProgram, rank: int, *, ranks: int, **kwargs: Any) -> list[StageModule]:
    """`build_stage` for each of rank ``rank``'s virtual stages: ``rank``, ``rank + ranks``, ... of
    ``program`` (one for a plain pipeline, a rank's chunks under interleaved 1F1B)."""
    return [build_stage(program, k, **kwargs) for k in range(rank, program.num_stages, ranks)]


def _materialise(module: nn.Module, device: torch.device) -> None:
    """Replace every meta parameter/buffer by an empty one on ``device``, keeping ties.

    ``Module.to_empty`` would create one new tensor per module slot and silently
    untie a parameter shared by two submodules.
    """
    new: dict[int, torch.Tensor] = {}
    keep = []
    for mod in module.modules():
        for slots in (mod._parameters, mod._buffers):
            for key, t in list(slots.items()):
                if t is None:
                    continue
                if id(t) not in new:
                    keep.append(t)
                    empty = torch.empty_like(t, device=device)
                    new[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(
                        t, nn.Parameter) else empty
                slots[key] = new[id(t)]


def _local_tensors(module: fx.GraphModule) -> list[tuple[torch.Tensor, list[str], str]]:
    """(tensor, every local name, kind) for each unique parameter, buffer and tensor constant."""
    groups: dict[int, tuple[torch.Tensor, list[str], str]] = {}
    for kind, items in (("parameter", module.named_parameters(remove_duplicate=False)),
                        ("buffer", module.named_buffers(remove_duplicate=False))):
        for name, t in items:
            groups.setdefault(id(t), (t, [], kind))[1].append(name)
    for name, t in _get_attr_tensors(module):
        groups.setdefault(id(t), (t, [], "constant"))[1].append(name)
    return list(groups.values())


def _load(module: fx.GraphModule, *, stage: int, program: StagedProgram,
          state_dict: Mapping[str, torch.Tensor] | None, seed: int, device: torch.device,
          buffers: Mapping[str, torch.Tensor]) -> None:
    for tensor, names, kind in _local_tensors(module):
        keys = list(dict.fromkeys(a for n in names for a in program.aliases.get(n, (n,))))
        value = next((state_dict[k] for k in keys if k in state_dict), None) if state_dict is not None else None
        for source in (buffers, program.fallback_tensors) if kind != "parameter" else ():
            value = value if value is not None else next((source[k] for k in keys if k in source), None)
        if value is None and kind == "parameter" and state_dict is None:
            value = seeded_init(keys[0], tuple(tensor.shape), seed=seed)
        if value is None:
            where = "the state dict" if state_dict is not None else "the traced module (it is on meta)"
            raise RuntimeFailure(f"stage {stage}: {kind} {names[0]!r} (also tried {keys[1:] or 'no alias'}) is not in "
                                 f"{where} nor in buffers=; pass state_dict= a full state dict of the same model "
                                 "or buffers=ModelBuffers(model)")
        if tuple(value.shape) != tuple(tensor.shape):
            raise RuntimeFailure(f"stage {stage}: {kind} {names[0]!r} has shape {tuple(value.shape)} in the state dict, "
                                 f"the traced model expects {tuple(tensor.shape)}; load a checkpoint of this model")
        if kind == "constant":  # plain attributes are still meta after _materialise
            for name in names:
                owner, _, attr = name.rpartition(".")
                setattr(module.get_submodule(owner) if owner else module, attr,
                        value.to(device=device, dtype=tensor.dtype, copy=True))
            continue
        with torch.no_grad():
            tensor.copy_(value)


def seeded_init(name: str, shape: tuple[int, ...], *, seed: int) -> torch.Tensor:
    """Deterministic placeholder weights for benchmarks and tests, not a training-quality init.

    Drawn on the CPU from a generator seeded by ``seed`` and the canonical name, so every
    replica of a tied parameter and every partition of the model get the same values:
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for matrices (nn.Linear's default bound), ones
    for 1-D weights (norm scales), zeros for biases and scalars.

    Example:
        >>> torch.equal(seeded_init("h.0.w", (2, 3), seed=1), seeded_init("h.0.w", (2, 3), seed=1))
        True
        >>> seeded_init("ln.bias", (2,), seed=1).tolist(), seeded_init("ln.weight", (2,), seed=1).tolist()
        ([0.0, 0.0], [1.0, 1.0])
    """
    if len(shape) >= 2:
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        bound = 1.0 / math.sqrt(math.prod(shape[1:]))
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound
    if len(shape) == 1 and not name.endswith("bias"):
        return torch.ones(shape)
    return torch.zeros(shape)
