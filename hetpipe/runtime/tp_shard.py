"""One member's shard of a model split over a tensor-parallel group, uneven shares (issue 15).

For every `TensorParallelBlock` the capture found, member m of a group with shares
``w`` holds parts ``[a_m, b_m)`` (heads / key-value groups / hidden columns): the parts are
``largest_remainder(w, block.parts)`` laid out in member order.  Its column-parallel
``nn.Linear`` (or Hugging Face ``Conv1D``) layers become `ColumnParallelLinear` (the output
rows of those parts, bias included) and its row-parallel layer `RowParallelLinear` (the input
columns of those parts; the bias whole, added once after the all-reduce).  Slices are cut from the full initial
weights by the model's own parameter names, so a group starts from exactly the weights
a single device starts from; only the slice is kept (the full tensor is dropped with the
replaced layer, or never allocated when ``state`` supplies it).  A token embedding and an LM head
split by vocabulary become `tp_vocab.VocabParallelEmbedding` / `VocabParallelHead` (the member's
rows).  Everything else (norms, position embeddings) is replicated: every member computes it alike
on the same inputs.

The model's own forward runs unchanged on the shard, so it must read head counts from
the projections' widths (``view(b, t, -1, head_dim)``) as the built-in GPT / Llama and Hugging
Face Llama do.

Example (a group of one holds everything):
    >>> import torch
    >>> from hetpipe.models import build
    >>> from hetpipe.partitioner.capture.capture import capture
    >>> model, batch = build("gpt-tiny", device="cpu", batch=2, seq=8)
    >>> blocks = [b for u in capture(model, batch).units for b in u.tensor_parallel]
    >>> ref = model(*batch)
    >>> shard = shard_model(model, blocks, share=MemberShare(member=0, weights=(1.0,)), group=None)
    >>> type(shard.transformer.h[0].attn.c_attn).__name__, bool(torch.allclose(shard(*batch), ref, atol=1e-6))
    ('ColumnParallelLinear', True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetpipe.cost_models.tensor_parallel import largest_remainder
from hetpipe.errors import ConfigError
from hetpipe.partitioner.capture.tensor_blocks import ShardedParameter, TensorParallelBlock
from hetpipe.runtime.tp_comm import copy_to_group, reduce_from_group
from hetpipe.runtime.tp_vocab import shard_vocab_block


@dataclass(frozen=True)
class MemberShare:
    """Which member this process is and every member's share (weights sum to 1).

    Example:
        >>> MemberShare(member=1, weights=(0.75, 0.25)).part_range(parts=4)
        (3, 4)
    """

    member: int
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.weights or any(not w > 0 for w in self.weights) or abs(sum(self.weights) - 1.0) > 1e-9:
            raise ConfigError(f"tensor-parallel shares {self.weights} must be positive and sum to 1; give one per "
                              "group member (e.g. TensorShares.weights)")
        if not 0 <= self.member < len(self.weights):
            raise ConfigError(f"member={self.member} is not a member of a group of {len(self.weights)}; "
                              f"use 0..{len(self.weights) - 1} (the rank's index in its group)")

    def counts(self, parts: int) -> tuple[int, ...]:
        """Parts per member of a block of ``parts`` (largest remainder)."""
        return largest_remainder(self.weights, parts)

    def part_range(self, *, parts: int, member: int | None = None) -> tuple[int, int]:
        """``[first, end)`` parts of ``member`` (default: this one)."""
        counts = self.counts(parts)
        m = self.member if member is None else member
        first = sum(counts[:m])
        return first, first + counts[m]


class BlockInput:
    """`copy_to_group` once per block and forward, shared by the block's column layers (q, k, v)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._last is None or self._last[0] is not x:
            self._last = (x, copy_to_group(x, self.group))
        return self._last[1]

    def clear(self) -> None:
        """Forget the input once the block's row layer ran (it holds no tensor between steps)."""
        self._last = None


