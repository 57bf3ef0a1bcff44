"""Supervised runs: relaunch on a new plan when a rank dies (``--max-restarts``) or a card turns slow (``--adapt``).

`supervise` runs one launch (an *attempt*, `AttemptFn`: `hetpipe.runtime.run.run` without
supervision) at a time in ``RUN_DIR/attempt-<n>/`` and watches its run directory:

* **A rank dies** (the launch fails and torchrun's summary shows a rank that exited -- killed by
  a signal other than torchrun's own SIGTERM teardown, or with a non-zero code -- without writing
  an ``error-rank<r>.json``: it could not say why, so its device is taken to be gone).  With
  restarts left (``--max-restarts N``), its device is removed and the job re-planned on the
  survivors from the plan's own tables (`hetpipe.plan.replan`, seconds), then resumed from the
  newest complete checkpoint of ``--checkpoint-dir``.  With ``--wait-for-return SECONDS`` the
  supervisor first waits that long for the device to be back (`hetpipe.runtime.faults.returns`)
  and, if it is, resumes on the same plan (restart kind ``returned``); else it re-plans.  The steps every rank had finished
  since that checkpoint are redone (``steps_redone``), nothing else.  Any other failure (a rank
  that reported an error, a timeout without a dead rank) is raised as it is: re-planning
  would not fix it.  Without restarts left, one `RuntimeFailure` names the dead rank, its
  device, the step and how to continue.  A replica or grouped plan (``SuperviseOptions.same_plan``:
  `hetpipe.plan.replan` solves one pipeline of single cards) is relaunched on the same plan from the newest
  checkpoint (restart kind ``relaunched``: the rank is taken for a crashed process on a working
  card); if ``--wait-for-return`` runs out, one `RuntimeFailure` says to re-plan it by hand.
* **A straggler report** (``straggler-rank<r>.json``: stage, device, factor; written by the
  ranks' straggler detection) with ``--adapt``: the job is re-planned with that device's unit
  times x factor (`hetpipe.plan.replan.scale_device`), or for a slow link (``what: link``, the
  record's ``link`` and its ``send->S`` factor) with that link's bandwidth / factor and latency
  x factor (`hetpipe.plan.replan.scale_link`).  The gain over the remaining steps --
  the measured step since the slowdown x (1 - new T / old T with the slowdown) -- is weighed
  against the cost of acting (`hetpipe.runtime.adapt_decision`: a restart is the re-plan plus
  this attempt's own start-up, from launch to its first finished step).  If it wins, the supervisor waits for
  the next complete checkpoint, stops the job (``stop-request``, `hetpipe.runtime.launch`) and
  relaunches on the new plan from that checkpoint: no step is redone unless the stop lands
  after the next step finished.  On the same world (the card is slow, not dead) the job instead
  **switches in place** at the step boundary after the report (the job holds there for the
  verdict; `hetpipe.runtime.switch`), priced at the switch's cost (`hetpipe.runtime.switch_price`);
  it is listed as a restart of kind ``in-place``.  Every report read gets a verdict at once -- the
  new plan, or ``stay`` -- so a holding job waits for the supervisor only as long as it weighs.

How far each rank got comes from ``steps-rank<r>.json`` (`hetpipe.runtime.steps_done`).  Every
restart is logged in one line and listed in the final report (`Restart`); the final report is
the last attempt's (its step records are that attempt's steps), with the restarts attached.

Example:
    >>> describe_exit(-9), describe_exit(3)
    ('was killed by signal 9 (SIGKILL)', 'exited with code 3')
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hetpipe.errors import ConfigError, RuntimeFailure
from hetpipe.plan.group_run import rank_slots
from hetpipe.plan.replan import Replan, replan
from hetpipe.plan.schema import Plan
from hetpipe.runtime.adapt_decision import (
    Decision, Straggler, decide, read_straggler, recent_iteration_s, slow_steps_recorded, slowed_emulated_s,
    stage_text, steps_finished,
)
from hetpipe.runtime.checkpoint.files import find_checkpoint, is_complete, parse_step
from hetpipe.runtime.faults.returns import wait_for_return
from hetpipe.runtime.launch import STOP_REQUEST, describe_exit, exit_codes, read_errors
from hetpipe.runtime.report import RunReport
from hetpipe.runtime.restarts import Restart
from hetpipe.runtime.steps_done import StepsDone, read_steps
from hetpipe.runtime.switch import read_switches, request_pending, request_switch
from hetpipe.runtime.switch_price import in_place_restart

log = logging.getLogger(__name__)

#: (plan, run directory, checkpoint folder to resume from or None) -> the report of one launch.
AttemptFn = Callable[[Plan, Path, "str | None"], RunReport]
POLL_S = 0.2  # how often the run directory is read: far below a step's time and a restart's cost
TEARDOWN_CODE = -int(signal.SIGTERM)  # torchrun ends the survivors with SIGTERM once a rank failed
# A re-plan for a slowdown prices the straggler at its measured speed, so a new report means it
# got slower again; this bounds the relaunches of a run whose card keeps degrading.
MAX_ADAPT_RESTARTS = 8


@dataclass(frozen=True)
class SuperviseOptions:
    """``max_restarts``: relaunches after dead ranks; ``adapt``: re-plan on straggler reports;
    ``steps``: the total to reach; ``resume``: the first attempt's ``--resume`` (or None)."""

    checkpoint_dir: Path
    steps: int
    max_restarts: int = 0
    adapt: bool = False
    resume: str | None = None
    checkpoint_every: int | None = None  # adapt stops the job only at checkpoints
    wait_for_return_s: float | None = None  # after a lost rank: wait this long for its device, then re-plan
    same_plan: bool = False  # after a lost rank: relaunch this plan (replica plans: `hetpipe.plan.replan` solves one pipeline)
    switch_in_place: bool = False  # adapt: the attempts take switch requests (`hetpipe.runtime.switch`)
    poll_s: float = POLL_S


