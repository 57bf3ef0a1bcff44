"""Whether re-planning away from a straggler pays (``--adapt``): the report read, the gain and the cost weighed.

The ranks' detection (`hetpipe.runtime.faults.straggler`) writes ``straggler-rank<r>.json``;
the supervisor (`hetpipe.runtime.supervise`) reads it (`read_straggler`), re-plans with the slowdown
priced in (`Straggler.replan`) and weighs (`decide`), in real seconds:

* **gain** = remaining steps x (slowed step - new step).  The slowed step is measured: the median
  of the steps since the report's first slow step (``since_step``; `StepsDone.since_real_s`), the
  slowest rank's -- not the last few steps', which a report after one slow step would still price
  at the old speed.  The new step is that measured step x the plans' ratio (new T / old T with the
  slowdown priced in): the plan's tables say how much faster, the measurement how fast the job
  runs now.  The remaining steps start where the job acts: the boundary after the report's step
  (the job holds there for the verdict, `hetpipe.runtime.switch`), or the next checkpoint for a
  relaunch.
* **cost** = the re-plan's seconds + the act's: an in-place switch when the world is unchanged
  (`hetpipe.runtime.switch_price.switch_cost_s`), else a relaunch priced at this attempt's own
  start-up (launch to first finished step).

Example:
    >>> s = Straggler(rank=2, stage=2, device="desk:1", factor=3.0, step=5, since=5)
    >>> s.what
    'rank 2 (desk:1)'
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetpipe.errors import ConfigError
from hetpipe.plan.replan import Replan, link_pair, replan
from hetpipe.plan.schema import Plan
from hetpipe.runtime.steps_done import StepsDone
from hetpipe.runtime.switch import switch_refusal
from hetpipe.runtime.switch_price import switch_cost_s

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Straggler:
    """A straggler report of the ranks' detection (``straggler-rank<r>.json``)."""

    rank: int
    stage: int
    device: str
    factor: float
    step: int  # the step it was reported at (0 if the report does not say)
    link: tuple[str, str] | None = None  # a link straggler: its (sending, receiving) device ids
    since: int = -1  # its first slow step (-1: the report does not say)

    @property
    def what(self) -> str:
        """``rank 2 (n1:2)`` or, for a link, ``rank 1's link n0:1 -> n1:2``."""
        return (f"rank {self.rank}'s link {self.link[0]} -> {self.link[1]}" if self.link
                else f"rank {self.rank} ({self.device})")

    def replan(self, plan: Plan) -> Replan:
        """``plan`` re-solved with this slowdown priced in."""
        if self.link is not None:
            return replan(plan, link_slowdown={self.link: self.factor})
        return replan(plan, slowdown={self.device: self.factor})


@dataclass(frozen=True)
class Decision:
    """Whether re-planning away from a straggler pays: gain and cost in real seconds."""

    straggler: Straggler
    replan: Replan
    stop_step: int  # the checkpoint step the job stops at (in place: the boundary it switches at)
    gain_s: float
    cost_s: float
    in_place: bool = False  # the job switches plans at a step boundary instead of a relaunch

    @property
    def go(self) -> bool:
        return self.gain_s > self.cost_s

    def line(self) -> str:
        s = self.straggler
        verdict = (("switching in place after step" if self.in_place else "restarting at the checkpoint of step")
                   + f" {self.stop_step}" if self.go else "staying on this plan")
        act = "switch" if self.in_place else "restart"
        return (f"straggler: {s.what} {s.factor:.3g}x slower at step {s.step}; re-planned in "
                f"{self.replan.replan_s:.3g} s: {stage_text(self.replan.plan)}, T {self.replan.old_iteration_s:.4g} "
                f"-> {self.replan.new_iteration_s:.4g} s; predicted gain {self.gain_s:.3g} s vs {act} cost "
                f"{self.cost_s:.3g} s: {verdict}")


def stage_text(plan: Plan) -> str:
    """``dev[first-last] ...``: the plan's stages in one short string, a tensor-parallel group's every member
    (``lead+member[first-last]``)."""
    return " ".join(f"{'+'.join(s.group_devices or (s.device,))}[{s.first_unit}-{s.last_unit}]" for s in plan.stages)


def steps_finished(records: dict[int, StepsDone], num_ranks: int, start: int) -> int:
    """Steps every rank finished (a rank without a record finished none beyond ``start``)."""
    return min((records[r].steps_done if r in records else start) for r in range(num_ranks))


def recent_iteration_s(records: dict[int, StepsDone]) -> float:
    """The slowest rank's recent median step time (emulated seconds under ``--emulate``), 0 without records."""
    return max((r.recent_emulated_s() for r in records.values()), default=0.0)


