"""Issue #6, acceptance 3 (emulated half): DDP with equal batches vs one pipeline vs mixed replicas, run.

Two clusters scaled down for ``gpt-demo`` (fp32, Adam, micro-batch 1) so that a CPU box can run
every plan with every card emulated (figures and their derivation in each file's header):

* ``examples/clusters/homelab-mini.yaml``: a mini RTX 3090 and 4090 on one node, a mini RTX
  3060 with a quarter of their usable memory on another over 1 GbE; global batch 12;
* ``examples/clusters/community-16-mini.yaml``: the 16 cards of six homes joined over the
  internet (100-500 Mbit/s, 20-60 ms), six of them able to hold the whole model; global batch 32.

For each, the same tables give

* (a) DDP with equal batches: each card a single-stage replica with M / n micro-batches,
  synchronous gradient sync of the whole model every step;
* (b) the best single pipeline (`partition_graph`);
* (c) hetpipe's mixed replicas (`partition_replicas`, synchronous sync), whose gradient
  all-reduces run in buckets launched during the last backward (the default), and the same
  plan with ``--no-sync-overlap`` (all buckets after backward, as T charges them).

Buckets: `MINI_BUCKET_CAP_BYTES`, two gpt-demo blocks of fp32 gradients, the share of the
model that DDP's 25 MiB default is of GPT-2 small in bf16 (about two of its blocks).

Each runs under ``hetpipe run --emulate`` (every rank a CPU process emulating its card:
compute stretched to the plan's time, links and the replica sync delayed to theirs, memory
accounted against the card).  Measured = median emulated step over steps 1..N-1 (step 0 is
warm-up); throughput = global batch / iteration in samples per emulated second; simulated =
the simulator's replay of the same plan and schedule (with the sync overlapped as the run
does).  A plan the planner flags as not fitting is still run, to show its emulated OOM.

Example:
    $ python benchmarks/replicas.py --emulated-only --steps 5
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.scenarios import Scenario

ROOT = Path(__file__).resolve().parents[1]
MODEL, MICRO_BATCH = "gpt-demo", 1
MINI_BUCKET_CAP_BYTES = 2 * 198_272 * 4  # two gpt-demo blocks (198,272 parameters each) of fp32 gradients
MARKER = "### Emulated-measured"


SCENARIOS = (Scenario("homelab-mini.yaml", MODEL, MICRO_BATCH, global_batch=12),
             Scenario("community-16-mini.yaml", MODEL, MICRO_BATCH, global_batch=32))

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


def _ddp_equal_plan(graph: Any, cluster: Any, global_batch: int) -> Any:
    """(a) as a runnable replica plan: one single-stage replica per card, equal micro-batches."""
    from hetpipe.cost_models.sync import choose_policy
    from hetpipe.partitioner.problem import Stage, evaluate
    from hetpipe.plan.replicas import assemble_replica_plan, build_replica_problem
    from hetpipe.partitioner.replicas import Replica, ReplicaSolution, evaluate_sync, replica_problem

    rp = build_replica_problem(graph, cluster, global_batch=global_batch, bucket_cap_bytes=MINI_BUCKET_CAP_BYTES)
    n, whole = len(rp.base.devices), rp.base.num_units - 1
    m = rp.base.microbatches // n
    reps = tuple(Replica((Stage(d, 0, whole),), m, evaluate(replica_problem(rp.base, m), (Stage(d, 0, whole),))
                         .iteration_s) for d in range(n))
    sync = evaluate_sync(rp, [r.stages for r in reps])
    compute_s, sync_s = max(r.iteration_s for r in reps), sum(g.time_s for g in sync)
    pol = choose_policy(compute_s=compute_s, sync_s=sync_s, policy="synchronous")
    sol = ReplicaSolution(reps, sync, pol, compute_s, sync_s, compute_s + pol.amortised_s, "ddp-equal", "BASELINE",
                          0.0, 0.0, ())
    return assemble_replica_plan(graph, cluster, rp=rp, sol=sol, global_batch=global_batch)


def emulated_plans(sc: Scenario) -> dict[str, tuple[Any, bool]]:
    """(a), (b), (c) and (c) without overlap for `MODEL` on ``sc``: name -> (plan, sync overlapped)."""
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.plan.build import capture_builtin, partition_graph
    from hetpipe.plan.replicas import partition_replicas

    cluster = load_cluster(sc.cluster_path())
    graph = capture_builtin(sc.model, batch=sc.batch)
    replicas = partition_replicas(graph, cluster, global_batch=sc.global_batch, policy="synchronous",
                                  time_limit_s=10.0, bucket_cap_bytes=MINI_BUCKET_CAP_BYTES)
    return {"(a) DDP, equal batches": (_ddp_equal_plan(graph, cluster, sc.global_batch), True),
            "(b) best single pipeline": (partition_graph(graph, cluster, global_batch=sc.global_batch), True),
            "(c) hetpipe mixed replicas": (replicas, True),
            "(c) same, sync after backward": (replicas, False)}


def layout(plan: Any) -> str:
    """``m_r x [devices]`` per replica, or the single pipeline's devices."""
    if not plan.replicas:
        return f"{plan.training.microbatches}x[{'+'.join(s.device for s in plan.stages)}]"
    own = [plan.stages[r.first_stage:r.first_stage + r.num_stages] for r in plan.replicas]
    return ", ".join(f"{r.microbatches}x[{'+'.join(s.device for s in st)}]" for r, st in zip(plan.replicas, own))