@dataclass(frozen=True)
class Death:
    """A failed launch whose ranks died without reporting (their devices are taken to be gone)."""

    ranks: tuple[int, ...]
    devices: tuple[str, ...]
    cause: str
    failed_step: int
    link: tuple[str, str] | None = None  # an emulated link cut (--inject): its devices; `devices` is its far end

    @property
    def keys(self) -> tuple[str, ...]:
        """What to wait for with --wait-for-return: the lost devices, or the cut link ``a -> b``."""
        return (f"{self.link[0]} -> {self.link[1]}",) if self.link else self.devices


def diagnose(run_dir: Path, plan: Plan, *, start: int) -> Death | None:
    """The dead ranks of a failed launch in ``run_dir``, or None when no rank died silently."""
    log_path = run_dir / "torchrun.log"
    codes = exit_codes(log_path.read_text(errors="replace")) if log_path.exists() else {}
    reported = {e.rank for e in read_errors(run_dir)}
    dead = sorted(r for r, c in codes.items() if c not in (0, TEARDOWN_CODE) and r not in reported)
    if not dead:
        return None
    records, slots = read_steps(run_dir), rank_slots(plan)  # a group's members: one rank each, stage after stage
    stages = [records[r].stage if r in records else slots[r].stage for r in dead]  # records: after in-place switches
    devices = tuple(slots[r].device if plan.stages[s].group_devices else plan.stages[s].device
                    for r, s in zip(dead, stages))
    cause = "; ".join(f"rank {r} (stage {s}, device {d}) {describe_exit(codes[r])}"
                      for r, s, d in zip(dead, stages, devices))
    return Death(tuple(dead), devices, cause, steps_finished(records, len(slots), start))


