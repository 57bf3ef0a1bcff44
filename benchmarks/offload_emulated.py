"""Issue 14: a plan that fits only by offloading optimizer state, run on an emulated small lab.

For ``gpt-demo`` (fp32, Adam) on two mini cards (the mini home lab's RTX 3090 and RTX 4090, see
``examples/clusters/homelab-mini.yaml``, with 16 MB of memory each instead of 48 MB, and the
host link and host memory bandwidth scaled by the same 1/1000 as their compute: PCIe 4.0 x16
32 GB/s -> 32 MB/s, DDR4-3200 dual channel 51.2 GB/s -> 51.2 MB/s), this script

1. plans with ``offload="never"`` (expected: no plan fits) and ``offload="auto"`` (the planner
   keeps some stages' Adam moments on the host);
2. runs the offload plan with ``hetpipe run --emulate`` ``--repeats`` times: measured iteration
   (emulated seconds, median of the steps after the first) vs the plan's T (target: within 10%),
   each stage's held bytes at its peak vs the plan's M_s (target: within 5%, never above), no
   emulated OOM;
3. runs the same stages without offload and checks that it fails with an emulated OOM on a
   stage the planner predicts not to fit;
4. writes ``benchmarks/results/offload_emulated.md``.

Usage:
    python benchmarks/offload_emulated.py [--steps 4] [--repeats 2] [--batch 1] [--seq 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.recompute_emulated import MEMORY_TOLERANCE, MIB, TIME_TOLERANCE, Outcome, run_once  # noqa: E402

MODEL = "gpt-demo"
TITLE = "Optimizer-state offload, emulated (issue 14)"
_CARD = {"reserve": "4MB", "memory": "16MB"}
#: The two desk cards of homelab-mini.yaml with 16 MB each; host figures / 1000 like their compute.
CLUSTER = {"name": "small-lab-mini", "nodes": [{
    "name": "desk", "intra": "pcie-host", "network": {"bandwidth": "1Gbit/s", "latency": "0.2ms"},
    "host_link": "32MB/s", "host_memory_bandwidth": "51.2MB/s",
    "devices": [
        {"name": "rtx3090-mini", **_CARD, "tensor_tflops": 0.071, "fp32_tflops": 0.03558,
         "memory_bandwidth": "936MB/s", "p2p": True, "source": "rtx3090 catalog row / 1000"},
        {"name": "rtx4090-mini", **_CARD, "tensor_tflops": 0.1652, "fp32_tflops": 0.08258,
         "memory_bandwidth": "1008MB/s", "source": "rtx4090 catalog row / 1000"}]}]}

log = logging.getLogger("benchmarks.offload_emulated")


def make_plans(batch: int, seq: int, microbatches: int) -> tuple[object, object, str]:
    """(the planner's offload plan, the same stages without offload re-evaluated, what ``never`` says)."""
    import hetpipe
    from hetpipe.cost_models.cluster import cluster_from_dict
    from hetpipe.errors import InfeasibleError
    from hetpipe.models import build, training_loss
    from hetpipe.partitioner.problem import evaluate
    from hetpipe.plan.build import plan_stages
    from hetpipe.plan.offload_note import OFFLOAD_NOTE
    from hetpipe.plan.schema import problem_from_plan, stages_from_plan

    cluster = cluster_from_dict(CLUSTER, source="offload_emulated.CLUSTER")
    meta, inputs = build(MODEL, device="meta", batch=batch, seq=seq)
    fn, targets = training_loss(MODEL, inputs)
    common = dict(example_inputs=inputs, global_batch=batch * microbatches, loss_fn=fn, targets=targets,
                  recompute="none")
    try:
        hetpipe.partition(meta, cluster, offload="never", **common)
        never = "fits without offload"
    except InfeasibleError as err:
        never = str(err).splitlines()[0]
    plan = hetpipe.partition(meta, cluster, offload="auto", **common)
    problem = dataclasses.replace(problem_from_plan(plan), offload="never")
    stages = tuple(dataclasses.replace(s, offload=False) for s in stages_from_plan(plan))
    ev = evaluate(problem, stages)
    plain = dataclasses.replace(plan, stages=plan_stages(problem, stages, ev),
                                predicted=dataclasses.replace(plan.predicted, iteration_s=ev.iteration_s),
                                solver=dataclasses.replace(plan.solver, objective_s=ev.iteration_s),
                                cost_model={k: v for k, v in plan.cost_model.items() if k != OFFLOAD_NOTE})
    return plan, plain, never


def _stages(plan: object) -> str:
    return " / ".join(f"{s.device} {s.first_unit}-{s.last_unit}" + (" offload" if s.offload else "")
                      for s in plan.stages)


def check(plan: object, plain: object, runs: list[Outcome], plain_run: Outcome) -> list[str]:
    """The issue's targets; returns the misses (empty: all met)."""
    misses = []
    for r in runs:
        if r.error:
            misses.append(f"offload plan failed: {r.error}")
            continue
        if abs(r.measured_s / r.predicted_s - 1) > TIME_TOLERANCE:
            misses.append(f"measured {r.measured_s:.4g} vs predicted {r.predicted_s:.4g} emulated s")
        for st, held in zip(plan.stages, r.peaks):
            if not (1 - MEMORY_TOLERANCE) * st.memory_bytes <= held <= st.memory_bytes:
                misses.append(f"stage {st.index}: held {held} B vs M_s {st.memory_bytes} B")
    over = [s.index for s in plain.stages if s.memory_bytes > s.usable_bytes]
    oom = re.search(r"emulated OOM on rank \d+ \(stage (\d+)", plain_run.error)
    if not over:
        misses.append("the stages without offload are predicted to fit")
    elif oom is None or int(oom.group(1)) not in over:
        misses.append(f"without offload: expected an emulated OOM on stage(s) {over}, got {plain_run.error or 'a run'}")
    return misses


def report_lines(plan: object, plain: object, never: str, runs: list[Outcome], plain_run: Outcome,
                 args: argparse.Namespace) -> list[str]:
    ok = [r for r in runs if not r.error]
    measured = statistics.median(r.measured_s for r in ok) if ok else float("nan")
    pred, sim = plan.predicted.iteration_s, ok[0].simulated_s if ok else float("nan")
    rows = [["offload (planner, auto)", _stages(plan), f"{pred:.4g}", f"{sim:.4g}", f"{measured:.4g}",
             f"{measured / pred:.3f}", str(sum(r.overruns for r in ok)), "ran" if len(ok) == len(runs) else runs[0].error],
            ["same stages, no offload", _stages(plain), f"{plain.predicted.iteration_s:.4g}", "-", "-", "-", "-",
             plain_run.error or "ran (expected an emulated OOM)"]]
    lines = [markdown_table(["plan", "stages (device units)", "predicted T (emu s)", "simulated (emu s)",
                             "measured (emu s)", "measured / predicted", "overruns", "result"], rows), ""]
    mem = []
    for k, (st, pst) in enumerate(zip(plan.stages, plain.stages)):
        held = statistics.median(r.peaks[k] for r in ok) if ok else float("nan")
        mem.append([str(k), st.device, "yes" if st.offload else "no", f"{st.offload_bytes / MIB:.2f}",
                    f"{st.offload_s * 1e3:.1f}", f"{held / MIB:.2f}", f"{st.memory_bytes / MIB:.2f}",
                    f"{held / st.memory_bytes:.4f}", f"{pst.memory_bytes / MIB:.2f}", f"{st.usable_bytes / MIB:.2f}"])
    lines += [markdown_table(["stage", "device", "offloads", "state on host MiB", "tail O_s (emu ms)",
                              "held MiB (measured peak)", "plan M_s MiB", "held / M_s", "M_s without offload MiB",
                              "usable MiB"], mem), ""]
    lines.append(f"`{MODEL}`, micro-batch {args.batch} x {args.seq} tokens, {plan.training.microbatches} micro-batches, "
                 f"fp32, Adam, 1F1B, recompute none; two mini cards of 16 MB (12 MB usable), host link 32 MB/s and "
                 f"host memory 51.2 MB/s (the real figures / 1000, like the mini cards' compute); {args.steps} steps "
                 f"per run (the first excluded), {len(runs)} runs. `offload=\"never\"` planning: {never}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import benchmarks.recompute_emulated as rc

    rc.MODEL = MODEL
    plan, plain, never = make_plans(args.batch, args.seq, args.microbatches)
    runs = [run_once(plan, steps=args.steps, seq=args.seq) for _ in range(args.repeats)]
    plain_run = run_once(plain, steps=2, seq=args.seq)
    misses = check(plan, plain, runs, plain_run)
    lines = report_lines(plan, plain, never, runs, plain_run, args) + [""]
    lines.append("Targets met (time within 10%, held memory within 5% and never above, no OOM with offload, "
                 "the predicted OOM without)." if not misses else "Targets missed: " + "; ".join(misses))
    body = "\n".join(lines)
    print(body)
    write_result("offload_emulated", TITLE, body)
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
