"""Issue 17 item 2: interleaved virtual stages (Megatron-LM's interleaved 1F1B): simulated, planned and run.

(a) Stage tables (p = 4 cards, equal F = 1, B = 2 per card's quarter of the model, v chunks per card of
    1/v of it): T and bubble of 1F1B, ZB-H1 and interleaved:2 / :4 from the simulator, the peak of
    micro-batch activations a card holds (in units of one card-quarter's activations: sum over its
    chunks of in-flight micro-batches / v, from `schedule/held_virtual.py`), and the messages per
    micro-batch (cuts crossed), with free links and with a link as slow as F + B.
(b) The planner: `hetpipe plan --schedule 1f1b` and ``--schedule interleaved:2`` (the 1F1B answer's
    cards, re-cut into 2 chunks each, `partitioner/interleave.py`) of gpt-demo on the bundled mini
    clusters: predicted T and the fullest card's memory share (every card's usable memory is the
    budget).
(c) Emulated runs: `hetpipe run --emulate` of 1F1B and interleaved:2 plans of gpt-demo (each rank holds
    its chunks, `runtime/interleaved_run.py`): the measured emulated iteration (median of the steps after
    the first) against the plan's predicted T, the per-step losses of both (equal: the same seeded weights
    and data), and the fullest rank's measured peak over the plan's memory.
(d) Equal stages, real compute: `benchmarks/schedules.py --equal-only` (hetpipe interleaved:2 beside hetpipe
    1F1B / ZB-H1 and torch's ZBV, interleaved zero-bubble and interleaved 1F1B schedules; paired medians).

Usage:
    OMP_NUM_THREADS=1 python benchmarks/interleaved.py [--runs-only]
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "interleaved.md"

from hetpipe.schedule.held_virtual import rank_held_terms  # noqa: E402
from hetpipe.schedule.held import stage_held_terms  # noqa: E402
from hetpipe.schedule.simulate import SimCosts, simulate_stages  # noqa: E402

P, F, B = 4, 1.0, 2.0
#: (model, cluster, global batch): m = global batch / 2 is a multiple of the cards the 1F1B plan uses
#: (4 of the 4x3090 box, 3 of the home lab; community-16-mini's plan uses 6 cards)
SCENARIOS = (("gpt-demo", "homogeneous-4x3090", 16), ("gpt-demo", "homogeneous-4x3090", 64),
             ("gpt-demo", "homelab", 12), ("gpt-demo", "homelab-mini", 12), ("gpt-demo", "community-16-mini", 36))


def _table_row(name: str, m: int, link_s: float) -> str:
    v = int(name.split(":")[1]) if name.startswith("interleaved") else 1
    virtual = P * v
    costs = SimCosts(fwd_s=(F / v,) * virtual, bwd_s=(B / v,) * virtual, send_s=(link_s,) * (virtual - 1),
                     bwd_weight_s=(B / 2,) * virtual if name.startswith("zb") else ())
    res = simulate_stages(costs, m, schedule=name)
    if v > 1:
        held = max(sum(c.microbatches for c in t) / v for r in range(P) for t in rank_held_terms(P, r, v, m))
    else:
        held = max(t.microbatches for s in range(P) for t in stage_held_terms(P, s, m, schedule=name))
    return (f"| {name} | {m} | {link_s:g} | {res.iteration_s:.2f} | {res.bubble_fraction:.3f} | {held:g} | "
            f"{virtual - 1} |")


def stage_tables() -> list[str]:
    out = ["| schedule | m | C per cut (s) | T (s) | bubble | peak activations held (card-quarters) | "
           "messages per micro-batch each way |", "|---|---|---|---|---|---|---|"]
    for link_s in (0.0, F + B):
        for m in (8, 32):
            out += [_table_row(name, m, link_s) for name in ("1f1b", "zb-h1", "interleaved:2", "interleaved:4")]
    return out


def planner_rows() -> list[str]:
    from hetpipe.models import build
    from hetpipe.plan.build import partition

    out = ["| model | cluster | m | cards | 1F1B T | interleaved:2 T | change | fullest card 1F1B / interleaved:2 | "
           "plan wall (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for model_name, cluster, gb in SCENARIOS:
        model, inputs = build(model_name, device="meta", batch=2, seq=128)
        path = ROOT / "examples" / "clusters" / f"{cluster}.yaml"
        t0 = time.perf_counter()
        plain = partition(model, str(path), example_inputs=inputs, global_batch=gb, time_limit_s=10.0)
        try:
            inter = partition(model, str(path), example_inputs=inputs, global_batch=gb, time_limit_s=10.0,
                              schedule="interleaved:2")
        except Exception as err:  # noqa: BLE001 - the refusal is the result (one line)
            inter, why = None, str(err).splitlines()[0]
        wall = time.perf_counter() - t0
        full = max(s.memory_bytes / s.usable_bytes for s in plain.stages)
        if inter is None:
            out.append(f"| {model_name} | {cluster} | {plain.training.microbatches} | {len(plain.stages)} | "
                       f"{plain.predicted.iteration_s * 1e3:.1f} ms | refused: {why} | - | {full:.2%} / - | {wall:.0f} |")
            continue
        ifull = max(s.memory_bytes / s.usable_bytes for s in inter.stages)
        change = inter.predicted.iteration_s / plain.predicted.iteration_s - 1
        out.append(f"| {model_name} | {cluster} | {plain.training.microbatches} | {len(plain.stages)} | "
                   f"{plain.predicted.iteration_s * 1e3:.1f} ms | {inter.predicted.iteration_s * 1e3:.1f} ms | "
                   f"{change:+.1%} | {full:.2%} / {ifull:.2%} | {wall:.0f} |")
    return out


#: (cluster, global batch) of the emulated runs: m = 4 on the home lab's two chosen cards, m = 8 on 4 cards
RUNS = (("homelab", 8), ("homogeneous-4x3090", 16))
RUN_STEPS = 5


def emulated_rows() -> list[str]:
    import tempfile

    from hetpipe.models import build
    from hetpipe.plan.build import partition
    from hetpipe.runtime.run import run

    out = ["| cluster | schedule | cards | m | predicted T | measured emulated T | measured / predicted | losses | "
           "fullest rank peak / plan | wall (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cluster, gb in RUNS:
        model, inputs = build("gpt-demo", device="meta", batch=2, seq=128)
        path = ROOT / "examples" / "clusters" / f"{cluster}.yaml"
        for schedule in ("1f1b", "interleaved:2"):
            plan = partition(model, str(path), example_inputs=inputs, global_batch=gb, time_limit_s=10.0,
                             schedule=schedule)
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                rep = run(plan, model="gpt-demo", seq=128, steps=RUN_STEPS, emulate=True, run_dir=tmp)
            wall = time.perf_counter() - t0
            steps = sorted(r.emulated_step_s for r in rep.step_records[1:])
            measured = steps[len(steps) // 2]
            full = max(s.peak_bytes / s.predicted_memory_bytes for s in rep.stages)
            losses = ", ".join(f"{r.loss:.4f}" for r in rep.step_records)
            out.append(f"| {cluster} | {schedule} | {len(plan.stages)} | {plan.training.microbatches} | "
                       f"{plan.predicted.iteration_s * 1e3:.3f} ms | {measured * 1e3:.3f} ms | "
                       f"{measured / plan.predicted.iteration_s:.3f} | {losses} | {full:.3f} | {wall:.0f} |")
    return out


def main() -> None:
    t0 = time.perf_counter()
    if "--runs-only" in sys.argv:
        print("\n".join(emulated_rows()))
        return
    load = os.getloadavg()[0]
    lines = ["# Interleaved virtual stages: priced, planned and run (issue 17, item 2)", "",
             f"`python benchmarks/interleaved.py` -- {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{platform.platform()}, {os.cpu_count()} CPUs; 1-min load {load:.1f} before.", "",
             f"## (a) Stage tables: p = {P}, F = {F:g} s, B = {B:g} s per card's share, v chunks of 1/v each", ""]
    lines += stage_tables()
    lines += ["", "## (b) The planner: gpt-demo (micro-batch 2 x 128), `--schedule 1f1b` vs `interleaved:2`", ""]
    lines += planner_rows()
    lines += ["", f"## (c) Emulated runs: gpt-demo (micro-batch 2 x 128), `hetpipe run --emulate`, {RUN_STEPS} steps "
              "(measured: median emulated step after the first)", ""]
    lines += emulated_rows()
    lines += ["", "## (d) Equal stages, real compute, 2 ranks: `python benchmarks/schedules.py --equal-only --repeats 9` "
              "(its part (a); every rank computes the same 4 of 8 Linear(512) + ReLU blocks; > 1: the column's "
              "schedule is faster than the row's)", ""]
    import subprocess

    eq = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "schedules.py"), "--equal-only", "--repeats", "9"],
                        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines += ["1-min " + eq.stdout.strip().splitlines()[0], "", *eq.stdout.strip().splitlines()[1:]]
    lines += ["", f"{time.perf_counter() - t0:.0f} s wall; 1-min load {os.getloadavg()[0]:.1f} after."]
    text = "\n".join(lines) + "\n"
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
