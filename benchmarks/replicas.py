"""Issue #6, acceptance 3 (predicted half): DDP with equal batches vs one pipeline vs mixed replicas.

For each scenario (a bundled GPT captured on meta, an example cluster file, bf16 mixed
precision with Adam, two micro-batches per card in the global batch) the predicted
throughput (global batch / T) of

* (a) DDP with equal batches: every card a replica with M / n micro-batches and an
  every-step ring all-reduce of the whole model; "OOM" where a card cannot hold it;
* (b) the best single pipeline (issue #3's planner);
* (c) hetpipe mixed replicas, every-step synchronous sync (exact large-batch update);
* (d) hetpipe mixed replicas with the policy chosen from the links (``auto``: DiLoCo with
  H local steps where every-step sync over the links costs more than 10% of compute),

all under the same cost model, memory check and sync model (`hetpipe.cost_models.sync`).
The replica search's gap is stated against the exact reference where that is tractable
(home lab) and against the work lower bound otherwise.

Emulated-measured half (`benchmarks/replicas_emulated.py`): (a), (b) and (c), with (c) also with
its sync after backward, planned for the home lab and the community cluster scaled down so that
this CPU box runs them with ``hetpipe run --emulate``; the measured samples per emulated second sit
next to the predicted and simulated ones.

Writes benchmarks/results/replicas.md (``--emulated-only`` keeps its predicted tables and
replaces only the emulated section).

Usage:
    python benchmarks/replicas.py [--quick] [--time-limit S] [--emulated-only] [--skip-emulated] [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, markdown_table, write_result  # noqa: E402
from benchmarks.scenarios import Scenario  # noqa: E402


SCENARIOS = (
    Scenario("homelab.yaml", "gpt2-small", 4, 1024),
    Scenario("homelab.yaml", "gpt2-medium", 4, 1024),
    Scenario("community-16.yaml", "gpt2-small", 4, 1024),
    Scenario("community-16.yaml", "gpt2-medium", 4, 1024),
)
QUICK = SCENARIOS[:2]


def _layout(plan) -> str:
    """Replicas as m_r x [devices] (and the sync policy)."""
    reps = []
    for r in plan.replicas:
        devs = "+".join(s.device for s in plan.stages[r.first_stage:r.first_stage + r.num_stages])
        reps.append(f"{r.microbatches}x[{devs}]")
    return ", ".join(reps)


def _policy(plan) -> str:
    s = plan.sync
    return "sync" if s.policy == "synchronous" else f"DiLoCo H={s.outer_steps}"


def run_scenario(sc: Scenario, *, time_limit_s: float) -> list[object]:
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.plan.build import capture_builtin
    from hetpipe.plan.replicas import build_replica_problem, partition_replicas
    from hetpipe.partitioner.replicas import solve_replicas_exact

    cluster = load_cluster(sc.cluster_path())
    graph = capture_builtin(sc.model, batch=sc.batch, seq=sc.seq, precision="bf16-mixed")
    gb = 2 * sc.batch * len(cluster.devices)
    start = time.perf_counter()
    sync = partition_replicas(graph, cluster, global_batch=gb, policy="synchronous", time_limit_s=time_limit_s)
    wall = time.perf_counter() - start
    auto = partition_replicas(graph, cluster, global_batch=gb, policy="auto", time_limit_s=time_limit_s)
    ddp, single = sync.baselines["ddp-equal"], sync.baselines["single-pipeline"]
    t = sync.predicted.iteration_s
    if len(cluster.devices) <= 4:
        exact = solve_replicas_exact(build_replica_problem(graph, cluster, global_batch=gb), policy="synchronous")
        gap = f"{t / exact.iteration_s - 1:.1%} vs exact"
    else:
        gap = f"{1 - sync.solver.bound_s / t:.0%} vs work bound"
    rate = lambda s: f"{gb / s:.1f}"  # noqa: E731 - samples per second
    ddp_cell = f"{rate(ddp.iteration_s)} ({ddp.note})" if ddp.fits else f"OOM ({ddp.note.removeprefix('OOM on ')})"
    return [sc.cluster.removesuffix(".yaml"), sc.model, gb, ddp_cell,
            f"{rate(single.iteration_s)} ({single.note.split(',')[0]})" if single.fits else "OOM",
            f"{rate(t)}: {_layout(sync)}", f"{single.iteration_s / t:.2f}x" if single.fits else "-",
            f"{rate(auto.predicted.iteration_s)}: {_layout(auto)}, {_policy(auto)}",
            f"{sync.sync.sync_s:.2f} s / {sync.sync.compute_s:.2f} s", gap, f"{wall:.1f} s"]


def _kept_predicted_table() -> str:
    """The predicted table of the existing replicas.md, with the date it was measured (``--emulated-only``)."""
    old = (RESULTS_DIR / "replicas.md").read_text().splitlines()
    stamp = next((line.strip("_") for line in old if line.startswith("_")), "an earlier run")
    start = next(i for i, line in enumerate(old) if line.startswith("| cluster |"))
    end = next((i for i in range(start, len(old)) if not old[i].startswith("|")), len(old))
    return "\n".join([f"_Predicted table kept from {stamp}._", "", *old[start:end]])


def main(argv: list[str] | None = None) -> int:
    from benchmarks.replicas_emulated import MARKER, emulated_section

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="home lab only")
    ap.add_argument("--time-limit", type=float, default=30.0, help="replica search limit per plan (s)")
    ap.add_argument("--emulated-only", action="store_true", help="keep the predicted tables in replicas.md")
    ap.add_argument("--skip-emulated", action="store_true", help="predicted tables only")
    ap.add_argument("--steps", type=int, default=5, help="emulated steps per run (the first is warm-up)")
    args = ap.parse_args(argv)
    header = ["cluster", "model", "global batch", "(a) DDP equal, samples/s", "(b) one pipeline",
              "(c) replicas, sync every step", "(c)/(b)", "(d) replicas, policy from links",
              "sync / compute of (c)", "search gap", "plan time (c)"]
    intro = __doc__.split("Usage:")[0].strip()
    if args.emulated_only:
        predicted = f"{intro}\n\n{_kept_predicted_table()}"
    else:
        rows = []
        for sc in QUICK if args.quick else SCENARIOS:
            rows.append(run_scenario(sc, time_limit_s=args.time_limit))
            print(" | ".join(map(str, rows[-1])), flush=True)
        predicted = f"{intro}\n\n{markdown_table(header, rows)}"
    emulated = "" if args.skip_emulated else emulated_section(steps=args.steps)
    print(emulated)
    body = f"{predicted}\n\n{emulated}\n"
    print(f"wrote {write_result('replicas', 'Mixed data-parallel replicas, predicted and emulated (issue #6)', body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
