"""Per-op CPU time of a model's forward beside each op's price (issue 17 item 4's per-op profile).

One process pinned to one core with one thread calibrates (`calibrate_device`, on thread CPU time
like `benchmarks/cpu_truth_cputime.py`), then runs the model's forward (with the loss) once under a
dispatch mode that records every aten op with copies of its operands, replays the recorded ops back to
back (timing each in thread CPU time, median over replays) and prices each call: the op re-runs on meta
under `hetpipe.cost_models.flops.CostCounter` and its counts go through
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
#: The tiny forward that shows the fixed cost per forward: one sequence of 4 tokens (the kernels' work ~0).
TINY_BATCH, TINY_SEQ = 1, 4


def _op_recorder(calls: list[tuple[object, tuple, dict]]) -> object:
    """A dispatch mode appending each op's (func, args, kwargs) to `calls`, its tensors detached copies.

    Timing inside the mode inflated every op (its Python between the kernels evicts their operands:
    session 13's table summed to 1.4x the whole forward); the recorded calls are timed afterwards,
    replayed back to back (`_replay_times`).
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    def copy(x: object) -> object:
        return x.detach().clone() if isinstance(x, torch.Tensor) else x

    class OpRecorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            calls.append((func, tree_map(copy, args), tree_map(copy, kwargs)))
            return out

    return OpRecorder()


def _replay_times(calls: list[tuple[object, tuple, dict]], *, iterations: int) -> list[float]:
    """Median thread CPU seconds of each recorded call over `iterations` replays of the whole sequence in order
    (caches as the forward leaves them; each timer adds ~1 us, the clock's own system call)."""
    spent: list[list[float]] = [[] for _ in calls]
    for _ in range(iterations + 1):  # the first replay warms up
        for i, (func, args, kwargs) in enumerate(calls):
            t0 = time.thread_time()
            func(*args, **kwargs)
            spent[i].append(time.thread_time() - t0)
    return [statistics.median(s[1:]) for s in spent]


def _price(calls: list[tuple[object, tuple, dict]], times: list[float], profile: object) -> dict[str, list[float]]:
    """Per aten op: [measured s, priced s, calls] (each call re-run on meta under `CostCounter`, `pass_time_s`)."""
    import torch
    from torch.utils._pytree import tree_map

    from hetpipe.cost_models.flops import CostCounter
    from hetpipe.cost_models.timing import pass_time_s

    def meta(x: object) -> object:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") if isinstance(
            x, torch.Tensor) else x

    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for (func, args, kwargs), spent in zip(calls, times):
        with CostCounter() as cc:
            func(*tree_map(meta, args), **tree_map(meta, kwargs))
        row = totals[str(func.overloadpacket.__name__)]
        row[0] += spent
        row[1] += pass_time_s(cc.work(), profile=profile, precision="fp32")
        row[2] += 1
    return totals


def _forward(model: object, x: object) -> None:
    """The model's forward with the benchmark's loss (cross entropy of the logits against the tokens)."""
    import torch

    out = model(x)
    logits = getattr(out, "logits", out)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())


def _whole_forward_s(name: str, *, batch: int, seq: int, iterations: int) -> tuple[float, object, object]:
    """(median thread CPU seconds of the forward with the loss at batch x seq, the model, its tokens)."""
    from hetpipe.models import build

    model, inputs = build(name, device="cpu", batch=batch, seq=seq)
    x = inputs[0]
    _forward(model, x)  # warm-up
    whole = []
    for _ in range(iterations):
        t0 = time.thread_time()
        _forward(model, x)
        whole.append(time.thread_time() - t0)
    return statistics.median(whole), model, x


def _priced_forward_s(name: str, profile: object, *, batch: int, seq: int) -> float:
    """The planner's forward price of the whole model (its units' forward times, the loss on the last unit)."""
    from hetpipe.plan.build import capture_builtin, profile_unit_times

    graph = capture_builtin(name, batch=batch, seq=seq, optimizer="adam", precision="fp32", granularity="block")
    return sum(t.fwd for t in profile_unit_times(graph, profile))


