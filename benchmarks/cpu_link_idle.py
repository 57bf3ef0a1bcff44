"""A message's cost against how long its receiver waited idle (issue 17 item 4, session 19).

`hetpipe.cost_models.link_calibration` times one-way messages through the runtime's own `StageComm`
between two processes pinned on the host's two core groups, each end streaming the last-level cache
before each message.  Its receiver posts its receive and then waits while the sender computes for
``receiver_idle_s`` before sending.  This script sweeps that wait: for each idle time, the median one-way
time of a 16 KiB message (the fixed cost) and of a 512 KiB one (the demo models' cut: 8 x 128 tokens,
h = 128, fp32).  The idle times take turns within each round, so drift in the host lands on all of them.

Why it matters: on a VM whose idle vCPUs halt at once (cpuidle ``haltpoll`` with
``guest_halt_poll_ns=0``), waking the receiver costs more the longer it was halted.  A pipeline's receiver
on the critical path has waited for the sender's whole pass (30-60 ms per pass for the built-in
models on one core).  The calibration used to let it wait ~2 ms, which is on the steep part of this curve.
`link_calibration.RECEIVER_IDLE_S` (20 ms) is on the plateau.

Wall time of two processes: only a quiet machine's figures describe the link.  The load average is
written beside them.

Usage:
    python benchmarks/cpu_link_idle.py [--rounds 2] [--repeats 21]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, write_result  # noqa: E402

#: Receiver idle times swept (s): below, at and above the old ~2 ms, up to a pass of the demo models.
IDLE_S = (0.001, 0.002, 0.004, 0.007, 0.010, 0.020, 0.040)
#: The fixed cost's size and the demo models' cut (bytes).
SIZES_BYTES = (16 * 2**10, 512 * 2**10)


def cpuidle_line() -> str:
    """The guest's cpuidle driver and halt-poll setting, as sysfs and the kernel command line say."""
    base = Path("/sys/devices/system/cpu/cpuidle")
    try:
        driver = (base / "current_driver").read_text().strip()
    except OSError:
        driver = "unknown"
    poll = next((w for w in Path("/proc/cmdline").read_text().split() if "halt_poll_ns" in w), "not set") \
        if Path("/proc/cmdline").exists() else "not set"
    return f"cpuidle driver `{driver}`, kernel command line `{poll}`"


def one_round(repeats: int) -> dict[float, tuple[float, ...]]:
    """Idle time (s) -> the median one-way time per size (s)."""
    from hetpipe.cost_models.cpu_cores import split_cores
    from hetpipe.cost_models.link_calibration import measure_message_link
    from hetpipe.runtime.execute.comm_probe import RuntimePath

    groups = split_cores(2)
    return {idle: measure_message_link(sizes_bytes=SIZES_BYTES, repeats=repeats, core_groups=groups,
                                       path=RuntimePath(), receiver_idle_s=idle).median_times_s
            for idle in IDLE_S}


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.3f} ms ({min(values) * 1e3:.3f}-{max(values) * 1e3:.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=21, help="messages per size and idle time")
    args = ap.parse_args(argv)
    from hetpipe.cost_models.link_calibration import RECEIVER_IDLE_S

    rounds, loads = [], []
    for i in range(args.rounds):
        loads.append(os.getloadavg()[0])
        print(f"round {i + 1}/{args.rounds}: load average {loads[-1]:.2f}", flush=True)
        rounds.append(one_round(args.repeats))
    rows = [[f"{idle * 1e3:g} ms" + (" (the calibration's)" if idle == RECEIVER_IDLE_S else ""),
             *(_cell([r[idle][k] for r in rounds]) for k in range(len(SIZES_BYTES)))] for idle in IDLE_S]
    body = (f"{args.rounds} round(s) of {args.repeats} messages per size and idle time; the runtime's `StageComm` "
            f"between two processes pinned on two core groups of {os.cpu_count()} cores, last-level cache streamed "
            f"by each end before each message; {cpuidle_line()}; load average before each round: "
            f"{', '.join(f'{x:.1f}' for x in loads)}.\n\n"
            + markdown_table(["receiver idle before the message", "16 KiB: median (spread over rounds)",
                              "512 KiB: median (spread)"], rows)
            + "\n\nMedians over rounds of each round's median; module docstring of `benchmarks/cpu_link_idle.py`: "
              "why the receiver's idle time matters. The runs' measured C is in `benchmarks/results/cpu_truth.md`.")
    path = write_result("cpu_link_idle", "CPU link: a message's cost against its receiver's idle time "
                        "(issue 17 item 4)", body)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
