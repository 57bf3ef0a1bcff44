"""A group member's stage of a ``torch.export`` graph (Hugging Face models), issue 15.

An export graph applies its weights with ``aten.linear`` / ``aten.addmm`` on ``get_attr`` nodes and
bakes the head counts into ``view`` / ``expand`` / ``reshape`` constants (on ``hf-llama-tiny`` the
batch equals the key/value group count, so a constant cannot be told from its value).  So no
constant is rewritten: each member builds its *own* model, the same class on meta with every
tensor-parallel layer of its stage at the member's local width (`local_model`: a column layer's
outputs and a row layer's inputs cut to its parts, a fixed split width such as GPT-2's
``split_size`` set to the local one), exports it and cuts its stage out with the plan's node names
(`member_stage_graph`: export names nodes by the code, not the sizes, so the names match the full
graph's).  `shard_export_stage` then swaps that graph into the full stage the member built, keeps
only the member's slices of the full initial weights (by name, `tp_shard.slice_parameter`), and
inserts the group's operators where Megatron-LM puts them: `tp_comm.copy_to_group` on the block
input of the column layers, `reduce_from_group` on the row layer's output before its bias; the
token embedding and the LM head split by vocabulary become `tp_vocab.VocabParallelEmbedding` /
`VocabParallelHead` (call_module nodes in place of ``aten.embedding`` / ``aten.linear``).

Example:
    >>> from hetpipe.models import build
    >>> from hetpipe.partitioner.capture.capture import capture
    >>> model, batch = build("hf-gpt2-tiny", device="meta", batch=2, seq=8)
    >>> blocks = [b for b in capture(model, batch).units[1].tensor_parallel]
    >>> local = local_model(model, blocks, MemberShare(1, (0.75, 0.25)))
    >>> attn = local.transformer.h[0].attn
    >>> tuple(attn.c_attn.weight.shape), tuple(attn.c_proj.weight.shape), attn.split_size
    ((32, 24), (8, 32), 8)
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.partitioner.capture.devices import retarget_devices
from hetpipe.partitioner.capture.export import export_for_training
from hetpipe.partitioner.capture.tensor_blocks import ShardedParameter, TensorParallelBlock
from hetpipe.runtime.stage.build import split_stages
from hetpipe.runtime.tp_comm import copy_to_group, reduce_from_group
from hetpipe.runtime.tp_shard import MemberShare, narrow_fixed_splits, slice_parameter
from hetpipe.runtime.tp_vocab import VocabParallelEmbedding, VocabParallelHead

_ATEN = torch.ops.aten


def _is_conv1d(mod: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (weight stored (in, out)); matched by name: no transformers import."""
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "nx")


def _resized(mod: nn.Module, *, out_features: int | None = None, in_features: int | None = None) -> nn.Module:
    """``mod`` (nn.Linear or Conv1D) on meta with new output / input widths (same class, same bias)."""
    with torch.device("meta"):
        if _is_conv1d(mod):
            return type(mod)(out_features or mod.nf, in_features or mod.nx)
        if type(mod) is nn.Linear:
            return nn.Linear(in_features or mod.in_features, out_features or mod.out_features,
                             bias=mod.bias is not None, dtype=mod.weight.dtype)
    raise ConfigError(f"tensor-parallel layer is a {type(mod).__name__}; only nn.Linear and Conv1D layers of an "
                      "exported model are resized per member: run this unit width-1 (--tensor-parallel off)")


def _set(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _local_width(spec: ShardedParameter, count: int) -> int:
    return count * spec.part_size * spec.segments


def local_model(model: nn.Module, blocks: Sequence[TensorParallelBlock], share: MemberShare) -> nn.Module:
    """``model`` (on meta) with every non-vocabulary block's layers at this member's widths, in place."""
    for block in blocks:
        if block.is_vocab:
            continue  # split at run time by call_module shards; the traced widths stay whole
        count = share.counts(block.parts)[share.member]
        for spec in block.column:
            path, leaf = spec.name.rsplit(".", 1)
            if leaf != "weight":
                continue
            mod = model.get_submodule(path)
            full = mod.nf if _is_conv1d(mod) else mod.out_features
            width = _local_width(spec, count)
            _set(model, path, _resized(mod, out_features=width))
            parent = model.get_submodule(path.rpartition(".")[0])
            narrow_fixed_splits(parent, segments=spec.segments, full=full, local=width)
        row_path = block.row.name.rsplit(".", 1)[0]
        _set(model, row_path, _resized(model.get_submodule(row_path), in_features=_local_width(block.row, count)))
    return model


def member_stage_graph(model: nn.Module, example: Sequence[torch.Tensor], blocks: Sequence[TensorParallelBlock], *,
                       share: MemberShare, stage: int, node_stage: Any, expect: Any = None) -> fx.GraphModule:
    """Stage ``stage`` of ``model`` exported at this member's widths (meta; module docstring).

    ``node_stage``: a callable from the exported graph module to its node -> stage mapping
    (`member_node_stage`); ``expect``: the full stage's (``in_cut``, ``out_cut``), which the
    member's cuts must equal in shape, dtype and order.
    """
    gm = export_for_training(local_model(model, blocks, share), example)
    program = split_stages(gm, node_stage(gm), example_inputs=example)
    if expect is not None:  # the executor feeds and sends cut tensors by position: same layout, every member
        for k, want in ((stage - 1, expect[0]), (stage, expect[1])):
            got = program.cuts[k] if 0 <= k < len(program.cuts) else None
            if _layout(got) != _layout(want):
                raise ConfigError(f"stage {stage}: the member's re-exported cut {k} carries {_layout(got)}, the "
                                  f"plan's graph {_layout(want)}; re-plan with --tensor-parallel off")
    return program.modules[stage]


def _layout(cut: Any) -> list[tuple[tuple[int, ...], Any, bool]] | None:
    return None if cut is None else [(t.shape, t.dtype, t.requires_grad) for t in cut.tensors]


def _signature(node: fx.Node) -> tuple[str, str, str]:
    """What a node is, independent of its name and sizes: op, target, innermost module path."""
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()))[0] if stack else ""
    return node.op, str(node.target), path


