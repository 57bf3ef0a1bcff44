"""Issue #6, acceptance 3 (emulated half): DDP with equal batches vs one pipeline vs mixed replicas, run.

On ``examples/clusters/homelab-mini.yaml`` (the home lab scaled down for ``gpt-demo``: a mini
RTX 3090 and 4090 on one node, a mini RTX 3060 with a quarter of their usable memory on
another over 1 GbE; figures and their derivation in the file's header), for ``gpt-demo`` at
micro-batch 1 and a global batch of 12 (Adam, fp32), three plans over the same tables:

* (a) DDP with equal batches: each card a single-stage replica with 12 / 3 = 4
  micro-batches, synchronous gradient sync of the whole model every step;
* (b) the best single pipeline (`partition_graph`);
* (c) hetpipe's mixed replicas (`partition_replicas`, synchronous sync).

Each runs under ``hetpipe run --emulate`` (every rank a CPU process emulating its card:
compute stretched to the plan's time, links and the replica sync delayed to theirs, memory
accounted against the card).  Measured = median emulated step over steps 1..N-1 (step 0 is
warm-up); throughput = global batch / iteration in samples per emulated second.  A plan the
planner flags as not fitting is still run, to show its emulated out-of-memory.

Example:
    $ python benchmarks/replicas.py --emulated-only --steps 5
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "homelab-mini.yaml"
MODEL, MICRO_BATCH, GLOBAL_BATCH = "gpt-demo", 1, 12
MARKER = "### Emulated-measured"

log = logging.getLogger("benchmarks.replicas_emulated")


@dataclass(frozen=True)
class EmulatedOutcome:
    name: str
    layout: str  # "4x[desk:0], 8x[shelf:0+desk:1]"
    fits: bool  # as the planner predicts
    predicted_s: float  # plan T (emulated s)
    simulated_s: float  # simulator, per replica + sync (emulated s)
    measured_s: float  # median step after the first (emulated s); nan when it failed
    time_scale: float
    overruns: int
    error: str  # first error line, "" when it ran


def _ddp_equal_plan(graph: Any, cluster: Any) -> Any:
    """(a) as a runnable replica plan: one single-stage replica per card, equal micro-batches."""
    from hetpipe.cost_models.sync import choose_policy
    from hetpipe.partitioner.problem import Stage, evaluate
    from hetpipe.partitioner.replica_plan import assemble_replica_plan, build_replica_problem
    from hetpipe.partitioner.replicas import Replica, ReplicaSolution, evaluate_sync, replica_problem

    rp = build_replica_problem(graph, cluster, global_batch=GLOBAL_BATCH)
    n, whole = len(rp.base.devices), rp.base.num_units - 1
    m = rp.base.microbatches // n
    reps = tuple(Replica((Stage(d, 0, whole),), m, evaluate(replica_problem(rp.base, m), (Stage(d, 0, whole),))
                         .iteration_s) for d in range(n))
    sync = evaluate_sync(rp, [r.stages for r in reps])
    compute_s, sync_s = max(r.iteration_s for r in reps), sum(g.time_s for g in sync)
    pol = choose_policy(compute_s=compute_s, sync_s=sync_s, policy="synchronous")
    sol = ReplicaSolution(reps, sync, pol, compute_s, sync_s, compute_s + pol.amortised_s, "ddp-equal", "BASELINE",
                          0.0, 0.0, ())
    return assemble_replica_plan(graph, cluster, rp=rp, sol=sol, global_batch=GLOBAL_BATCH)


def emulated_plans() -> dict[str, Any]:
    """(a), (b) and (c) for `MODEL` on `CLUSTER`, in that order."""
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.partitioner.api import capture_builtin, partition_graph
    from hetpipe.partitioner.replica_plan import partition_replicas

    cluster = load_cluster(CLUSTER)
    graph = capture_builtin(MODEL, batch=MICRO_BATCH)
    return {"(a) DDP, equal batches": _ddp_equal_plan(graph, cluster),
            "(b) best single pipeline": partition_graph(graph, cluster, global_batch=GLOBAL_BATCH),
            "(c) hetpipe mixed replicas": partition_replicas(graph, cluster, global_batch=GLOBAL_BATCH,
                                                             policy="synchronous", time_limit_s=10.0)}


def layout(plan: Any) -> str:
    """``m_r x [devices]`` per replica, or the single pipeline's devices."""
    if not plan.replicas:
        return f"{plan.training.microbatches}x[{'+'.join(s.device for s in plan.stages)}]"
    own = [plan.stages[r.first_stage:r.first_stage + r.num_stages] for r in plan.replicas]
    return ", ".join(f"{r.microbatches}x[{'+'.join(s.device for s in st)}]" for r, st in zip(plan.replicas, own))


