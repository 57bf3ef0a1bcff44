"""The link between two CPU core groups, measured the way the pipeline runtime uses it (issue 17 item 4).

`hetpipe.cost_models.calibrate.measure_link` ping-pongs one reused buffer between two processes
that do nothing else.  A pipeline message is another thing (`hetpipe.runtime.execute.comm`): the
sender, between two passes of compute on its core, encodes a header, allocates a fresh frame, copies
header and tensors into it and posts one ``isend``; the receiver, already waiting in its RECV, posted
an ``irecv`` into a fresh frame, and once woken decodes the header and views the tensors in place.
The run report times exactly that span (`hetpipe.runtime.measured_links`: SEND start to the waiting
RECV's end), so the link is measured over the same span here: one-way messages, the sender's core
busy before and after each send, the receiver waiting, fresh frames on both ends, start and end on
CLOCK_MONOTONIC (one host), then ``t = latency + bytes / bandwidth`` fitted to the medians per size.

Why (2-core reference VM, one core per group, 512 KiB, medians of 40, load average 5-6): a reused
buffer between idle ends took 0.19 ms one way; with the runtime's fresh frames, header and copy
0.48 ms (a fresh 512 KiB frame is fresh pages: the kernel zeroes and maps them on first touch, on
both ends); with the sender's core busy around the send 0.58-0.61 ms (gloo's I/O thread must
preempt the computing thread to finish the write).  The ping-pong's fit priced it at 0.34-0.42 ms;
the runs measured 0.82-0.86 ms on a quiet machine (benchmarks/results/cpu_truth.md), part of it a
second message in the span (`hetpipe.runtime.measured_links`).  `benchmarks/cpu_link.py` repeats
that ladder with this module's ``framed`` and ``sender_busy_s``.

Session 14: the quiet runs still measured 0.79 ms against a 0.39-0.44 ms price.  The messages timed
here followed one another with the caches warm; a run's message comes after a stage's pass that
streamed its data through them.  The message path's own CPU work (header, frame, copy, unpacking,
checks) took 5-8x its warm time after a stream beyond the last-level cache
(`benchmarks/cpu_link_cache.py`), as it did in the runs.  So each end now streams
`EVICT_LLC_MULTIPLE` times the last-level cache before each message, and `hetpipe profile` sends the
messages through the runtime's own `StageComm` (`MessagePath`) rather than this module's imitation.

Session 15: the messages here carry one tensor; a cut may carry several (the HF Llama's forward cut:
its causal mask and two rotary tables beside the hidden states), and the path's work per tensor (checks,
header words and a copy on the sender; a view, a header check and ``requires_grad_`` on the receiver)
cost that cut 85-100 us of CPU more than one tensor of its bytes after a streamed cache
(`benchmarks/cpu_link_cuts.py`).  ``t`` has no term for it: it is left unpriced (README, CPU truth).

Session 19: the receiver now waits idle `RECEIVER_IDLE_S` (20 ms) before each message, as a pipeline's
receiver waits for the sender's pass; before, it waited ~2 ms, where on this VM the fixed cost still
climbs steeply with the idle time (an idle vCPU halts and its wake-up slows with the halt's length),
so calibrations minutes apart disagreed by up to 2x.  A 512 KiB size joins the fit (the demo models' cut).

Example:
    >>> m = measure_message_link(sizes_bytes=(4096, 2**18), repeats=2)  # doctest: +SKIP
    >>> m.method  # doctest: +SKIP
    'framed one-way messages'
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch

from hetpipe.cost_models.calibrate import (
    LINK_OP_TIMEOUT_S, LINK_TIMEOUT_S, LinkMeasurement, fit_alpha_beta, free_port, join_or_kill,
)
from hetpipe.errors import ConfigError

logger = logging.getLogger(__name__)

#: Message sizes: 16 KiB pins the fixed cost per message, 256 KiB-4 MiB the bytes (the built-in
#: models' cuts at 8 x 128 tokens are 512 KiB, measured here too; cost_formulas.md §3.4: fit beta at MB sizes).
MESSAGE_SIZES_BYTES: tuple[int, ...] = (16 * 2**10, 256 * 2**10, 512 * 2**10, 2**20, 4 * 2**20)
#: Timed messages per size (one more round as a warm-up; the sizes take turns); the median is fitted.
#: Session 19: within one calibration the host switched between a fast and a slow regime (16 KiB
#: ~0.47 vs ~0.70 ms with the receiver idle 20 ms) every second or so, so a median of 15 messages
#: (~3 s per calibration) took one regime or the other; 40 spread each size's messages over ~8 s and
#: six calibrations in a row priced the 512 KiB cut 0.79-0.99 ms (the runs: 0.78-1.00 ms).
MESSAGE_REPEATS = 40
#: Seconds the sender computes after each send, as a stage computes its next pass after a SEND:
#: gloo's I/O thread then shares a busy core, as in a run.  2 ms outlasts the delivery of a 4 MiB message.
SENDER_BUSY_S = 0.002
#: Seconds the receiver waits idle in its receive before each message leaves (the sender computes
#: meanwhile).  A transfer is on a pipeline's critical path exactly when its receiver waits for it,
#: and a waiting receiver has waited for the sender's pass: 30-60 ms per pass for the built-in models
#: on one core (benchmarks/results/cpu_truth.md), the span every run report measures.  On the
#: reference VM (cpuidle haltpoll with guest_halt_poll_ns=0: an idle vCPU halts at once) the
#: receiver's idle time sets the fixed cost (`benchmarks/cpu_link_idle.py`, runtime path, caches
#: streamed, medians of 21, quiet): 16 KiB took 0.36 ms after 1 ms idle, 0.51 after 2, 0.66 after 7,
#: 0.78 after 20 and 0.91 after 40 ms -- steep up to ~7-10 ms, then slower.  The old ~2 ms (the
#: sender busy before its send) sat on the steep part, so calibrations minutes apart priced a 512 KiB
#: cut 0.48-0.97 ms where the runs measured 0.78-0.95 ms; 20 ms is past the steep part and under the
#: passes it stands for (a receiver idle 40 ms paid ~15% more in that sweep).
RECEIVER_IDLE_S = 0.020
#: Edge of the square matmul the sender repeats while busy (a few us each on a CPU core).
BUSY_MATMUL_EDGE = 128
#: Header words of a one-tensor frame: ``HEADER_FIXED`` 6 + ``PER_TENSOR`` 10 int64 words in
#: `hetpipe.runtime.execute.comm`'s wire protocol (128 bytes, already a multiple of its 16-byte alignment).
FRAME_HEADER_WORDS = 16
FRAME_HEADER_BYTES = FRAME_HEADER_WORDS * 8
#: Tags of the timed message and of the receiver's "posted" note (any two distinct tags).
MESSAGE_TAG, READY_TAG = 7, 9
METHOD = "framed one-way messages"
#: The method with `MessagePath` given: the runtime's own send and receive (`hetpipe profile` passes it).
METHOD_RUNTIME = "the runtime's one-way messages"
#: A stage's pass between two messages streams its activations and weights through the caches,
#: and the other stage's pass shares the last-level cache: in the runs the message path's own CPU time
#: (pack_frame and isend on the sender, unpack_frame and the header check on the receiver) was 4-8x
#: what it took in a loop with warm caches, as it was here after streaming at least the last-level
#: cache (AMD EPYC VM, 32 MiB L3: 8 MiB changed nothing).  The runs' own pack_frame (0.21 ms of CPU,
#: load 9-11) matched one cache's stream (0.22-0.31 ms) better than two (0.30-0.35 ms), and whole
#: 512 KiB messages took 0.86 ms after one, 0.95 ms after two (medians, load 2.8; the quiet runs
#: 0.79 ms).  So each end streams this multiple of the last-level cache before each message.
EVICT_LLC_MULTIPLE = 1
#: Last-level cache assumed where sysfs does not tell (bytes; the reference VM's L3).
FALLBACK_LLC_BYTES = 32 * 2**20


class MessagePath(Protocol):
    """The runtime's own send and receive of one message (`hetpipe.runtime.execute.comm_probe.RuntimePath`).

    The cost-model layer cannot import the runtime; the CLI hands it down.  Picklable (spawned ends).
    """

    def payload(self, num_bytes: int) -> torch.Tensor:
        """The tensor the sender sends as a `num_bytes` message."""
        ...

    def send(self, payload: torch.Tensor, seq: int) -> Callable[[], None]:
        """Post message `seq` to rank 1; returns the wait for its delivery."""
        ...

    def post_recv(self, num_bytes: int, seq: int) -> Callable[[], None]:
        """Post the receive of message `seq` from rank 0; returns what completes it (wait and unpack)."""
        ...


@dataclass(frozen=True)
class _How:
    """How messages are sent: framed as the runtime does (or by the runtime itself: `path`), the
    sender's compute after each send and the receiver's idle wait before it (s)."""

    framed: bool
    sender_busy_s: float
    path: MessagePath | None = None
    evict_bytes: int = 0  # streamed by each end before each message (0: caches left warm)
    receiver_idle_s: float = RECEIVER_IDLE_S


def last_level_cache_bytes(cpu: int = 0) -> int:
    """The largest data or unified cache of `cpu` (sysfs), `FALLBACK_LLC_BYTES` where unknown.

    Example:
        >>> last_level_cache_bytes() >= 2**10
        True
    """
    sizes = []
    for entry in Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"):
        try:
            if (entry / "type").read_text().strip() == "Instruction":
                continue
            text = (entry / "size").read_text().strip().upper()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes) if sizes else FALLBACK_LLC_BYTES


def _evict(buffer: torch.Tensor | None) -> None:
    """Stream `buffer` through the caches (read and write), as a stage's pass does between messages."""
    if buffer is not None:
        buffer.add_(1.0)


