"""What a cut of several tensors costs on the message path beyond one tensor of its bytes (issue 17 item 4).

The plan prices a message as ``C = latency + bytes / bandwidth``, calibrated on messages of one
tensor (`hetpipe.cost_models.link_calibration` through `hetpipe.runtime.execute.comm_probe.RuntimePath`).
The HF Llama's forward cut carries four (`cpu_truth.py`'s config at 8 x 128 tokens, split at the
middle unit): the causal mask ``(8, 1, 128, 128)`` bool, the rotary tables ``(1, 128, 32)`` float32
twice and the hidden states ``(8, 128, 128)`` float32: 672 KiB; its gradient message back one
tensor of 512 KiB; gpt-demo's cut one tensor of 512 KiB each way.  The message path does per-tensor
work on both ends (header words, checks, one copy into the frame per tensor on the sender; a view,
a header check and ``requires_grad_`` per tensor on the receiver), which the price does not see.

Two tables, three cuts (gpt-demo's, the Llama's forward cut, one tensor of the Llama cut's bytes):

1. thread CPU time of each end's piece in one pinned process, with the caches warm and after a
   stream of `EVICT_LLC_MULTIPLE` last-level caches (as a stage's pass leaves them): load-robust;
2. whole one-way messages through `StageComm` between two processes pinned on two cores, the cuts
   taking turns message by message, each end streaming its caches first and the sender computing
   2 ms before and after each send (the calibration's way): wall time, so it needs a quiet machine.

Usage:
    python benchmarks/cpu_link_cuts.py [--repeats 60] [--messages 40]
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

#: Bytes of the hidden states at 8 x 128 tokens x 128 features, fp32: gpt-demo's cut, the Llama's gradient.
HIDDEN_BYTES = 8 * 128 * 128 * 4
#: The HF Llama cut's tensors besides the hidden states: (name, shape, dtype name, requires grad).
LLAMA_EXTRA = (("expand_2", (8, 1, 128, 128), "bool", False), ("to_4", (1, 128, 32), "float32", False),
               ("to_5", (1, 128, 32), "float32", False))
WARM_EDGE = 128  # `link_calibration.BUSY_MATMUL_EDGE`
SENDER_BUSY_S = 0.002  # `link_calibration.SENDER_BUSY_S`


def _extra() -> tuple:
    import torch

    from hetpipe.runtime.stage.types import TensorSpec

    return tuple(TensorSpec(n, shape, getattr(torch, dt), grad) for n, shape, dt, grad in LLAMA_EXTRA)


def _cuts() -> dict[str, tuple[object, int]]:
    """Name -> (the `RuntimePath` sending it, its bytes)."""
    from hetpipe.runtime.execute.comm_probe import RuntimePath

    extra = _extra()
    llama = HIDDEN_BYTES + sum(t.num_bytes for t in extra)
    return {"gpt-demo's cut (1 tensor, 512 KiB)": (RuntimePath(), HIDDEN_BYTES),
            "HF Llama forward cut (4 tensors, 672 KiB)": (RuntimePath(extra), llama),
            "1 tensor of 672 KiB": (RuntimePath(), llama)}


def _pieces(path: object, num_bytes: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """(the sender's piece: StageComm.send's checks, header and frame without the isend; the receiver's:
    StageComm.recv of an arrived frame and each tensor's requires_grad_, as a stage's RECV_F)."""
    from types import SimpleNamespace as NS

    import torch

    from hetpipe.runtime.execute import comm
    from hetpipe.schedule.actions import Action, Op

    tensors = path.tensors(num_bytes)
    specs = tuple(path.extra) + (path.spec(num_bytes),)
    stage = NS(stage=1, device=torch.device("cpu"), in_cut=NS(index=0, tensors=specs, grad_tensors=()),
               out_cut=None, num_stages=2)
    sc = comm.StageComm(stage, rank=1, stage_ranks=(0, 1), timeout_s=60.0, send_delay_s=lambda c, n: 0.0,
                        on_comm_bytes=lambda k, n: None)

    def pack() -> object:
        comm.mismatch(tensors, specs)
        header = comm.encode_header(stage=0, kind=comm.KIND_ACT, microbatch=1, arrive_ns=0, tensors=tensors)
        return comm.pack_frame(header, tensors, specs, device=torch.device("cpu"))

    frame, action = pack(), Action(1, Op.RECV_F, 1)
    done = NS(is_completed=lambda: True, wait=lambda: None)  # the message has arrived

    def receive() -> object:
        sc.reset()
        sc.recvs[action] = comm.Pending(action, 0, specs, frame, [done])
        sc.posted.add(action)
        got = sc.recv(action)
        for t, spec in zip(got, specs):
            t.requires_grad_(spec.requires_grad)
        return got
    return pack, receive


def cpu_table(repeats: int) -> str:
    """Table 1: median thread CPU time per piece, warm and streamed, interleaved call by call."""
    import torch

    from hetpipe.cost_models.cpu_cores import available_cores, pin_cores
    from hetpipe.cost_models.link_calibration import EVICT_LLC_MULTIPLE, last_level_cache_bytes

    pin_cores(available_cores()[-1:])
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    stream = torch.zeros(EVICT_LLC_MULTIPLE * last_level_cache_bytes() // 4)
    a = torch.randn(WARM_EDGE, WARM_EDGE)
    pieces = {(cut, end): fn for cut, (path, n) in _cuts().items() for end, fn in zip(("sender", "receiver"),
                                                                                        _pieces(path, n))}
    samples: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(repeats):
        for (cut, end), fn in pieces.items():
            for way in ("warm", "streamed"):
                if way == "warm":
                    fn(), torch.mm(a, a)
                else:
                    stream.add_(1.0)
                t = time.thread_time()
                fn()
                samples.setdefault((cut, end, way), []).append(time.thread_time() - t)
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = []
    for cut in _cuts():
        both = {w: med[(cut, "sender", w)] + med[(cut, "receiver", w)] for w in ("warm", "streamed")}
        rows.append([cut] + [f"{med[(cut, e, w)] * 1e6:.0f} us" for e in ("sender", "receiver")
                             for w in ("warm", "streamed")] + [f"{both['streamed'] * 1e6:.0f} us"])
    return (f"Thread CPU time per call, medians of {repeats} (interleaved), one process pinned to one core; "
            f"streamed: {EVICT_LLC_MULTIPLE} x {last_level_cache_bytes() / 2**20:.0f} MiB first; load average "
            f"{load0:.1f} before, {os.getloadavg()[0]:.1f} after.\n\n"
            + markdown_table(["cut", "sender warm", "sender streamed", "receiver warm", "receiver streamed",
                              "both ends streamed"], rows))


def _wall_worker(rank: int, port: int, messages: int, out: str) -> None:
    """One end of table 2; rank 1 writes the one-way spans (s) per cut."""
    import datetime

    import torch
    import torch.distributed as dist

    from hetpipe.cost_models.cpu_cores import pin_cores, split_cores
    from hetpipe.cost_models.link_calibration import EVICT_LLC_MULTIPLE, last_level_cache_bytes

    torch.set_num_threads(1)
    pin_cores(split_cores(2)[rank])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    cuts, a, ready = _cuts(), torch.randn(WARM_EDGE, WARM_EDGE), torch.zeros(1)
    stream = torch.zeros(EVICT_LLC_MULTIPLE * last_level_cache_bytes() // 4)
    payloads = {cut: path.payload(n) for cut, (path, n) in cuts.items()}
    stamps: dict[str, list[float]] = {cut: [] for cut in cuts}

    def busy() -> None:
        t = time.monotonic()
        while time.monotonic() - t < SENDER_BUSY_S:
            torch.mm(a, a)
    seq = 0
    for _ in range(messages + 1):
        for cut, (path, n) in cuts.items():
            seq += 1
            if rank == 0:
                dist.recv(ready, 1, tag=2**29)
                busy()
                stream.add_(1.0)
                payloads[cut].mul_(1)  # the pass's last op wrote the hidden states sent
                stamps[cut].append(time.monotonic())
                wait = path.send(payloads[cut], seq)
                busy()
                wait()
            else:
                receive = path.post_recv(n, seq)
                stream.add_(1.0)
                dist.send(ready, 0, tag=2**29)
                receive()
                stamps[cut].append(time.monotonic())
    one_way_spans(stamps, out)


def wall_table(messages: int) -> str:
    """Table 2: quartiles of the interleaved one-way messages (ms) per cut, and the load."""
    load0 = os.getloadavg()[0]
    spans = spawn_spans(_wall_worker, messages)
    one = statistics.median(spans["1 tensor of 672 KiB"])
    rows = []
    for cut, ts in spans.items():
        q = statistics.quantiles(ts, n=4)
        rows.append([cut, f"{min(ts) * 1e3:.3f}", f"{q[0] * 1e3:.3f}", f"{q[1] * 1e3:.3f}", f"{q[2] * 1e3:.3f}",
                     f"{q[1] / one:.2f}"])
    return (f"One-way messages through `StageComm`, {messages} per cut, the cuts taking turns; load average "
            f"{load0:.1f} before, {os.getloadavg()[0]:.1f} after.\n\n"
            + markdown_table(["cut", "min ms", "p25 ms", "median ms", "p75 ms", "median / 1 tensor of 672 KiB"],
                             rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--messages", type=int, default=40, help="per cut in the wall-time table (0: skip it)")
    args = ap.parse_args(argv)
    wall = wall_table(args.messages) if args.messages else ""
    body = (cpu_table(args.repeats) + "\n\n" + wall + "\n\nModule docstring of `benchmarks/cpu_link_cuts.py`: the "
            "cuts, and what each piece includes.")
    path = write_result("cpu_link_cuts", "CPU link: a cut of several tensors against one (issue 17 item 4)", body)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
