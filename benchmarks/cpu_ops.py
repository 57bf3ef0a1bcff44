"""Per-op CPU time of a model's forward beside each op's price (issue 17 item 4's per-op profile).

One process pinned to one core with one thread calibrates (`calibrate_device`, on thread CPU time
like `benchmarks/cpu_truth_cputime.py`), then runs the model's forward (with the loss) under a
dispatch mode that times every aten op in thread CPU time and, after the pass, prices that very call:
the op re-runs on meta under `hetpipe.cost_models.flops.CostCounter` and its counts go through
`hetpipe.cost_models.timing.pass_time_s` on the calibrated profile.  The table sums both per aten
op (largest measured first), and the forward's whole CPU time beside the ops' sum: the rest is
Python, autograd and dispatch between the kernels (priced only as the fixed cost per op).

Usage:
    python benchmarks/cpu_ops.py [--model hf-llama] [--iterations 3]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.cpu_truth import BATCH, LLAMA_CONFIG, SEQ  # noqa: E402

#: Rows of the table (the ops with the most measured time).
TOP_OPS = 20


def _op_timer(calls: list[tuple[object, tuple, dict, float]]) -> object:
    """A dispatch mode appending each op's (func, meta args, meta kwargs, thread CPU seconds) to `calls`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    def meta(x: object) -> object:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") if isinstance(
            x, torch.Tensor) else x

    class OpTimer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            t0 = time.thread_time()
            out = func(*args, **kwargs)
            spent = time.thread_time() - t0
            calls.append((func, tree_map(meta, args), tree_map(meta, kwargs), spent))  # priced after the pass
            return out

    return OpTimer()


def _price(calls: list[tuple[object, tuple, dict, float]], profile: object) -> dict[str, list[float]]:
    """Per aten op: [measured s, priced s, calls] (each call re-run on meta under `CostCounter`, `pass_time_s`)."""
    from hetpipe.cost_models.flops import CostCounter
    from hetpipe.cost_models.timing import pass_time_s

    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for func, args, kwargs, spent in calls:
        with CostCounter() as cc:
            func(*args, **kwargs)
        row = totals[str(func.overloadpacket.__name__)]
        row[0] += spent
        row[1] += pass_time_s(cc.work(), profile=profile, precision="fp32")
        row[2] += 1
    return totals


def profile_model(name: str, *, iterations: int) -> tuple[list[list[object]], float, float, float]:
    """(rows, whole forward s, ops' measured s, ops' priced s), per forward (medians over `iterations`)."""
    import torch

    import hetpipe.cost_models.rates as rates
    from hetpipe.cost_models.calibrate import apply_calibration, calibrate_device
    from hetpipe.cost_models.catalog import load_catalog
    from hetpipe.cost_models.cpu_cores import available_cores, pin_cores
    from hetpipe.models import build

    pin_cores(available_cores()[-1:])
    torch.set_num_threads(1)
    rates.CLOCK = time.thread_time
    profile = apply_calibration(load_catalog().entries["cpu"].profile, calibrate_device("cpu", repeats=3))
    model, inputs = build(name, device="cpu", batch=BATCH, seq=SEQ)
    x = inputs[0]

    def forward() -> None:
        out = model(x)
        logits = getattr(out, "logits", out)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())

    forward()
    whole = []
    for _ in range(iterations):
        t0 = time.thread_time()
        forward()
        whole.append(time.thread_time() - t0)
    calls: list[tuple[object, tuple, dict, float]] = []
    with _op_timer(calls):
        for _ in range(iterations):
            forward()
    totals = _price(calls, profile)
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    table = [[op, int(n / iterations), f"{m / iterations * 1e3:.3f} ms", f"{p / iterations * 1e3:.3f} ms",
              f"{m / p:.2f}" if p > 0 else "-"] for op, (m, p, n) in rows[:TOP_OPS]]
    measured = sum(v[0] for v in totals.values()) / iterations
    priced = sum(v[1] for v in totals.values()) / iterations
    return table, statistics.median(whole), measured, priced


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hf-llama", help="a built-in model name, or hf-llama (cpu_truth's Llama)")
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hetpipe-cpu-ops-") as tmp:
        name = args.model
        if name == "hf-llama":
            config = Path(tmp, "config.json")
            config.write_text(json.dumps(LLAMA_CONFIG))
            name = f"hf:{config}"
        load = os.getloadavg()[0]
        table, whole, measured, priced = profile_model(name, iterations=args.iterations)
    body = (f"`{args.model}`, {BATCH} x {SEQ} tokens, forward with the loss, thread CPU time in one pinned process, "
            f"{args.iterations} forwards; load average {load:.1f} on {os.cpu_count()} cores.\n\n"
            f"Whole forward {whole * 1e3:.2f} ms; its aten ops {measured * 1e3:.2f} ms measured, "
            f"{priced * 1e3:.2f} ms priced (ratio {measured / priced:.2f}); the rest, "
            f"{(whole - measured) * 1e3:.2f} ms, is Python, autograd and dispatch between the kernels "
            "(the dispatch mode's own cost inflates it).\n\n"
            + markdown_table(["aten op", "calls per forward", "measured", "priced", "ratio"], table))
    path = write_result(f"cpu_ops_{args.model.replace('-', '_')}", f"CPU ops: {args.model}'s forward op by op", body)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
