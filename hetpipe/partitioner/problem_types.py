"""The placement types of the solver input (`hetpipe.partitioner.problem` re-exports them): a device
as the solver sees it, a tied parameter's copy, and a stage's placement with its levers.

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
