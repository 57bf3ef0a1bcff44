"""The load-robust half of the CPU truth benchmark: one pinned process, thread CPU time throughout.

On a shared machine a pinned stage is slowed by whoever else runs on its core, in the calibration or
in the run (``benchmarks/cpu_truth.py``).  Here one process, pinned to one core with one thread,
calibrates (`hetpipe.cost_models.calibrate.calibrate_device`) and then runs each whole model's
forward, backward and Adam step, every figure timed with ``time.thread_time`` (the CPU time of
the thread: time other processes hold the core does not count).  Predicted figures come from the
captured units on that calibration as each cut of issue 17 item 4 priced them (`_cuts`: before, first,
second, now), so the ratios compare the cost models on the same measurement.  Per stage (`_stage_forwards`,
session 14): the runtime's own stage modules of a 2-stage split at the middle unit, each forward (the
loss on the last) in thread CPU time beside the planner's price of its units.  What load still
changes (caches and branch predictors shared with other processes) shows as the spread over rounds.
The host's own drift (session 16): the fixed reference workload (`hetpipe.cost_models.host_reference`)
timed in this process right before and after each calibration and right after each model's
measurement, so the table can set the reference's CPU seconds then / at the calibration beside the
ratios (``reference`` in each row).

Example:
    $ python benchmarks/cpu_truth_cputime.py --models gpt-demo --rounds 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Timed iterations per round (after two warm-up iterations); the median is kept.
ITERATIONS = 5


def _measure(name: str, *, batch: int, seq: int) -> dict[str, object]:
    """Median thread CPU seconds of the whole model's forward (with the loss), backward and Adam step, and under
    ``stages`` each iteration's stage forwards (`_stage_forwards`) with the graph and the split."""
    import torch

    from hetpipe.models import build

    model, inputs = build(name, device="cpu", batch=batch, seq=seq)
    x = inputs[0]
    opt = torch.optim.Adam(model.parameters())  # foreach off on CPU tensors: the per-tensor loop

    def once() -> tuple[float, float, float]:
        t0 = time.thread_time()
        out = model(x)
        logits = getattr(out, "logits", out)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
        t1 = time.thread_time()
        loss.backward()
        t2 = time.thread_time()
        opt.step()
        t3 = time.thread_time()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, t3 - t2

    stage_once, graph, half = _stage_forwards(name, batch=batch, seq=seq)
    for _ in range(2):
        once()
        stage_once()
    timed, staged = [], []
    for _ in range(ITERATIONS):  # the whole model and its stages in turn: one load for both
        timed.append(once())
        staged.append(stage_once())
    f, b, s = zip(*timed)
    return {"F": statistics.median(f), "B": statistics.median(b), "S": statistics.median(s),
            "stages": (staged, graph, half)}


def _cuts(profile: object) -> tuple[tuple[str, object], ...]:
    """`profile` as each cut of issue 17 item 4 priced: "before" (the roofline and the foreach step), "first"
    (per-op rates without the matmul shapes, the per-tensor loop's ops on the fused pass's bytes), "second"
    (also matmul shapes, the loop's own bytes, backward and view costs per op) and "now" (also the fixed
    cost per forward op measured on tiny transformers and the held activations' bytes at their measured
    rate, `hetpipe.cost_models.forward_fixed`)."""
    from hetpipe.cost_models.work import FORWARD_OP_KEY, HELD_KEY, is_matmul_key

    second = dataclasses.replace(profile, op_rates=tuple((k, r) for k, r in profile.op_rates
                                                         if k not in (FORWARD_OP_KEY, HELD_KEY)))
    first = dataclasses.replace(second, op_rates=tuple((k, r) for k, r in second.op_rates if not is_matmul_key(k)),
                                step_bytes_s=None)
    before = dataclasses.replace(profile, op_rates=(), step_op_s=None, step_bytes_s=None)
    return (("before", before), ("first", first), ("second", second), ("now", profile))


def _predict(name: str, profile: object, *, batch: int, seq: int) -> dict[str, dict[str, float]]:
    """Whole-model F, B, S on `profile` as each cut priced (`_cuts`), from the planner's own tables."""
    from hetpipe.plan.build import capture_builtin, profile_step_table, profile_unit_times

    graph = capture_builtin(name, batch=batch, seq=seq, optimizer="adam", precision="fp32", granularity="block")
    out = {}
    for label, prof in _cuts(profile):
        times = profile_unit_times(graph, prof)  # the planner's own per-unit F, B and S tables
        f, b = sum(t.fwd for t in times), sum(t.bwd for t in times)
        shares, fixed_s = profile_step_table(graph, prof)
        out[label] = {"F": f, "B": b, "S": sum(shares) + fixed_s}
    return out


