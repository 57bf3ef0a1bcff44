"""Run the benchmark suite (or named benchmarks) and rewrite benchmarks/RESULTS.md.

Each benchmark script writes benchmarks/results/<name>.md (its table, medians and ratios
measured side by side in one run, the date and the machine); this script runs them and
concatenates those files, in the order below, into RESULTS.md.

Usage:
    python benchmarks/run_all.py                 # every benchmark (~10 minutes on 2 cores)
    python benchmarks/run_all.py planner_speed   # one, then re-assemble RESULTS.md
    python benchmarks/run_all.py --assemble      # only re-assemble from results/*.md
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ("planner_speed", "planner_scale", "limit_trace", "planner_anneal", "pace_relaxation", "pace_windows", "finer_walk", "plan_quality", "capture_7b", "simulator", "demo_run", "simulator_fidelity",
         "objective_history", "objective", "runtime_emulated", "runtime_vs_torch", "replicas", "model_zoo", "memory_levers",
         "memory_tightness", "memory_tightness_brute", "selective_recompute", "selective_emulated", "recompute_emulated", "offload_emulated", "sharding", "checkpoint", "faults", "tensor_parallel",
         "tp_emulated", "tp_cpsat", "cpu_truth", "gpu_check", "cpu_link", "cpu_link_cache", "cpu_link_cuts", "cpu_link_idle", "schedules", "interleaved")
#: Sections kept as written (history, no script to rerun).
STATIC = ("objective_history",)
#: Sections measured on a lent GPU (the device tool); rerun only where CUDA is present.
NEEDS_GPU = ("gpu_check",)
#: Further runs of one script with its arguments, each writing its own results/<file>.md after the script's own.
VARIANTS = {"cpu_truth": (("cpu_truth_cpu_clock", ("--clock", "cpu")),),
            "planner_scale": (("planner_scale_60s", ("--time-limit", "60")),),
            "tp_emulated": (("tp_emulated_hf_llama_tiny", ("--model", "hf-llama-tiny")),
                            ("tp_emulated_hf_gpt2_tiny", ("--model", "hf-gpt2-tiny")))}


def torch_cuda_available() -> bool:
    """Is there a CUDA device for the `NEEDS_GPU` sections (asked in a child: this script imports no torch)?"""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.call([sys.executable, "-c", probe]) == 0


def assemble() -> Path:
    parts = ["# hetpipe benchmark results\n",
             "Written by `python benchmarks/run_all.py`; each section by its own script "
             "(`benchmarks/<name>.py`), with its date and machine.\n"]
    for name in ORDER:
        for file in (name, *(file for file, _ in VARIANTS.get(name, ()))):
            path = HERE / "results" / f"{file}.md"
            parts.append(path.read_text() if path.exists() else f"## {file}\n\n_not run yet_\n")
    out = HERE / "RESULTS.md"
    out.write_text("\n".join(parts))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"any of {', '.join(ORDER)}")
    ap.add_argument("--assemble", action="store_true", help="do not run anything; rebuild RESULTS.md")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in ORDER]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(ORDER)}")
    failed = []
    if not args.assemble:
        gpu = torch_cuda_available()
        for name in [n for n in args.names or ORDER if n not in STATIC and (gpu or n not in NEEDS_GPU)]:
            print(f"== {name}", flush=True)
            for extra in ((), *(args for _, args in VARIANTS.get(name, ()))):
                if subprocess.call([sys.executable, str(HERE / f"{name}.py"), *extra]) != 0:
                    failed.append(" ".join((name, *extra)))
    print(f"wrote {assemble()}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