_CUT_BY_DEVICES = re.compile(r"the emulated link (\S+) -> (\S+) is cut")
_CUT_BY_RANKS = re.compile(r"the emulated link from rank (\d+) to rank (\d+) was cut")


def diagnose_cut(run_dir: Path, plan: Plan, *, start: int) -> Death | None:
    """The emulated link whose cut (``--inject link:...,factor=cut``) failed the launch, named by the ranks'
    errors, or None.  A cut is survived like the loss of its far end: the pipeline has no other way there."""
    for err in read_errors(run_dir):
        by_devices, by_ranks = _CUT_BY_DEVICES.search(err.message), _CUT_BY_RANKS.search(err.message)
        if by_devices:
            link = (by_devices.group(1), by_devices.group(2))
        elif by_ranks and max(int(g) for g in by_ranks.groups()) < len(plan.stages):
            link = tuple(plan.stages[int(g)].device for g in by_ranks.groups())
        else:
            continue
        stage = next(i for i, s in enumerate(plan.stages) if s.device == link[0])
        done = steps_finished(read_steps(run_dir), len(plan.stages), start)
        return Death((stage,), (link[1],), f"the emulated link {link[0]} -> {link[1]} was cut", done, link)
    return None


def newest_checkpoint(root: Path) -> int:
    """Step of the newest complete checkpoint in ``root`` (0 when there is none)."""
    steps = [parse_step(d.name) for d in root.iterdir() if d.is_dir() and is_complete(d)] if root.is_dir() else []
    return max((s for s in steps if s is not None), default=0)


class _Attempt:
    """One launch running in a thread, so that the supervisor can watch its run directory."""

    def __init__(self, fn: AttemptFn, plan: Plan, run_dir: Path, resume: str | None) -> None:
        self.plan, self.run_dir, self.started = plan, run_dir, time.time()
        self.report: RunReport | None = None
        self.error: BaseException | None = None
        self.ended = math.nan
        self.first_step_at = math.nan
        self.notes: list[str] = []  # re-plans weighed while it ran (`Decision.line`)
        self.switched: list[tuple[Decision, float]] = []  # in-place switches made: (decision, measured step before)
        self.awaiting: tuple[Decision, float] | None = None  # a switch requested, not made yet
        self._thread = threading.Thread(target=self._run, args=(fn, resume), daemon=True, name=run_dir.name)
        self._thread.start()

    def _run(self, fn: AttemptFn, resume: str | None) -> None:
        try:
            self.report = fn(self.plan, self.run_dir, resume)
        except BaseException as err:  # noqa: BLE001 - handed to the supervisor's thread
            self.error = err
        self.ended = time.time()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()


@dataclass(frozen=True)
class _Pending:
    """A restart whose new job has not started yet (its ``restart_s`` and new measured time come later)."""

    kind: str
    cause: str
    rank: int
    device: str
    factor: float
    failed_step: int
    resumed_step: int
    replan: Replan
    old_stages: str
    old_measured_s: float
    ended: float
    waited_s: float = 0.0

    def finish(self, job: _Attempt) -> Restart:
        began = job.first_step_at if not math.isnan(job.first_step_at) else job.ended
        new_s = (job.report.measured_emulated_iteration_s if job.report is not None
                 else recent_iteration_s(read_steps(job.run_dir)))
        return Restart(kind=self.kind, cause=self.cause, rank=self.rank, device=self.device,
                       failed_step=self.failed_step, resumed_step=self.resumed_step,
                       steps_redone=self.failed_step - self.resumed_step, replan_s=self.replan.replan_s,
                       restart_s=began - self.ended, old_predicted_s=self.replan.old_iteration_s,
                       new_predicted_s=self.replan.new_iteration_s, old_stages=self.old_stages,
                       new_stages=stage_text(self.replan.plan), old_measured_s=self.old_measured_s,
                       new_measured_s=new_s, factor=self.factor, waited_s=self.waited_s)


