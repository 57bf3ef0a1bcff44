"""What a pipeline message between two CPU core groups costs, ingredient by ingredient (issue 17 item 4).

Two processes pinned on the host's two core groups (`hetpipe.cost_models.cpu_cores.split_cores`)
send one-way messages over gloo while the receiver waits (`hetpipe.cost_models.link_calibration`),
six ways, each fitted to ``t = latency + bytes / bandwidth``:

1. ``ping-pong``: `calibrate.measure_link`, what ``--cpu-devices`` priced the link with before session 13;
2. ``bare``: one-way, the payload buffer reused, the sender idle around the send;
3. ``framed``: the runtime's framing (a header, fresh frames on both ends, the copy into the frame);
4. ``framed, busy sender``: also the sender's core computing before and after the send, as a stage
   does around its SEND -- what `hetpipe profile --calibrate --cpu-devices 2` measured in session 13;
5. ``runtime's StageComm, busy sender``: the same with the runtime's own send and receive
   (`hetpipe.runtime.execute.comm_probe.RuntimePath`) instead of the imitation;
6. ``... and caches streamed``: also each end streaming the last-level cache (`EVICT_LLC_MULTIPLE`) before each
   message, as a stage's pass does between two messages -- what the profile measures since session 14.

Ways 1-5 leave the caches warm between messages.

The table gives each fit and its time for one 512 KiB message (a cut of the demo models at
8 x 128 tokens, h = 128, fp32), medians over rounds.  Wall time of two processes: only a quiet
machine's figures describe the link; the load average is written beside them.

Usage:
    python benchmarks/cpu_link.py [--rounds 3]
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

#: One cut of the demo models: 8 x 128 tokens x 128 features, fp32.
CUT_BYTES = 8 * 128 * 128 * 4
#: The ping-pong's sizes as `hetpipe profile` used them (`profile.PROFILE_LINK_SIZES_BYTES`).
PING_PONG_REPEATS = 5


def one_round() -> dict[str, tuple[float, float]]:
    """(latency s, bandwidth B/s) per way of sending (module docstring)."""
    from hetpipe.cost_models.calibrate import measure_link
    from hetpipe.cost_models.cpu_cores import split_cores
    from hetpipe.cost_models.link_calibration import measure_message_link
    from hetpipe.cost_models.profile import PROFILE_LINK_SIZES_BYTES

    groups = split_cores(2)
    out = {}
    pp = measure_link(2, sizes_bytes=PROFILE_LINK_SIZES_BYTES, repeats=PING_PONG_REPEATS, core_groups=groups)
    out["ping-pong"] = (pp.latency_s, pp.bandwidth_bytes_s)
    from hetpipe.runtime.execute.comm_probe import RuntimePath

    for label, framed, busy in (("bare", False, 0.0), ("framed", True, 0.0), ("framed, busy sender", True, None)):
        kwargs = {} if busy is None else {"sender_busy_s": busy}
        m = measure_message_link(core_groups=groups, framed=framed, evict_caches=False, **kwargs)
        out[label] = (m.latency_s, m.bandwidth_bytes_s)
    for label, evict in (("runtime's StageComm, busy sender", False), ("... and caches streamed", True)):
        m = measure_message_link(core_groups=groups, path=RuntimePath(), evict_caches=evict)
        out[label] = (m.latency_s, m.bandwidth_bytes_s)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    rounds, loads = [], []
    for i in range(args.rounds):
        loads.append(os.getloadavg()[0])
        print(f"round {i + 1}/{args.rounds}: load average {loads[-1]:.2f}", flush=True)
        rounds.append(one_round())
    rows = []
    for label in rounds[0]:
        lat = statistics.median(r[label][0] for r in rounds)
        bw = statistics.median(r[label][1] for r in rounds)
        cut = statistics.median(r[label][0] + CUT_BYTES / r[label][1] for r in rounds)
        spread = [r[label][0] + CUT_BYTES / r[label][1] for r in rounds]
        rows.append([label, f"{lat * 1e3:.3f} ms", f"{bw / 1e9:.2f} GB/s",
                     f"{cut * 1e3:.3f} ms ({min(spread) * 1e3:.3f}-{max(spread) * 1e3:.3f})"])
    body = (f"{args.rounds} round(s); two processes pinned on two core groups of {os.cpu_count()} cores; load "
            f"average before each round: {', '.join(f'{x:.1f}' for x in loads)}.\n\n"
            + markdown_table(["way", "latency (fit)", "bandwidth (fit)", "512 KiB message (spread)"], rows)
            + "\n\nModule docstring of `benchmarks/cpu_link.py`: what each way includes. The runs' measured C "
              "(`benchmarks/results/cpu_truth.md`) is to be compared with the last row.")
    path = write_result("cpu_link", "CPU link: a pipeline message between two core groups (issue 17 item 4)", body)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
