"""Find the token embedding and the LM head, each split by vocabulary rows (issue 15).

A language model reads token ids through an embedding of V rows and ends in a linear onto the same
V tokens (GPT-2 ties the two weights).  Both split by *vocabulary* across a tensor-parallel
group, as Megatron-LM's ``VocabParallelEmbedding`` and vocab-parallel cross-entropy do
(Shoeybi et al. 2019, §3, "input embedding ... parallelized along the vocabulary dimension";
``megatron/core/tensor_parallel/layers.py`` and ``cross_entropy.py``): member i holds the rows
``[a_i, b_i)`` of the weight (``largest_remainder`` of the shares over V parts of one row each).

* **embedding** -- an ``nn.Embedding`` module (``aten.embedding`` of a parameter under
  ``torch.export``) whose ids are a graph input.  Forward: each member looks up the ids in its rows
  (zeros elsewhere), then one all-reduce of the (b, s, h) output; no collective backward (ids
  carry no gradient).  FLOPs: none split (a lookup); memory: its rows of the weight.
* **head** -- a linear onto V outputs whose result is the model's output, when the graph has such
  an embedding.  Forward: the member's logits slice (b, s, V_i) and the vocab-parallel
  cross-entropy's three all-reduces of a (b, s) fp32 vector (max, sum of exp, target logit);
  backward: the loss needs no collective, the head's input gradient one all-reduce of (b, s, h).
  FLOPs: the head's and the loss's split with the rows; memory: its rows of the weight and of the
  loss's saved log-probabilities (b, s, V_i).

A tied weight is split in both units; its state is counted where it is owned (the first unit
using it, `TiedParameter`): a tied head's block records 0 parameters of its own unit.

Example:
    >>> from hetpipe.plan.build import capture_builtin
    >>> g = capture_builtin("gpt-tiny", batch=2, seq=16, optimizer="adam")
    >>> [(b.kind, b.parts, b.column[0].name) for b in g.units[0].tensor_parallel]
    [('embedding', 256, 'transformer.wte.weight')]
    >>> head = g.units[-1].tensor_parallel[0]
    >>> head.kind, head.param_numel, head.allreduce_bytes, head.loss_allreduce_bytes, head.activation_bytes
    ('head', 0, 8192, 128, 32768)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from hetpipe.partitioner.capture.graph import TiedParameter, Unit
from hetpipe.partitioner.capture.measure import LossCosts, NodeCost
from hetpipe.partitioner.capture.tensor_blocks import ShardedParameter, TensorParallelBlock
from hetpipe.partitioner.capture.tensor_parallel import op_name

#: fp32 bytes of one element of the cross-entropy's per-token all-reduced vectors.
LOSS_VECTOR_ELEMENT_BYTES = 4
NO_PAIR_NOTE = "no column-parallel -> row-parallel linear pair"
#: Reshapes the token ids may pass through between the model input and the embedding.
ID_VIEWS = frozenset({"view", "reshape", "contiguous", "to", "alias"})


@dataclass(frozen=True)
class _Found:
    node: fx.Node
    weight: str
    rows: int  # V: the vocabulary
    inp: fx.Node | None = None  # the head's input


def _param_name(gm: fx.GraphModule, node: Any) -> str | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        try:
            gm.get_parameter(str(node.target))
            return str(node.target)
        except AttributeError:
            return None
    return None


def _model_input(node: Any) -> bool:
    """``node`` is a graph input, or a view of one (Hugging Face GPT-2: ``input_ids.view(-1, s)``)."""
    while isinstance(node, fx.Node) and op_name(node) in ID_VIEWS and node.args:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "placeholder"


def _embedding(gm: fx.GraphModule, node: fx.Node) -> _Found | None:
    """The token embedding: a lookup of a parameter by ids that are a graph input."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if type(mod) is nn.Embedding and node.args and _model_input(node.args[0]):
            return _Found(node, f"{node.target}.weight", mod.num_embeddings)
        return None
    if op_name(node) == "embedding" and (w := _param_name(gm, node.args[0])) is not None:
        if _model_input(node.args[1]):
            return _Found(node, w, gm.get_parameter(w).shape[0])
    return None