def _resume_step(resume: str | None) -> int:
    return find_checkpoint(resume)[1].step if resume is not None else 0


def _new_reports(job: _Attempt, seen: set[tuple[Path, float]],
                 records: dict[int, StepsDone] | None = None) -> list[Straggler]:
    """The straggler reports of ``job`` not read before (each once; a later record of a rank replaces its file).
    With ``records``: a report whose first slow step no rank's record holds yet is left for a later poll (the
    rank may write its report before its step record: weighed now, the gain would be priced at the old speed)."""
    out = []
    for path in sorted(job.run_dir.glob("straggler-rank*.json")):
        try:
            key = (path, path.stat().st_mtime)
        except OSError:
            continue
        straggler = read_straggler(path, job.plan) if key not in seen else None
        if straggler is not None and records is not None and not slow_steps_recorded(records, straggler):
            continue
        if straggler is not None:
            seen.add(key)
            out.append(straggler)
    return out


def _stay(job: _Attempt, opts: SuperviseOptions, reason: str) -> None:
    """Answer ``stay`` to a job that may hold at a boundary for a verdict (`hetpipe.runtime.switch`), unless a
    request is already waiting there."""
    if opts.switch_in_place and not request_pending(job.run_dir):
        request_switch(job.run_dir, None, reason)


def _consider(job: _Attempt, records: dict[int, StepsDone], seen: set[tuple[Path, float]], opts: SuperviseOptions, *,
              every: int | None, start: int) -> Decision | None:
    """The first new straggler report whose re-plan pays (each report is weighed once); the job gets its
    verdict at once: the new plan (in place), else ``stay`` (staying, or relaunching at a checkpoint)."""
    reports = _new_reports(job, seen, records)
    for straggler in reports:
        decision = decide(job, straggler, records, steps=opts.steps, every=every, start=start,
                          checkpoint_dir=opts.checkpoint_dir if opts.switch_in_place else None)
        if decision is not None:
            log.warning("%s", decision.line())
            job.notes.append(decision.line())
            if decision.go and decision.in_place:  # the job holds (or goes on); rank 0 takes it at a boundary
                request_switch(job.run_dir, decision.replan.plan, decision.line())
                job.awaiting = (decision, slowed_emulated_s(records, straggler))
                return None
            if decision.go:
                _stay(job, opts, "relaunching at a checkpoint")
                return decision
    if reports:
        _stay(job, opts, "staying on this plan")
    return None


def _watch(job: _Attempt, opts: SuperviseOptions, *, every: int | None, start: int, adapt: bool) -> Decision | None:
    """Poll ``job`` until it ends; with ``adapt``, stop it at a checkpoint when a re-plan pays.
    Returns the decision that stopped it (None: it finished or failed by itself)."""
    seen: set[tuple[Path, float]] = set()
    decision, stop = None, job.run_dir / STOP_REQUEST
    try:
        while job.alive():
            time.sleep(opts.poll_s)
            records = read_steps(job.run_dir)
            if math.isnan(job.first_step_at) and any(r.steps_done > start for r in records.values()):
                job.first_step_at = time.time()
            if adapt and _switching(job):
                continue
            if adapt and decision is None:
                decision = _consider(job, records, seen, opts, every=every, start=start)
                continue
            if _new_reports(job, seen):  # not weighed (no --adapt left, or a relaunch decided): do not hold
                _stay(job, opts, "not weighed")
            if decision is not None and not stop.exists() and newest_checkpoint(opts.checkpoint_dir) >= decision.stop_step:
                stop.write_text(decision.line() + "\n")
    except BaseException:  # Ctrl-C: the launcher's watchdog ends the job on the stop request
        stop.write_text("interrupted\n")
        job.join()
        raise
    job.join()
    return decision if decision is not None and stop.exists() else None


