"""Find the tensor-parallel blocks of each unit in the captured graph (issue 15).

A block is found from its row-parallel end: for every linear node R (``nn.Linear`` under
``symbolic_trace``, ``aten.linear`` / ``aten.addmm`` of a parameter under ``torch.export``),
walk back from R's input through *width-local* operations only (elementwise functions,
reshapes, splits, ``scaled_dot_product_attention``) until linear nodes are reached: those
are the column-parallel layers.  The pair is a block when

* every column layer reads the same input (the block's input, replicated on every member),
* every value of the walk is used only inside the block (nothing full-width escapes),
* the walk's other inputs (rotary tables, attention masks) do not depend on that input,
* the widths agree: with an attention, every projection is whole heads of the
  attention's ``head_dim`` and the parts are the key/value groups (the gcd of the
  projections' head counts; a grouped-query key/value head serves the query heads next
  to it); without, every column layer's output width equals R's input width.

A fused projection whose output is chunked into n equal pieces (the built-in GPT's q|k|v)
has n segments.  One split by a fixed width (Hugging Face GPT-2's ``split(self.split_size)``) has n
segments too when its weights are applied in a ``torch.export`` graph, whose runtime re-exports
each member at its local widths (`hetpipe.runtime.tp_export`); under ``torch.fx`` (an ``nn.Linear``
module) it is width-1 with that reason, since a member's narrower slice would be cut at the full width.
``Conv1D`` (Hugging Face GPT-2's transposed linear, ``addmm`` under ``torch.export``) splits
like a linear with its weight's dimensions swapped.

Example:
    >>> from hetpipe.models import build
    >>> from hetpipe.partitioner.capture.capture import capture
    >>> model, batch = build("gpt-tiny", device="meta", batch=2, seq=16)
    >>> u = capture(model, batch).units[1]
    >>> [(b.kind, b.division, b.parts) for b in u.tensor_parallel]
    [('attention', 'heads', 4), ('mlp', 'columns', 256)]
    >>> u.tensor_parallel[0].column[0].segments, round(u.tp_param_fraction, 4)
    (3, 0.9923)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from hetpipe.partitioner.capture.graph import Unit
from hetpipe.partitioner.capture.measure import NodeCost
from hetpipe.partitioner.capture.tensor_blocks import ShardedParameter, TensorParallelBlock

#: Operations that act on each hidden column (or each head) on its own: a block's
#: columns can be split across members without changing what these compute.
ELEMENTWISE = frozenset({"mul", "add", "sub", "truediv", "div", "neg", "gelu", "silu", "relu", "tanh", "sigmoid",
                         "pow", "exp", "to", "type_as", "float", "contiguous", "dropout", "clone", "alias"})
RESHAPES = frozenset({"view", "reshape", "transpose", "permute", "split", "chunk", "getitem", "unsqueeze",
                      "expand", "repeat_interleave", "slice", "cat", "narrow", "flatten", "unflatten"})
ATTENTION = frozenset({"scaled_dot_product_attention"})
SPLITS = frozenset({"split", "chunk"})
#: node name -> (storage key, storage bytes) of its outputs kept for backward.
Held = Mapping[str, tuple[tuple[int, int], ...]]


@dataclass(frozen=True)
class _Linear:
    node: fx.Node
    inp: fx.Node  # the 3-D input (a Conv1D's flattening view skipped)
    out: fx.Node  # the 3-D output (a Conv1D's unflattening view included)
    weight: str
    bias: str
    out_features: int
    in_features: int
    transposed: bool  # weight stored (in, out): Hugging Face Conv1D


def op_name(node: fx.Node) -> str:
    """The operation's plain name: ``aten.view.default`` and ``Tensor.view`` -> ``view``."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return node.op
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0].lstrip("_") if hasattr(node.target, "_schema") else name


def _param(gm: fx.GraphModule, node: Any) -> tuple[str, Any] | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        try:
            return str(node.target), gm.get_parameter(str(node.target))
        except AttributeError:
            return None
    return None


