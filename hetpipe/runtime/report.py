"""The run report (``run.json``, ``format: "hetpipe.run"``): what a run measured next to what the plan predicted.

Each rank writes a `RankResult` into the run directory; the launcher merges them with
the plan into one `RunReport`:

* per step: the loss (mean over micro-batches, from the last stage) and the step time
  (the slowest rank, from the step's start barrier to its optimizer step);
* per stage: the measured forward/backward time per micro-batch -- the real compute
  and, when emulated, the stretched duration in emulated seconds -- and the peak
  accounted bytes, beside the plan's ``fwd_s`` / ``bwd_s`` / ``memory_bytes``;
* the predicted iteration (the plan's T, its real-time equivalent ``T x time_scale``
  and the discrete-event simulation of the schedule with the plan's stage costs),
  the time scale and how many emulated actions overran their targets.

Measured figures are medians over steps 1..N-1 (step 0 includes one-off warm-up such
as lazy optimizer-state allocation); with a single step, step 0 is used.

Example:
    >>> r = RankResult(rank=0, stage=0, device="n0:0", kind="rtx3090", step_s=(0.2, 0.1, 0.3))
    >>> measured_steps(r.step_s)
    (0.1, 0.3)
    >>> measured_steps((5.0, 5.0, 1.0, 2.0), per_step=2)  # two micro-batches per step
    (1.0, 2.0)
    >>> median((0.1, 0.3))
    0.2
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

from hetpipe.errors import ConfigError, HetpipeError
from hetpipe.plan.group_run import member_timings
from hetpipe.plan.run_sim import simulated_iteration_s
from hetpipe.plan.serde import from_json, to_json
from hetpipe.runtime.chunk_report import card_totals, chunk_rows
from hetpipe.runtime.faults.straggler import StepRatios, StragglerRecord
from hetpipe.runtime.measured_links import cut_transfers_s, run_message_steps, steps_cut_transfers_s
from hetpipe.runtime.restarts import Restart

RUN_FORMAT = "hetpipe.run"
RUN_VERSION = 1


def median(values: Sequence[float]) -> float:
    """Median (mean of the middle two for an even count); NaN when empty."""
    xs = sorted(values)
    if not xs:
        return math.nan
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def measured_steps(values: Sequence[float], per_step: int = 1) -> tuple[float, ...]:
    """What counts for medians: all but step 0's ``per_step`` values (warm-up), unless there is only one step."""
    return tuple(values[per_step:]) if len(values) > per_step else tuple(values)


@dataclass(frozen=True)
class ActionRecord:
    """One action of a rank's last measured step: real seconds since the step began.

    Every rank starts a step right after a barrier, so the ranks' clocks start within a
    barrier's latency of each other (same host: one clock; across hosts only as well
    synchronised as the hosts' clocks).
    """

    action: str  # e.g. "1F3"
    start_s: float
    duration_s: float


@dataclass(frozen=True)
class RankTimeline:
    """The last step's actions of one rank, for a measured Gantt chart."""

    rank: int
    stage: int
    actions: tuple[ActionRecord, ...]
    origin_s: float = 0.0  # the step's start on CLOCK_MONOTONIC (one host: the ranks' timelines line up)


