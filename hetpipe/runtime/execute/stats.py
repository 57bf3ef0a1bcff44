"""What an executor step reports, and the callbacks it offers around every action.

`StepStats` is one rank's view of one step (timings per micro-batch and per action,
memory by category, the loss on the last stage); `ActionHooks` is what the emulation and
instrumentation layers subclass (`hetpipe.runtime.emulate.pipeline`).  The executor
(`hetpipe.runtime.execute.executor`) re-exports both.

Example:
    >>> ActionHooks().send_delay_s(0, 1024), ActionHooks.exact_memory
    (0.0, False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hetpipe.schedule.actions import Action


class ActionHooks:
    """Callbacks around every action (the emulation layer subclasses this; the default does nothing).

    ``send_delay_s`` is asked by the *sender* right before it posts a message over
    cut ``cut``; the arrival time (now + delay, CLOCK_MONOTONIC) travels in the
    header and the receiver sleeps until it, so the sender never blocks.
    ``memory`` gets the bytes held after each action by `MEMORY_CATEGORIES`.

    Example:
        >>> ActionHooks().send_delay_s(0, 1024)
        0.0
    """

    exact_memory = False  # True: account autograd's saved tensors on every step (an emulated memory limit)

    def before(self, action: Action) -> None:
        """Called right before ``action`` runs."""

    def after(self, action: Action, seconds: float) -> None:
        """Called right after ``action`` ran for ``seconds`` (measured; CUDA synchronised)."""

    def send_delay_s(self, cut: int, num_bytes: int) -> float:
        return 0.0

    def memory(self, action: Action, held_bytes: Mapping[str, int]) -> None:
        """Bytes held after ``action``, by category (a read-only live view: copy it to keep it)."""

    def arrived(self, action: Action, late_s: float) -> None:
        """A RECV's message with an emulated arrival time came ``late_s`` after it (< 0: early)."""


@dataclass(frozen=True)
class ActionTiming:
    action: str
    start_s: float  # since the start of the step
    duration_s: float  # the whole action, including an emulation stretch


@dataclass(frozen=True)
class MemoryStats:
    """What this rank held, as far as it can account for it (unique storages).

    ``peak_bytes`` is the largest total seen after any action; activations are the
    storages autograd saved plus the stage inputs/outputs of in-flight
    micro-batches; comm is posted receive buffers and outgoing gradients.
    """

    param_bytes: int  # parameters and buffers
    grad_bytes: int
    optimizer_state_bytes: int
    peak_activation_bytes: int
    peak_comm_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class StepStats:
    """One rank's view of one step; ``loss`` is None off the last stage unless broadcast."""

    rank: int
    stage: int
    loss: float | None
    forward_s: tuple[float, ...]  # per micro-batch index
    backward_s: tuple[float, ...]
    actions: tuple[ActionTiming, ...]
    comm_wait_s: float  # time spent in RECV actions and waiting for sends
    optimizer_s: float  # the STEP action (tied all-reduce, clipping, optimizer, scheduler)
    step_s: float
    grad_norm: float | None  # global norm before clipping (only with grad_clip_norm)
    memory: MemoryStats
    #: CLOCK_MONOTONIC seconds at which ``actions``' ``start_s`` count from (0.0: not recorded); the
    #: step's own start, so timelines of one host line up (`hetpipe.runtime.measured_links`)
    origin_s: float = 0.0

    @property
    def peak_bytes(self) -> int:
        return self.memory.peak_bytes