def _linear(gm: fx.GraphModule, node: fx.Node) -> _Linear | None:
    """`_Linear` if ``node`` multiplies by a parameter weight (Linear module, aten.linear, addmm)."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if type(mod) is nn.Linear:
            bias = f"{node.target}.bias" if mod.bias is not None else ""
            return _Linear(node, node.args[0], node, f"{node.target}.weight", bias, mod.out_features,
                           mod.in_features, False)
        return None
    name = op_name(node)
    if name == "linear" and (w := _param(gm, node.args[1])) is not None:
        b = _param(gm, node.args[2]) if len(node.args) > 2 else None
        return _Linear(node, node.args[0], node, w[0], b[0] if b else "", w[1].shape[0], w[1].shape[1], False)
    if name == "addmm" and (w := _param(gm, node.args[2])) is not None and (b := _param(gm, node.args[0])):
        flat = node.args[1]
        inp = flat.args[0] if isinstance(flat, fx.Node) and op_name(flat) == "view" else flat
        users = list(node.users)
        out = users[0] if len(users) == 1 and op_name(users[0]) == "view" else node
        return _Linear(node, inp, out, w[0], b[0], w[1].shape[1], w[1].shape[0], True)
    return None


def _is_tensor(costs: Mapping[str, NodeCost], node: fx.Node) -> bool:
    return node.name in costs and bool(costs[node.name].shapes)


def _walk(row: _Linear, by_out: Mapping[fx.Node, _Linear], costs: Mapping[str, NodeCost], unit: set[str]
          ) -> tuple[set[fx.Node], list[_Linear], set[fx.Node]]:
    """The width-local region behind ``row``, the column layers ending it and its side inputs."""
    region: set[fx.Node] = set()
    columns: dict[fx.Node, _Linear] = {}
    side: set[fx.Node] = set()
    stack = [row.inp]
    while stack:
        n = stack.pop()
        if n in region or n in side or n in columns or not _is_tensor(costs, n):
            continue  # sizes and dtypes are read, not split
        if n in by_out and by_out[n] is not row:
            columns[n] = by_out[n]
        elif n.name in unit and op_name(n) in ELEMENTWISE | RESHAPES | ATTENTION:
            region.add(n)
            stack.extend(n.all_input_nodes)
        else:
            side.add(n)
    return region, list(columns.values()), side


def _descendants(start: fx.Node, unit: set[str]) -> set[fx.Node]:
    seen: set[fx.Node] = {start}
    stack = [start]
    while stack:
        for u in stack.pop().users:
            if u not in seen and u.name in unit:
                seen.add(u)
                stack.append(u)
    return seen


def _segments(col: _Linear) -> int:
    """Equal pieces a fused projection's output is split into (q|k|v: 3), else 1."""
    users = list(col.out.users)
    if len(users) == 1 and op_name(users[0]) in SPLITS:
        return sum(1 for u in users[0].users if op_name(u) == "getitem") or 1
    return 1


def _closed(region: set[fx.Node], columns: list[_Linear], row: _Linear, costs: Mapping[str, NodeCost]) -> bool:
    """No full-width value escapes: every tensor the block makes is read only inside it."""
    inside = region | {row.node} | {a for a in row.node.all_input_nodes if a not in region and op_name(a) == "view"}
    made = region | {c.out for c in columns}
    return all(u in inside for n in made for u in n.users if _is_tensor(costs, u))


def _resized_per_member(fixed: list[fx.Node], columns: list[_Linear]) -> bool:
    """A fused projection split by a fixed width into equal pieces splits when its weights are applied
    in the graph (``torch.export``): the runtime re-exports each member's model at its local widths,
    the split width included (`hetpipe.runtime.tp_export`); an ``nn.Linear`` module's would not."""
    outs = {c.out: c for c in columns}
    for n in fixed:
        col = outs.get(n.args[0])
        if col is None or col.node.op == "call_module" or not isinstance(n.args[1], int) \
                or n.args[1] * _segments(col) != col.out_features:
            return False
    return True