@dataclass(frozen=True)
class RankResult:
    """What one rank measured (written by the worker as ``result-rank<r>.json``).

    Times are real seconds.  ``fwd_compute_s`` / ``bwd_compute_s`` are the real compute
    of every F / B before any emulation stretch; ``fwd_s`` / ``bwd_s`` the whole action
    (compute plus stretch sleep).  ``losses`` is filled on the last stage only.
    """

    rank: int
    stage: int
    device: str
    kind: str
    step_s: tuple[float, ...] = ()
    losses: tuple[float, ...] = ()
    fwd_s: tuple[float, ...] = ()
    bwd_s: tuple[float, ...] = ()
    fwd_compute_s: tuple[float, ...] = ()
    bwd_compute_s: tuple[float, ...] = ()
    # every F / B in the rank's thread CPU seconds (session 16, `RecordingHooks`): beside the wall seconds
    # they tell the time other processes held the core (on a CPU device; a GPU's F is launches)
    fwd_cpu_s: tuple[float, ...] = ()
    bwd_cpu_s: tuple[float, ...] = ()
    calibration_fwd_s: float | None = None  # None without emulation
    calibration_bwd_s: float | None = None
    time_scale: float = 1.0
    time_scale_limiting: str = ""
    safety_factor: float = 1.0
    contention_factor: float = 1.0
    peak_bytes: int = 0
    peak_breakdown: Mapping[str, int] = field(default_factory=dict)
    peak_action: str = ""
    overruns_fwd: int = 0
    overruns_bwd: int = 0
    worst_overrun_ratio: float = 0.0
    messages: int = 0
    late_messages: int = 0  # arrived (really) after their emulated arrival time
    worst_late_s: float = 0.0
    late_total_s: float = 0.0  # every real wait past an emulated arrival, summed over the run's steps
    backend: str = "gloo"
    optimizer_s: tuple[float, ...] = ()  # per step: the STEP action, real seconds (issue 17)
    last_step_actions: tuple[ActionRecord, ...] = ()
    stragglers: tuple[StragglerRecord, ...] = ()  # named by this rank (`hetpipe.runtime.faults.watch`)
    step_ratios: tuple[StepRatios, ...] = ()  # per step after the first: measured / predicted per measure
    step_origin_s: float = 0.0  # the last step's start on CLOCK_MONOTONIC (`last_step_actions` count from it)
    cores: tuple[int, ...] = ()  # the CPU cores the rank ran on (pinned to a core-group device, or all)
    update_s: tuple[float, ...] = ()  # per step: optimizer.step() alone, real seconds (runtime/update_timer.py)
    member: int = 0  # its member of the stage's tensor-parallel group (0: the lead, or a width-1 stage)
    # The SENDs and RECVs of its last steps (`hetpipe.runtime.measured_links.MessageLog`), one timeline per step,
    # origin_s its first message's start; the first kept step is step `message_steps_from` of the run.
    message_steps: tuple[RankTimeline, ...] = ()
    message_steps_from: int = 0

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(to_json(self)))
        os.replace(tmp, path)  # readers never see a half-written file

    @classmethod
    def load(cls, path: Path) -> "RankResult":
        return from_json(cls, json.loads(path.read_text()), path=str(path))


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    step_s: float  # real seconds, slowest rank
    emulated_step_s: float  # step_s / time_scale (equal to step_s without emulation)


