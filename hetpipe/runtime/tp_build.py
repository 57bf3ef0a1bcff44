"""Build one group member's model from a meta model and the full weights, allocating only its bytes.

`build_member` shards every tensor-parallel block straight out of ``state`` (the full
initial weights by parameter name: a ``torch.load(..., mmap=True)`` dict or any mapping
that reads a tensor on access), slicing where ``state`` lives and moving only the slice to
``device``, so no full-size copy of a sharded weight is made on the member's device; then it materialises the replicated rest (norms, embeddings, head) from ``state``,
a tied parameter once under all its names, and the buffers from the weights or the model's
own initialiser (`hetpipe.runtime.stage.buffers.ModelBuffers`: rotary tables, BatchNorm
statistics).  Parameters held = the replicated ones + this member's parts of each block.

Example:
    >>> import torch
    >>> from hetpipe.models import build
    >>> from hetpipe.partitioner.capture.capture import capture
    >>> full, batch = build("llama-tiny", device="cpu", batch=1, seq=8)
    >>> meta, _ = build("llama-tiny", device="meta", batch=1, seq=8)
    >>> blocks = [b for u in capture(meta, batch).units for b in u.tensor_parallel]
    >>> m = build_member(meta, blocks, share=MemberShare(0, (1.0,)), group=None,
    ...                  state=full.state_dict(), device="cpu")
    >>> bool(torch.allclose(m(*batch), full(*batch), atol=1e-6)), held_numel(m) == held_numel(full)
    (True, True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.partitioner.capture.tensor_blocks import TensorParallelBlock
from hetpipe.runtime.stage.buffers import ModelBuffers
from hetpipe.runtime.tp_shard import MemberShare, shard_model


def held_numel(model: nn.Module) -> int:
    """Elements of the parameters ``model`` holds (a tied parameter once)."""
    return sum(p.numel() for p in model.parameters())


def expected_numel(full_numel: int, blocks: Sequence[TensorParallelBlock], share: MemberShare,
                   numel_of: Mapping[str, int]) -> int:
    """What a member holds: everything, less the other members' parts of every block's parameters."""
    held = full_numel
    for b in blocks:
        first, end = share.part_range(parts=b.parts)
        for spec in b.parameters:
            held -= numel_of[spec.name] - numel_of[spec.name] * (end - first) // b.parts
    return held


def materialize_replicated(model: nn.Module, state: Mapping[str, torch.Tensor], device: Any) -> None:
    """Give every parameter and buffer still on meta its value from ``state`` (buffers: or the model's init)."""
    made: dict[int, nn.Parameter] = {}
    buffers = ModelBuffers(model)
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for attr, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:  # a tied parameter: one tensor under every name it has
                key = prefix + attr
                if key not in state:
                    raise ConfigError(f"parameter {key!r} is missing from the weights; pass the model's full "
                                      "state dict (by its own parameter names)")
                made[id(p)] = nn.Parameter(state[key].detach().to(device).clone(), requires_grad=p.requires_grad)
            module._parameters[attr] = made[id(p)]
        for attr, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                key = prefix + attr
                value = state[key] if key in state else buffers[key]
                module._buffers[attr] = value.detach().to(device).clone()


def build_member(model: nn.Module, blocks: Sequence[TensorParallelBlock], *, share: MemberShare, group: Any,
                 state: Mapping[str, torch.Tensor], device: Any) -> nn.Module:
    """``model`` (on meta) as this member: its block shards, then the replicated rest (module docstring)."""
    shard_model(model, blocks, share=share, group=group, state=state, device=device)
    materialize_replicated(model, state, device)
    return model

