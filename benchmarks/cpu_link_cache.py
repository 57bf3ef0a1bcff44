"""Why a run's message between two CPU core groups costs ~2x its calibrated price (issue 17 item 4).

The message path's own CPU work -- on the sender the runtime's ``encode_header`` + ``pack_frame``
(a fresh frame, the header and the tensor copied in), on the receiver ``unpack_frame`` + the header
check (`hetpipe.runtime.execute.comm`) -- timed in thread CPU time in one pinned process, each
right after one of:

* ``warm``: the same piece once more and a 128 x 128 matmul, as the calibration's messages followed
  one another with only its busy sender's small matmul between them before session 14 (its working
  set stays in the caches, and so does the path's code and data);
* ``stream N MiB``: one read-and-write pass over N MiB, as a stage's forward or backward streams its
  activations and weights between two messages (and the other stage's pass shares the last-level
  cache).  Sizes below and above this host's last-level cache.

CPU time, so the figures hold on a loaded machine (load written beside them); the ratio to
``warm`` is the point.  The calibration's imitation of the frame (`link_calibration`'s built-in
sender and receiver) is timed beside the runtime's own code.

Usage:
    python benchmarks/cpu_link_cache.py [--repeats 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, write_result  # noqa: E402

#: One cut of the demo models: 8 x 128 tokens x 128 features, fp32 (512 KiB).
CUT_SHAPE = (8, 128, 128)
#: Streams between two timed calls, MiB (the reference VM: 1 MiB L2 per core, 32 MiB shared L3).
STREAM_MIB = (2, 8, 32, 64)
WARM_EDGE = 128  # `link_calibration.BUSY_MATMUL_EDGE`


def _paths() -> dict[str, Callable[[], object]]:
    """The four timed pieces: (runtime | calibration's imitation) x (pack | unpack)."""
    from types import SimpleNamespace as NS

    import torch

    from hetpipe.cost_models.link_calibration import FRAME_HEADER_BYTES, FRAME_HEADER_WORDS
    from hetpipe.runtime.execute import comm
    from hetpipe.runtime.stage.types import TensorSpec
    from hetpipe.schedule.actions import Action, Op

    x = torch.randn(CUT_SHAPE)
    specs = (TensorSpec("h", CUT_SHAPE, torch.float32, True),)
    raw = x.reshape(-1).view(torch.uint8)
    stage = NS(stage=1, device=torch.device("cpu"), in_cut=NS(index=0, tensors=specs, grad_tensors=()),
               out_cut=None, num_stages=2)
    sc = comm.StageComm(stage, rank=1, stage_ranks=(0, 1), timeout_s=60.0, send_delay_s=lambda c, n: 0.0,
                        on_comm_bytes=lambda k, n: None)

    def rt_pack() -> object:
        header = comm.encode_header(stage=0, kind=comm.KIND_ACT, microbatch=1, arrive_ns=0, tensors=[x])
        return comm.pack_frame(header, [x], specs, device=torch.device("cpu"))

    frame, action = rt_pack(), Action(1, Op.RECV_F, 1)
    done = NS(is_completed=lambda: True, wait=lambda: None)  # the message has arrived

    def rt_unpack() -> object:  # StageComm.recv as a RECV runs it: the wait, unpack_frame, the header check
        sc.reset()
        sc.recvs[action] = comm.Pending(action, 0, specs, frame, [done])
        sc.posted.add(action)
        return sc.recv(action)

    def cal_pack() -> object:
        header = torch.tensor(list(range(FRAME_HEADER_WORDS)), dtype=torch.int64)
        out = torch.empty(FRAME_HEADER_BYTES + raw.numel(), dtype=torch.uint8)
        out[:FRAME_HEADER_BYTES].copy_(header.view(torch.uint8))
        out[FRAME_HEADER_BYTES:].copy_(raw)
        return out

    cal_frame = cal_pack()

    def cal_unpack() -> object:
        return cal_frame[:FRAME_HEADER_BYTES].view(torch.int64).tolist(), cal_frame[FRAME_HEADER_BYTES:].view(
            torch.float32)

    return {"runtime pack (sender)": rt_pack, "runtime StageComm.recv (receiver)": rt_unpack,
            "imitation pack": cal_pack, "imitation unpack": cal_unpack}


def measure(repeats: int) -> dict[str, dict[str, float]]:
    """Median thread CPU seconds of each piece after each preceding work, interleaved call by call."""
    import torch

    torch.set_num_threads(1)
    paths = _paths()
    a = torch.randn(WARM_EDGE, WARM_EDGE)
    # each preceding work gets the piece about to be timed: warm runs it once more (a loop of messages
    # with only the busy matmul between them, as the calibration's sender repeated them)
    before: dict[str, Callable[[Callable[[], object]], object]] = {"warm": lambda fn: (fn(), torch.mm(a, a))}
    for mib in STREAM_MIB:
        buf = torch.zeros(mib * 2**20 // 4)
        before[f"stream {mib} MiB"] = lambda fn, b=buf: b.add_(1.0)
    samples: dict[str, dict[str, list[float]]] = {p: {b: [] for b in before} for p in paths}
    for _ in range(repeats):
        for b, prepare in before.items():
            for p, fn in paths.items():
                prepare(fn)
                t = time.thread_time()
                fn()
                samples[p][b].append(time.thread_time() - t)
    return {p: {b: statistics.median(v) for b, v in per.items()} for p, per in samples.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args(argv)
    from hetpipe.cost_models.cpu_cores import available_cores, pin_cores
    from hetpipe.cost_models.link_calibration import last_level_cache_bytes

    pin_cores(available_cores()[-1:])
    load0 = os.getloadavg()[0]
    medians = measure(args.repeats)
    load1 = os.getloadavg()[0]
    befores = list(next(iter(medians.values())))
    rows = [[p] + [f"{medians[p][b] * 1e6:.0f} us" + ("" if b == "warm" else f" ({medians[p][b] / medians[p]['warm']:.1f}x)")
                   for b in befores] for p in medians]
    body = (f"Thread CPU time per call, medians of {args.repeats} (interleaved), one process pinned to one core; "
            f"last-level cache {last_level_cache_bytes() / 2**20:.0f} MiB; load average {load0:.1f} before, "
            f"{load1:.1f} after (2 cores).\n\n"
            + markdown_table(["piece (512 KiB cut)", *[f"after {b}" for b in befores]], rows)
            + "\n\nModule docstring of `benchmarks/cpu_link_cache.py`: what each column's preceding work is. "
              "Streams under the last-level cache leave the path's cost as it was warm; streams beyond it "
              "multiply it, as in the runs (`benchmarks/results/cpu_truth.md`, Transfer).")
    path = write_result("cpu_link_cache", "CPU link: the message path's CPU cost with the caches warm and "
                        "after a pass (issue 17 item 4)", body)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
