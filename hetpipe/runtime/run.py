"""`run()`: train a model with a plan, one torchrun process per stage, and return the `RunReport`.

Before anything is launched, `preflight` checks on this process what would
otherwise fail on every rank: the schedule name and its validity, that the
plan was made for ``model`` (re-captured on the meta device, fingerprints compared),
and the data and loss, tried on one batch on meta (`hetpipe.runtime.user_checks`).
Then `hetpipe.runtime.launch.launch` runs torchrun, and the per-rank results are
merged into one report.

Data: by default every step draws a seeded synthetic global batch (token ids for
language models, images for vision models); only the first and last stages read
it.  Bring your own with ``data=``: an iterable of ``(inputs, targets)`` global
batches (its first ``steps`` items are saved into the run directory for the first
and last ranks) or ``"package.module:factory"`` (each rank that needs data calls it).
``loss=`` is a module-level function ``loss(output, targets)`` or its
``"package.module:function"`` name; the default is the built-in model's loss.

Example:
    >>> from hetpipe.runtime.run import run
    >>> report = run("plan.json", model="gpt-demo", steps=4, emulate=True,
    ...              report="run.json")                             # doctest: +SKIP
    >>> report.losses, report.measured_emulated_iteration_s         # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from hetpipe.cost_models.outputs import writable_folder
from hetpipe.errors import ConfigError, RuntimeFailure
from hetpipe.plan.check import check_plan
from hetpipe.plan.group_run import has_groups, rank_slots, refuse_group_supervision, refuse_unrunnable_groups
from hetpipe.plan.levers import unit_ranges
from hetpipe.plan.schema import Plan
from hetpipe.plan.validate import validate_plan
from hetpipe.runtime.checkpoint.options import checkpoint_args, refuse_weights_with_resume
from hetpipe.runtime.faults.carry import InjectionCarrier
from hetpipe.runtime.faults.options import FaultArgs, check_wait_for_return, fault_args
from hetpipe.runtime.interleaved_run import plan_chunks, refuse_unrunnable_interleaved
from hetpipe.runtime.launch import LaunchSpec, launch
from hetpipe.runtime.tp_run import check_shardable
from hetpipe.runtime.report import RankResult, RunReport, build_report
from hetpipe.runtime.switch import final_plan, forced_switch, read_switches
from hetpipe.runtime.user_checks import check_user_code

log = logging.getLogger(__name__)

DATA_FILE = "data.pt"


# ----------------------------------------------------------------------------- run


def preflight(plan: Plan, *, model: str, seq: int | None, schedule: str, data: Any = None,
              loss: str | None = None, weights: str | None = None) -> Any:
    """Refuse, before launching, a plan for another model, an invalid schedule, ``data`` / ``loss``
    the workers would fail on (``data``: an import spec, a data file, or the list of batches), or
    ``weights`` that lack a tensor of the model or hold one of another shape (headers only); returns
    the UnitGraph."""
    from hetpipe.schedule.builders import make_schedule, validate_schedule
    from hetpipe.runtime.interleaved_run import check_schedule
    from hetpipe.plan.tables import verify_tables
    from hetpipe.runtime.rank import capture_for_plan
    refuse_unrunnable_groups(plan, schedule)  # issue 15: what groups do not run yet, each with its fix
    check_schedule(plan, schedule)  # interleaved: the plan's chunk count, no replicas or groups (interleaved_run.py)
    if plan.replicas:  # each replica is its own pipeline
        from hetpipe.runtime.replicas.trainer import check_runnable

        check_runnable(plan, world_size=len(plan.stages))
        for r in plan.replicas:
            validate_schedule(make_schedule(schedule, r.num_stages, r.microbatches), num_stages=r.num_stages,
                              num_microbatches=r.microbatches)
    else:
        p, m = len(plan.stages), plan.training.microbatches
        validate_schedule(make_schedule(schedule, p, m), num_stages=p, num_microbatches=m)
        refuse_split_recompute(plan, schedule)
    graph, example = capture_for_plan(plan, model=model, seq=seq)  # raises PlanError for another model
    check_shardable(plan, graph, loss=loss)  # a group of a torch.export graph (Hugging Face) cannot shard yet
    if [u.node_names for u in plan.units] == [tuple(u.node_names) for u in graph.units]:
        verify_tables(plan, graph, loss_costed=False)  # edited tables never reach the ranks (plan/tables.py)
    check_user_code(plan, model=model, data=data, loss=loss, example=example, meta_model=graph.module)
    if weights is not None:
        _check_weights(plan, graph, example, weights)
    report = check_plan(plan)
    for violation in report.violations:
        # Not fatal: an over-full plan is exactly what --emulate demonstrates (emulated OOM).
        log.warning("plan check: %s", violation)
    return graph


def refuse_split_recompute(plan: Plan, schedule: str) -> None:
    """A split schedule (ZB) runs no recomputing stage: the two halves of its backward would each
    recompute (`hetpipe.partitioner.schedule_choice`)."""
    from hetpipe.schedule.builders import is_split

    recomputing = [st.index for st in plan.stages if st.recompute_units or st.selective]  # the level: priced for 1F1B
    if is_split(schedule) and recomputing:
        raise ConfigError(f"--schedule {schedule}: stages {recomputing} recompute activations, which a split "
                          "backward does not run; use --schedule 1f1b, or re-plan with --schedule auto")


def _check_weights(plan: Plan, graph: Any, example: Any, weights: str) -> None:
    from hetpipe.runtime.rank import node_to_stage
    from hetpipe.runtime.stage.build import split_stages
    from hetpipe.runtime.stage.weights import check_stage, open_weights

    ckpt = open_weights(weights)
    if plan.replicas:  # every replica holds the whole model: one stage covers every name
        program = split_stages(graph.module, {}, example_inputs=example, num_stages=1)
    else:
        program = split_stages(graph.module, node_to_stage(plan, graph.module), example_inputs=example,
                               num_stages=len(plan.stages))
    for stage in range(program.num_stages):
        check_stage(program, stage, ckpt)


def _weights_args(weights: str | Path | None, save_weights: str | Path | None,
                  plan: Plan) -> tuple[str | None, str | None]:
    """Absolute ``weights`` and ``save_weights`` paths for the workers; the save folder created and writable."""
    weights_arg = str(Path(weights).absolute()) if weights is not None else None
    if save_weights is None:
        return weights_arg, None
    if plan.replicas:
        raise ConfigError("--save-weights is not supported for replica plans yet; run the plan without it, or save "
                          "from a single-pipeline plan")
    return weights_arg, writable_folder(save_weights, "--save-weights")


def function_spec(fn: Callable[..., Any] | str | None, what: str) -> str | None:
    """``"module:qualname"`` of a module-level function, so a worker process can import it."""
    if fn is None or isinstance(fn, str):
        return fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname or module == "__main__":
        raise ConfigError(f"{what} {fn!r} cannot be imported by the worker processes; define it at module level "
                          "in an importable module (not __main__, not a lambda) or pass 'package.module:function'")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not fn:
        raise ConfigError(f"{what} {module}:{qualname} does not resolve back to the given function; "
                          "pass 'package.module:function'")
    return f"{module}:{qualname}"


def save_data(data: Iterable[Any], steps: int, path: Path) -> None:
    """Materialise the first ``steps`` (inputs, targets) batches of ``data`` for the worker processes."""
    torch.save(take_batches(data, steps), path)


def take_batches(data: Iterable[Any], steps: int) -> list[tuple[Any, Any]]:
    """The first ``steps`` (inputs, targets) batches of ``data``, checked to be pairs."""
    batches = []
    for i, item in enumerate(data):
        if i == steps:
            break
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ConfigError(f"data item {i} is a {type(item).__name__}; each item must be (inputs, targets) "
                              "for one global batch")
        batches.append((item[0], item[1]))
    if len(batches) < steps:
        raise ConfigError(f"data yielded {len(batches)} batches, the run needs {steps}; pass more data or fewer steps")
    return batches


def _default_timeout_s(plan: Plan, *, steps: int, emulate: bool, safety_factor: float | None) -> float:
    from hetpipe.runtime.estimate import BASE_TIMEOUT_S, default_timeout_s, estimate_wall

    if not emulate:
        return BASE_TIMEOUT_S
    est = estimate_wall(plan, steps=max(1, steps) if isinstance(steps, int) else 1, safety_factor=safety_factor)
    log.info("%s", est.line())
    return default_timeout_s(est)


def _check_args(plan: Plan, steps: int, timeout_s: float, faults: tuple[Sequence[str] | None, bool], *,
                margin: float | None, window: int | None) -> FaultArgs:
    """Refuse bad ``steps`` / ``timeout_s``; the checked fault options: ``faults`` is (``inject``, ``emulate``),
    ``margin`` / ``window`` are ``straggler_margin`` / ``straggler_steps`` (`hetpipe.runtime.faults`)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be a positive integer, got {steps!r}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout must be positive seconds, got {timeout_s!r}")
    return fault_args(plan, faults[0], emulate=faults[1], steps=steps, margin=margin, window_steps=window)


