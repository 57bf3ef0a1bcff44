"""Issue 12 item 3: does a longer --time-limit certify gpt2-xl on 64 cards within 2% (`solvers/finer_walk.py`)?

planner_scale.py's gpt2-xl row on 64 cards (`planner_scale.run_case`: the estimate's search, then `verify` with
what it leaves) at several time limits; each row: the schedule T, the bound, the gap, whether the finer kind cut's
walk ran (its log line), the wall and the process's CPU seconds.  The clock the deadlines read is the wall
(`time.perf_counter`), so the load (stated) changes what fits.

Usage:
    python benchmarks/finer_walk.py [--limits 10 30 60]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.planner_scale import run_case  # noqa: E402


class _Lines(logging.Handler):
    """Keeps the finer walk's log messages."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limits", type=float, nargs="+", default=[10.0, 30.0, 60.0])
    args = ap.parse_args(argv)
    lines = _Lines()
    log = logging.getLogger("hetpipe.partitioner.solvers.finer_walk")
    log.setLevel(logging.INFO)
    log.addHandler(lines)
    rows = []
    for limit in args.limits:
        lines.lines.clear()
        cpu, load = time.process_time(), os.getloadavg()[0]
        row = run_case("gpt2-xl", 64, time_limit_s=limit)
        rows.append([f"{limit:g}", row[9], row[10], row[11], "; ".join(lines.lines) or "not asked (gap <= 2%)",
                     row[12], f"{time.process_time() - cpu:.1f}", f"{load:.1f}"])
        print(" | ".join(map(str, rows[-1])), flush=True)
    table = markdown_table(["limit (s)", "schedule T (s)", "bound (s)", "gap", "finer walk", "wall (s)",
                            "CPU (s)", "load (1 min)"], rows)
    print(table)
    write_result("finer_walk", "The finer kind cut's walk under longer time limits (gpt2-xl, 64 cards)",
                 f"{__doc__.split('Usage:')[0].strip()}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