def _fits(plan: Any) -> bool:
    from hetpipe.plan.check import check_plan

    return not any("memory" in v or "usable" in v for v in check_plan(plan).violations)


def run_emulated(name: str, plan: Any, *, overlap: bool, steps: int, workdir: Path) -> EmulatedOutcome:
    """One emulated run of ``plan`` (an emulated OOM or other failure is recorded, not raised)."""
    from hetpipe.errors import RuntimeFailure
    from hetpipe.plan.run_sim import simulated_iteration_s
    from hetpipe.runtime.run import run

    sim = simulated_iteration_s(plan, plan.training.schedule, overlap_sync=overlap)
    tag = name[:3].strip("()") + ("" if overlap else "-late")
    try:
        rep = run(plan, model=MODEL, steps=steps, emulate=True, timeout_s=120.0, run_dir=workdir / tag,
                  sync_overlap=overlap)
    except RuntimeFailure as err:
        return EmulatedOutcome(name, layout(plan), _fits(plan), plan.predicted.iteration_s, sim, float("nan"), 0.0,
                               0, str(err).split(" (log: ")[0])
    return EmulatedOutcome(name, layout(plan), _fits(plan), plan.predicted.iteration_s, sim,
                           rep.measured_emulated_iteration_s, rep.time_scale, rep.overruns, "")


def emulated_table(outcomes: list[EmulatedOutcome], global_batch: int) -> list[str]:
    rate = lambda s: global_batch / s  # noqa: E731 - samples per emulated second
    lines = ["| plan | replicas (m_r x [devices]) | fits (planner) | predicted samples/s | simulated samples/s | "
             "measured samples/s | measured / predicted | measured / simulated | time scale (real s / emu s) | "
             "overruns | result |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        head = (f"| {o.name} | {o.layout} | {'yes' if o.fits else 'no'} | {rate(o.predicted_s):.2f} | "
                f"{rate(o.simulated_s):.2f} |")
        if o.error:
            lines.append(f"{head} - | - | - | - | - | {o.error.replace('|', '/')} |")
        else:
            lines.append(f"{head} {rate(o.measured_s):.2f} | {o.predicted_s / o.measured_s:.3f} | "
                         f"{o.simulated_s / o.measured_s:.3f} | {o.time_scale:.4g} | {o.overruns} | ran |")
    return lines


def _ratios(outcomes: list[EmulatedOutcome]) -> str:
    """(c) over (b), and overlap over sync-after-backward, predicted/simulated next to measured."""
    by = {o.name: o for o in outcomes}
    b, c, late = (by[k] for k in ("(b) best single pipeline", "(c) hetpipe mixed replicas",
                                  "(c) same, sync after backward"))
    out = []
    if not b.error and not c.error:
        out.append(f"(c) over (b): predicted {b.predicted_s / c.predicted_s:.3f}x, simulated "
                   f"{b.simulated_s / c.simulated_s:.3f}x, measured {b.measured_s / c.measured_s:.3f}x.")
    if not c.error and not late.error:
        out.append(f"Sync overlapped with backward over sync after it: simulated {late.simulated_s / c.simulated_s:.3f}x, "
                   f"measured {late.measured_s / c.measured_s:.3f}x.")
    return " ".join(out)


def emulated_section(*, steps: int = 5, workdir: Path | None = None) -> str:
    """The markdown section: setup, then per cluster the table and the measured ratios."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="hetpipe-bench-replicas-"))
    doc = __doc__.split("Example:")[0].strip().split("\n", 1)[1].strip()
    lines = [f"{MARKER} (`python benchmarks/replicas.py --emulated-only --steps {steps}`)", "", doc]
    for sc in SCENARIOS:
        outcomes = [run_emulated(name, plan, overlap=overlap, steps=steps, workdir=workdir / sc.cluster[:-5])
                    for name, (plan, overlap) in emulated_plans(sc).items()]
        lines += ["", f"**{sc.cluster}**, global batch {sc.global_batch}:", "",
                  *emulated_table(outcomes, sc.global_batch), "", _ratios(outcomes)]
    return "\n".join(lines)