class ShardedLinear(nn.Module):
    """A member's slice of a linear layer (weight, optional bias) and the block input it shares.

    ``transposed``: the weight is stored (in, out), as Hugging Face's ``Conv1D`` stores it; it
    keeps the model's layout so its name and shape still match the model's weights.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, block_input: BlockInput, *,
                 transposed: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.block_input = block_input
        self.transposed = transposed

    def matrix(self) -> torch.Tensor:
        """The weight as ``F.linear`` takes it, (out, in)."""
        return self.weight.t() if self.transposed else self.weight


class ColumnParallelLinear(ShardedLinear):
    """This member's output rows of a column-parallel layer: ``x -> x W_m^T + b_m``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.block_input(x), self.matrix(), self.bias)


class RowParallelLinear(ShardedLinear):
    """This member's input columns of a row-parallel layer; the partial outputs summed over the group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_group(F.linear(x, self.matrix()), self.block_input.group)
        self.block_input.clear()
        return y if self.bias is None else y + self.bias


def slice_parameter(full: torch.Tensor, spec: ShardedParameter, parts: tuple[int, int]) -> torch.Tensor:
    """The slice of ``full`` for parts ``[first, end)`` (a new tensor of just those elements)."""
    index = torch.tensor(spec.index(parts=parts, length=full.shape[spec.dim]), dtype=torch.long, device=full.device)
    return full.detach().index_select(spec.dim, index)


def _module_path(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0]


def _transposed(mod: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (weight stored (in, out)); matched by name: hetpipe does not import transformers here."""
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "nx")


def _linear(model: nn.Module, path: str) -> nn.Module:
    mod = model.get_submodule(path)
    if type(mod) is not nn.Linear and not _transposed(mod):
        raise ConfigError(f"tensor-parallel layer {path!r} is a {type(mod).__name__}; only nn.Linear (and "
                          "Conv1D) layers are sharded so far (a torch.export graph applies its weights with "
                          "aten.linear, which is not yet): run this unit width-1")
    return mod


def _set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _source(model: nn.Module, state: Mapping[str, torch.Tensor] | None, name: str) -> torch.Tensor:
    if state is not None and name not in state:
        raise ConfigError(f"parameter {name!r} is missing from the weights; pass the model's full state dict "
                          "(by its own parameter names)")
    t = state[name] if state is not None else model.get_parameter(name)
    if t.is_meta:
        raise ConfigError(f"parameter {name!r} is on the meta device; pass its full initial value in state=")
    return t


def shard_block(model: nn.Module, block: TensorParallelBlock, *, share: MemberShare, group: Any,
                state: Mapping[str, torch.Tensor] | None = None, device: Any = None) -> None:
    """Replace ``block``'s layers in ``model`` by this member's column / row shards (in place).

    Slices are cut where ``state`` (or the layer) lives, then only they move to ``device``
    (default: the layer's own device; required for a layer on meta).
    """
    parts = share.part_range(parts=block.parts)
    if parts[0] == parts[1]:  # the model's view(b, t, -1, head_dim) cannot infer -1 from 0 elements
        raise ConfigError(f"shares {share.weights} give member {share.member} none of the {block.parts} "
                          f"{block.division} of {block.row.name.rsplit('.', 2)[0]}; raise its share or leave it "
                          "out of the group")
    block_input = BlockInput(group)
    by_module: dict[str, dict[str, ShardedParameter]] = {}
    for spec in block.column:
        by_module.setdefault(_module_path(spec.name), {})[spec.name.rsplit(".", 1)[1]] = spec
    for path, specs in by_module.items():
        mod = _linear(model, path)
        weight = slice_parameter(_source(model, state, specs["weight"].name), specs["weight"], parts)
        bias = slice_parameter(_source(model, state, specs["bias"].name), specs["bias"], parts) \
            if "bias" in specs else None
        shard = ColumnParallelLinear(weight, bias, block_input, transposed=_transposed(mod))
        _set_module(model, path, shard.to(_target(mod, device)))
        out_dim = 1 if _transposed(mod) else 0  # Conv1D stores (in, out), nn.Linear (out, in)
        narrow_fixed_splits(model.get_submodule(path.rpartition(".")[0]), segments=specs["weight"].segments,
                            full=mod.weight.shape[out_dim], local=weight.shape[out_dim])
    row_path = _module_path(block.row.name)
    mod = _linear(model, row_path)
    weight = slice_parameter(_source(model, state, block.row.name), block.row, parts)
    bias = _source(model, state, block.row_bias).detach().clone() if block.row_bias else None
    shard = RowParallelLinear(weight, bias, block_input, transposed=_transposed(mod))
    _set_module(model, row_path, shard.to(_target(mod, device)))


