"""Issue 12 item 3: at which --time-limit is gpt2-xl on 64 cards within 2% (`solvers/finer_walk.py`, `pace_search`)?

planner_scale.py's gpt2-xl row on 64 cards (`planner_scale.run_case`: the estimate's search, then `verify` with
what it leaves) at several time limits, `--runs` times each; each row: the schedule T, the bound, the gap, the
annealing's passes (`pace_search.anneal_passes`' log line: more passes where the limit leaves time), whether the finer
kind cut's walk ran (its log line), the wall and the process's CPU seconds.  The clock the deadlines read is the
wall (`time.perf_counter`), so the load (stated) changes what fits.

With `--seeds N`, a second table: `anneal_passes` from the starts `verify` annealed from in the first run (the two of
least windowed pace among its candidates, window start and walks' placements), seeds 0 .. N - 1 (x 100), on a clock
of CPU seconds with 60 s to spare: the replayed T after the first pass and after the passes, their count and CPU s.

Usage:
    python benchmarks/finer_walk.py [--limits 10 30 60] [--runs 1] [--seeds 0]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.planner_scale import run_case  # noqa: E402
from hetpipe.partitioner.problem import evaluate  # noqa: E402
from hetpipe.partitioner.solvers import pace_search  # noqa: E402
from hetpipe.partitioner.solvers import verify as verify_module  # noqa: E402

#: The same row before `anneal_passes` (one annealing pass whatever the limit), kept with the table it explains.
BEFORE = ("Before `pace_search.anneal_passes` (one annealing pass of fixed work whatever the limit; the local search had the "
          "rest of the searches' time): session 16 at load 5.1-5.4, --time-limit 10 / 30 / 60 s -> T 3.294 / 3.294 / "
          "3.293 s, bound 3.108 / 3.192 / 3.198 s, gap 5.66 / 3.09 / 2.89%; main this session (session 17, load 3.2-4.5, "
          "one run each, the hour of the table): T 3.294 / 3.293 / 3.293 s, bound 3.110 / 3.198 / 3.198 s, gap "
          "5.58 / 2.89 / 2.89%, wall 10.0 / 29.8 / 36.5 s.  The finer walk's cut proves 3.198 s at most (its walk to "
          "the end), which certifies 2% only for T <= 3.262 s: the T side had to move.")
#: CPU seconds each seed's passes may take at most (a guard: they end by themselves in 4-8 s).
SEED_CPU_S = 60.0


class _Lines(logging.Handler):
    """Keeps the finer walk's and the annealing's log messages, by logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: dict[str, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.setdefault(record.name, []).append(record.getMessage())


def _recording_starts(seen: list[tuple]) -> None:
    """`verify`'s annealing wrapped: each call's (problem, starts, floor) appended to `seen`."""
    real = verify_module.anneal_passes

    def anneal_passes(problem, starts, *, deadline, floor_s=0.0, **kw):
        seen.append((problem, [tuple(s) for s in starts], floor_s))
        return real(problem, starts, deadline=deadline, floor_s=floor_s, **kw)

    verify_module.anneal_passes = anneal_passes


def seed_rows(problem, starts, floor_s: float, seeds: int) -> list[list[object]]:
    """One row per seed: `anneal_passes` on a CPU-second clock (module docstring)."""
    saved, real_chains, firsts = pace_search.time, pace_search.anneal_chains, []

    def chains(*args, **kw):
        found = real_chains(*args, **kw)
        firsts.append(found)
        return found

    rows = []
    try:
        pace_search.time, pace_search.anneal_chains = SimpleNamespace(perf_counter=time.process_time), chains
        for seed in range(seeds):
            firsts.clear()
            began = time.process_time()
            found = pace_search.anneal_passes(problem, starts, deadline=began + SEED_CPU_S, seed=100 * seed,
                                              floor_s=floor_s)
            rows.append([100 * seed, f"{evaluate(problem, firsts[0]).iteration_s:.4f}",
                         f"{evaluate(problem, found).iteration_s:.4f}", len(firsts),
                         f"{time.process_time() - began:.1f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    finally:
        pace_search.time, pace_search.anneal_chains = saved, real_chains
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limits", type=float, nargs="+", default=[10.0, 30.0, 60.0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=0)
    args = ap.parse_args(argv)
    lines, seen = _Lines(), []
    for name in ("hetpipe.partitioner.solvers.finer_walk", "hetpipe.partitioner.solvers.pace_search"):
        logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger(name).addHandler(lines)
    _recording_starts(seen)
    rows = []
    for _ in range(args.runs):
        for limit in args.limits:
            lines.lines.clear()
            cpu, load = time.process_time(), os.getloadavg()[0]
            row = run_case("gpt2-xl", 64, time_limit_s=limit)
            rows.append([f"{limit:g}", row[9], row[10], row[11],
                         "; ".join(lines.lines.get("hetpipe.partitioner.solvers.pace_search", [])) or "not run",
                         "; ".join(lines.lines.get("hetpipe.partitioner.solvers.finer_walk", []))
                         or "not asked (gap <= 2%)", row[12], f"{time.process_time() - cpu:.1f}", f"{load:.1f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    table = markdown_table(["limit (s)", "schedule T (s)", "bound (s)", "gap", "annealing", "finer walk", "wall (s)",
                            "CPU (s)", "load (1 min)"], rows)
    body = f"{__doc__.split('Usage:')[0].strip()}\n\n{table}\n\n{BEFORE}\n"
    if args.seeds and seen:
        problem, starts, floor_s = seen[0]
        load = os.getloadavg()[0]
        seeded = markdown_table(["seed", "T after the first pass (s)", "T after the passes (s)", "passes", "CPU (s)"],
                                seed_rows(problem, starts, floor_s, args.seeds))
        body += f"\n`anneal_passes` by seed (load {load:.1f} before):\n\n{seeded}\n"
    print(body)
    write_result("finer_walk", "gpt2-xl on 64 cards under longer time limits: the annealing's passes and the finer walk",
                 body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
