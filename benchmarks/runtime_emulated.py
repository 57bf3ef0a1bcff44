"""Issue #4, acceptance 3: run hetpipe's plan and the baseline plans on the emulated home-lab-mini cluster.

For ``gpt-demo`` on ``examples/clusters/homelab-mini.yaml`` (RTX 3090 + RTX 4090 on one
node, RTX 3060 12GB on another over 1 GbE, scaled down; see the file), this script

1. plans with hetpipe (`partition_graph`) and places the ``uniform`` and ``parameters``
   baselines on the same `Problem`, forced onto every card (`hetpipe.partitioner.baselines.baseline`)
   and on their best cards (`hetpipe.partitioner.baseline_search.best_baseline`, issue 17;
   a placement equal to one already listed is run once);
2. runs each plan with ``hetpipe run --emulate`` (the same launcher, worker and
   emulation as users get) for ``--steps`` steps, ``--repeats`` times;
3. prints measured vs predicted iteration time (emulated seconds; medians over the
   steps after the first, then over repeats), the measured speed-up of hetpipe over
   each baseline next to the predicted one (target: measured >= 80% of predicted), and
   checks that every baseline the planner flags as not fitting fails with an emulated
   out-of-memory;
4. writes ``benchmarks/results/runtime_emulated.md``.

Usage:
    python benchmarks/runtime_emulated.py [--steps 5] [--repeats 1] [--batch 2]

Example:
    $ python benchmarks/runtime_emulated.py --steps 4
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "homelab-mini.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "runtime_emulated.md"
MODEL = "gpt-demo"
BASELINES = ("uniform", "parameters")
SPEEDUP_TARGET = 0.80  # measured speed-up / predicted speed-up (issue #4, acceptance 3)

log = logging.getLogger("benchmarks.runtime_emulated")


@dataclass(frozen=True)
class Outcome:
    """One plan run the same way as every other."""

    name: str
    stages: str  # "rtx3090:0-3 | rtx4090:4-7 | ..."
    fits: bool  # as the planner predicts
    predicted_s: float  # plan T, emulated seconds
    simulated_s: float  # simulator, emulated seconds
    measured_s: float  # median over repeats of the median step, emulated seconds (nan if it failed)
    time_scale: float
    overruns: int
    error: str  # the run's first error line ("" if it ran)


def _plans(batch: int, global_batch: int | None, cluster_path: Path = CLUSTER) -> dict[str, object]:
    """hetpipe's plan and the baseline plans, all assembled from one Problem."""
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.plan.build import assemble_plan, build_problem, capture_builtin, partition_graph
    from hetpipe.partitioner.baseline_search import best_baseline
    from hetpipe.partitioner.baselines import baseline
    from hetpipe.plan.schema import SolverReport
    from hetpipe.partitioner.problem import evaluate

    cluster = load_cluster(cluster_path)
    graph = capture_builtin(MODEL, batch=batch)
    plans: dict[str, object] = {"hetpipe": partition_graph(graph, cluster, global_batch=global_batch)}
    m = plans["hetpipe"].training.microbatches
    problem = build_problem(graph, cluster, microbatches=m)
    candidates = [(name, baseline(problem, name).stages) for name in BASELINES]
    for name in BASELINES:  # issue 17: each rule also on the cards a careful user would pick
        best = best_baseline(problem, name)
        if best.fits:
            candidates.append((f"{name} (best cards)", best.stages))
    placed: dict[tuple[object, ...], str] = {}  # placement -> its names, "a = b" when two agree (run once)
    for name, stages in candidates:
        key = tuple(stages)
        placed[key] = f"{placed[key]} = {name}" if key in placed else name
    for stages, name in placed.items():
        ev = evaluate(problem, stages)
        plans[name] = assemble_plan(graph, cluster, problem=problem, stages=tuple(stages),
                                    solver=SolverReport(name, "BASELINE", ev.iteration_s, 0.0, 0.0),
                                    global_batch=plans["hetpipe"].training.global_batch)
    return plans


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _describe(plan: object) -> str:
    kinds = {d.id: d.kind for d in plan.devices}
    return " | ".join(f"{kinds[s.device]}:{s.first_unit}-{s.last_unit}" for s in plan.stages)


def _run_plan(name: str, plan: object, *, steps: int, repeats: int, workdir: Path) -> Outcome:
    from hetpipe.errors import RuntimeFailure
    from hetpipe.partitioner.problem import evaluate
    from hetpipe.plan.schema import problem_from_plan, stages_from_plan
    from hetpipe.plan.run_sim import simulated_iteration_s
    from hetpipe.runtime.run import run

    fits = evaluate(problem_from_plan(plan), stages_from_plan(plan)).fits
    measured, scale, overruns, error = [], 0.0, 0, ""
    for i in range(repeats):
        try:
            rep = run(plan, model=MODEL, steps=steps, emulate=True, timeout_s=60.0,
                      run_dir=workdir / f"{name}-{i}", report=workdir / f"{name}-{i}.json")
        except RuntimeFailure as err:
            error = str(err).split(" (log: ")[0]
            break
        measured.append(rep.measured_emulated_iteration_s)
        scale, overruns = rep.time_scale, overruns + rep.overruns
    return Outcome(name, _describe(plan), fits, plan.predicted.iteration_s, simulated_iteration_s(plan, "1f1b"),
                   statistics.median(measured) if measured else float("nan"), scale, overruns, error)