def _switching(job: _Attempt) -> bool:
    """Note a requested switch once made (the job then runs its plan); True until it is (nothing else is weighed)."""
    if job.awaiting is not None and len(read_switches(job.run_dir)) > len(job.switched):
        job.switched.append(job.awaiting)
        job.plan, job.awaiting = job.awaiting[0].replan.plan, None
    return job.awaiting is not None


def _switch_restarts(job: _Attempt, start: int) -> list[Restart]:
    """The `Restart` records (kind ``in-place``) of the switches ``job`` made, measured before and after."""
    out = []
    records = job.report.step_records if job.report is not None else ()
    for (decision, before_s), record in zip(job.switched, read_switches(job.run_dir)):
        s = decision.straggler
        after = sorted(r.emulated_step_s for r in records if r.step + start >= record.after_steps)
        # The slow steps before the switch, from the run's own report: at decision time a rank's step
        # records can lag its straggler report, and `before_s` then fell back to the steps before the slowdown.
        slow = sorted(r.emulated_step_s for r in records
                      if 0 <= s.since <= r.step + start < record.after_steps)
        before_s = slow[len(slow) // 2] if slow else before_s
        out.append(in_place_restart(record, cause=f"straggler report of rank {s.rank}", rank=s.rank,
                                    device=f"{s.link[0]} -> {s.link[1]}" if s.link else s.device, factor=s.factor,
                                    replan_s=decision.replan.replan_s, old_predicted_s=decision.replan.old_iteration_s,
                                    old_measured_s=before_s, new_measured_s=after[len(after) // 2] if after else 0.0))
    return out


def _lost(job: _Attempt, opts: SuperviseOptions, *, start: int,
          restarts_used: int) -> tuple[Death, Replan, float, str]:
    """The failed job's dead ranks and what to resume on: (death, re-plan, seconds waited, the restart's
    kind: ``returned`` or ``relaunched`` -- then the re-plan is the same plan -- or ``lost``).  Raises
    when it cannot restart."""
    death = diagnose(job.run_dir, job.plan, start=start) or diagnose_cut(job.run_dir, job.plan, start=start)
    if death is None:
        raise job.error if job.error is not None else RuntimeFailure("the job ended without a report")
    if restarts_used >= opts.max_restarts:
        cont = f"--resume {opts.checkpoint_dir}" if newest_checkpoint(opts.checkpoint_dir) else "no checkpoint yet"
        used = "allows no restart" if opts.max_restarts == 0 else "is used up"
        raise RuntimeFailure(f"{death.cause} at step {death.failed_step} (every rank had finished "
                             f"{death.failed_step} steps); --max-restarts {opts.max_restarts} {used}: rerun with "
                             f"--max-restarts {opts.max_restarts + 1} to re-plan on the surviving devices, or "
                             f"continue by hand ({cont})")
    waited = 0.0
    if opts.wait_for_return_s:
        back = wait_for_return(death.keys, attempt_dir=job.run_dir, run_dir=job.run_dir.parent,
                               timeout_s=opts.wait_for_return_s)
        if back is not None:
            t = job.plan.predicted.iteration_s
            return death, Replan(job.plan, t, t, 0.0), back, "returned"
        waited = opts.wait_for_return_s
    if opts.same_plan:
        return death, _same_plan(job, death, opts, waited), waited, "relaunched"
    return death, replan(job.plan, lost=death.devices), waited, "lost"


def _same_plan(job: _Attempt, death: Death, opts: SuperviseOptions, waited_s: float) -> Replan:
    """``opts.same_plan`` (replica plans): the dead rank is taken for a crashed process on a working card and
    the same plan is relaunched; after ``--wait-for-return`` ran out, the card is gone: one error naming the fix."""
    if waited_s:
        cont = f"--resume {opts.checkpoint_dir}" if newest_checkpoint(opts.checkpoint_dir) else "from the start"
        raise RuntimeFailure(f"{death.cause} at step {death.failed_step}; {', '.join(death.keys)} not back within "
                             f"{waited_s:.3g} s, and replica plans are not re-planned around a lost card: re-plan "
                             f"with `hetpipe plan --replicas` on the remaining cards and continue ({cont})")
    t = job.plan.predicted.iteration_s
    return Replan(job.plan, t, t, 0.0)


def _next_pending(job: _Attempt, decision: Decision | None, opts: SuperviseOptions, *, start: int,
                  restarts_used: int) -> _Pending:
    """What the relaunch after ``job`` resumes from and runs (a dead rank's, or an adapt decision's)."""
    records = read_steps(job.run_dir)
    measured = recent_iteration_s(records)
    waited = 0.0
    if decision is None:
        death, rp, waited, kind = _lost(job, opts, start=start, restarts_used=restarts_used)
        cause, rank, device, factor, failed = death.cause, death.ranks[0], death.keys[0], 0.0, death.failed_step
    else:
        s, rp = decision.straggler, decision.replan
        kind, cause, rank, factor = "adapt", f"straggler report of rank {s.rank}", s.rank, s.factor
        device = f"{s.link[0]} -> {s.link[1]}" if s.link else s.device
        failed = steps_finished(records, len(job.plan.stages), start)
    resumed = newest_checkpoint(opts.checkpoint_dir) or _resume_step(opts.resume)
    failed = max(failed, resumed)  # a complete checkpoint proves every rank finished its step (records may lag)
    if resumed >= opts.steps:
        raise RuntimeFailure(f"{cause}: the job had saved its last checkpoint (step {resumed}) and then failed; "
                             f"the trained state is in {opts.checkpoint_dir}")
    return _Pending(kind, cause, rank, device, factor, failed, resumed, rp, stage_text(job.plan), measured,
                    job.ended, waited)


def supervise(plan: Plan, attempt: AttemptFn, opts: SuperviseOptions, *, run_dir: Path | None = None) -> RunReport:
    """Run ``plan`` to ``opts.steps`` through ``attempt``, relaunching as the module docstring says."""
    if opts.max_restarts < 0 or isinstance(opts.max_restarts, bool):
        raise ConfigError(f"--max-restarts must be 0 or more, got {opts.max_restarts!r}")
    base = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="hetpipe-supervised-"))
    restarts: list[Restart] = []
    notes: list[str] = []
    pending: _Pending | None = None
    resume, start, lost_used, adapt_used = opts.resume, _resume_step(opts.resume), 0, 0
    try:
        for n in range(opts.max_restarts + MAX_ADAPT_RESTARTS + 1):
            job = _Attempt(attempt, plan, base / f"attempt-{n}", resume)
            decision = _watch(job, opts, every=opts.checkpoint_every, start=start,
                              adapt=opts.adapt and adapt_used < MAX_ADAPT_RESTARTS)
            notes.extend(job.notes)
            for r in _switch_restarts(job, start):
                restarts, notes = [*restarts, r], [*notes, r.line(len(restarts) + 1)]
            if pending is not None:
                restarts.append(pending.finish(job))
                log.warning("%s", restarts[-1].line(len(restarts)))
                notes.append(restarts[-1].line(len(restarts)))
            if job.report is not None:
                return dataclasses.replace(job.report, restarts=tuple(restarts), notes=(*job.report.notes, *notes))
            pending = _next_pending(job, decision, opts, start=start, restarts_used=lost_used)
            lost_used, adapt_used = lost_used + (decision is None), adapt_used + (decision is not None)
            plan, start = pending.replan.plan, pending.resumed_step
            resume = str(find_checkpoint(opts.checkpoint_dir)[0]) if newest_checkpoint(opts.checkpoint_dir) \
                else opts.resume
        raise RuntimeFailure(f"the job was relaunched {len(restarts)} times without finishing; see {base}")
    finally:
        if run_dir is None:
            shutil.rmtree(base, ignore_errors=True)