def _fill_workdir(workdir: Path, plan: Plan, data: Any, batches: list[Any] | None) -> tuple[Any, Path]:
    """Create ``workdir`` with the plan and the data file the workers read; returns (data spec, plan path)."""
    workdir.mkdir(parents=True, exist_ok=True)
    if batches is not None:
        torch.save(batches, workdir / DATA_FILE)
    return (data if batches is None else str(workdir / DATA_FILE)), _fresh_run_dir(workdir, plan)


def _fresh_run_dir(workdir: Path, plan: Plan) -> Path:
    """Drop a previous run's rank files from ``workdir`` and write the plan the workers load; returns its path."""
    for stale in [*workdir.glob("error-rank*.json"), *workdir.glob("result-rank*.json"),
                  *workdir.glob("progress-rank*"), *workdir.glob("straggler-rank*.json"),
                  *workdir.glob("steps-rank*.json")]:
        stale.unlink()
    plan_path = workdir / "plan.json"
    plan.save(plan_path)
    return plan_path


def run(
    plan: Plan | str | Path,
    *,
    model: str,
    steps: int,
    emulate: bool = False,
    data: Iterable[Any] | str | None = None,
    loss: Callable[..., Any] | str | None = None,
    report: str | Path | None = None,
    schedule: str | None = None,
    timeout_s: float | None = None,
    seq: int | None = None,
    seed: int = 0,
    lr: float | None = None,
    safety_factor: float | None = None, run_dir: str | Path | None = None, sync_overlap: bool = True,
    weights: str | Path | None = None, save_weights: str | Path | None = None,
    checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, resume: str | Path | None = None,
    inject: Sequence[str] | None = None, straggler_margin: float | None = None, straggler_steps: int | None = None,
    max_restarts: int | None = None, adapt: bool = False, wait_for_return: float | None = None,
    switch_at: tuple[int, Plan] | None = None, switch_listen: bool = False,
) -> RunReport:
    """Train ``model`` for ``steps`` optimizer steps with ``plan`` (see the module docstring).

    ``timeout_s`` defaults to 60 s, under ``emulate`` to at least three real iterations at the estimated time
    scale (`hetpipe.runtime.estimate.default_timeout_s`).  ``weights``: a checkpoint to start from, each rank
    reading its stage only (default: `seeded_init` from ``seed``; not with ``resume``, which holds the weights);
    ``save_weights``: a folder for the trained weights (`hetpipe.runtime.stage.weights`).
    ``checkpoint_dir`` / ``checkpoint_every`` / ``resume``: `hetpipe.runtime.checkpoint` (``steps``: the total to reach).
    ``max_restarts`` / ``adapt`` / ``wait_for_return``: `hetpipe.runtime.supervise` (lost ranks, stragglers);
    ``switch_at=(K, plan2)`` / ``switch_listen``: in-place plan switches (`hetpipe.runtime.switch`).
    Raises `PlanError` (plan for another model), `ScheduleError`, `ConfigError` before launching; `RuntimeFailure`
    naming the rank, stage and action if a rank fails.
    """
    plan = loaded_plan(plan)
    refuse_weights_with_resume(weights, resume)  # the checkpoint's weights would silently win
    refuse_unrunnable_interleaved(plan_chunks(plan), locals())  # what interleaved runs do not take yet
    if max_restarts is not None or adapt or wait_for_return is not None:
        return _supervised(plan, locals())
    if timeout_s is None:
        timeout_s = _default_timeout_s(plan, steps=steps, emulate=emulate, safety_factor=safety_factor)
    faults = _check_args(plan, steps, timeout_s, (inject, emulate), margin=straggler_margin, window=straggler_steps)
    schedule, loss_spec = schedule or plan.training.schedule, function_spec(loss, "loss")
    batches = None if data is None or isinstance(data, str) else take_batches(data, steps)
    preflight(plan, model=model, seq=seq, schedule=schedule, data=data if batches is None else batches,
              loss=loss_spec, weights=str(Path(weights).absolute()) if weights is not None else None)
    weights_arg, save_arg = _weights_args(weights, save_weights, plan)  # creates the save folder: after the checks
    ckpt = checkpoint_args(plan, checkpoint_dir, checkpoint_every, resume, model=model, seq=seq, steps=steps, seed=seed)
    workdir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="hetpipe-run-"))
    data_spec, plan_path = _fill_workdir(workdir, plan, data, batches)
    spec = LaunchSpec(plan_path=plan_path, model=model, steps=steps, nproc=len(rank_slots(plan)), run_dir=workdir,
                      emulate=emulate, schedule=schedule, timeout_s=timeout_s, seed=seed, seq=seq, lr=lr,
                      data=data_spec, loss=loss_spec, safety_factor=safety_factor, sync_overlap=sync_overlap,
                      weights=weights_arg, save_weights=save_arg, **ckpt.launch_fields(), **faults.launch_fields(),
                      switch_at=forced_switch(workdir, plan, switch_at), switch_listen=switch_listen)
    out = faults.annotate(ckpt.annotate(_launch_and_report(spec, plan, sync_overlap=sync_overlap)))
    if report is not None:
        out.save(report)
    if run_dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return out