def _table(outcomes: list[Outcome]) -> list[str]:
    lines = ["| plan | stages (kind:units) | fits (planner) | predicted T (emu s) | simulated (emu s) | "
             "measured (emu s) | measured / predicted | time scale (real s / emu s) | overruns | result |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        head = f"| {o.name} | {o.stages} | {'yes' if o.fits else 'no'} | {o.predicted_s:.4g} | {o.simulated_s:.4g} |"
        if o.error:
            lines.append(f"{head} - | - | - | - | {o.error.replace('|', '/')} |")
        else:
            lines.append(f"{head} {o.measured_s:.4g} | {o.measured_s / o.predicted_s:.3f} | {o.time_scale:.4g} | "
                         f"{o.overruns} | ran |")
    return lines


def _speedups(outcomes: list[Outcome]) -> tuple[list[str], bool]:
    ours = outcomes[0]
    lines = ["| baseline | predicted speed-up | measured speed-up | measured / predicted | target >= 0.80 |",
             "|---|---|---|---|---|"]
    ok = not ours.error and any(not o.error for o in outcomes[1:])  # a speed-up needs two runs that finished
    for o in outcomes[1:]:
        if o.error:
            lines.append(f"| {o.name} | {o.predicted_s / ours.predicted_s:.3f} | - (did not run) | - | - |")
            continue
        predicted, measured = o.predicted_s / ours.predicted_s, o.measured_s / ours.measured_s
        ratio = measured / predicted
        ok &= ratio >= SPEEDUP_TARGET
        lines.append(f"| {o.name} | {predicted:.3f} | {measured:.3f} | {ratio:.3f} | "
                     f"{'yes' if ratio >= SPEEDUP_TARGET else 'NO'} |")
    return lines, ok


def _planned_memory(plan: object, error: str) -> str:
    """The planner's memory for the stage an emulated OOM names, to set beside the measured bytes."""
    match = re.search(r"\(stage (\d+),", error)
    if match is None or "emulated OOM" not in error:
        return ""
    stage = plan.stages[int(match.group(1))]
    return (f" (the planner predicted {stage.memory_bytes / 2**20:.2f} MiB for stage {stage.index}, "
            f"units {stage.first_unit}-{stage.last_unit}: the difference is what its memory model leaves out)")


def _oom_checks(outcomes: list[Outcome], plans: dict[str, object]) -> tuple[list[str], bool]:
    lines, ok = [], True
    for o in outcomes:
        if o.fits:
            good = o.error == ""
            why = "" if good else _planned_memory(plans[o.name], o.error)
            lines.append(f"- {o.name}: planner says it fits; it {'ran' if good else 'FAILED: ' + o.error + why}")
        else:
            good = "emulated OOM" in o.error
            lines.append(f"- {o.name}: planner says it does not fit; the run "
                         f"{'failed with an emulated OOM as it should' if good else 'did NOT fail with an emulated OOM'}"
                         f": `{o.error or 'it ran'}`")
        ok &= good
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per plan (median)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch size")
    parser.add_argument("--global-batch", type=int, default=4, help="samples per step (4 micro-batches of 1)")
    parser.add_argument("--cluster", type=Path, default=CLUSTER, help="cluster file (default: home-lab-mini)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hetpipe-bench-runtime"))
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from hetpipe.runtime.report import machine_info

    t0, load_before = time.monotonic(), os.getloadavg()[0]
    plans = _plans(args.batch, args.global_batch, args.cluster)
    outcomes = [_run_plan(name, plan, steps=args.steps, repeats=args.repeats, workdir=args.workdir)
                for name, plan in plans.items()]
    speed, speed_ok = _speedups(outcomes)
    oom, oom_ok = _oom_checks(outcomes, plans)
    machine = machine_info()
    hp = plans["hetpipe"]
    doc = [
        "# Emulated home lab (mini): hetpipe's plan vs the baselines, run the same way",
        "",
        f"`python benchmarks/runtime_emulated.py --steps {args.steps} --repeats {args.repeats} --batch {args.batch} "
        f"--global-batch {args.global_batch} --cluster {_shown(args.cluster)}`"
        f" -- {machine['date']}, {machine['platform']}, {machine['cpus']} CPUs, torch {machine['torch']}; "
        f"{time.monotonic() - t0:.0f} s wall; 1-min load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other processes share the cores).",
        "",
        f"Model `{MODEL}` (micro-batch {hp.training.micro_batch_size}, {hp.training.microbatches} micro-batches, "
        f"global batch {hp.training.global_batch}, {hp.training.optimizer}), cluster "
        f"`{_shown(args.cluster)}`, 1F1B, every rank a CPU process emulating its card "
        "(compute stretched to the plan's per-stage time, links delayed to their alpha-beta time, memory "
        "accounted against the card's usable bytes). Times are emulated seconds: real seconds / time scale; "
        "measured = median step over steps 1..N-1 (step 0 is warm-up), median over repeats.",
        "",
        *_table(outcomes), "", "## Speed-up of hetpipe's plan", "", *speed, "", "## Memory", "", *oom, "",
        f"Verdict: speed-up target {'met' if speed_ok else 'NOT met'}; OOM check {'passed' if oom_ok else 'FAILED'}.",
    ]
    from benchmarks.common import emit

    emit(doc, args.output)
    return 0 if speed_ok and oom_ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
