"""Issue #2: capture a 7B Llama on the meta device within 60 s and 4 GB of RSS.

Each repeat runs in a fresh process (peak RSS is per process: ``resource.getrusage``'s
``ru_maxrss``) that builds ``llama-7b`` on meta (batch 1 x 4096 tokens, the built-in
default) and captures it with the default options.  The script prints a table of the
medians (capture wall time, whole-process wall time including ``import torch`` and the
model build, peak RSS, units, parameters) next to the targets and writes
``benchmarks/results/capture_7b.md``.

Usage:
    python benchmarks/capture_7b.py [--repeats 3] [--model llama-7b]

Example:
    $ python benchmarks/capture_7b.py --repeats 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "capture_7b.md"
WALL_TARGET_S = 60.0  # issue #2
RSS_TARGET_BYTES = 4 * 1024**3  # issue #2: < 4 GB
LLAMA_7B_PARAMS = 6_738_415_616  # Llama-2-7B (hetpipe.models.llama)


def child(model_name: str) -> dict[str, float]:
    """One measurement, in this process: build on meta, capture, report."""
    import resource

    t0 = time.perf_counter()
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture

    model, inputs = build(model_name, device="meta")
    t1 = time.perf_counter()
    graph = capture(model, inputs, name=model_name)
    t2 = time.perf_counter()
    return {
        "capture_s": t2 - t1,
        "process_s": t2 - t0,
        "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "units": graph.num_units,
        "params": graph.param_count,
        "fwd_flops": graph.total("fwd_flops"),
        "bwd_flops": graph.total("bwd_flops"),
        "tracer": graph.tracer,
    }


def _run_child(model_name: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", "--model", model_name], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(runs: list[dict[str, float]], model_name: str) -> list[str]:
    med = {k: statistics.median(r[k] for r in runs) for k in ("capture_s", "process_s", "rss_bytes")}
    first = runs[0]
    rows = [
        ("capture wall (median)", f"{med['capture_s']:.2f} s", f"< {WALL_TARGET_S:.0f} s",
         f"{med['capture_s'] / WALL_TARGET_S:.3f}"),
        ("process wall incl. import + build (median)", f"{med['process_s']:.2f} s", f"< {WALL_TARGET_S:.0f} s",
         f"{med['process_s'] / WALL_TARGET_S:.3f}"),
        ("peak RSS (median)", f"{med['rss_bytes'] / 2**20:.0f} MiB", f"< {RSS_TARGET_BYTES / 2**30:.0f} GiB",
         f"{med['rss_bytes'] / RSS_TARGET_BYTES:.3f}"),
        ("units", f"{first['units']}", "34 (embed + 32 layers + head)", ""),
        ("parameters", f"{first['params']:,}", f"{LLAMA_7B_PARAMS:,}" if model_name == "llama-7b" else "", ""),
        ("forward / backward FLOPs per micro-batch", f"{first['fwd_flops']:.3e} / {first['bwd_flops']:.3e}", "", ""),
    ]
    lines = ["| quantity | measured | target | ratio |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes (medians reported)")
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model)))
        return 0
    runs = [_run_child(args.model) for _ in range(args.repeats)]
    ok = all(r["capture_s"] < WALL_TARGET_S and r["rss_bytes"] < RSS_TARGET_BYTES for r in runs)
    if args.model == "llama-7b":
        ok &= all(r["params"] == LLAMA_7B_PARAMS for r in runs)
    import torch

    doc = [
        f"# Capture of `{args.model}` on the meta device",
        "",
        f"`python benchmarks/capture_7b.py --repeats {args.repeats}` -- {time.strftime('%Y-%m-%d')}, "
        f"{platform.platform()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}; batch 1 x 4096 tokens, default options, tracer `{runs[0]['tracer']}`; "
        f"each repeat a fresh process.",
        "",
        *_table(runs, args.model),
        "",
        "Per run (capture s, process s, RSS MiB): "
        + "; ".join(f"{r['capture_s']:.2f}, {r['process_s']:.2f}, {r['rss_bytes'] / 2**20:.0f}" for r in runs),
        "",
        f"Verdict: {'targets met' if ok else 'targets NOT met'}.",
    ]
    from benchmarks.common import emit

    emit(doc, args.output)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
