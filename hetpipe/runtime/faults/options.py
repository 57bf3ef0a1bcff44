"""``hetpipe run``'s fault and straggler options, checked before anything is launched.

Example:
    >>> from types import SimpleNamespace
    >>> plan = SimpleNamespace(stages=tuple(SimpleNamespace(device=d) for d in "abc"), replicas=())
    >>> fault_args(plan, ["kill:rank=2,step=1"], emulate=False, steps=3, margin=None, window_steps=None).inject
    ('kill:rank=2,step=1',)
    >>> fault_args(plan, None, emulate=True, steps=3, margin=-1.0, window_steps=None)
    Traceback (most recent call last):
    ...
    hetpipe.errors.ConfigError: --straggler-margin must be a finite number > 0 (0.25: 25% slower than the plan), got -1.0; write e.g. --straggler-margin 0.25
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

from hetpipe.errors import ConfigError
from hetpipe.runtime.faults.inject import check_faults, parse_faults, run_ranks

#: Longest straggler window: more steps than this would name a slow card only after most short runs end.
MAX_STRAGGLER_STEPS = 1000


@dataclass(frozen=True)
class FaultArgs:
    """The checked options: canonical fault specs for the workers and the detection settings."""

    inject: tuple[str, ...] = ()
    straggler_margin: float | None = None
    straggler_steps: int | None = None

    def launch_fields(self) -> dict[str, Any]:
        """The `LaunchSpec` fields."""
        return {"inject": self.inject, "straggler_margin": self.straggler_margin,
                "straggler_steps": self.straggler_steps}

    def annotate(self, report: Any) -> Any:
        """The run report with the injected faults listed, and how they were applied."""
        if not self.inject:
            return report
        note = (f"injected {len(self.inject)} fault(s) in-process (kills: the rank exits; slowdowns: the emulator's "
                "stretch and link delays)")
        return dataclasses.replace(report, injected=self.inject, notes=(*report.notes, note))


def fault_args(plan: Any, inject: Sequence[str] | None, *, emulate: bool, steps: int, margin: float | None,
               window_steps: int | None) -> FaultArgs:
    """Parse and check ``--inject`` against the plan and the run; check the straggler settings."""
    if margin is not None and not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin > 0):
        raise ConfigError(f"--straggler-margin must be a finite number > 0 (0.25: 25% slower than the plan), got "
                          f"{margin!r}; write e.g. --straggler-margin 0.25")
    if window_steps is not None and (isinstance(window_steps, bool) or not isinstance(window_steps, int)
                                     or not 1 <= window_steps <= MAX_STRAGGLER_STEPS):
        raise ConfigError(f"--straggler-steps must be a whole number of steps from 1 to {MAX_STRAGGLER_STEPS}, "
                          f"got {window_steps!r}; write e.g. --straggler-steps 3")
    faults = parse_faults(list(inject or ()))
    # ``rank=`` is the launched process's rank: a tensor-parallel group runs one per member (`run_ranks`)
    num_ranks = len(plan.stages) if plan.replicas else run_ranks(plan)
    check_faults(faults, num_ranks=num_ranks, emulate=emulate, replicas=bool(plan.replicas), steps=steps)
    return FaultArgs(tuple(f.spec() for f in faults), margin, window_steps)


def check_wait_for_return(seconds: float | None, max_restarts: int) -> float | None:
    """``--wait-for-return SECONDS``: a finite number > 0, and only with restarts to spend.

    Example:
        >>> check_wait_for_return(30, 1), check_wait_for_return(None, 0)
        (30.0, None)
        >>> check_wait_for_return(30, 0)
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: --wait-for-return 30 needs --max-restarts N (N >= 1): resuming on a device that came back is a restart; add e.g. --max-restarts 1
    """
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (math.isfinite(seconds)
                                                                                 and seconds > 0):
        raise ConfigError(f"--wait-for-return must be a finite number of seconds > 0, got {seconds!r}; write e.g. "
                          "--wait-for-return 60")
    if max_restarts < 1:
        raise ConfigError(f"--wait-for-return {seconds:g} needs --max-restarts N (N >= 1): resuming on a device that "
                          "came back is a restart; add e.g. --max-restarts 1")
    return float(seconds)