def _fits(plan: Any) -> bool:
    from hetpipe.partitioner.plan import check_plan

    return not any("memory" in v or "usable" in v for v in check_plan(plan).violations)


def run_emulated(name: str, plan: Any, *, steps: int, workdir: Path) -> EmulatedOutcome:
    """One emulated run of ``plan`` (an emulated OOM or other failure is recorded, not raised)."""
    from hetpipe.errors import RuntimeFailure
    from hetpipe.runtime.report import simulated_iteration_s
    from hetpipe.runtime.trainer import run

    sim = simulated_iteration_s(plan, plan.training.schedule)
    try:
        rep = run(plan, model=MODEL, steps=steps, emulate=True, timeout_s=60.0, run_dir=workdir / name[:3].strip("()"))
    except RuntimeFailure as err:
        return EmulatedOutcome(name, layout(plan), _fits(plan), plan.predicted.iteration_s, sim, float("nan"), 0.0,
                               0, str(err).split(" (log: ")[0])
    return EmulatedOutcome(name, layout(plan), _fits(plan), plan.predicted.iteration_s, sim,
                           rep.measured_emulated_iteration_s, rep.time_scale, rep.overruns, "")


def emulated_table(outcomes: list[EmulatedOutcome]) -> list[str]:
    rate = lambda s: GLOBAL_BATCH / s  # noqa: E731 - samples per emulated second
    lines = ["| plan | replicas (m_r x [devices]) | fits (planner) | predicted samples/s | simulated samples/s | "
             "measured samples/s | measured / predicted samples/s | time scale (real s / emu s) | overruns | result |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        head = (f"| {o.name} | {o.layout} | {'yes' if o.fits else 'no'} | {rate(o.predicted_s):.2f} | "
                f"{rate(o.simulated_s):.2f} |")
        if o.error:
            lines.append(f"{head} - | - | - | - | {o.error.replace('|', '/')} |")
        else:
            lines.append(f"{head} {rate(o.measured_s):.2f} | {o.predicted_s / o.measured_s:.3f} | "
                         f"{o.time_scale:.4g} | {o.overruns} | ran |")
    return lines


def emulated_section(*, steps: int = 5, workdir: Path | None = None) -> str:
    """The markdown section: setup, the table, and the measured (c)/(b) next to the predicted one."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="hetpipe-bench-replicas-"))
    plans = emulated_plans()
    outcomes = [run_emulated(name, plan, steps=steps, workdir=workdir) for name, plan in plans.items()]
    by = {o.name[:3]: o for o in outcomes}
    b, c = by["(b)"], by["(c)"]
    ratio = ""
    if not b.error and not c.error:
        ratio = (f"(c) over (b): predicted {b.predicted_s / c.predicted_s:.3f}x, measured "
                 f"{b.measured_s / c.measured_s:.3f}x.")
    doc = __doc__.split("Example:")[0].strip().split("\n", 1)[1].strip()
    return "\n".join([f"{MARKER} (`python benchmarks/replicas.py --emulated-only --steps {steps}`)", "", doc, "",
                      *emulated_table(outcomes), "", ratio])
