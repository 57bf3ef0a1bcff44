"""Checkpoints of plans with tensor-parallel groups (issues 15 and 16): whole tensors by the model's names.

A group stage's members each hold a slice of every tensor-parallel block's split parameters
(`hetpipe.runtime.tp_shard`: rows, columns or heads, uneven shares).  A checkpoint holds them
whole, in the layout a width-1 stage writes, so any plan resumes from it:

* **save** (collective over the group): every member all-gathers each split parameter and each
  optimizer state tensor of the same shape (SGD's momentum, Adam's moments) along the split
  dimension (`gather_parameter`, the gather ``--save-weights`` uses), in name order; the lead
  writes them whole, the members write only their random generators.  Replicated parameters
  (norms, embeddings, a row layer's bias) and their optimizer state are equal on every member
  (equal gradients: `hetpipe.runtime.execute.group`), so the lead writes them too: exactly one
  writer per tensor.  A 0-d state (Adam's ``step``) is replicated.
* **resume**: each member reads the whole tensors its stage names and keeps its own slice
  (`slice_parameter`, what ``--weights`` cuts for a member), its optimizer state sliced the same way.

What the gather costs: every member receives every other member's slice of each split tensor,
i.e. about the split tensors' whole bytes per member and save (parameters, plus 1x them for SGD
momentum, 2x for Adam), padded to the largest slice (`gather_parameter`).  Measured figures:
``benchmarks/results/checkpoint.md`` (``CheckpointInfo.stage_gather_s`` / ``stage_gather_bytes``).

Example (a member's split parameters, by local name):
    >>> from types import SimpleNamespace as NS
    >>> from hetpipe.partitioner.capture.tensor_blocks import ShardedParameter
    >>> w = ShardedParameter("fc.weight", dim=0, part_size=1)
    >>> s = GroupSlices({"fc.weight": (w, 4)}, MemberShare(1, (0.75, 0.25)), group=None)
    >>> import torch
    >>> s.slice("fc.weight", torch.arange(8.).reshape(4, 2)).tolist()
    [[6.0, 7.0]]
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetpipe.partitioner.capture.tensor_blocks import ShardedParameter
from hetpipe.runtime.tp_run import stage_blocks
from hetpipe.runtime.tp_shard import MemberShare, gather_parameter, slice_parameter


@dataclass(frozen=True)
class GroupSlices:
    """One member's split parameters: local name -> (how it splits, parts of its block); its share and group."""

    specs: Mapping[str, tuple[ShardedParameter, int]]
    share: MemberShare
    group: Any

    def slice(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This member's slice of the whole tensor ``whole`` of parameter ``name`` (or of its optimizer state)."""
        spec, parts = self.specs[name]
        return slice_parameter(whole, spec, self.share.part_range(parts=parts))

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Collective over the group: the whole tensor assembled from every member's slice."""
        spec, parts = self.specs[name]
        return gather_parameter(local, spec, parts=parts, share=self.share, group=self.group)


@dataclass(frozen=True)
class WholeState:
    """A member's split tensors gathered whole: parameters by local name, optimizer state by
    (local name, state key); with the seconds and bytes the gather took."""

    tensors: dict[str, torch.Tensor]
    optim: dict[tuple[str, str], torch.Tensor]
    seconds: float
    bytes: int


def member_slices(run: Any) -> GroupSlices | None:
    """The `GroupSlices` of a prepared run's rank (the worker's or `Trainer`'s), None off a group stage."""
    setup = getattr(run, "groups", None)
    st = run.plan.stages[run.index]
    if setup is None or not st.group_devices:
        return None
    specs = {spec.name: (spec, block.parts) for block in stage_blocks(run.units, st) for spec in block.parameters}
    return GroupSlices(specs, MemberShare(setup.layout.slot.member, tuple(st.group_shares)), setup.handles.my_group())


def _split_state(value: Any, param: torch.Tensor) -> bool:
    """An optimizer state tensor that splits with its parameter (same shape; not a 0-d ``step``)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def gather_whole(slices: GroupSlices, module: nn.Module, optimizer: Any) -> WholeState:
    """Collective over the group: every split parameter and its split optimizer state, whole.

    Every member calls it with the same names in the same order (sorted), and holds the same
    optimizer state keys (the same optimizer, the same steps)."""
    started = time.monotonic()
    params = dict(module.named_parameters(remove_duplicate=False))
    tensors: dict[str, torch.Tensor] = {}
    optim: dict[tuple[str, str], torch.Tensor] = {}
    for name in sorted(slices.specs):
        param = params[name]
        tensors[name] = slices.gather(name, param.detach())
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if _split_state(value, param):
                optim[(name, key)] = slices.gather(name, value.detach())
    size = sum(t.numel() * t.element_size() for t in (*tensors.values(), *optim.values()))
    return WholeState(tensors, optim, time.monotonic() - started, size)


def sliced_value(slices: GroupSlices | None, name: str, value: torch.Tensor,
                 whole_shape: tuple[int, ...] | None) -> torch.Tensor:
    """A loaded tensor of parameter ``name`` (or of its optimizer state) as this member holds it: its
    slice where ``name`` splits and ``value`` has the whole parameter's shape, else ``value`` itself."""
    if slices is None or name not in slices.specs or whole_shape is None or tuple(value.shape) != whole_shape:
        return value
    return slices.slice(name, value)
