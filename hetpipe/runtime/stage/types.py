"""The data a staged program is made of: tensor and cut specs, tied groups, the program, a built stage.

`hetpipe.runtime.stage.build` makes these (`split_stages`, `build_stage`) and re-exports them;
the executor and the wire protocol read them.

Example:
    >>> import torch
    >>> spec = TensorSpec("h", (2, 4), torch.float32, True)
    >>> spec.num_bytes, spec.describe()
    (32, "'h' (2, 4) float32")
    >>> CutSpec(0, (spec,)).grad_tensors == (spec,)
    True
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
import torch.fx as fx
from torch import nn


@dataclass(frozen=True)
class TensorSpec:
    """One tensor crossing a cut (or a model input), per micro-batch.

    ``requires_grad`` says whether a gradient flows back across the cut (the value
    depends on a parameter); integer tensors and inputs never carry one.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    def describe(self) -> str:
        """``'add_3' (4, 16) float32``: how errors print a spec."""
        return f"{self.name!r} {tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class CutSpec:
    """Everything crossing cut ``index`` (from stage ``index`` to ``index + 1``), in send order."""

    index: int
    tensors: tuple[TensorSpec, ...]
    baked: tuple[tuple[str, str], ...] = ()  # (node name, repr of the baked value)

    @property
    def grad_tensors(self) -> tuple[TensorSpec, ...]:
        """The tensors whose gradients travel back across this cut, in send order."""
        return tuple(t for t in self.tensors if t.requires_grad)

    @property
    def num_bytes(self) -> int:
        """Forward bytes per micro-batch."""
        return sum(t.num_bytes for t in self.tensors)

    def fingerprint(self) -> int:
        """A process-independent 31-bit checksum both ends of the cut compare before the first step."""
        text = repr([(t.name, tuple(t.shape), str(t.dtype), t.requires_grad) for t in self.tensors])
        return zlib.crc32(f"{self.index}:{text}".encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class TiedGroup:
    """One parameter replicated on several stages; ``members`` are (stage, local qualified name)."""

    canonical_name: str
    members: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.members)

    @property
    def owner_stage(self) -> int:
        """The stage that counts the parameter once (e.g. for the global gradient norm)."""
        return self.members[0][0]

    def local_name(self, stage: int) -> str | None:
        return next((name for s, name in self.members if s == stage), None)


@dataclass(frozen=True)
class StagedProgram:
    """A model split into stages; ``modules`` live on the meta device and hold no weights.

    Attributes:
        num_stages: number of stages.
        modules: one ``GraphModule`` per stage.  Stage k's ``forward`` takes the
            tensors of cut k-1 (the model inputs on stage 0) positionally and returns
            the tuple of cut k's tensors (the model's output on the last stage).
        input_specs: the model inputs (placeholders) per micro-batch.
        cuts: ``num_stages - 1`` cut specs.
        tied: parameters used by more than one stage.
        node_stages: the stage of every compute node, inferred ones included.
        aliases: every qualified name of each parameter/buffer (tied names), so a
            state dict holding only one of them still loads.
        fallback_tensors: real buffers and tensor constants of the source module
            (not copies), used when a state dict lacks them (non-persistent buffers).
    """

    num_stages: int
    modules: tuple[fx.GraphModule, ...] = field(repr=False, compare=False)
    input_specs: tuple[TensorSpec, ...]
    cuts: tuple[CutSpec, ...]
    tied: tuple[TiedGroup, ...]
    node_stages: Mapping[str, int] = field(repr=False, compare=False)
    aliases: Mapping[str, tuple[str, ...]] = field(repr=False, compare=False)
    fallback_tensors: Mapping[str, torch.Tensor] = field(repr=False, compare=False)

    def stage_inputs(self, stage: int) -> tuple[TensorSpec, ...]:
        """What stage ``stage``'s forward takes."""
        return self.input_specs if stage == 0 else self.cuts[stage - 1].tensors


@dataclass(frozen=True, eq=False)
class StageModule:
    """One stage materialised on its device: call it like the stage's forward.

    ``module`` holds only this stage's parameters and buffers, under their original
    qualified names; ``tied_groups`` is the program-wide list (every rank needs it
    to create the same process groups), `tied_parameters` the local view of it.
    """

    module: fx.GraphModule
    stage: int
    num_stages: int
    in_cut: CutSpec | None  # None on stage 0 (it reads the model inputs)
    out_cut: CutSpec | None  # None on the last stage (it returns the model output)
    input_specs: tuple[TensorSpec, ...]
    tied_groups: tuple[TiedGroup, ...]
    device: torch.device
    # the units its forward runs under torch.utils.checkpoint (`hetpipe.runtime.stage.recompute`)
    recomputed: tuple[Any, ...] = ()
    # the units it runs the selective level on (`hetpipe.runtime.stage.selective.UnitLevel`)
    selective: tuple[Any, ...] = ()

    def __call__(self, *args: Any) -> Any:
        return self.module(*args)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    @property
    def recompute_bytes(self) -> int:
        """Bytes one recompute allocates at most (the largest recomputed unit's saved bytes; 0 before
        its first forward)."""
        return max((r.saved_bytes or 0 for r in self.recomputed), default=0)

    @property
    def selective_bytes(self) -> int:
        """Bytes the selective level re-makes in a backward at most (the largest unit's dropped outputs; 0
        before its first forward): the planner's peak, added once."""
        return max((lv.dropped_bytes or 0 for lv in self.selective), default=0)

    def tied_parameters(self) -> dict[str, tuple[int, ...]]:
        """Local parameter name -> every stage holding a replica (this one included)."""
        out = {}
        for group in self.tied_groups:
            name = group.local_name(self.stage)
            if name is not None:
                out[name] = group.stages
        return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
