"""Switch plans inside a running job (issue 16, item 3): a re-plan acted on without a relaunch.

When the world is unchanged -- a card turned slow, not dead -- ``--adapt`` moves the running job onto
the new plan at a step boundary instead of checkpointing, ending every process and launching again
(process start, torch import, rendezvous, re-capture: 12-21 s on the 2-core reference box):

1. **Agreement.** Rank 0 alone decides whether a switch is due after the steps just finished: a
   forced switch (``--switch-at K=PLAN``: after K steps, for tests and demos) or a request the
   supervisor wrote (``RUN_DIR/switch-request.json``, `request_switch`).  It broadcasts the new
   plan's text to every rank (one ``broadcast_object_list`` per step boundary, only in runs that
   can switch), so no two ranks can act on different plans or at different steps.  In a run that
   takes requests, the ranks first tell rank 0 whether one of them named a straggler in the step
   just finished (one ``all_gather_object`` of a flag); if so, rank 0 *holds* the job at this
   boundary until the supervisor's verdict is there (a plan, or ``stay``: a request without one),
   at most `VERDICT_WAIT_S`, so a switch lands at the first boundary after the straggler is
   named instead of one step later (the supervisor's re-plan takes 0.1-0.45 s, a slowed step
   longer).  The hold's seconds are part of the switch's cost (`SwitchRecord.held_s`).
2. **Hand-over by parameter name, through a DCP checkpoint on local disk.**  Every rank saves its
   stage (parameters, buffers, optimizer state keyed by the model's own names) into
   ``RUN_DIR/switch/step-NNNNNN`` (`hetpipe.runtime.checkpoint.state.save_checkpoint`, collective)
   and each rank of the new plan reads only its new stage's keys back.  Disk rather than an
   all-to-all of named tensors because it reuses the name-keyed save and restore that the resume
   tests already hold equal to a single-device run (tied parameters saved once, Adam's scalar
   ``step``, offloading stages, group slices), and on one host the files stay in the page cache;
   the switch's seconds are measured and reported (`SwitchRecord`), and they are what the
   supervisor prices a switch at.  The folder is removed once every rank has read it (the run's
   own ``--checkpoint-dir`` checkpoints are the recovery points).
3. **Rebuild.** Once the hand-over is written, each rank releases its old stage's tensors
   (parameters, buffers, gradients, optimizer state: `release_stage`), so a rank never holds the
   old and the new stage at once (peak: one stage's state, as at start-up).  Each rank then splits the graph it captured at start-up with the new plan's cuts and
   builds its new stage through the public builders (`split_stages`, `build_stage`: no re-capture),
   a new optimizer, schedule and executor; the emulation keeps the run's time scale (one clock per
   run, so step times before and after stay comparable) with the new stage's targets and links.
   The data stream continues at the same position; the step count goes on.
4. **Faults** (``--inject``) follow the cards: a slowdown that already fired stays with its card, by
   the factor the new plan does not already price (`hetpipe.runtime.faults.carry`).

Only plans of the same world switch in place: the same number of single-card stages (no
tensor-parallel groups, no replicas) and the same training settings (`switch_refusal`).  Anything
else -- a dead rank, a plan on fewer cards -- goes through the supervisor's relaunch.

Example:
    >>> parse_switch_at("3=plan2.json")
    SwitchAt(after_steps=3, plan_path=PosixPath('plan2.json'))
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetpipe.errors import ConfigError
from hetpipe.plan.group_run import has_groups
from hetpipe.plan.schema import Plan

log = logging.getLogger(__name__)

SWITCH_REQUEST = "switch-request.json"  # written by the supervisor, taken by rank 0
SWITCHES = "switches.json"  # rank 0's record of the switches made (`SwitchRecord`)
SWITCH_FOLDER = "switch"  # the hand-over checkpoints, under the run directory
#: The longest rank 0 holds the job at a boundary for the supervisor's verdict on a straggler named in the
#: step just finished: > 10x its measured reaction (poll 0.2 s + re-plan 0.1-0.45 s on 2 loaded cores,
#: benchmarks/results/faults.md).  A verdict later than this is taken at a later boundary.
VERDICT_WAIT_S = 5.0
#: How often rank 0 looks for the verdict while holding: small against the supervisor's reaction.
VERDICT_POLL_S = 0.01


@dataclass(frozen=True)
class SwitchAt:
    """A forced switch: after ``after_steps`` steps, onto the plan in ``plan_path``."""

    after_steps: int
    plan_path: Path


def add_switch_args(parser: argparse.ArgumentParser) -> None:
    """The worker's flags: ``--switch-at STEPS=PLAN.json`` (forced) and ``--switch-listen`` (a supervisor's requests)."""
    parser.add_argument("--switch-at", default=None, help="STEPS=PLAN.json: switch plans in place after STEPS steps")
    parser.add_argument("--switch-listen", action="store_true", help="take the supervisor's in-place switch requests")


def parse_switch_at(text: str) -> SwitchAt:
    """``K=PATH`` -> `SwitchAt` (one `ConfigError` naming the form otherwise)."""
    steps, sep, path = text.partition("=")
    if not sep or not steps.strip().isdigit() or not path:
        raise ConfigError(f"--switch-at {text!r}: write STEPS=PLAN.json, e.g. --switch-at 3=plan2.json")
    return SwitchAt(int(steps), Path(path))


def switch_refusal(old: Plan, new: Plan) -> str | None:
    """Why ``new`` cannot replace ``old`` inside the running job (None: it can)."""
    if old.replicas or new.replicas:
        return "replica plans are relaunched"
    if has_groups(old) or has_groups(new):
        return "plans with tensor-parallel groups are relaunched"
    if any(getattr(s, "chunks", ()) for s in (*old.stages, *new.stages)):
        return "interleaved plans (several chunks per rank) are relaunched"
    if len(new.stages) != len(old.stages):
        return f"the new plan has {len(new.stages)} stages, the running job {len(old.stages)} processes"
    a, b = old.training, new.training
    for field in ("microbatches", "global_batch", "optimizer", "precision"):
        if getattr(a, field, None) != getattr(b, field, None):
            return f"training.{field} differs ({getattr(a, field, None)!r} -> {getattr(b, field, None)!r})"
    return None


def forced_switch(workdir: Path, plan: Plan, switch_at: tuple[int, Plan] | None) -> str | None:
    """``run(switch_at=(K, plan2))`` checked and written for the workers: ``"K=PATH"`` (None: no switch)."""
    if switch_at is None:
        return None
    steps, new = switch_at
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"switch_at: the step count {steps!r} must be a whole number >= 1 (steps before the switch)")
    refusal = switch_refusal(plan, new)
    if refusal is not None:
        raise ConfigError(f"switch_at: cannot switch in place: {refusal}; relaunch with --resume instead")
    path = Path(workdir) / f"switch-at-{steps}.json"
    new.save(path)
    return f"{steps}={path.absolute()}"


def request_switch(run_dir: Path, plan: Plan | None, reason: str) -> None:
    """The supervisor's request: ``plan`` and why, written atomically for rank 0 to take; ``plan=None`` is
    the verdict ``stay`` (a job holding for it goes on, `SwitchPoint.agree`)."""
    path = Path(run_dir) / SWITCH_REQUEST
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"reason": reason, "plan": plan.to_dict() if plan is not None else None}))
    os.replace(tmp, path)


def request_pending(run_dir: Path) -> bool:
    """Whether a request or verdict is written and not taken yet."""
    return (Path(run_dir) / SWITCH_REQUEST).exists()


@dataclass(frozen=True)
class SwitchRecord:
    """One switch made in place: after ``after_steps`` steps; ``seconds`` from the agreement to the new
    stage ready (``save_s`` of them writing the hand-over checkpoint, ``load_s`` reading it back,
    ``build_s`` rebuilding stage, optimizer and executor; the slowest rank's); the plans' stages and T."""

    after_steps: int
    seconds: float
    save_s: float
    load_s: float
    build_s: float
    old_stages: str
    new_stages: str
    old_predicted_s: float
    new_predicted_s: float
    plan_file: str
    reason: str = ""
    held_s: float = 0.0  # before ``seconds``: the job held at the boundary for the supervisor's verdict
    released_bytes: int = 0  # the old stages' tensors released before the rebuild (every rank's, summed)

    def line(self) -> str:
        held = f", after holding {self.held_s:.3g} s for the verdict" if self.held_s else ""
        held += f"; old stages released ({self.released_bytes / 1e6:.3g} MB) before the rebuild" \
            if self.released_bytes else ""
        return (f"switched in place after step {self.after_steps} ({self.reason or 'forced'}): {self.old_stages} -> "
                f"{self.new_stages}, T {self.old_predicted_s:.4g} -> {self.new_predicted_s:.4g} s, in "
                f"{self.seconds:.3g} s (save {self.save_s:.3g} s, load {self.load_s:.3g} s, rebuild "
                f"{self.build_s:.3g} s){held}, no relaunch")


def read_switches(run_dir: Path) -> list[SwitchRecord]:
    """The switches rank 0 recorded in ``run_dir`` (none: an empty list)."""
    path = Path(run_dir) / SWITCHES
    try:
        return [SwitchRecord(**d) for d in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        return []


def final_plan(run_dir: Path, plan: Plan) -> Plan:
    """The plan the job ended on: the last switch's, else ``plan``."""
    done = read_switches(run_dir)
    return Plan.load(done[-1].plan_file) if done else plan


def stage_text(plan: Plan) -> str:
    return " ".join(f"{'+'.join(s.group_devices or (s.device,))}[{s.first_unit}-{s.last_unit}]" for s in plan.stages)


class SwitchPoint:
    """Where a rank learns, at each step boundary, whether the job switches plans (rank 0 decides)."""

    def __init__(self, *, run_dir: Path, rank: int, forced: SwitchAt | None, listen: bool) -> None:
        self.run_dir, self.rank, self.forced, self.listen = Path(run_dir), rank, forced, listen

    @classmethod
    def from_args(cls, args: argparse.Namespace, rank: int) -> "SwitchPoint | None":
        forced = getattr(args, "switch_at", None)
        listen = bool(getattr(args, "switch_listen", False))
        if forced is None and not listen:
            return None
        return cls(run_dir=args.run_dir, rank=rank, forced=parse_switch_at(forced) if forced else None, listen=listen)

    def _wanted(self, steps_done: int) -> tuple[dict, str] | None:
        """Rank 0: (the plan's JSON document, reason) of a switch due now, or None (a ``stay`` verdict is
        taken and answers None)."""
        if self.forced is not None and steps_done == self.forced.after_steps:
            return json.loads(self.forced.plan_path.read_text()), f"--switch-at {steps_done}"
        request = self.run_dir / SWITCH_REQUEST
        if self.listen and request.exists():
            doc = json.loads(request.read_text())
            os.replace(request, self.run_dir / f"switch-taken-{steps_done}.json")  # taken once
            return (doc["plan"], doc.get("reason", "")) if doc.get("plan") is not None else None
        return None

    def _hold(self, steps_done: int) -> float:
        """Rank 0: wait (at most `VERDICT_WAIT_S`) for the supervisor's verdict; the seconds held."""
        began = time.monotonic()
        request = self.run_dir / SWITCH_REQUEST
        while not request.exists() and time.monotonic() - began < VERDICT_WAIT_S:
            time.sleep(VERDICT_POLL_S)
        held_s = time.monotonic() - began
        log.info("rank 0: held %.3f s after step %d for the supervisor's verdict on a straggler (%s)", held_s,
                 steps_done, "answered" if request.exists() else "none yet: going on")
        return held_s

    def agree(self, steps_done: int, *, named: bool = False) -> tuple[Plan, str, float] | None:
        """Collective: the plan every rank switches to after ``steps_done`` steps, why, and the seconds rank 0
        held for the supervisor's verdict (``named``: this rank named a straggler in the step just finished);
        or None."""
        held_s = 0.0
        if self.listen:
            flags: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(flags, bool(named))
            if self.rank == 0 and any(flags):
                held_s = self._hold(steps_done)
        box: list[Any] = [(self._wanted(steps_done), held_s) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        wanted, held_s = box[0]
        if wanted is None:
            return None
        doc, reason = wanted
        return Plan.from_dict(doc, source="the switched plan"), reason, held_s


def rebuild_run(run: Any, plan: Plan, *, args: argparse.Namespace, rank: int) -> Any:
    """A copy of the rank's prepared run (the worker's ``_Run``) holding ``plan``'s stage for this rank,
    split from the graph captured at start-up and built by the public builders (no re-capture)."""
    from hetpipe.plan.schema import verify_model
    from hetpipe.runtime.rank import (device_backend, node_to_stage, recompute_nodes, resolve_for_plan,
                                      selective_nodes, stage_for)
    from hetpipe.runtime.stage.buffers import ModelBuffers
    from hetpipe.runtime.stage.build import build_stage, split_stages
    from hetpipe.runtime.stage.weights import saved_names
    from hetpipe.schedule.builders import make_schedule, validate_schedule

    verify_model(plan, run.graph)
    p, m = len(plan.stages), plan.training.microbatches
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = stage_for(plan, node=args.node, rank=rank, local_rank=local_rank)
    schedule = make_schedule(args.schedule or plan.training.schedule, p, m)
    validate_schedule(schedule, num_stages=p, num_microbatches=m)
    program = split_stages(run.meta_model, node_to_stage(plan, run.meta_model), example_inputs=run.example,
                           num_stages=p)
    stage = build_stage(program, index, state_dict=None, device=device_backend(local_rank)[1], seed=args.seed,
                        buffers=ModelBuffers(resolve_for_plan(plan, model=args.model, seq=args.seq).model),
                        recompute=recompute_nodes(plan, index), selective=selective_nodes(plan, index))
    new = copy.copy(run)
    new.plan, new.stage, new.index, new.actions, new.num_stages = plan, stage, index, schedule[index], p
    new.program, new.saved_names = program, saved_names(program, index)
    return new


def kept_clock_hooks(old: Any, plan: Plan, *, stage: int, rank: int, schedule: str) -> Any:
    """The new stage's executor hooks: under emulation, its device's targets and links on the run's own
    time scale (``old``'s: one clock per run); else plain recording hooks."""
    from hetpipe.runtime.emulate.pipeline import EmulationHooks, RecordingHooks, StageTiming
    from hetpipe.runtime.rank import stage_links
    from hetpipe.schedule.builders import is_split

    if not isinstance(old, EmulationHooks):
        return RecordingHooks()
    st = plan.stages[stage]
    dev = plan.devices[plan.device_index()[st.device]]
    predicted = StageTiming(st.fwd_s, st.bwd_s, st.offload_s, st.bwd_weight_s if is_split(schedule) else 0.0)
    return EmulationHooks(rank=rank, stage=stage, device_label=f"{dev.id} ({dev.kind})", usable_bytes=dev.usable_bytes,
                          predicted=predicted, links=stage_links(plan, stage), time_scale=old.time_scale,
                          origin=old.origin)


def carried_specs(specs: Any, old: Plan, new: Plan, *, steps_done: int) -> tuple[str, ...]:
    """``--inject`` specs on ``new`` after ``steps_done`` steps of ``old``: a fired slowdown stays with its
    card by the factor ``new`` does not price; the rest as a relaunch would get them.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> dev = lambda i, kind: NS(id=i, kind=kind)
        >>> old = NS(stages=(NS(device="a"), NS(device="b")), devices=(dev("a", "k"), dev("b", "k")))
        >>> new = NS(stages=(NS(device="b"), NS(device="a")), devices=(dev("a", "k@x3"), dev("b", "k")))
        >>> carried_specs(["slow:rank=0,factor=3,step=1"], old, old, steps_done=4)  # the card keeps its fault
        ('slow:rank=0,factor=3,step=4',)
        >>> carried_specs(["slow:rank=0,factor=3,step=1"], old, new, steps_done=4)  # priced by the new plan
        ()
    """
    from hetpipe.runtime.faults.carry import InjectionCarrier

    carrier = InjectionCarrier(list(specs or ()))
    carrier.specs_for(old, high_water=0, start=0)  # where each fault lands on the running plan
    return carrier.specs_for(new, high_water=steps_done, start=steps_done)


def release_stage(module: Any, optimizer: Any) -> int:
    """Free a stage's parameters, buffers, gradients and optimizer state (each tensor's storage replaced by an
    empty one; the hand-over checkpoint holds them); returns the bytes released.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.Adam(m.parameters())
        >>> m(torch.ones(1, 4)).sum().backward(); opt.step()
        >>> release_stage(m, opt)  # (8 + 2 floats) x (weight, gradient, exp_avg, exp_avg_sq) + 2 scalar steps
        168
        >>> m.weight.numel(), len(opt.state)
        (0, 0)
    """
    import torch

    def size(t: Any) -> int:
        return t.numel() * t.element_size() if torch.is_tensor(t) else 0

    freed = sum(size(v) for st in optimizer.state.values() for v in st.values())
    optimizer.state.clear()
    for t in (*module.parameters(), *module.buffers()):
        freed += size(t) + size(t.grad)
        t.grad = None
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return freed


@dataclass(frozen=True)
class RankSwitchTimes:
    """One rank's share of a switch: seconds from the barrier to the new loop, of which saving the hand-over,
    loading it into the new stage and building that stage, and the bytes `release_stage` freed.

    >>> RankSwitchTimes(total_s=2.0, save_s=0.3, load_s=0.5, build_s=1.0, released_bytes=4096).released_bytes
    4096
    """

    total_s: float
    save_s: float
    load_s: float
    build_s: float
    released_bytes: int


@dataclass(frozen=True)
class Switched:
    """What the rank's step loop continues with: its new loop, fault watch and plan."""

    loop: Any
    watch: Any
    plan: Plan


def switch_in_place(plan: Plan, reason: str, held_s: float = 0.0, *, steps_done: int, args: argparse.Namespace,
                    state: Any, run: Any, saved: Any, hooks: Any, make_loop: Any) -> Switched:
    """Collective: move this rank onto ``plan`` after ``steps_done`` steps (module docstring, steps 2-4).

    ``run``: the worker's prepared run; ``saved``: its (`StageState`, `Checkpointing`); ``hooks``: its
    executor hooks; ``make_loop(args, run, hooks, stage_ranks)``: the worker's loop builder, which restores
    ``args.resume`` (the hand-over checkpoint) into the new stage and optimizer."""
    from hetpipe.runtime.checkpoint.state import save_checkpoint
    from hetpipe.runtime.faults.watch import step_watch
    from hetpipe.runtime.rank import gather_stage_ranks

    dist.barrier()  # every rank finished its step: what follows is the switch's own cost
    began = time.monotonic()
    refusal = switch_refusal(run.plan, plan)
    if refusal is not None:
        raise ConfigError(f"cannot switch plans inside the running job after step {steps_done}: {refusal}; "
                          "relaunch on the new plan with --resume from a checkpoint instead")
    st, ckpt = saved
    state.phase = f"saving the hand-over checkpoint of step {steps_done}"
    folder = save_checkpoint(Path(args.run_dir) / SWITCH_FOLDER, step=steps_done, state=st,
                             info=ckpt.info(steps_done))
    saved_at = time.monotonic()
    released = release_stage(st.module, st.optimizer)  # the hand-over holds it: never two stages at once
    state.phase = "rebuilding the stage on the new plan"
    new_run = rebuild_run(run, plan, args=args, rank=state.rank)
    built_at = time.monotonic()
    ranks = gather_stage_ranks(new_run.index, len(plan.stages))
    new_hooks = kept_clock_hooks(hooks, plan, stage=new_run.index, rank=state.rank,
                                 schedule=args.schedule or plan.training.schedule)
    new_args = copy.copy(args)
    new_args.resume = folder
    new_args.inject = list(carried_specs(args.inject, run.plan, plan, steps_done=steps_done))
    state.stage, state.hooks = new_run.index, new_hooks
    loop = make_loop(new_args, new_run, new_hooks, ranks)
    watch = step_watch(new_args, plan=plan, stage=new_run.index, rank=state.rank, stage_ranks=ranks, hooks=new_hooks,
                       first_step=steps_done)
    ended = time.monotonic()
    _record(args.run_dir, plan, reason, steps_done=steps_done, old=run.plan, rank=state.rank,
            times=RankSwitchTimes(total_s=ended - began, save_s=saved_at - began, load_s=ended - built_at,
                                  build_s=built_at - saved_at, released_bytes=released), held_s=held_s)
    if state.rank == 0:  # every rank read its keys (the gather above): the hand-over is not a recovery point
        shutil.rmtree(folder, ignore_errors=True)
    return Switched(loop, watch, plan)


def _record(run_dir: Path, plan: Plan, reason: str, *, steps_done: int, old: Plan, rank: int,
            times: RankSwitchTimes, held_s: float = 0.0) -> None:
    """Collective: rank 0 writes the new plan and appends the switch (the slowest rank's seconds, every rank's
    released bytes) to `SWITCHES`."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, times)
    if rank != 0:
        return
    seconds, save_s, load_s, build_s = (max(getattr(t, f) for t in every) for f in ("total_s", "save_s", "load_s",
                                                                                    "build_s"))
    released = sum(t.released_bytes for t in every)
    plan_file = Path(run_dir) / f"plan-after-step-{steps_done}.json"
    plan.save(plan_file)
    record = SwitchRecord(after_steps=steps_done, seconds=seconds, save_s=save_s, load_s=load_s, build_s=build_s,
                          old_stages=stage_text(old), new_stages=stage_text(plan),
                          old_predicted_s=old.predicted.iteration_s, new_predicted_s=plan.predicted.iteration_s,
                          plan_file=str(plan_file.absolute()), reason=reason, held_s=held_s,
                          released_bytes=released)
    done = [asdict(r) for r in read_switches(run_dir)] + [asdict(record)]
    tmp = Path(run_dir) / (SWITCHES + ".tmp")
    tmp.write_text(json.dumps(done))
    os.replace(tmp, Path(run_dir) / SWITCHES)
    log.warning("%s", record.line())


def at_boundaries(state: Any, **switch: Any) -> Any:
    """The worker loop's ``switch(steps_done)``: collective at each step boundary when the run may switch
    (`SwitchPoint` on ``state.switch``), the `Switched` loop when it does, else None (``switch``: the
    keywords of `switch_in_place` but the plan and step)."""

    def at(steps_done: int) -> Switched | None:
        point = getattr(state, "switch", None)
        named = any(r.detected_step == steps_done - 1 for r in getattr(getattr(state, "watch", None), "records", ()))
        agreed = point.agree(steps_done, named=named) if point is not None else None
        return switch_in_place(*agreed, steps_done=steps_done, state=state, **switch) if agreed else None

    return at