#: Attributes of a fused projection's parent module holding the width its output is split at
#: (Hugging Face GPT-2's ``GPT2Attention.split_size``): set to the member's local width.
FIXED_SPLIT_ATTRS = ("split_size",)


def narrow_fixed_splits(parent: nn.Module, *, segments: int, full: int, local: int) -> None:
    """Set ``parent``'s `FIXED_SPLIT_ATTRS` that cut a fused projection's ``full`` output columns into
    ``segments`` equal parts (GPT-2's q|k|v) to a part of the member's ``local`` columns.

    Example:
        >>> attn = nn.Module(); attn.split_size = 64
        >>> narrow_fixed_splits(attn, segments=3, full=192, local=48); attn.split_size
        16
    """
    for attr in FIXED_SPLIT_ATTRS if segments > 1 else ():
        if getattr(parent, attr, None) == full // segments:
            setattr(parent, attr, local // segments)


def _target(mod: nn.Module, device: Any) -> Any:
    own = next(mod.parameters()).device
    if device is None and own.type == "meta":
        raise ConfigError("the model is on the meta device; pass device= (where the shard goes) and state=")
    return own if device is None else device


def shard_model(model: nn.Module, blocks: Sequence[TensorParallelBlock], *, share: MemberShare, group: Any,
                state: Mapping[str, torch.Tensor] | None = None, device: Any = None) -> nn.Module:
    """``model`` with every block in ``blocks`` replaced by this member's shard; returns ``model``.

    ``group``: the tensor-parallel process group (`tensor_parallel_group`), or None for one member.
    ``state``: full initial values by parameter name (default: the model's own parameters);
    ``device``: where the shards go (default: each layer's own device).
    """
    size = dist.get_world_size(group) if group is not None else 1
    if size != len(share.weights):
        raise ConfigError(f"{len(share.weights)} shares for a tensor-parallel group of {size} ranks; "
                          "give one share per group member")
    made: dict[int, nn.Parameter] = {}  # a tied embedding and head share their sliced rows
    for block in blocks:
        if block.is_vocab:
            parts = _parts_of(share, block)
            shard_vocab_block(model, block, parts=parts, group=group, device=device, made=made,
                              full=_source(model, state, block.column[0].name))
        else:
            shard_block(model, block, share=share, group=group, state=state, device=device)
    return model


def _parts_of(share: MemberShare, block: TensorParallelBlock) -> tuple[int, int]:
    parts = share.part_range(parts=block.parts)
    if parts[0] == parts[1]:
        raise ConfigError(f"shares {share.weights} give member {share.member} none of the {block.parts} "
                          f"{block.division} rows of {block.column[0].name}; raise its share or leave it out of "
                          "the group")
    return parts


def tensor_parallel_group(members: Sequence[int]) -> Any:
    """A process group of ``members`` (global ranks); every rank of the world must call it, in the same order."""
    return dist.new_group(ranks=sorted(members))


def gather_parameter(local: torch.Tensor, spec: ShardedParameter, *, parts: int, share: MemberShare,
                     group: Any) -> torch.Tensor:
    """The full parameter assembled from every member's slice (uneven slices padded for all_gather)."""
    size = len(share.weights)
    counts = share.counts(parts)
    lengths = [n * spec.part_size * spec.segments for n in counts]
    pad = list(local.shape)
    pad[spec.dim] = max(lengths)
    padded = local.detach().new_zeros(pad)  # all_gather needs equal sizes; members' slices differ
    padded.narrow(spec.dim, 0, local.shape[spec.dim]).copy_(local.detach())
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded, group=group)
    full_shape = list(local.shape)
    full_shape[spec.dim] = sum(lengths)
    full = local.detach().new_empty(full_shape)
    for m, piece in enumerate(pieces):
        index = spec.index(parts=share.part_range(parts=parts, member=m), length=full_shape[spec.dim])
        full.index_copy_(spec.dim, torch.tensor(index, dtype=torch.long), piece.narrow(spec.dim, 0, lengths[m]))
    return full