_NOT_PER_ATTEMPT = ("plan", "resume", "run_dir", "report", "max_restarts", "adapt", "wait_for_return")


def loaded_plan(plan: Plan | str | Path) -> Plan:
    """The plan file `plan` loaded, or the `Plan` object checked as a loaded one is (`plan.validate`: an
    overlapping split or an unknown schedule edited in code is refused here, not inside a rank)."""
    if not isinstance(plan, Plan):
        return Plan.load(plan)
    validate_plan(plan)
    return plan


def _supervised(plan: Plan, args: dict[str, Any]) -> RunReport:
    """`run` under `hetpipe.runtime.supervise` (``args``: `run`'s arguments); each attempt is a plain
    `run` in its own folder ``RUN_DIR/attempt-<n>``."""
    from hetpipe.runtime.supervise import SuperviseOptions, supervise

    once = {k: v for k, v in args.items() if k not in _NOT_PER_ATTEMPT}
    resume, run_dir, report, adapt = args["resume"], args["run_dir"], args["report"], args["adapt"]
    max_restarts = args["max_restarts"] if args["max_restarts"] is not None else 0

    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"--max-restarts must be a whole number of restarts, 0 or more; got {max_restarts!r}")
    wait_s = check_wait_for_return(args["wait_for_return"], max_restarts)
    if plan.replicas and adapt:  # hetpipe.plan.replan solves one pipeline: a slow card needs the replica planner
        raise ConfigError("--adapt re-plans single-pipeline plans only; run the replica plan with --max-restarts "
                          "(a dead rank relaunches the same plan from the newest checkpoint) and, for a slow card, "
                          "re-plan it with `hetpipe plan --replicas` and continue with --resume DIR")
    if adapt or wait_s is not None:  # re-planning solves width-1 stages; --max-restarts relaunches a grouped plan
        refuse_group_supervision(plan)
    if once["checkpoint_dir"] is None:
        flag = "--adapt" if adapt else f"--max-restarts {max_restarts}"
        raise ConfigError(f"{flag} needs --checkpoint-dir DIR (and --checkpoint-every N): a relaunched job "
                          "continues from the newest checkpoint there")
    data = once["data"]
    if data is not None and not isinstance(data, str):  # an iterator is read once, by the first attempt
        once["data"] = take_batches(data, once["steps"])
    opts = SuperviseOptions(checkpoint_dir=Path(writable_folder(once["checkpoint_dir"], "--checkpoint-dir")),
                            steps=once["steps"], max_restarts=max_restarts, adapt=adapt,
                            resume=str(resume) if resume is not None else None,
                            checkpoint_every=once["checkpoint_every"], wait_for_return_s=wait_s,
                            same_plan=bool(plan.replicas) or has_groups(plan), switch_in_place=adapt)
    once["switch_listen"] = adapt  # a slow card's re-plan on the same world is switched into the running job

    carrier = InjectionCarrier(once.pop("inject", None))  # the faults belong to the run, not to one launch
    out = supervise(plan, carried_attempts(once, carrier), opts, run_dir=Path(run_dir) if run_dir is not None else None)
    if carrier.records:
        carrier.settle(opts.steps)  # the run finished: its last attempt reached every step
        out = dataclasses.replace(out, notes=(*out.notes, *(f"injection {line}" for line in carrier.lines())))
    if report is not None:
        out.save(report)
    return out