@dataclass(frozen=True)
class StageRecord:
    """One stage: measured (medians per micro-batch) beside predicted."""

    stage: int
    rank: int
    device: str
    kind: str
    first_unit: int
    last_unit: int
    fwd_compute_s: float  # real compute per micro-batch
    bwd_compute_s: float
    fwd_emulated_s: float  # whole action / time_scale (emulated seconds); = real without emulation
    bwd_emulated_s: float
    predicted_fwd_s: float
    predicted_bwd_s: float
    calibration_fwd_s: float | None  # uncontended real F / B used to choose the time scale (None: not emulated)
    calibration_bwd_s: float | None
    peak_bytes: int
    peak_breakdown: Mapping[str, int]
    peak_action: str
    predicted_memory_bytes: int
    usable_bytes: int
    overruns_fwd: int
    overruns_bwd: int
    worst_overrun_ratio: float
    messages: int
    late_messages: int
    worst_late_s: float = 0.0  # real seconds a receiver waited past an emulated arrival
    # plan units whose forward this stage recomputed in its backward (torch.utils.checkpoint; issue 14)
    recompute_units: tuple[int, ...] = ()
    # per step after the first: measured / predicted forward, backward and sends (``send->S``), in plan
    # seconds (emulated runs and CUDA runs; `hetpipe.runtime.faults.straggler`); `hetpipe calibrate` reads them
    step_ratios: tuple[StepRatios, ...] = ()
    # the optimizer step (issue 17): measured median real seconds, in emulated seconds, and the plan's S_s
    # (the emulation does not stretch the step: its emulated figure is real compute / time_scale)
    step_real_s: float = 0.0
    step_emulated_s: float = 0.0
    predicted_step_s: float = 0.0
    # transfers on the cut to the next stage (issue 17): the measured median one-way message (in the run's
    # seconds: emulated seconds under --emulate) where the receiver was already waiting
    # (`hetpipe.runtime.measured_links`; None: none seen or several hosts), how many messages that median is
    # of, and the plan's C_s; the cores the rank ran on.  Since session 15 over every step after the first,
    # forward messages only (what C_s prices: boundary_bytes); before, the last step's, both directions.
    transfer_s: float | None = None
    transfer_messages: int = 0
    predicted_transfer_s: float = 0.0
    cores: tuple[int, ...] = ()
    # optimizer.step() alone (no send waits, no tied all-reduce), median real seconds: what S_s prices
    update_real_s: float = 0.0
    member: int = 0  # a row of `RunReport.members`: which member of the stage's group (0: its lead)
    # the gradient messages back over the same cut (session 15): measured as transfer_s, and priced on the
    # same link at the cut's boundary_grad_bytes (the schedule prices them as C_s)
    transfer_grad_s: float | None = None
    transfer_grad_messages: int = 0
    predicted_transfer_grad_s: float = 0.0
    # F and B per micro-batch in the rank's thread CPU seconds (session 16; medians as fwd_compute_s): wall
    # over CPU is the share other processes took of the stage's core (None: a report from before, or no F/B)
    fwd_cpu_s: float | None = None
    bwd_cpu_s: float | None = None


