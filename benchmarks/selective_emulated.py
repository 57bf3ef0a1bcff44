"""Issue 14: a plan whose stages run the selective recompute level, run on the emulated mini home lab.

For ``gpt-demo`` (micro-batch ``--batch`` x ``--seq`` tokens, fp32, Adam) on
``examples/clusters/homelab-mini.yaml`` this script plans as ``hetpipe plan --recompute auto`` does
(the level offered from a node-granularity capture, `hetpipe.plan.selective_plan.offer_for_capture`),
checks that some stage runs the level, and runs the plan with ``hetpipe run --emulate`` ``--repeats``
times: measured iteration time (emulated seconds, median of the steps after the first) vs the plan's T
(target: within 10%) and each stage's held bytes at its peak (the emulation ledger, which adds the
level's largest unit of re-made outputs at each backward, `runtime/execute/compute.py`) vs the plan's
M_s (target for the stages running the level: within 5%; every stage: never above).  Writes ``benchmarks/results/selective_emulated.md``.

Usage:
    python benchmarks/selective_emulated.py [--steps 4] [--repeats 2] [--batch 8] [--seq 128]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.recompute_emulated import CLUSTER, MEMORY_TOLERANCE, MIB, MODEL, TIME_TOLERANCE, run_once  # noqa: E402

TITLE = "Selective recompute level, emulated (issue 14)"


def make_plan(batch: int, seq: int, microbatches: int) -> object:
    """The planner's plan under ``--recompute auto`` with the selective level offered (as the CLI plans)."""
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.plan.build import capture_builtin, partition_graph
    from hetpipe.plan.selective_plan import offer_for_capture

    cluster = load_cluster(CLUSTER)
    graph = capture_builtin(MODEL, batch=batch, seq=seq)
    offer = offer_for_capture(graph, lambda: capture_builtin(MODEL, batch=batch, seq=seq, granularity="node"),
                              cluster)
    return partition_graph(graph, cluster, global_batch=batch * microbatches, recompute="auto", selective=offer)


def _stages(plan: object) -> str:
    return " / ".join(f"{s.device} {s.first_unit}-{s.last_unit}" + (" selective" if s.selective else "")
                      + (f" rc {','.join(map(str, s.recompute_units))}" if s.recompute_units else "")
                      for s in plan.stages)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=6)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    plan = make_plan(args.batch, args.seq, args.microbatches)
    runs = [run_once(plan, steps=args.steps, seq=args.seq) for _ in range(args.repeats)]
    ok = [r for r in runs if not r.error]
    misses = [] if any(s.selective for s in plan.stages) else ["no stage runs the selective level"]
    misses += [f"run failed: {r.error}" for r in runs if r.error]
    pred = plan.predicted.iteration_s
    measured = statistics.median(r.measured_s for r in ok) if ok else float("nan")
    misses += [f"measured {r.measured_s:.4g} vs predicted {pred:.4g} emulated s" for r in ok
               if abs(r.measured_s / pred - 1) > TIME_TOLERANCE]
    mem_rows = []
    for k, st in enumerate(plan.stages):
        held = statistics.median(r.peaks[k] for r in ok) if ok else float("nan")
        mem_rows.append([str(k), st.device, "yes" if st.selective else "no", ",".join(map(str, st.recompute_units)) or "-",
                         f"{held / MIB:.2f}", f"{st.memory_bytes / MIB:.2f}", f"{held / st.memory_bytes:.4f}",
                         f"{st.usable_bytes / MIB:.2f}"])
        if ok and st.selective and not (1 - MEMORY_TOLERANCE) * st.memory_bytes <= held <= st.memory_bytes:
            misses.append(f"stage {k}: held {held:.0f} B vs M_s {st.memory_bytes} B")
        elif ok and held > st.memory_bytes:  # every stage: never above its M_s
            misses.append(f"stage {k}: held {held:.0f} B above M_s {st.memory_bytes} B")
    lines = [markdown_table(["plan", "stages (device units)", "predicted T (emu s)", "measured (emu s)",
                             "measured / predicted", "overruns"],
                            [["planner, --recompute auto + selective level", _stages(plan), f"{pred:.4g}",
                              f"{measured:.4g}", f"{measured / pred:.3f}", str(sum(r.overruns for r in ok))]]), "",
             markdown_table(["stage", "device", "selective", "recomputed units", "held MiB (measured peak)",
                             "plan M_s MiB", "held / M_s", "usable MiB"], mem_rows), "",
             f"`{MODEL}`, micro-batch {args.batch} x {args.seq} tokens, {plan.training.microbatches} micro-batches, "
             f"fp32, Adam, 1F1B, `{CLUSTER.relative_to(ROOT)}`; {args.steps} steps per run (the first excluded), "
             f"{len(runs)} runs; load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min, "
             "at the end).", "",
             "The 5% memory target is checked on the stages that run the selective level; every stage must stay at "
             "or below its M_s (a stage recomputing whole units is `recompute_emulated.py`'s lever and figures).", "",
             "Targets met (time within 10%, held memory of the selective stages within 5%, no stage above its M_s)."
             if not misses
             else "Targets missed: " + "; ".join(misses)]
    body = "\n".join(lines)
    print(body)
    write_result("selective_emulated", TITLE, body)
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
