"""How a `PipelineExecutor` runs: one frozen options object instead of a long keyword list.

`ExecutorOptions` holds the plain settings (timeouts, loss reduction, clipping, prefetch,
memory accounting); `ReplicaWiring` the callbacks and process groups a replica plan wires
in (`hetpipe.runtime.replicas.trainer`); a single pipeline leaves it at its default.

Example:
    >>> opts = ExecutorOptions(timeout_s=30.0, grad_clip_norm=1.0)
    >>> opts.loss_reduction, opts.replace(broadcast_loss=True).broadcast_loss
    ('mean', True)
    >>> ExecutorOptions(loss_reduction="max")
    Traceback (most recent call last):
    ...
    hetpipe.errors.ConfigError: loss_reduction='max'; use 'mean' or 'sum'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from hetpipe.errors import ConfigError

#: Default bound of every single wait (receive, send completion, collective), seconds.
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ExecutorOptions:
    """Settings of one rank's executor (see `PipelineExecutor` for what each does).

    timeout_s: bound of every single wait (receive, send completion, collective).
    grad_clip_norm: clip the global gradient norm (across all stages) to this.
    loss_reduction: "mean" (average over micro-batches) or "sum".
    broadcast_loss: give every rank the loss (one broadcast per step).
    prefetch_depth: receives posted before their action (None: the executor's default).
    sync_cuda_timing: synchronise CUDA after F/B so their timings are real.
    track_saved_every_step: account autograd's saved tensors every step (None: when the
        hooks emulate a memory limit), not on the first step only.
    wait_sends_at_recv: at each RECV, wait until this rank's earlier sends were received
        (None: on gloo, for the built-in GPipe/1F1B action lists and, one RECV behind,
        interleaved ones: `prefetch.INTERLEAVED_SEND_LAG`).
    cut_specs: the program's cuts, checked against the stage's (None: the stage's own).
    """

    timeout_s: float = DEFAULT_TIMEOUT_S
    grad_clip_norm: float | None = None
    loss_reduction: str = "mean"
    broadcast_loss: bool = False
    prefetch_depth: int | None = None
    sync_cuda_timing: bool = True
    track_saved_every_step: bool | None = None
    wait_sends_at_recv: bool | None = None
    cut_specs: Sequence[Any] | None = None

    def __post_init__(self) -> None:
        if self.loss_reduction not in ("mean", "sum"):
            raise ConfigError(f"loss_reduction={self.loss_reduction!r}; use 'mean' or 'sum'")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s={self.timeout_s!r}; a wait bound must be positive seconds")

    def replace(self, **changes: Any) -> "ExecutorOptions":
        """A copy with ``changes`` applied (checked again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ReplicaWiring:
    """What a replica plan or a tensor-parallel group plugs into a pipeline's executor (all None for a
    single pipeline of width-1 stages).

    group: process group of exactly the pipeline's ranks for the gradient-norm all-reduce
        and the loss broadcast (None: the world, right when the pipeline spans it).
    tied_group: ``tied_group(ranks) -> process group`` per tied parameter (None:
        ``dist.new_group``; replicas of different layouts pass groups made up front).
    grad_sync: called in ``STEP`` after the sends completed and before the tied-parameter
        all-reduce (data-parallel gradient sync between replicas).
    final_backward: called right before the step's last ``B`` of this rank (the replica
        sync launches its all-reduces from gradient hooks from then on).
    make_comm: ``make_comm(stage_module, **StageComm's keywords)`` builds the stage's messages
        (None: `StageComm`; a tensor-parallel group member: `hetpipe.runtime.execute.group.GroupComm`).
    uncounted: ids of parameters this rank leaves out of the global gradient norm (a group member's
        replicated parameters: its lead counts them).
    tied_rows: id of a tied parameter this rank holds only rows of (split by vocabulary) -> (first
        row, whole rows): its gradient is all-reduced in a whole-size buffer, zeros outside its rows.
    """

    group: Any = None
    tied_group: Callable[[Sequence[int]], Any] | None = None
    grad_sync: Callable[[], None] | None = None
    final_backward: Callable[[], None] | None = None
    make_comm: Callable[..., Any] | None = None
    uncounted: frozenset[int] = frozenset()
    tied_rows: Mapping[int, tuple[int, int]] = field(default_factory=dict)
