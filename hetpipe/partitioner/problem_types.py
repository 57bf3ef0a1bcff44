"""The placement types of the solver input and of its evaluation (`hetpipe.partitioner.problem` re-exports
them): a device as the solver sees it, a tied parameter's copy, a stage's placement with its levers, and a
placement's per-stage figures and objective (`StageCost`, `Evaluation`).

Example:
    >>> Stage(device=0, first_unit=0, last_unit=3).recompute_units
    ()
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSlot:
    """A device as the solver sees it."""

    id: str
    kind: str
    node: str
    usable_bytes: int
    # The card's link to its host and the host's memory bandwidth (optimizer-state offload,
    # `hetpipe.cost_models.offload`); 0 = unknown: the stage on it cannot offload.
    host_link_bytes_s: float = 0.0
    host_memory_bytes_s: float = 0.0


@dataclass(frozen=True)
class TiedCopy:
    """A parameter used by several units: its state is counted in `owner_unit`, and again on
    any stage that holds one of `user_units` but not the owner (the runtime's replica)."""

    owner_unit: int
    user_units: tuple[int, ...]
    state_bytes: int
    step_bytes: int = 0  # the replica as its optimizer steps it (fp32; memory model 5's U_s); 0 = not recorded


@dataclass(frozen=True)
class Stage:
    """Stage placement: device index into `Problem.devices`, units [first_unit, last_unit], the units it
    recomputes in the backward (global, ascending) and whether it keeps its optimizer state on the host."""

    device: int
    first_unit: int
    last_unit: int
    recompute_units: tuple[int, ...] = ()
    offload: bool = False
    # A tensor-parallel group (issue 15): every member's device index, `device` first; () = `device` alone (`tp_tables`)
    members: tuple[int, ...] = ()
    selective: bool = False  # runs the selective recompute level on its units (`cost_models.selective`)


@dataclass(frozen=True)
class StageCost:
    """Per-stage figures under the objective (seconds per micro-batch, bytes)."""

    fwd_s: float
    bwd_s: float
    send_s: float  # C_s, one way; 0 for the last stage
    memory_bytes: int
    usable_bytes: int
    offload_bytes: int = 0  # optimizer state kept on the host (0: the stage does not offload)
    offload_s: float = 0.0  # O_s, its tail after the stage's last backward
    step_s: float = 0.0  # S_s: the stage's optimizer step, once per iteration
    bwd_weight_s: float = 0.0  # W_s: the weight-gradient part of bwd_s (`cost_models.backward_split`)
    shares: tuple[float, ...] = ()  # a group's shares, member order (memory: its tightest member)

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.usable_bytes


@dataclass(frozen=True)
class Evaluation:
    """The objective and memory of one placement."""

    iteration_s: float  # T under the objective (`Problem.objective`, or evaluate's `objective`)
    bottleneck_s: float  # max( max_s (F_s+B_s), max_s 2 C_s )
    stages: tuple[StageCost, ...]
    tail_s: float = 0.0  # max_s O_s over the offloading stages, included in iteration_s
    estimate_s: float = 0.0  # the H-1F1B formula (no step): the solvers' search surrogate
    objective: str = "estimate"

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)