def _head(gm: fx.GraphModule, node: fx.Node, rows: int) -> _Found | None:
    """A bias-free linear onto ``rows`` outputs read only by the graph's output."""
    if not node.users or any(u.op != "output" for u in node.users):
        return None
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if type(mod) is nn.Linear and mod.bias is None and mod.out_features == rows:
            return _Found(node, f"{node.target}.weight", rows, node.args[0])
        return None
    if op_name(node) == "linear" and (w := _param_name(gm, node.args[1])) is not None:
        no_bias = len(node.args) < 3 or node.args[2] is None
        if no_bias and gm.get_parameter(w).shape[0] == rows:
            return _Found(node, w, rows, node.args[0])
    return None


def _owned_numel(gm: fx.GraphModule, weight: str, unit: int, tied: Sequence[TiedParameter]) -> int:
    """The weight's elements if ``unit`` counts its state (not a tied replica's user), else 0."""
    for t in tied:
        if weight in t.qualified_names:
            return t.numel if t.unit_indices[0] == unit else 0
    return gm.get_parameter(weight).numel()


def vocab_blocks(gm: fx.GraphModule, unit_of: Mapping[str, int], costs: Mapping[str, NodeCost], *,
                 tied: Sequence[TiedParameter] = (), loss: LossCosts | None = None
                 ) -> dict[int, tuple[TensorParallelBlock, ...]]:
    """Unit index -> its vocabulary blocks (module docstring); empty without a token embedding."""
    nodes = list(gm.graph.nodes)
    emb = next((f for n in nodes if (f := _embedding(gm, n)) is not None), None)
    if emb is None:
        return {}
    out: dict[int, list[TensorParallelBlock]] = {}
    u = unit_of[emb.node.name]
    out.setdefault(u, []).append(TensorParallelBlock(
        kind="embedding", division="vocabulary", parts=emb.rows, column=(ShardedParameter(emb.weight, 0, 1),),
        row=None, row_bias="", fwd_flops=costs[emb.node.name].flops,
        param_numel=_owned_numel(gm, emb.weight, u, tied), allreduce_bytes=costs[emb.node.name].out_bytes))
    head = next((f for n in reversed(nodes) if (f := _head(gm, n, emb.rows)) is not None), None)
    if head is not None and isinstance(head.inp, fx.Node):
        u = unit_of[head.node.name]
        logits = costs[head.node.name]
        tokens = logits.out_bytes // max(1, _element_bytes(logits)) // head.rows  # b · s
        out.setdefault(u, []).append(TensorParallelBlock(
            kind="head", division="vocabulary", parts=head.rows, column=(ShardedParameter(head.weight, 0, 1),),
            row=None, row_bias="", fwd_flops=logits.flops + (loss.fwd_flops if loss else 0),
            param_numel=_owned_numel(gm, head.weight, u, tied), allreduce_bytes=costs[head.inp.name].out_bytes,
            activation_bytes=logits.out_bytes if loss else 0,  # the loss's saved log-probs, one per logit
            loss_allreduce_bytes=tokens * LOSS_VECTOR_ELEMENT_BYTES))
    return {k: tuple(v) for k, v in out.items()}


def _element_bytes(cost: NodeCost) -> int:
    shape = cost.shapes[0][0] if cost.shapes else ()
    numel = 1
    for d in shape:
        numel *= d
    return cost.out_bytes // numel if numel else 0


def with_vocab_parallel(gm: fx.GraphModule, units: tuple[Unit, ...], unit_of: Mapping[str, int],
                        costs: Mapping[str, NodeCost], *, tied: Sequence[TiedParameter] = (),
                        loss: LossCosts | None = None) -> tuple[Unit, ...]:
    """``units`` with their vocabulary blocks added to ``tensor_parallel`` and the fractions and notes updated."""
    found = vocab_blocks(gm, unit_of, costs, tied=tied, loss=loss)
    out = []
    for u in units:
        extra = found.get(u.index, ())
        if not extra:
            out.append(u)
            continue
        blocks = (*u.tensor_parallel, *extra)
        note = "; ".join(n for n in u.tp_note.split("; ") if n and not n.startswith(NO_PAIR_NOTE))
        out.append(dataclasses.replace(
            u, tensor_parallel=blocks, tp_note=note,
            tp_flops_fraction=min(1.0, sum(b.fwd_flops for b in blocks) / u.fwd_flops) if u.fwd_flops else 0.0,
            tp_param_fraction=min(1.0, sum(b.param_numel for b in blocks) / u.param_count) if u.param_count else 0.0))
    return tuple(out)