def _parts(region: set[fx.Node], columns: list[_Linear], row: _Linear, costs: Mapping[str, NodeCost]
           ) -> tuple[str, int, list[int]] | str:
    """(kind, parts, each column's part size) or the reason the widths do not split."""
    fixed = [n for n in region if op_name(n) == "split"]
    if fixed and not _resized_per_member(fixed, columns):
        return (f"its fused projection is split by fixed widths {fixed[0].args[1]} (the model's code, e.g. GPT-2's "
                "split_size), which a member's narrower slice would break; split it with chunk() instead")
    attn = [n for n in region if op_name(n) in ATTENTION]
    segs = [_segments(c) for c in columns]
    if len(attn) > 1:
        return f"{len(attn)} attentions between one pair of linears"
    if attn:
        head_dim = costs[attn[0].all_input_nodes[0].name].shapes[0][0][-1]
        heads = [c.out_features // (s * head_dim) for c, s in zip(columns, segs)]
        if any(h * s * head_dim != c.out_features for h, s, c in zip(heads, segs, columns)):
            return f"projection widths {[c.out_features for c in columns]} are not whole heads of {head_dim}"
        groups = math.gcd(*heads)
        if row.in_features % groups:
            return f"output projection width {row.in_features} does not split into {groups} head groups"
        return "attention", groups, [h // groups * head_dim for h in heads]
    widths = {c.out_features // s for c, s in zip(columns, segs)}
    if widths != {row.in_features}:
        return f"column widths {sorted(widths)} differ from the row layer's input width {row.in_features}"
    return "mlp", row.in_features, [1] * len(columns)


def _split_bytes(region: set[fx.Node], columns: list[_Linear], held: Held) -> int:
    """Held storages made from the column outputs on (per-head / per-column), each storage once."""
    names = {n.name for n in region}
    split = set().union(*(_descendants(c.out, names) for c in columns))
    storages = {key: size for n in split for key, size in held.get(n.name, ())}
    return sum(storages.values())


def _block(gm: fx.GraphModule, row: _Linear, by_out: Mapping[fx.Node, _Linear], costs: Mapping[str, NodeCost],
           unit: set[str], held: Held) -> TensorParallelBlock | str | None:
    """The block ending at ``row``; a reason if it looks like one but cannot split; None if no pair."""
    region, columns, side = _walk(row, by_out, costs, unit)
    if not columns or len({c.inp for c in columns}) != 1:
        return None
    block_input = _descendants(columns[0].inp, unit)
    if side & block_input or not _closed(region, columns, row, costs):
        return None
    found = _parts(region, columns, row, costs)
    if isinstance(found, str):
        return f"{row.weight}: {found}"
    kind, parts, sizes = found
    col_dim, row_dim = (1, 0) if row.transposed else (0, 1)
    column: list[ShardedParameter] = []
    for c, size in zip(columns, sizes):
        seg = _segments(c)
        column.append(ShardedParameter(c.weight, col_dim, size, seg))
        if c.bias:
            column.append(ShardedParameter(c.bias, 0, size, seg))
    row_param = ShardedParameter(row.weight, row_dim, row.in_features // parts)
    names = [p.name for p in column] + [row.weight]
    flops = sum(costs[n.name].flops for n in region | {c.node for c in columns} | {row.node})
    return TensorParallelBlock(kind=kind, division="heads" if kind == "attention" else "columns", parts=parts,
                               column=tuple(column), row=row_param, row_bias=row.bias, fwd_flops=flops,
                               param_numel=sum(gm.get_parameter(n).numel() for n in names),
                               allreduce_bytes=costs[row.out.name].out_bytes,
                               activation_bytes=_split_bytes(region, columns, held))


def with_tensor_parallel(gm: fx.GraphModule, units: tuple[Unit, ...], unit_of: Mapping[str, int],
                         costs: Mapping[str, NodeCost], *, held: Held | None = None) -> tuple[Unit, ...]:
    """``units`` with their tensor-parallel blocks, fractions and notes filled in.

    ``held``: node -> (storage, bytes) of its outputs kept for backward
    (`measure.TrainingCosts.held_output_storages`); without it blocks record no activation bytes.
    """
    members: dict[int, set[str]] = {}
    for name, idx in unit_of.items():
        members.setdefault(idx, set()).add(name)
    linears = {n: lin for n in gm.graph.nodes if (lin := _linear(gm, n)) is not None}
    by_out = {lin.out: lin for lin in linears.values()}
    out = []
    for u in units:
        blocks, notes = [], []
        for lin in linears.values():
            if unit_of.get(lin.node.name) != u.index:
                continue
            found = _block(gm, lin, by_out, costs, members.get(u.index, set()), held or {})
            if isinstance(found, str):
                notes.append(found)
            elif found is not None:
                blocks.append(found)
        if not blocks and not notes:
            notes.append("no column-parallel -> row-parallel linear pair: runs width-1 (replicated)")
        out.append(dataclasses.replace(
            u, tensor_parallel=tuple(blocks), tp_note="; ".join(notes),
            tp_flops_fraction=sum(b.fwd_flops for b in blocks) / u.fwd_flops if u.fwd_flops else 0.0,
            tp_param_fraction=sum(b.param_numel for b in blocks) / u.param_count if u.param_count else 0.0))
    return tuple(out)
