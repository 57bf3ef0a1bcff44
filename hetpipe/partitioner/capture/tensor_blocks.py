"""What of a unit can be split across a tensor-parallel group (issue 15): the data contract.

A `TensorParallelBlock` is one Megatron-LM pair (Shoeybi et al. 2019, §3): column-parallel
weights (split by their outputs: attention q/k/v by heads, MLP up/gate by hidden columns),
then width-local operations only (activation, attention), then one row-parallel weight
(split by its inputs) whose partial outputs the group sums with one all-reduce.  Parameters
are named by the model's own parameter names, so the runtime slices a shard out of the
full initial weights (`hetpipe.runtime.tensor_parallel`).

A block has ``parts`` indivisible parts (heads; key/value groups under grouped-query
attention, each one key/value head with its query heads; or hidden columns).  Member i of
a group holds ``n_i`` consecutive parts; a parameter's slice for parts ``[a, b)`` is
``[a · part_size, b · part_size)`` along ``dim`` within each of its ``segments`` (a fused
q|k|v projection has 3 segments, each sliced alike).

Example:
    >>> qkv = ShardedParameter(name="h.0.attn.c_attn.weight", dim=0, part_size=16, segments=3)
    >>> qkv.index(parts=(1, 3), length=192)
    [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 144, 145, 146, 147, 148, 149, 150, 151, 152, 153, 154, 155, 156, 157, 158, 159, 160, 161, 162, 163, 164, 165, 166, 167, 168, 169, 170, 171, 172, 173, 174, 175]
"""

from __future__ import annotations

from dataclasses import dataclass

#: Kinds of block and units of division.  ``embedding`` / ``head``: the token embedding and the LM
#: head split by vocabulary rows (Megatron-LM's VocabParallelEmbedding and vocab-parallel
#: cross-entropy; `capture.vocab_parallel`): one sharded weight (``column``), no row layer.
KINDS = ("attention", "mlp", "embedding", "head")
DIVISIONS = ("heads", "columns", "vocabulary")


@dataclass(frozen=True)
class ShardedParameter:
    """One parameter that splits, and how.

    Attributes:
        name: the model's parameter name (``model.layers.0.mlp.up_proj.weight``).
        dim: the dimension that splits (a Linear's weight: 0 by outputs, 1 by inputs).
        part_size: elements of ``dim`` per part within one segment (head_dim × query heads per
            group for q, head_dim for k/v, 1 for an MLP column).
        segments: equal blocks along ``dim`` that each split alike (3 for a fused q|k|v).
    """

    name: str
    dim: int
    part_size: int
    segments: int = 1

    def index(self, *, parts: tuple[int, int], length: int) -> list[int]:
        """Indices along ``dim`` of parts ``[first, end)`` for a dimension of ``length`` elements."""
        first, end = parts
        segment = length // self.segments
        return [s * segment + i for s in range(self.segments)
                for i in range(first * self.part_size, end * self.part_size)]


@dataclass(frozen=True)
class TensorParallelBlock:
    """A column-parallel -> row-parallel pair found in the captured graph.

    Attributes:
        kind: ``"attention"`` (a scaled_dot_product_attention between) or ``"mlp"``.
        division: ``"heads"`` (key/value groups) or ``"columns"`` (hidden columns).
        parts: indivisible parts the shares are rounded to.
        column: column-parallel weights and their biases (split by output).
        row: the row-parallel weight (split by input); None for a vocabulary block.
        row_bias: the row-parallel bias, replicated, added once after the all-reduce ("" if none).
        fwd_flops: forward FLOPs of the block's nodes (what splits with the shares).
        param_numel: elements of the parameters that split.
        allreduce_bytes: bytes of the row layer's output per micro-batch (``b · s · h``
            elements): what the group all-reduces forward, and the input gradient backward.
        activation_bytes: held storages per micro-batch the block makes from its column
            outputs on (per-head / per-column tensors kept for backward): they split with the
            shares; the block's input and output are whole on every member.
        loss_allreduce_bytes: a vocabulary head only: bytes of one (b, s) fp32 vector, each of the
            three forward all-reduces of the vocab-parallel cross-entropy (max, sum of exp, target
            logit; `cost_models.tensor_parallel.block_allreduce_bytes`).
    """

    kind: str
    division: str
    parts: int
    column: tuple[ShardedParameter, ...]
    row: ShardedParameter | None
    row_bias: str
    fwd_flops: int
    param_numel: int
    allreduce_bytes: int = 0
    activation_bytes: int = 0
    loss_allreduce_bytes: int = 0

    @property
    def parameters(self) -> tuple[ShardedParameter, ...]:
        """Every parameter that splits, column ones first."""
        return (*self.column, self.row) if self.row is not None else self.column

    @property
    def is_vocab(self) -> bool:
        """Split by vocabulary rows (a token embedding or an LM head)."""
        return self.division == "vocabulary"