def profile_model(name: str, *, iterations: int) -> dict[str, object]:
    """The op table and, per forward (medians over `iterations`): the whole forward measured and priced, its aten
    ops' measured and priced sums, and the same forward at `TINY_BATCH` x `TINY_SEQ` tokens measured and priced
    (there the kernels' work is nothing: what is left is the fixed cost per forward)."""
    import torch

    import hetpipe.cost_models.rates as rates
    from hetpipe.cost_models.calibrate import apply_calibration, calibrate_device
    from hetpipe.cost_models.catalog import load_catalog
    from hetpipe.cost_models.cpu_cores import available_cores, pin_cores

    pin_cores(available_cores()[-1:])
    torch.set_num_threads(1)
    rates.CLOCK = time.thread_time
    profile = apply_calibration(load_catalog().entries["cpu"].profile, calibrate_device("cpu", repeats=3))
    whole, model, x = _whole_forward_s(name, batch=BATCH, seq=SEQ, iterations=iterations)
    calls: list[tuple[object, tuple, dict]] = []
    with _op_recorder(calls):
        _forward(model, x)
    totals = _price(calls, _replay_times(calls, iterations=iterations), profile)
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    table = [[op, int(n), f"{m * 1e3:.3f} ms", f"{p * 1e3:.3f} ms",
              f"{m / p:.2f}" if p > 0 else "-"] for op, (m, p, n) in rows[:TOP_OPS]]
    tiny = _whole_forward_s(name, batch=TINY_BATCH, seq=TINY_SEQ, iterations=max(iterations, 9))[0]
    return {"table": table, "whole": whole, "whole_priced": _priced_forward_s(name, profile, batch=BATCH, seq=SEQ),
            "ops": sum(v[0] for v in totals.values()), "ops_priced": sum(v[1] for v in totals.values()),
            "tiny": tiny, "tiny_priced": _priced_forward_s(name, profile, batch=TINY_BATCH, seq=TINY_SEQ)}


def _body(model: str, res: dict, *, iterations: int, load: float) -> str:
    """The result file's text (module docstring: what each figure is)."""
    ms = {k: v * 1e3 for k, v in res.items() if k != "table"}
    return (f"`{model}`, {BATCH} x {SEQ} tokens, forward with the loss, thread CPU time in one pinned process, "
            f"{iterations} replays of its recorded aten ops; load average {load:.1f} on {os.cpu_count()} cores.\n\n"
            f"Whole forward {ms['whole']:.2f} ms measured, {ms['whole_priced']:.2f} ms priced by the planner "
            f"(ratio {res['whole'] / res['whole_priced']:.2f}); its aten ops replayed {ms['ops']:.2f} ms, "
            f"{ms['ops_priced']:.2f} ms priced (ratio {res['ops'] / res['ops_priced']:.2f}); the rest, "
            f"{ms['whole'] - ms['ops']:.2f} ms, is Python, autograd and dispatch between the kernels "
            "(the replay calls each op from Python: ~1-2 us more per op than the model's C++ calls).\n\n"
            f"Fixed cost per forward: at {TINY_BATCH} x {TINY_SEQ} tokens (the kernels' work is nothing) the forward "
            f"took {ms['tiny']:.2f} ms, priced {ms['tiny_priced']:.2f} ms (the per-op fixed costs `profile --calibrate` "
            f"measures): {ms['tiny'] - ms['tiny_priced']:.2f} ms per forward is not priced (an upper bound: "
            "matmuls of 4 rows run below the 1024-row rates, so part of it is work).\n\n"
            + markdown_table(["aten op", "calls per forward", "measured", "priced", "ratio"], res["table"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hf-llama", help="a built-in model name, or hf-llama (cpu_truth's Llama)")
    ap.add_argument("--iterations", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hetpipe-cpu-ops-") as tmp:
        name = args.model
        if name == "hf-llama":
            config = Path(tmp, "config.json")
            config.write_text(json.dumps(LLAMA_CONFIG))
            name = f"hf:{config}"
        load = os.getloadavg()[0]
        res = profile_model(name, iterations=args.iterations)
    path = write_result(f"cpu_ops_{args.model.replace('-', '_')}", f"CPU ops: {args.model}'s forward op by op",
                        _body(args.model, res, iterations=args.iterations, load=load))
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