def read_straggler(path: Path, plan: Plan) -> Straggler | None:
    """A straggler report (None while it is being written, or when it names no device or link of the plan).
    Reads the faults package's `StragglerRecord` file (``what``: compute or link; ``factors``: measure ->
    measured / predicted; ``link``: ``"a:0 -> b:0"``; ``detected_step``, ``since_step``) and a plain
    ``{"factor": F, "step": K}``."""
    try:
        doc = json.loads(path.read_text())
        rank = int(doc.get("rank", path.stem.removeprefix("straggler-rank")))
        stage = int(doc.get("stage", rank))
        device = str(doc.get("device") or plan.stages[stage].device)
        what = doc.get("what", "compute")
        factors = doc.get("factors") or {}
        wanted = [float(v) for k, v in factors.items() if (k in ("fwd", "bwd")) == (what == "compute")]
        factor = float(doc["factor"]) if "factor" in doc else max(wanted)
        step = int(doc.get("detected_step", doc.get("step", 0)))
        link = link_pair(doc["link"]) if what == "link" else None
        since = int(doc.get("since_step", -1))
    except (OSError, ValueError, KeyError, TypeError, IndexError, ConfigError):
        return None
    known = {d.id for d in plan.devices}
    if not {device, *(link or ())} <= known or factor <= 1.0:
        return None
    return Straggler(rank, stage, device, factor, step, link, since)


def slowed_step_s(records: dict[int, StepsDone], straggler: Straggler) -> float:
    """The job's measured step since the slowdown (real s): the slowest rank's median from its first slow step."""
    if straggler.since < 0:
        return max((r.recent_real_s() for r in records.values()), default=0.0)
    return max((r.since_real_s(straggler.since) for r in records.values()), default=0.0)


def slow_steps_recorded(records: dict[int, StepsDone], straggler: Straggler) -> bool:
    """Whether some rank's record holds a step since the report's first slow step (`slowed_step_s` prices
    the slowdown, not the steps before it); a report without ``since_step`` is priced from the recent steps.

    Example:
        >>> rec = StepsDone(0, 0, 3, 1, (1.0, 1.0, 4.0), 1.0, 0.0)
        >>> s = Straggler(rank=0, stage=0, device="a:0", factor=4.0, step=2, since=2)
        >>> slow_steps_recorded({0: rec}, s), slow_steps_recorded({}, s)
        (True, False)
    """
    if straggler.since < 0:
        return True
    return any(0 < r.steps_done - straggler.since <= len(r.step_s) for r in records.values())


def slowed_emulated_s(records: dict[int, StepsDone], straggler: Straggler) -> float:
    """`slowed_step_s` in emulated seconds (the measured step before a switch, for the report)."""
    if straggler.since < 0:
        return recent_iteration_s(records)
    return max((r.since_real_s(straggler.since) / r.time_scale for r in records.values()), default=0.0)


def decide(job: Any, straggler: Straggler, records: dict[int, StepsDone], *, steps: int,
           every: int | None, start: int, checkpoint_dir: Path | None = None) -> Decision | None:
    """Re-plan for ``straggler`` and weigh the gain against the switch in place (same world, priced) or
    the restart (None: neither -- no checkpoint to stop at).  ``job``: the supervisor's attempt (its
    ``plan``, ``run_dir``, ``started`` and ``first_step_at``)."""
    done = steps_finished(records, len(job.plan.stages), start)
    rp = straggler.replan(job.plan)
    slow_s = slowed_step_s(records, straggler)
    new_real_s = slow_s * rp.new_iteration_s / rp.old_iteration_s  # the measured step, scaled by the plans' ratio
    switch_s = switch_cost_s(job.run_dir, checkpoint_dir) if checkpoint_dir is not None else None
    if switch_s is not None and switch_refusal(job.plan, rp.plan) is None:  # the world is unchanged
        stop = max(done, straggler.step + 1)  # the boundary after the report's step, where the job holds
        return Decision(straggler, rp, stop, gain_s=max(0, steps - stop) * (slow_s - new_real_s),
                        cost_s=rp.replan_s + switch_s, in_place=True)
    if not every:
        log.warning("straggler: %s %.3gx slower; --adapt stops only at checkpoints and this run has no "
                    "--checkpoint-every: staying on this plan", straggler.what, straggler.factor)
        return None
    stop = (done // every + 1) * every
    startup_s = (job.first_step_at - job.started) if not math.isnan(job.first_step_at) else math.inf
    return Decision(straggler, rp, stop, gain_s=max(0, steps - stop) * (slow_s - new_real_s),
                    cost_s=rp.replan_s + startup_s)
