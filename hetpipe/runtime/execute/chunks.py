"""The stage modules one pipeline rank holds, keyed by virtual stage (issue 17 item 2).

A rank of a plain pipeline holds one stage; under interleaved 1F1B it holds v **chunks**, chunk c
of rank r being virtual stage ``c p + r`` (`hetpipe.schedule.interleaved`).  Every action names
its virtual stage, so the executor looks the module up by ``action.stage``.  The rank's optimizer
steps every chunk's parameters at its one STEP, and its ledger sums every chunk's bytes.

Example:
    >>> import torch
    >>> from hetpipe.runtime.stage.build import build_stage, split_stages
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    >>> prog = split_stages(torch.fx.symbolic_trace(net), {"_0": 0, "_1": 1, "_2": 2},
    ...                     example_inputs=(torch.zeros(2, 3),), num_stages=3)
    >>> stages = RankStages.of([build_stage(prog, k, state_dict=net.state_dict(), device="cpu") for k in (0, 2)])
    >>> stages.stages, stages.first.stage, stages.holds_first, stages.holds_last, len(stages.parameters())
    ((0, 2), 0, True, True, 4)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hetpipe.runtime.stage.types import StageModule


@dataclass(frozen=True)
class RankStages:
    """A rank's stage modules in virtual-stage order (one for a plain pipeline)."""

    modules: tuple[StageModule, ...]

    @classmethod
    def of(cls, stage_modules: StageModule | Sequence[StageModule]) -> "RankStages":
        """From one `StageModule` or a sequence of them (any order; virtual stages distinct)."""
        if isinstance(stage_modules, RankStages):
            return stage_modules
        mods = (stage_modules,) if isinstance(stage_modules, StageModule) else tuple(stage_modules)
        if not mods:
            raise ValueError("a rank holds at least one stage module")
        ordered = tuple(sorted(mods, key=lambda s: s.stage))
        if len({s.stage for s in ordered}) != len(ordered):
            raise ValueError(f"stage modules of virtual stages {[s.stage for s in ordered]}: each at most once")
        return cls(ordered)

    @property
    def first(self) -> StageModule:
        """The lowest virtual stage's module (chunk 0): its device is where the rank computes."""
        return self.modules[0]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s.stage for s in self.modules)

    @property
    def holds_first(self) -> bool:
        """Does this rank run virtual stage 0 (it reads the model's inputs)?"""
        return any(s.is_first for s in self.modules)

    @property
    def holds_last(self) -> bool:
        """Does this rank run the last virtual stage (it applies the loss)?"""
        return any(s.is_last for s in self.modules)

    @property
    def module(self) -> torch.nn.ModuleList:
        """Every chunk's module in chunk order (for code that walks parameters and buffers; names carry
        the chunk index first, so they are not the model's: checkpoints refuse interleaved runs)."""
        return torch.nn.ModuleList([s.module for s in self.modules])

    def __getitem__(self, stage: int) -> StageModule:
        for s in self.modules:
            if s.stage == stage:
                return s
        raise KeyError(stage)

    def __len__(self) -> int:
        return len(self.modules)

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every chunk's parameters, each once."""
        return list(dict.fromkeys(p for s in self.modules for p in s.parameters()))

    def statics(self) -> list[torch.Tensor]:
        """Parameters and buffers of every chunk, each once (never counted as activations)."""
        buffers = [b for s in self.modules for b in s.module.buffers()]
        return list(dict.fromkeys([*self.parameters(), *buffers]))