def member_node_stage(full: fx.GraphModule, full_stage: Mapping[str, int], local: fx.GraphModule) -> dict[str, int]:
    """fx node name -> stage for a member's re-export, aligned with the full graph node by node.

    Names are not stable across widths: export records no ``contiguous`` of an already contiguous
    tensor (one head), and the later nodes of that kind are numbered from there.  So the two graphs
    are aligned by each node's op, target and module (`difflib`); the member's graph may lack nodes
    (no-ops at its widths), never have others.
    """
    a, b = list(full.graph.nodes), list(local.graph.nodes)
    matcher = difflib.SequenceMatcher(None, [_signature(n) for n in a], [_signature(n) for n in b], autojunk=False)
    out: dict[str, int] = {}
    for tag, i0, i1, j0, j1 in matcher.get_opcodes():
        if tag == "equal":
            out.update({b[j0 + k].name: full_stage[a[i0 + k].name] for k in range(i1 - i0) if a[i0 + k].name in full_stage})
        elif tag != "delete":
            raise ConfigError(f"the member's re-exported model has nodes {[n.name for n in b[j0:j1]][:5]} the plan's "
                              "graph lacks (its layers trace differently at the member's widths): re-plan with "
                              "--tensor-parallel off")
    return out


class _GroupOp(nn.Module):
    """A call_module wrapper of a `tp_comm` operator bound to the group (fx cannot name a group object)."""

    def __init__(self, fn: Any, group: Any) -> None:
        super().__init__()
        self.fn, self.group = fn, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.group)


def _weight_users(graph: fx.Graph, name: str) -> list[fx.Node]:
    return [u for n in graph.nodes if n.op == "get_attr" and n.target == name for u in n.users]


def _add_op(gm: fx.GraphModule, fn: Any, group: Any) -> str:
    name = f"tp_{fn.__name__}_{sum(1 for n, _ in gm.named_children() if n.startswith('tp_'))}"
    gm.add_submodule(name, _GroupOp(fn, group))
    return name


def _applied(graph: fx.Graph, name: str) -> list[fx.Node]:
    """The linear / addmm nodes applying weight ``name``; refuses a weight applied otherwise (or not at all)."""
    users = _weight_users(graph, name)
    if not users or any(u.target not in (_ATEN.linear.default, _ATEN.addmm.default) for u in users):
        raise ConfigError(f"tensor-parallel weight {name!r} is applied by {[str(u.target) for u in users]} in the "
                          "member's exported stage, not by aten.linear / aten.addmm: re-plan with --tensor-parallel off")
    return users


def _wire_block(gm: fx.GraphModule, block: TensorParallelBlock, group: Any) -> None:
    """copy_to_group on the column layers' shared input, reduce_from_group before the row bias."""
    graph, copied = gm.graph, {}
    for spec in block.column:
        if not spec.name.endswith(".weight"):
            continue  # a bias is read by its weight's node, already wired
        for node in _applied(graph, spec.name):
            # linear(x, w, b): x; Conv1D: addmm(b, view(x), w): the view's input x
            flat = node.args[1] if node.target == _ATEN.addmm.default else None
            x = flat.args[0] if flat is not None else node.args[0]
            if x not in copied:
                with graph.inserting_after(x):
                    copied[x] = graph.call_module(_add_op(gm, copy_to_group, group), (x,))
            (flat or node).replace_input_with(x, copied[x])
    for node in _applied(graph, block.row.name):
        with graph.inserting_after(node):
            if node.target == _ATEN.addmm.default:  # addmm(bias, x, w)
                partial = graph.call_function(_ATEN.mm.default, (node.args[1], node.args[2]))
                bias = node.args[0]
            else:  # linear(x, w[, bias])
                partial = graph.call_function(_ATEN.linear.default, (node.args[0], node.args[1]))
                bias = node.args[2] if len(node.args) > 2 else None
        with graph.inserting_after(partial):
            out = graph.call_module(_add_op(gm, reduce_from_group, group), (partial,))
        if bias is not None:
            with graph.inserting_after(out):
                out = graph.call_function(_ATEN.add.Tensor, (out, bias))
        node.replace_all_uses_with(out)
        graph.erase_node(node)