def carried_attempts(once: dict[str, Any], carrier: InjectionCarrier) -> Callable[[Plan, Path, str | None], RunReport]:
    """The supervisor's attempt: a plain `run` in its folder, resumed from the checkpoint it is given, with
    the faults ``carrier`` hands it (`hetpipe.runtime.faults.carry`); ``once``: `run`'s other arguments."""
    from hetpipe.runtime.checkpoint.files import find_checkpoint

    def attempt(p: Plan, folder: Path, resume_from: str | None) -> RunReport:
        start = find_checkpoint(resume_from)[1].step if resume_from else 0
        rest = {**once, "weights": None} if resume_from else once  # a relaunch continues the checkpoint's weights
        return run(p, run_dir=folder, resume=resume_from, inject=carrier.for_attempt(p, folder, start), **rest)

    return attempt


def _launch_and_report(spec: LaunchSpec, plan: Plan, *, sync_overlap: bool) -> RunReport:
    """Run torchrun for ``spec`` and merge the ranks' results with ``plan``."""
    try:
        outcome = launch(spec)
    except RuntimeFailure as err:
        injected = f" (injected: {'; '.join(spec.inject)})" if spec.inject else ""
        raise RuntimeFailure(f"{err}{injected} (log: {spec.run_dir / 'torchrun.log'})") from None
    if spec.save_weights and spec.weights:  # config.json & co.: the saved folder is a from_pretrained folder too
        from hetpipe.runtime.stage.weights import copy_side_files

        copy_side_files(spec.weights, spec.save_weights)
    results = [RankResult.load(spec.run_dir / f"result-rank{r}.json") for r in range(spec.nproc)]
    plan = final_plan(spec.run_dir, plan)  # the plan an in-place switch moved the job onto, if any
    out = build_report(plan, results, schedule=spec.schedule or plan.training.schedule, emulate=spec.emulate,
                       wall_s=outcome.wall_s, sync_overlap=sync_overlap)
    switched = tuple(r.line() for r in read_switches(spec.run_dir))
    return dataclasses.replace(out, notes=(*out.notes, *switched)) if switched else out