def _busy(seconds: float, a: torch.Tensor) -> None:
    """Compute for `seconds` (the sender's stage between its passes and the SEND)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        torch.mm(a, a)


def _send_one(payload: torch.Tensor, a: torch.Tensor, how: _How, seq: int = 0,
              evict: torch.Tensor | None = None) -> float:
    """One message to rank 1 once it is waiting; returns the CLOCK_MONOTONIC start (s)."""
    import torch.distributed as dist

    dist.recv(torch.zeros(1), 1, tag=READY_TAG)  # rank 1's irecv is posted; it now waits idle
    if how.sender_busy_s > 0:  # the sender's pass before its SEND
        _busy(how.receiver_idle_s, a)
    else:
        time.sleep(how.receiver_idle_s)
    if evict is not None:  # the pass before the SEND: its data went through the caches, and its last op
        _evict(evict)  # wrote the tensors sent (hot)
        payload.mul_(1)
    start = time.monotonic()
    if how.path is not None:  # the runtime's own SEND
        wait = how.path.send(payload, seq)
        _busy(how.sender_busy_s, a)
        wait()
        return start
    if not how.framed:  # the ping-pong's way: the payload itself, reused
        work = dist.isend(payload, 1, tag=MESSAGE_TAG)
        _busy(how.sender_busy_s, a)
        work.wait()
        return start
    header = torch.tensor(list(range(FRAME_HEADER_WORDS)), dtype=torch.int64)  # encode_header's list of words
    frame = torch.empty(FRAME_HEADER_BYTES + payload.numel(), dtype=torch.uint8)  # pack_frame: a fresh frame
    frame[:FRAME_HEADER_BYTES].copy_(header.view(torch.uint8))
    frame[FRAME_HEADER_BYTES:].copy_(payload)
    work = dist.isend(frame, 1, tag=MESSAGE_TAG)
    _busy(how.sender_busy_s, a)
    work.wait()
    return start


def _post(num_bytes: int, how: _How, reused: torch.Tensor, seq: int) -> Callable[[], None]:
    """Post the receive of one message from rank 0; returns what waits for and decodes it."""
    import torch.distributed as dist

    if how.path is not None:  # the runtime's own RECV
        return how.path.post_recv(num_bytes, seq)
    if not how.framed:
        return dist.irecv(reused, 0, tag=MESSAGE_TAG).wait
    frame = torch.empty(FRAME_HEADER_BYTES + num_bytes, dtype=torch.uint8)  # post_recv: a fresh frame
    work = dist.irecv(frame, 0, tag=MESSAGE_TAG)

    def finish() -> None:
        work.wait()
        words = frame[:FRAME_HEADER_BYTES].view(torch.int64).tolist()  # decode_header reads the words
        frame[FRAME_HEADER_BYTES:].view(torch.float32)  # unpack_frame views the tensors in place
        if len(words) != FRAME_HEADER_WORDS:
            raise RuntimeError(f"a framed message carried {len(words)} header words, expected {FRAME_HEADER_WORDS}")
    return finish


def _recv_one(num_bytes: int, how: _How, reused: torch.Tensor, seq: int = 0,
              evict: torch.Tensor | None = None) -> float:
    """Wait for one message from rank 0, decode it; returns the CLOCK_MONOTONIC end (s).

    The receive is posted first (a run posts its receives ahead), then this end streams its
    caches (its pass before the RECV), then tells rank 0 it waits.
    """
    import torch.distributed as dist

    finish = _post(num_bytes, how, reused, seq)
    _evict(evict)
    dist.send(torch.zeros(1), 0, tag=READY_TAG)
    finish()
    return time.monotonic()


def _stamps(rank: int, sizes: list[int], repeats: int, how: _How) -> list[list[float]]:
    """This rank's stamps per size (starts on rank 0, ends on rank 1), `repeats` each after one warm-up round.

    The sizes take turns message by message, so a burst of other work on the machine lands on
    every size alike instead of on all of one size's messages (which would tilt the fit).
    """
    a = torch.randn(BUSY_MATMUL_EDGE, BUSY_MATMUL_EDGE)
    payloads = [how.path.payload(size) if how.path is not None else torch.ones(size, dtype=torch.uint8)
                for size in sizes]
    evict = torch.zeros(how.evict_bytes // 4) if how.evict_bytes else None  # float32 words
    stamps: list[list[float]] = [[] for _ in sizes]
    for r in range(repeats + 1):
        for i, (size, payload) in enumerate(zip(sizes, payloads)):
            seq = r * len(sizes) + i  # every message its own tag, as a run's micro-batches
            stamps[i].append(_send_one(payload, a, how, seq, evict) if rank == 0
                             else _recv_one(size, how, payload, seq, evict))
    return [per_size[1:] for per_size in stamps]


def _message_worker(rank: int, port: int, sizes: list[int], repeats: int, out: str,
                    core_groups: list[list[int]] | None, how: _How) -> None:
    """Spawned per end: pin, time every size; rank 1 writes the one-way times per size."""
    import torch.distributed as dist

    from hetpipe.cost_models.cpu_cores import pin_cores

    torch.set_num_threads(1)
    if core_groups:
        pin_cores(core_groups[rank])  # each end runs where its device (core group) runs
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=LINK_OP_TIMEOUT_S))
    try:
        stamps = torch.tensor(_stamps(rank, sizes, repeats, how), dtype=torch.float64)
        starts = stamps.clone()
        dist.broadcast(starts, 0)  # rank 1 learns the starts; both ends read one clock
        times = (stamps - starts).tolist()  # on rank 1: end - start per size and message
        if rank == 1:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def measure_message_link(*, sizes_bytes: Sequence[int] = MESSAGE_SIZES_BYTES, repeats: int = MESSAGE_REPEATS,
                         core_groups: Sequence[Sequence[int]] | None = None, timeout_s: float = LINK_TIMEOUT_S,
                         framed: bool = True, sender_busy_s: float = SENDER_BUSY_S,
                         path: MessagePath | None = None, evict_caches: bool = True,
                         receiver_idle_s: float = RECEIVER_IDLE_S) -> LinkMeasurement:
    """Fit ``t = latency + bytes / bandwidth`` to framed one-way messages between two local gloo ranks.

    With `core_groups` (two), rank r runs pinned to ``core_groups[r]``; the sender is rank 0.
    Module docstring: what a message includes and why.  ``framed=False`` sends the reused payload
    itself and ``sender_busy_s=0`` leaves the sender idle (`benchmarks/cpu_link.py` takes the
    ingredients apart with them); `path` sends and receives with the runtime's own code instead of this
    module's imitation of it (`hetpipe profile --calibrate --cpu-devices N` passes
    `hetpipe.runtime.execute.comm_probe.RuntimePath`); `evict_caches` streams `EVICT_LLC_MULTIPLE` times
    the last-level cache on each end before each message, as a stage's pass does (False: warm caches);
    the receiver waits `receiver_idle_s` in its receive before each message leaves (`RECEIVER_IDLE_S`: why).

    Example:
        >>> measure_message_link(sizes_bytes=(4096,))
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: sizes_bytes needs at least two distinct sizes of 4 bytes or more, got [4096]
    """
    sizes = sorted({int(s) for s in sizes_bytes})
    if len(sizes) < 2 or sizes[0] < 4:
        raise ConfigError(f"sizes_bytes needs at least two distinct sizes of 4 bytes or more, got {sizes}")
    if repeats < 1 or sender_busy_s < 0 or receiver_idle_s < 0:
        raise ConfigError(f"repeats must be at least 1, sender_busy_s and receiver_idle_s at least 0, got {repeats}, "
                          f"{sender_busy_s} and {receiver_idle_s}; pass the defaults")
    groups = [list(g) for g in core_groups] if core_groups else None
    if groups is not None and len(groups) != 2:
        raise ConfigError(f"core_groups has {len(groups)} groups; give the link's two ends")
    how = _How(framed, sender_busy_s, path, EVICT_LLC_MULTIPLE * last_level_cache_bytes() if evict_caches else 0,
               receiver_idle_s)
    with tempfile.TemporaryDirectory(prefix="hetpipe-msg-link-") as tmp:
        out = os.path.join(tmp, "times.json")
        context = torch.multiprocessing.spawn(
            _message_worker, args=(free_port(), sizes, repeats, out, groups, how),
            nprocs=2, join=False)
        join_or_kill(context, timeout_s, what="message link measurement")
        samples = json.loads(Path(out).read_text())
    medians = [statistics.median(s) for s in samples]
    latency_s, bandwidth = fit_alpha_beta(sizes, medians)
    logger.info("message link: %.3g s per message, %.3g B/s (medians %s s)", latency_s, bandwidth,
                ", ".join(f"{t:.3g}" for t in medians))
    method = method_name(framed, sender_busy_s, path, receiver_idle_s) + ("" if evict_caches else ", caches warm")
    return LinkMeasurement(latency_s, bandwidth, tuple(sizes), tuple(medians), 2, method=method)


def method_name(framed: bool, sender_busy_s: float, path: MessagePath | None,
                receiver_idle_s: float = RECEIVER_IDLE_S) -> str:
    """The measurement's name in the cluster file's record (without ", caches warm").

    Example:
        >>> method_name(True, SENDER_BUSY_S, None)
        'framed one-way messages'
        >>> method_name(True, SENDER_BUSY_S, None, receiver_idle_s=0.002)
        'framed one-way messages, receiver idle 2 ms'
    """
    base = METHOD_RUNTIME if path is not None else METHOD if framed else "bare one-way messages"
    if sender_busy_s != SENDER_BUSY_S:
        base += f", sender busy {sender_busy_s * 1e3:.3g} ms"
    return base if receiver_idle_s == RECEIVER_IDLE_S else f"{base}, receiver idle {receiver_idle_s * 1e3:.3g} ms"