def _wire_vocab(gm: fx.GraphModule, full: torch.Tensor, *, parts: tuple[int, int], group: Any) -> None:
    """Each embedding / head op on ``full`` becomes a call of this member's vocabulary shard (its rows)."""
    graph = gm.graph
    rows = nn.Parameter(full.detach().narrow(0, parts[0], parts[1] - parts[0]).clone())  # tied uses share it
    gets = [n for n in graph.nodes if n.op == "get_attr" and _param(gm, n) is full]
    paths = [str(g.target).rsplit(".", 1)[0] for g in gets]
    for get in gets:
        for node in list(get.users):
            if node.target == _ATEN.embedding.default:
                pad = node.args[2] if len(node.args) > 2 and node.args[2] >= 0 else None
                shard: nn.Module = VocabParallelEmbedding(rows, first=parts[0], vocab=full.shape[0], group=group,
                                                          padding_idx=pad)
                args = (node.args[1],)
            elif node.target == _ATEN.linear.default and len(node.args) == 2:
                shard, args = VocabParallelHead(rows, first=parts[0], vocab=full.shape[0], group=group), (node.args[0],)
            else:
                raise ConfigError(f"vocabulary-split weight {get.target!r} is used by {node.target} in the exported "
                                  "graph; only aten.embedding and a bias-free aten.linear head split by vocabulary: "
                                  "re-plan with --tensor-parallel off")
            # the first shard takes the weight's container (the name stays <path>.weight), a second
            # (a tied embedding and head in one stage) a fresh name holding the same rows
            path = paths.pop(0) if paths else f"tp_vocab_{node.name}"
            _set(gm, path, shard)
            with graph.inserting_before(node):
                new = graph.call_module(path, args)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        graph.erase_node(get)


def shard_export_stage(module: fx.GraphModule, local: fx.GraphModule, blocks: Sequence[TensorParallelBlock], *,
                       share: MemberShare, group: Any, device: Any) -> None:
    """``module`` (a full stage of an export graph, weights loaded on ``device``) as this member's shard,
    in place."""
    vocab: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}
    for block in blocks:
        if block.is_vocab:
            for n in module.graph.nodes:
                if n.op == "get_attr" and _same(module, n, block):
                    full = module.get_parameter(str(n.target))
                    vocab[id(full)] = (full, share.part_range(parts=block.parts))
            continue
        parts = share.part_range(parts=block.parts)
        for spec in block.parameters:
            path, leaf = spec.name.rsplit(".", 1)
            owner = module.get_submodule(path)
            owner._parameters[leaf] = nn.Parameter(slice_parameter(owner._parameters[leaf], spec, parts))
    module.graph = local.graph  # the member's shapes; node names and weight targets are the full graph's
    retarget_devices(module, torch.device(device))  # the export's device constants are meta
    for block in blocks:
        if not block.is_vocab:
            _wire_block(module, block, group)
    for full, parts in vocab.values():
        _wire_vocab(module, full, parts=parts, group=group)
    module.graph.eliminate_dead_code()
    module.graph.lint()
    module.recompile()


def is_export_stage(module: nn.Module, blocks: Sequence[TensorParallelBlock]) -> bool:
    """The stage applies its blocks' weights in the graph (``torch.export``: the owners are plain
    containers), not through ``nn.Linear`` / ``Conv1D`` / ``nn.Embedding`` modules (``torch.fx``)."""
    for block in blocks:
        path = block.column[0].name.rsplit(".", 1)[0]
        try:
            return type(module.get_submodule(path)) is nn.Module
        except AttributeError:  # a tied weight held under another name: not this block's proof
            continue
    return False


def _param(module: fx.GraphModule, node: fx.Node) -> nn.Parameter | None:
    """The parameter a get_attr node reads (None for a buffer or constant)."""
    try:
        return module.get_parameter(str(node.target))
    except AttributeError:
        return None


def _same(module: fx.GraphModule, node: fx.Node, block: TensorParallelBlock) -> bool:
    """``node`` reads the vocabulary block's weight (a tied one may be read under another name)."""
    mine = _param(module, node)
    if mine is None:
        return False
    try:
        return mine is module.get_parameter(block.column[0].name)
    except AttributeError:
        return str(node.target) == block.column[0].name
