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

A second table times whole one-way 512 KiB messages between two processes pinned on two cores,
through the runtime's own `StageComm` (`hetpipe.runtime.execute.comm_probe.RuntimePath`), the
receiver waiting and the sender computing a 128 x 128 matmul for 2 ms before and after each send:
``warm`` and ``streamed`` (each end first streams `EVICT_LLC_MULTIPLE` times the last-level cache, as the calibration does
since session 14) alternate message by message in one pair of processes, so load lands on both.
Wall time: the minimum is the undisturbed message; on a loaded machine the median carries preemption.

Usage:
    python benchmarks/cpu_link_cache.py [--repeats 60] [--messages 40]
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

from benchmarks.common import markdown_table, one_way_spans, spawn_spans, write_result  # noqa: E402

#: One cut of the demo models: 8 x 128 tokens x 128 features, fp32 (512 KiB).
CUT_SHAPE = (8, 128, 128)
CUT_BYTES = 8 * 128 * 128 * 4
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


def _wall_worker(rank: int, port: int, messages: int, out: str) -> None:
    """One end of the interleaved wall-time comparison (second table); rank 1 writes the spans (s)."""
    import datetime

    import torch
    import torch.distributed as dist

    from hetpipe.cost_models.cpu_cores import pin_cores, split_cores
    from hetpipe.cost_models.link_calibration import EVICT_LLC_MULTIPLE, last_level_cache_bytes
    from hetpipe.runtime.execute.comm_probe import RuntimePath

    pin_cores(split_cores(2)[rank])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    path, a, ready = RuntimePath(), torch.randn(WARM_EDGE, WARM_EDGE), torch.zeros(1)
    stream = torch.zeros(EVICT_LLC_MULTIPLE * last_level_cache_bytes() // 4)
    payload, stamps = path.payload(CUT_BYTES), {"warm": [], "streamed": []}

    def busy() -> None:
        t = time.monotonic()
        while time.monotonic() - t < 0.002:
            torch.mm(a, a)
    for i in range(2 * (messages + 1)):
        way = "warm" if i % 2 == 0 else "streamed"
        if rank == 0:
            dist.recv(ready, 1, tag=2**29)
            busy()
            if way == "streamed":
                stream.add_(1.0)
                payload.mul_(1)  # the pass's last op wrote the tensors sent
            stamps[way].append(time.monotonic())
            wait = path.send(payload, i)
            busy()
            wait()
        else:
            receive = path.post_recv(CUT_BYTES, i)
            if way == "streamed":
                stream.add_(1.0)
            dist.send(ready, 0, tag=2**29)
            receive()
            stamps[way].append(time.monotonic())
    one_way_spans(stamps, out)


def wall_table(messages: int) -> str:
    """The second table: min, quartiles of the interleaved one-way messages (ms), and the load."""
    load0 = os.getloadavg()[0]
    spans = spawn_spans(_wall_worker, messages)
    rows = []
    for way, ts in spans.items():
        q = statistics.quantiles(ts, n=4)
        rows.append([way, f"{min(ts) * 1e3:.2f}", f"{q[0] * 1e3:.2f}", f"{q[1] * 1e3:.2f}", f"{q[2] * 1e3:.2f}"])
    return (f"One-way 512 KiB messages through `StageComm`, {messages} per way, alternating; load average "
            f"{load0:.1f} before, {os.getloadavg()[0]:.1f} after.\n\n"
            + markdown_table(["caches", "min ms", "p25 ms", "median ms", "p75 ms"], rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--messages", type=int, default=40, help="per way in the wall-time table (0: skip it)")
    args = ap.parse_args(argv)
    wall = wall_table(args.messages) if args.messages else ""
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
              "multiply it, as in the runs (`benchmarks/results/cpu_truth.md`, Transfer).\n\n" + wall)
    path = write_result("cpu_link_cache", "CPU link: the message path's CPU cost with the caches warm and "
                        "after a pass (issue 17 item 4)", body)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