def _stage_programs(name: str, *, batch: int, seq: int) -> tuple[object, list, object, object]:
    """(captured graph, the runtime's two stage modules split at the middle unit, the loss fn, its targets)."""
    import torch

    from hetpipe.models import build, training_loss
    from hetpipe.plan.build import capture_builtin
    from hetpipe.runtime.stage.buffers import ModelBuffers
    from hetpipe.runtime.stage.build import build_stage, split_stages

    model, inputs = build(name, device="cpu", batch=batch, seq=seq)
    graph = capture_builtin(name, batch=batch, seq=seq, optimizer="adam", precision="fp32", granularity="block")
    half = len(graph.units) // 2
    mapping = {node: int(u.index >= half) for u in graph.units for node in u.node_names}
    program = split_stages(graph.module, mapping, num_stages=2,
                           example_inputs=tuple(torch.empty_like(t, device="meta") for t in inputs))
    stages = [build_stage(program, k, state_dict=model.state_dict(), device="cpu", buffers=ModelBuffers(model))
              for k in (0, 1)]
    loss_fn, targets = training_loss(name, inputs)
    return graph, [stages, inputs], loss_fn, targets


def _stage_forwards(name: str, *, batch: int, seq: int) -> tuple[Callable[[], tuple[float, float]], object, int]:
    """(a call timing one forward of each stage of a 2-stage split at the middle unit: the runtime's own stage
    modules, the loss on the last as `runtime.execute.compute` runs it, thread CPU seconds; the captured graph;
    the first unit of stage 1).  `_measure` calls it between the whole model's iterations, so both see one load."""
    graph, (stages, inputs), loss_fn, targets = _stage_programs(name, batch=batch, seq=seq)

    def once() -> tuple[float, float]:
        t0 = time.thread_time()
        out = stages[0](*inputs)
        t1 = time.thread_time()
        sent = tuple(t.detach().requires_grad_(spec.requires_grad) for t, spec in zip(
            out if isinstance(out, (tuple, list)) else (out,), stages[1].in_cut.tensors))  # as the next rank gets it
        t2 = time.thread_time()
        loss = loss_fn(stages[1](*sent), targets)  # held past the clock: freeing its graph is no part of F
        t3 = time.thread_time()
        del loss
        return t1 - t0, t3 - t2

    return once, graph, len(graph.units) // 2


def _stage_rows(name: str, profile: object, *, batch: int, seq: int, spent: list[tuple[float, float]],
                graph: object, half: int) -> list[dict[str, float]]:
    """Per stage: the median measured forward and the planner's price of its units ("now")."""
    from hetpipe.plan.build import profile_unit_times

    times = profile_unit_times(graph, profile)  # the planner's own per-unit table
    return [{"stage": k, "measured": statistics.median(t[k] for t in spent),
             "predicted": sum(t.fwd for u, t in zip(graph.units, times) if (u.index >= half) == bool(k))}
            for k in (0, 1)]


def run(models: list[tuple[str, str]], *, batch: int, seq: int, rounds: int) -> list[dict]:
    """Per round and model: measured and predicted figures (this process pinned to the last core)."""
    import torch

    import hetpipe.cost_models.rates as rates
    from hetpipe.cost_models.calibrate import apply_calibration, calibrate_device
    from hetpipe.cost_models.catalog import load_catalog
    from hetpipe.cost_models.cpu_cores import available_cores, pin_cores
    from hetpipe.cost_models.host_reference import time_reference

    core = available_cores()[-1:]
    pin_cores(core)
    torch.set_num_threads(1)
    rates.CLOCK = time.thread_time  # the calibration on the same clock as the model (module docstring)
    rows = []
    for r in range(rounds):
        at_calibration = [dataclasses.asdict(time_reference(cores=core))]  # the host's speed around the calibration
        profile = apply_calibration(load_catalog().entries["cpu"].profile, calibrate_device("cpu", repeats=3))
        at_calibration.append(dataclasses.asdict(time_reference(cores=core)))
        for label, name in models:
            measured = _measure(name, batch=batch, seq=seq)
            spent, graph, half = measured.pop("stages")
            rows.append({"round": r, "model": label, "measured": measured,
                         **_predict(name, profile, batch=batch, seq=seq), "load": os.getloadavg()[0],
                         "stages": _stage_rows(name, profile, batch=batch, seq=seq, spent=spent, graph=graph,
                                               half=half),
                         "reference": {"calibration": at_calibration,
                                       "measure": [dataclasses.asdict(time_reference(cores=core))]}})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-demo", help="label=name pairs or names, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    models = [tuple(m.split("=", 1)) if "=" in m else (m, m) for m in args.models.split(",") if m]
    rows = run(models, batch=args.batch, seq=args.seq, rounds=args.rounds)
    text = json.dumps(rows, indent=1)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