def collect_report(plan: Plan | str | Path, run_dirs: Sequence[str | Path], *, schedule: str | None = None,
                   emulate: bool = False) -> RunReport:
    """Merge the ``result-rank<r>.json`` files of a multi-node job (one run directory per node).

    Example:
        >>> collect_report("plan.json", ["desk/run", "shelf/run"]).losses   # doctest: +SKIP
    """
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    paths = [p for d in run_dirs for p in sorted(Path(d).glob("result-rank*.json"))]
    if not paths:
        raise ConfigError(f"no result-rank*.json in {', '.join(map(str, run_dirs))}; did the job finish?")
    results = [RankResult.load(p) for p in paths]
    return build_report(plan, results, schedule=schedule or plan.training.schedule, emulate=emulate)


def summary_tables(report: RunReport) -> list[Any]:
    """rich Tables for the CLI: steps, and stages measured next to predicted."""
    from rich.table import Table

    unit = "emulated s" if report.emulate else "s"
    ranks = f" on {report.world_size} ranks" if report.world_size != len(report.stages) else ""  # groups
    steps = Table(title=f"{report.model}: {report.steps} steps, {report.schedule}, {len(report.stages)} stages{ranks}"
                        + (f", time scale {report.time_scale:.4g} real s per emulated s" if report.emulate else ""))
    for col in ("step", "loss", "step (real s)", f"step ({unit})"):
        steps.add_column(col, justify="right")
    for r in report.step_records:
        steps.add_row(str(r.step), f"{r.loss:.4f}", f"{r.step_s:.4f}", f"{r.emulated_step_s:.4g}")
    steps.add_row("median", "", f"{report.measured_iteration_s:.4f}", f"{report.measured_emulated_iteration_s:.4g}")
    steps.add_row("predicted", "", f"{report.predicted_real_iteration_s:.4f}", f"{report.predicted_iteration_s:.4g}")
    stages = Table(title="stages: measured per micro-batch vs plan (F forward, B backward, C one message on the "
                         "cut to the next stage, S optimizer.step() once per iteration)")
    for col in ("stage", "device", "units", f"F ({unit})", "F plan", f"B ({unit})", "B plan", f"C ({unit})",
                "C plan", f"S ({unit})", "S plan", "peak MiB", "plan MiB", "usable MiB", "overruns"):
        stages.add_column(col, justify="right")
    mib = 2**20
    members = {}  # a group stage's row (its lead, the plan's F_s / B_s), then one row per member (its own)
    for m in report.members:
        members.setdefault(m.stage, []).append((f"{m.stage} member {m.member}", m))
    for c in report.chunks:  # an interleaved stage's row sums its chunks; then one row per chunk (virtual stage)
        members.setdefault(c.stage % len(report.stages), []).append((f"virtual {c.stage}", c))
    for label, s in [row for st in report.stages for row in [(str(st.stage), st), *members.get(st.stage, [])]]:
        units = f"{s.first_unit}-{s.last_unit}" + (f" (recompute {unit_ranges(s.recompute_units)})"
                                                    if s.recompute_units else "")
        sent = "-" if s.transfer_s is None else f"{s.transfer_s:.4g}"
        stages.add_row(label, f"{s.device} ({s.kind})", units,
                       f"{s.fwd_emulated_s:.4g}", f"{s.predicted_fwd_s:.4g}", f"{s.bwd_emulated_s:.4g}",
                       f"{s.predicted_bwd_s:.4g}", sent, f"{s.predicted_transfer_s:.4g}",
                       f"{s.update_real_s / report.time_scale:.4g}", f"{s.predicted_step_s:.4g}",
                       f"{s.peak_bytes / mib:.1f}", f"{s.predicted_memory_bytes / mib:.1f}",
                       f"{s.usable_bytes / mib:.1f}", str(s.overruns_fwd + s.overruns_bwd))
    return [steps, stages]