@dataclass(frozen=True)
class RunReport:
    """A whole run; `save` / `load` round-trip exactly.

    ``predicted_iteration_s`` is the plan's T in emulated (device) seconds,
    ``predicted_real_iteration_s`` = T x ``time_scale``, ``simulated_iteration_s`` the
    simulator's iteration for the same schedule and stage costs (it models 1F1B's
    overlap exactly where T over- or under-estimates; see `hetpipe.schedule.simulate`).
    ``measured_emulated_iteration_s`` is the median step time divided by the time scale.
    """

    model: str
    fingerprint: str
    schedule: str
    steps: int
    microbatches: int
    emulate: bool
    backend: str
    world_size: int
    time_scale: float
    time_scale_limiting: str
    safety_factor: float
    contention_factor: float
    predicted_iteration_s: float
    predicted_real_iteration_s: float
    simulated_iteration_s: float
    measured_iteration_s: float
    measured_emulated_iteration_s: float
    step_records: tuple[StepRecord, ...]
    stages: tuple[StageRecord, ...]
    overruns: int
    late_messages: int
    notes: tuple[str, ...] = ()
    machine: Mapping[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    timelines: tuple[RankTimeline, ...] = ()  # the last step, per rank, real seconds
    stragglers: tuple[StragglerRecord, ...] = ()  # stages named slower than planned (issue 16)
    # real seconds per step that receivers waited past emulated arrivals, all ranks summed (emulated runs):
    # each wait under the late threshold is a wake-up, not a late message, but together they stretch a step
    late_wait_per_step_s: float = 0.0
    injected: tuple[str, ...] = ()  # the --inject faults of the run, as specs
    restarts: tuple[Restart, ...] = ()  # a supervised run's relaunches (`hetpipe.runtime.supervise`)
    # every member of every tensor-parallel group (issue 15): its card, measured F / B and peak beside its own
    # predicted F / B (its share + the group's all-reduces + the lead's broadcast) and M_s
    members: tuple[StageRecord, ...] = ()
    # an interleaved run (issue 17 item 2): one row per virtual stage (``stage`` = c p + r), its chunk's units and
    # F / B beside the plan's; the stage rows then hold each card's sum over its chunks (`hetpipe.runtime.chunk_report`)
    chunks: tuple[StageRecord, ...] = ()
    format: str = RUN_FORMAT
    version: int = RUN_VERSION

    @property
    def losses(self) -> tuple[float, ...]:
        return tuple(r.loss for r in self.step_records)

    @property
    def prediction_error(self) -> float:
        """measured / predicted - 1, both in emulated seconds (0.05 = 5% slower than predicted)."""
        return self.measured_emulated_iteration_s / self.predicted_iteration_s - 1.0

    def to_dict(self) -> dict:
        doc = to_json(self)
        return {"format": doc.pop("format"), "version": doc.pop("version"), **doc}

    def save(self, path: str | Path) -> None:
        from hetpipe.cost_models.outputs import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "RunReport":
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read run report {path}: {err}; re-run `hetpipe run --report`") from None
        if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
            raise ConfigError(f"{path}: not a hetpipe run report (format {doc.get('format') if isinstance(doc, dict) else None!r})")
        if doc.get("version", 0) > RUN_VERSION:
            raise ConfigError(f"{path}: run report version {doc.get('version')} is newer than this hetpipe reads "
                              f"({RUN_VERSION}); upgrade hetpipe")
        try:
            return from_json(cls, doc, path="run")
        except HetpipeError as err:
            raise ConfigError(f"{path}: {err}") from None


def machine_info() -> dict[str, str]:
    """Where the run happened (for benchmark tables)."""
    import torch

    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": str(os.cpu_count()),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _microbatches_of(plan: "Plan", stage: int) -> int:  # noqa: F821
    """Micro-batches per step that ``plan.stages[stage]`` runs: its replica's m_r in a replica plan."""
    for rep in plan.replicas:
        if rep.first_stage <= stage < rep.first_stage + rep.num_stages:
            return rep.microbatches
    return plan.training.microbatches


def _stage_record(plan: "Plan", r: RankResult, transfers: Sequence[float] = (),  # noqa: F821
                  grad_transfers: Sequence[float] = ()) -> StageRecord:
    st, m = plan.stages[r.stage], _microbatches_of(plan, r.stage)
    fwd, bwd = median(measured_steps(r.fwd_s, m)), median(measured_steps(r.bwd_s, m))
    return StageRecord(
        stage=r.stage, rank=r.rank, device=r.device, kind=r.kind, first_unit=st.first_unit, last_unit=st.last_unit,
        fwd_compute_s=median(measured_steps(r.fwd_compute_s, m)),
        bwd_compute_s=median(measured_steps(r.bwd_compute_s, m)),
        fwd_emulated_s=fwd / r.time_scale, bwd_emulated_s=bwd / r.time_scale,
        predicted_fwd_s=st.fwd_s, predicted_bwd_s=st.bwd_s,
        calibration_fwd_s=r.calibration_fwd_s, calibration_bwd_s=r.calibration_bwd_s,
        peak_bytes=r.peak_bytes, peak_breakdown=dict(r.peak_breakdown), peak_action=r.peak_action,
        predicted_memory_bytes=st.memory_bytes, usable_bytes=st.usable_bytes,
        overruns_fwd=r.overruns_fwd, overruns_bwd=r.overruns_bwd, worst_overrun_ratio=r.worst_overrun_ratio,
        messages=r.messages, late_messages=r.late_messages, worst_late_s=r.worst_late_s,
        recompute_units=tuple(st.recompute_units), step_ratios=tuple(r.step_ratios),
        step_real_s=median(measured_steps(r.optimizer_s)) if r.optimizer_s else 0.0,
        step_emulated_s=(median(measured_steps(r.optimizer_s)) if r.optimizer_s else 0.0) / r.time_scale,
        predicted_step_s=st.step_s, transfer_s=median(transfers) if transfers else None,
        transfer_messages=len(transfers), predicted_transfer_s=st.send_s, cores=tuple(r.cores),
        update_real_s=median(measured_steps(r.update_s)) if r.update_s else 0.0,
        transfer_grad_s=median(grad_transfers) if grad_transfers else None,
        transfer_grad_messages=len(grad_transfers), predicted_transfer_grad_s=grad_price_s(plan, r.stage),
        fwd_cpu_s=median(measured_steps(r.fwd_cpu_s, m)) if r.fwd_cpu_s else None,
        bwd_cpu_s=median(measured_steps(r.bwd_cpu_s, m)) if r.bwd_cpu_s else None)


def grad_price_s(plan: "Plan", stage: int) -> float:  # noqa: F821
    """The gradient message back over the cut after `stage`: latency + its bytes / bandwidth (0: no cut, no link)."""
    if stage + 1 >= len(plan.stages):
        return 0.0
    src, dst = plan.stages[stage + 1].device, plan.stages[stage].device
    link = next((k for k in plan.links if (k.src, k.dst) == (src, dst)), None)
    unit = plan.units[plan.stages[stage].last_unit]
    grad_bytes = unit.boundary_grad_bytes if plan.memory_model >= 2 else unit.boundary_bytes
    return 0.0 if link is None else link.latency_s + grad_bytes / link.bandwidth_bytes_s


def _member_records(plan: "Plan", results: Sequence[RankResult]) -> tuple[StageRecord, ...]:  # noqa: F821
    """One row per member of every group stage, beside its own predictions (`plan.group_run.member_timings`)."""
    mine = member_timings(plan)
    usable = {d.id: d.usable_bytes for d in plan.devices}
    return tuple(replace(_stage_record(plan, r), member=r.member, predicted_fwd_s=t.fwd_s, predicted_bwd_s=t.bwd_s,
                         predicted_step_s=t.step_s, predicted_memory_bytes=t.memory_bytes, usable_bytes=usable[r.device])
                 for r in results for t in [mine.get((r.stage, r.member))] if t is not None)


def _ran_pinned(plan: "Plan", results: Sequence[RankResult]) -> bool:  # noqa: F821
    """Every rank ran on exactly its plan device's core group (`hetpipe.runtime.pinning`)."""
    index = plan.device_index()
    groups = [tuple(plan.devices[index[plan.stages[r.stage].device]].cores) for r in results]
    return all(g and tuple(r.cores) == g for g, r in zip(groups, results))


def _notes(emulate: bool, overruns: int, late: int, actions: int, worst: float, *,
           pinned: bool = False, replicas: bool = False) -> tuple[str, ...]:
    notes = []
    if replicas:  # runtime/faults/watch.py judges single pipelines only: no per-step ratios to record
        notes.append("replica plan: stragglers are not judged on replica plans, so no stage has step_ratios")
    if emulate and overruns:
        notes.append(
            f"{overruns} of {actions} emulated compute actions overran their targets (worst {worst:.2f}x): the "
            "emulation is partly measuring CPU contention, not the plan; raise --safety-factor or use fewer ranks")
    if emulate and late:
        notes.append(f"{late} messages arrived later than their emulated link time: the real transport was the "
                     "bottleneck there")
    if not emulate and pinned:
        notes.append("not emulated, every rank pinned to its device's cores: measured and predicted are the same "
                     "devices (CPU core groups)")
    elif not emulate:
        notes.append("not emulated: times are this machine's, predictions are the plan's devices'")
    return tuple(notes)


def _transfers(results: Sequence[RankResult], timelines: Sequence[RankTimeline], *, one_clock: bool,
               scale: float) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """(forward, gradient) transfers per cut, in the run's seconds: every step after the first that all ranks kept
    (`RankResult.message_steps`), else (results from before session 15) the last step's, both directions as forward."""
    if not one_clock:
        return {}, {}
    steps = run_message_steps([(r.message_steps_from, r.message_steps) for r in results],
                              steps=max(len(r.step_s) for r in results))
    if not steps:
        both = cut_transfers_s(timelines)
        return {cut: [t / scale for t in ts] for cut, ts in both.items()}, {}
    return tuple({cut: [t / scale for t in ts] for cut, ts in steps_cut_transfers_s(steps, kind).items()}
                 for kind in ("F", "B"))  # type: ignore[return-value]


def build_report(plan: "Plan", results: Sequence[RankResult], *, schedule: str, emulate: bool,  # noqa: F821
                 wall_s: float = 0.0, sync_overlap: bool = True) -> RunReport:
    """Merge every rank's result with the plan's predictions.

    Example:
        >>> # see tests/test_launch.py::test_build_report_merges_ranks
    """
    everyone = sorted(results, key=lambda r: (r.stage, r.member))
    results = [r for r in everyone if r.member == 0]  # a group's lead stands for its stage
    if [r.stage for r in results] != list(range(len(plan.stages))):
        raise ConfigError(f"run results cover stages {[r.stage for r in results]}, the plan has "
                          f"{len(plan.stages)}; a rank did not finish")
    last, scale = results[-1], results[0].time_scale
    n_steps = len(last.losses)
    step_s = tuple(max(r.step_s[i] for r in results) for i in range(n_steps))
    records = tuple(StepRecord(i, last.losses[i], step_s[i], step_s[i] / scale) for i in range(n_steps))
    overruns = sum(r.overruns_fwd + r.overruns_bwd for r in results)
    late = sum(r.late_messages for r in results)
    actions = sum(len(r.fwd_s) + len(r.bwd_s) for r in results)
    measured = median(measured_steps(step_s))
    nodes = {plan.devices[plan.device_index()[st.device]].node for st in plan.stages}
    one_clock = emulate or len(nodes) == 1  # CLOCK_MONOTONIC is per host (--emulate runs on one host): several
    timelines = tuple(RankTimeline(r.rank, r.stage, r.last_step_actions, r.step_origin_s if one_clock else 0.0)
                      for r in results if r.last_step_actions)  # hosts' origins do not compare: left out
    fwd, grad = _transfers(results, timelines, one_clock=one_clock, scale=scale)
    stages = tuple(_stage_record(plan, r, fwd.get(r.stage, ()), grad.get(r.stage, ())) for r in results)
    chunks = chunk_rows(plan, results, stages)
    return RunReport(
        model=plan.model.name, fingerprint=plan.model.fingerprint, schedule=schedule, steps=n_steps,
        microbatches=plan.training.microbatches, emulate=emulate, backend=results[0].backend,
        world_size=len(everyone), time_scale=scale, time_scale_limiting=results[0].time_scale_limiting,
        safety_factor=results[0].safety_factor, contention_factor=results[0].contention_factor,
        predicted_iteration_s=plan.predicted.iteration_s,
        predicted_real_iteration_s=plan.predicted.iteration_s * scale,
        simulated_iteration_s=simulated_iteration_s(plan, schedule, overlap_sync=sync_overlap),
        measured_iteration_s=measured, measured_emulated_iteration_s=measured / scale,
        step_records=records, stages=card_totals(stages, chunks), chunks=chunks,
        overruns=overruns, late_messages=late,
        late_wait_per_step_s=sum(r.late_total_s for r in results) / max(n_steps, 1),
        notes=_notes(emulate, overruns, late, actions, max(r.worst_overrun_ratio for r in results),
                     pinned=_ran_pinned(plan, results), replicas=bool(plan.replicas)),
        machine=machine_info(), wall_s=wall_s,
        timelines=timelines,
        stragglers=tuple(rec for r in results for rec in r.stragglers),
        members=_member_records(plan, everyone))
