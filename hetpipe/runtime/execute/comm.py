"""Point-to-point messages between neighbouring stages, with bounded waits.

Wire protocol of one SEND_F / SEND_B (both ends derive it from the same `CutSpec`):
one message, a flat uint8 buffer (`frame_layout`) holding

1. a header: ``HEADER_FIXED + n * PER_TENSOR`` int64 words -- magic, sender
   stage, kind (0 activations, 1 gradients), micro-batch, the arrival time in
   CLOCK_MONOTONIC nanoseconds (send time plus the emulated link delay; one host
   only), n, then per tensor its dtype code, ndim and up to ``MAX_DIMS`` sizes;
2. the ``n`` tensors' bytes in spec order, each starting at a multiple of
   ``ALIGN_BYTES`` (so the receiver views them in place; bool travels as uint8).

One message per SEND (not one per tensor plus a header) halves the point-to-point
operations, whose fixed cost dominates small activations on gloo.

The receiver checks the header against its spec before it trusts the data, so a
wrong shape, dtype, micro-batch or peer is reported by name on *both* ends
instead of a silent mis-read or a hang: a sender that produced a wrong tensor
still sends the (truthful) header, skips the data and raises.  Tags make every
message of a step unique (gloo matches on them; NCCL matches in issue order,
which the executor keeps per peer).  A rank of an interleaved plan holds several chunks
(`StageComm.hold`), so one pair of ranks carries one cut per chunk: the tag then counts
``microbatch * lanes + lane``, the lane being the cut's chunk (``cut index // ranks``; always 0,
and the tags unchanged, for a plain pipeline).

Waits never block forever: `wait_work` bounds each one by ``timeout_s`` (gloo's
``Work.wait(timeout)``; other backends poll ``is_completed``) and turns a
timeout or a lost peer into a `RuntimeFailure` the caller names.

Example:
    >>> import torch
    >>> h = encode_header(stage=1, kind=KIND_GRAD, microbatch=3, arrive_ns=5,
    ...                   tensors=[torch.zeros(2, 4), torch.zeros(7, dtype=torch.long)])
    >>> decode_header(h)
    WireHeader(stage=1, kind=1, microbatch=3, arrive_ns=5, tensors=((torch.float32, (2, 4)), (torch.int64, (7,))))
    >>> message_tag(KIND_GRAD, microbatch=3, index=0)
    28672
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hetpipe.errors import RuntimeFailure
from hetpipe.schedule.actions import Action, Op
from hetpipe.runtime.stage.build import StageModule, TensorSpec

KIND_ACT = 0
KIND_GRAD = 1
MAGIC = 0x68707031  # "hpp1"
MAX_DIMS = 8
HEADER_FIXED = 6
PER_TENSOR = 2 + MAX_DIMS
MAX_TENSORS_PER_CUT = 4095
_TAG_STRIDE = MAX_TENSORS_PER_CUT + 1  # tags of one micro-batch and kind (index 0: the framed message)
ALIGN_BYTES = 16  # largest element size (complex128), so every tensor in a frame can be viewed in place
_WORD_BYTES = 8  # int64 header words
HANDSHAKE_TAG = 2**30  # above every step tag for micro-batches < 2**30 / (2 * 4096)
_POLL_S = (1e-5, 1e-3)  # first and longest sleep while polling a non-gloo work

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_CODE = {d: i for i, d in enumerate(_DTYPES)}


@dataclass(frozen=True)
class WireHeader:
    """A decoded header; ``tensors`` are (dtype or None if unknown, shape)."""

    stage: int
    kind: int
    microbatch: int
    arrive_ns: int
    tensors: tuple[tuple[torch.dtype | None, tuple[int, ...]], ...]


def header_words(num_tensors: int) -> int:
    return HEADER_FIXED + num_tensors * PER_TENSOR


def encode_header(*, stage: int, kind: int, microbatch: int, arrive_ns: int,
                  tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The int64 header describing ``tensors`` (on the CPU; the caller moves it)."""
    words = [MAGIC, stage, kind, microbatch, arrive_ns, len(tensors)]
    for t in tensors:
        dims = list(t.shape)[:MAX_DIMS]
        words += [_CODE.get(t.dtype, -1), t.dim(), *dims, *[0] * (MAX_DIMS - len(dims))]
    return torch.tensor(words, dtype=torch.int64)


def decode_header(header: torch.Tensor) -> WireHeader:
    words = header.cpu().tolist()
    if words[0] != MAGIC:
        raise ValueError(f"not a hetpipe header (magic {words[0]:#x})")
    tensors = []
    for i in range(words[5]):
        code, ndim, *dims = words[HEADER_FIXED + i * PER_TENSOR: HEADER_FIXED + (i + 1) * PER_TENSOR]
        dtype = _DTYPES[code] if 0 <= code < len(_DTYPES) else None
        tensors.append((dtype, tuple(dims[:ndim])))
    return WireHeader(words[1], words[2], words[3], words[4], tuple(tensors))


def message_tag(kind: int, *, microbatch: int, index: int) -> int:
    """Unique tag of message ``index`` (0 = header) of one micro-batch's activations or gradients."""
    return (microbatch * 2 + kind) * _TAG_STRIDE + index


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """What actually travels: contiguous, bool as uint8 (NCCL has no bool)."""
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def recv_buffer(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=torch.uint8 if dtype == torch.bool else dtype, device=device)


def from_wire(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return buf.view(torch.bool) if dtype == torch.bool else buf


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


@functools.lru_cache(maxsize=256)
def frame_layout(specs: tuple[TensorSpec, ...]) -> tuple[tuple[int, ...], int]:
    """(byte offset of each tensor, total bytes) of the one-message frame for ``specs`` (cached per cut).

    Example:
        >>> frame_layout((TensorSpec("a", (3,), torch.float32, True), TensorSpec("b", (), torch.bool, False)))
        ((208, 224), 240)
    """
    offset, offsets = _aligned(header_words(len(specs)) * _WORD_BYTES), []
    for spec in specs:
        offsets.append(offset)
        offset += _aligned(spec.num_bytes)
    return tuple(offsets), offset


def pack_frame(header: torch.Tensor, tensors: Sequence[torch.Tensor], specs: tuple[TensorSpec, ...], *,
               device: torch.device) -> torch.Tensor:
    """The frame of one message: ``header`` then ``tensors`` (left out when they break ``specs``).

    Example:
        >>> specs = (TensorSpec("x", (2,), torch.float32, True),)
        >>> x = torch.tensor([1.5, -2.0])
        >>> h = encode_header(stage=0, kind=KIND_ACT, microbatch=1, arrive_ns=0, tensors=[x])
        >>> frame = pack_frame(h, [x], specs, device=torch.device("cpu"))
        >>> unpack_frame(frame, specs)[1][0]
        tensor([ 1.5000, -2.0000])
    """
    offsets, total = frame_layout(specs)
    frame = torch.empty(total, dtype=torch.uint8, device=device)  # padding bytes are never read
    frame[:header.numel() * _WORD_BYTES].copy_(header.view(torch.uint8))
    if mismatch(tensors, specs) is None:
        for t, offset, spec in zip(tensors, offsets, specs):
            frame[offset:offset + spec.num_bytes].copy_(wire_view(t).reshape(-1).view(torch.uint8))
    return frame


def unpack_frame(frame: torch.Tensor, specs: tuple[TensorSpec, ...]) -> tuple[WireHeader, list[torch.Tensor]]:
    """(header, tensors viewed in place) of a received frame; the tensors are valid only if the header matches."""
    offsets, _ = frame_layout(specs)
    header = decode_header(frame[:header_words(len(specs)) * _WORD_BYTES].view(torch.int64))
    tensors = [frame[o:o + s.num_bytes].view(s.dtype).view(s.shape) for o, s in zip(offsets, specs)]
    return header, tensors


def wait_work(work: dist.Work, *, timeout_s: float, gloo: bool,
              describe: Callable[[bool, str], str]) -> None:
    """Wait for ``work`` at most ``timeout_s``; on failure raise ``RuntimeFailure(describe(timed_out, detail))``.

    ``describe`` builds the message (it knows the rank, stage and action); ``detail``
    is the backend's first line, e.g. gloo's "Connection closed by peer".

    Example:
        >>> class Hung:
        ...     def is_completed(self): return False
        >>> wait_work(Hung(), timeout_s=0.01, gloo=False, describe=lambda t, d: f"timed out={t}")
        Traceback (most recent call last):
        ...
        hetpipe.errors.RuntimeFailure: timed out=True
    """
    start = time.monotonic()
    try:
        if gloo:
            if work.wait(timeout=timedelta(seconds=timeout_s)) is False:
                raise RuntimeFailure(describe(True, "wait returned False"))
            return
        _poll(work, deadline=start + timeout_s)
    except RuntimeFailure:
        raise
    except RuntimeError as err:  # DistBackendError and gloo's IoException arrive as RuntimeError
        detail = backend_detail(err)
        timed_out = "timed out" in detail.lower() or time.monotonic() - start >= timeout_s
        raise RuntimeFailure(describe(timed_out, detail)) from err
    if not work.is_completed():
        raise RuntimeFailure(describe(True, "no completion"))


def post_work(start: Callable[[], Any], *, describe: Callable[[bool, str], str]) -> Any:
    """``start()`` -- an isend or irecv -- whose ``RuntimeError`` becomes ``RuntimeFailure(describe(False, detail))``.

    A peer that is already gone makes gloo raise when the message is posted (the pair is
    closed), before any wait; the user then reads which message and which peer, not a bare
    backend error labelled as a bug.

    Example:
        >>> def closed(): raise RuntimeError("[/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:6581")
        >>> post_work(closed, describe=lambda t, d: f"failed waiting on 0RECV_F1 ({d})")
        Traceback (most recent call last):
        ...
        hetpipe.errors.RuntimeFailure: failed waiting on 0RECV_F1 (Connection closed by peer [127.0.0.1]:6581)
    """
    try:
        return start()
    except RuntimeError as err:
        raise RuntimeFailure(describe(False, backend_detail(err))) from err


#: gloo's words when the other end of a pair is gone (gloo/transport/tcp/pair.cc): the peer's process ended, so
#: the rank that raised is a consequence of another's failure, not a bug of its own.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_lost(err: BaseException) -> str | None:
    """gloo's first line, source prefix dropped, if ``err`` says a peer's connection closed; else None.

    Example:
        >>> peer_lost(RuntimeError("[/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:6581"))
        'Connection closed by peer [127.0.0.1]:6581'
        >>> peer_lost(ValueError("Connection closed by peer")) is None
        True
    """
    if not isinstance(err, RuntimeError) or not any(words in str(err) for words in PEER_LOST):
        return None
    return backend_detail(err)


def backend_detail(err: BaseException) -> str:
    """The backend error's first line without gloo's ``[/path/file.cc:78] `` prefix (its type name if empty).

    Example:
        >>> backend_detail(RuntimeError("[/gloo/pair.cc:553] Connection closed by peer; more"))
        'Connection closed by peer; more'
    """
    text = str(err).strip()
    return _strip_source(text.splitlines()[0]) if text else type(err).__name__


def _poll(work: dist.Work, *, deadline: float) -> None:
    pause = _POLL_S[0]
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S[1])
    work.wait()  # raises the backend's error if it failed; orders the current stream after it


def _strip_source(detail: str) -> str:
    """Drop gloo's ``[/path/file.cc:78] `` prefix."""
    return detail.split("] ", 1)[1] if detail.startswith("[") and "] " in detail else detail


def sleep_until_ns(arrive_ns: int) -> float:
    """Sleep until CLOCK_MONOTONIC reaches ``arrive_ns`` (emulated link delay); returns seconds slept."""
    remaining_s = (arrive_ns - time.monotonic_ns()) / 1e9
    if remaining_s > 0:
        time.sleep(remaining_s)
        return remaining_s
    return 0.0


@dataclass
class Pending:
    """A posted message: its frame (see `frame_layout`) and the work that fills or reads it."""

    action: Action
    peer: int
    specs: tuple[TensorSpec, ...]
    frame: torch.Tensor
    works: list[Any]
    recvs_before: int = 0  # a send: the RECVs its rank had completed this step when it was posted


class StageComm:
    """The messages of one stage: bounded waits, header checks, early receives, pending sends.

    ``send_delay_s(cut, num_bytes)`` is the emulation hook (`ActionHooks.send_delay_s`);
    ``on_comm_bytes(key, num_bytes | None)`` reports buffers held for memory accounting;
    ``on_arrived(action, late_s)`` reports, for a message with an emulated arrival time,
    how late it really arrived (negative: early, the receiver then sleeps until then).
    """

    def __init__(self, stage: StageModule, *, rank: int, stage_ranks: Sequence[int], timeout_s: float,
                 send_delay_s: Callable[[int, int], float], on_comm_bytes: Callable[[Any, int | None], None],
                 on_arrived: Callable[[Action, float], None] | None = None) -> None:
        self.stage, self.rank, self.stage_ranks, self.timeout_s = stage, rank, tuple(stage_ranks), timeout_s
        self.where = f"rank {rank} (stage {stage.stage})"
        distributed = dist.is_available() and dist.is_initialized()
        self.gloo = distributed and dist.get_backend() == "gloo"
        self.header_device = stage.device if distributed and not self.gloo else torch.device("cpu")
        self._send_delay_s, self._on_bytes, self._on_arrived = send_delay_s, on_comm_bytes, on_arrived
        self.wait_sends_at_recv = False  # set by the executor (see its ``wait_sends_at_recv``)
        self.send_wait_lag = 0  # with it: wait for the sends posted before the lag-th last RECV (interleaved: 1)
        self.chunks: dict[int, StageModule] = {stage.stage: stage}
        self.ranks = len(set(self.stage_ranks)) or 1  # a rank per chunk 0 stage
        self.lanes = max(1, len(self.stage_ranks) // self.ranks)  # chunks per rank
        self.reset()

    def hold(self, modules: Sequence[StageModule]) -> None:
        """This rank runs every module in ``modules`` (the chunks of an interleaved plan)."""
        self.chunks = {m.stage: m for m in modules}
        if len(modules) > 1:  # one module: `where` as built (a group member's names its lead)
            self.where = f"rank {self.rank} (stages {', '.join(str(k) for k in sorted(self.chunks))})"

    def tag(self, kind: int, microbatch: int, cut: int) -> int:
        """The tag of a step message over cut ``cut`` (module docstring: one lane per chunk)."""
        return message_tag(kind, microbatch=microbatch * self.lanes + cut // self.ranks, index=0)

    def reset(self) -> None:
        """Forget the previous step's (completed) messages."""
        self.recvs: dict[Action, Pending] = {}
        self.posted: set[Action] = set()
        self.sends: list[Pending] = []
        self.recvs_done = 0

    def describe(self, what: str, ask: str) -> Callable[[bool, str], str]:
        """The failure message of a wait on ``what`` (see `wait`), given (timed out, backend detail)."""
        def describe(timed_out: bool, detail: str) -> str:
            if timed_out:
                return (f"{self.where} timed out after {self.timeout_s:.1f} s waiting on {what}; {ask} "
                        "(if it is only slow, raise timeout_s)")
            return f"{self.where} failed waiting on {what} ({detail}); {ask} check its log for the first error"
        return describe

    def wait(self, work: Any, what: str, ask: str) -> None:
        """Bounded wait; ``what`` reads like "1RECV_B3 from rank 2", ``ask`` like "is rank 2 alive?"."""
        wait_work(work, timeout_s=self.timeout_s, gloo=self.gloo, describe=self.describe(what, ask))

    def post(self, start: Callable[[], Any], what: str, ask: str) -> Any:
        """``start()`` (an isend or irecv), its failure named like a failed wait (see `post_work`)."""
        return post_work(start, describe=self.describe(what, ask))

    def peer(self, action: Action) -> int:
        step = -1 if action.op in (Op.RECV_F, Op.SEND_B) else 1
        return self.stage_ranks[action.stage + step]

    def message_specs(self, action: Action) -> tuple[int, tuple[TensorSpec, ...], int]:
        """(kind, specs, cut index) of the message an action sends or receives."""
        s = self.chunks[action.stage]
        if action.op in (Op.RECV_F, Op.SEND_F):
            cut = s.in_cut if action.op is Op.RECV_F else s.out_cut
            return KIND_ACT, cut.tensors, cut.index
        cut = s.out_cut if action.op is Op.RECV_B else s.in_cut
        return KIND_GRAD, cut.grad_tensors, cut.index

    def handshake(self, microbatches: int) -> None:
        """Neighbours compare cut fingerprints, micro-batch and stage counts before the first step
        (one message per cut, every chunk's; the sends are posted before any receive is awaited)."""
        works = []
        for s in self.chunks.values():
            if s.out_cut is not None:
                mine = torch.tensor([s.out_cut.fingerprint(), microbatches, s.num_stages], device=self.header_device)
                dst = self.stage_ranks[s.stage + 1]
                tag = HANDSHAKE_TAG + s.out_cut.index // self.ranks
                works.append((self.post(lambda: dist.isend(mine, dst, tag=tag), "the start-up handshake",
                                        f"is rank {dst} alive?"), dst))
        for s in self.chunks.values():
            if s.in_cut is not None:
                self._handshake_from(s, microbatches)
        for work, dst in works:
            self.wait(work, "the start-up handshake", f"is rank {dst} alive?")

    def _handshake_from(self, s: StageModule, microbatches: int) -> None:
        prev = self.stage_ranks[s.stage - 1]
        theirs = torch.zeros(3, dtype=torch.int64, device=self.header_device)
        tag = HANDSHAKE_TAG + s.in_cut.index // self.ranks
        what, ask = f"the start-up handshake from rank {prev}", f"is rank {prev} alive?"
        self.wait(self.post(lambda: dist.irecv(theirs, prev, tag=tag), what, ask), what, ask)
        got, expected = theirs.cpu().tolist(), [s.in_cut.fingerprint(), microbatches, s.num_stages]
        if got != expected:
            raise RuntimeFailure(
                f"{self.where} and rank {prev} (stage {s.stage - 1}) disagree before the first step: peer has "
                f"(cut fingerprint, micro-batches, stages) = {tuple(got)}, this rank {tuple(expected)}; this "
                f"rank expects cut {s.in_cut.index} = [{', '.join(t.describe() for t in s.in_cut.tensors)}]. "
                "Build every stage from the same StagedProgram and schedule")

    def post_recv(self, action: Action) -> None:
        """Post the irecv of a RECV action's frame (idempotent)."""
        if action in self.posted:
            return
        kind, specs, cut = self.message_specs(action)
        src, mb = self.peer(action), action.microbatch
        frame = torch.empty(frame_layout(specs)[1], dtype=torch.uint8, device=self.stage.device)
        tag = self.tag(kind, mb, cut)
        works = [self.post(lambda: dist.irecv(frame, src, tag=tag), f"{action} from rank {src}",
                           f"is rank {src} alive?")]
        self.recvs[action] = Pending(action, src, specs, frame, works)
        self.posted.add(action)
        self._on_bytes(action, sum(t.num_bytes for t in specs))

    def recv(self, action: Action) -> list[torch.Tensor]:
        """Wait for a RECV action's message, check its header, honour the emulated arrival time."""
        self.post_recv(action)
        if self.wait_sends_at_recv:
            self.wait_sends(before=action, posted_before=self.recvs_done - self.send_wait_lag)
        p = self.recvs.pop(action)
        self.wait(p.works[0], f"{action} from rank {p.peer}", f"is rank {p.peer} alive?")
        header, tensors = unpack_frame(p.frame, p.specs)
        self._check_header(header, p)
        if header.arrive_ns > 0:
            if self._on_arrived is not None:
                self._on_arrived(action, (time.monotonic_ns() - header.arrive_ns) / 1e9)
            sleep_until_ns(header.arrive_ns)
        self._on_bytes(action, None)
        self.recvs_done += 1
        return tensors

    def _check_header(self, h: WireHeader, p: Pending) -> None:
        a, peer_stage = p.action, p.action.stage + (-1 if p.action.op is Op.RECV_F else 1)
        kind = KIND_ACT if a.op is Op.RECV_F else KIND_GRAD
        head = f"{self.where} received a wrong message on {a} from rank {p.peer} (stage {peer_stage})"
        if (h.stage, h.kind, h.microbatch) != (peer_stage, kind, a.microbatch):
            raise RuntimeFailure(f"{head}: it is {'gradients' if h.kind else 'activations'} of micro-batch "
                                 f"{h.microbatch} from stage {h.stage}; every rank must run the same schedule")
        for (dtype, shape), spec in zip(h.tensors, p.specs):
            if dtype != spec.dtype or shape != spec.shape:
                got = f"{shape} {str(dtype).removeprefix('torch.')}"
                raise RuntimeFailure(
                    f"{head}: micro-batch {a.microbatch}, tensor {spec.name!r} is {got}, the cut spec expects "
                    f"{spec.describe()}; feed micro-batches shaped like split_stages' example inputs and build "
                    "every stage from the same StagedProgram")

    def send(self, action: Action, tensors: Sequence[torch.Tensor]) -> None:
        """Post a SEND action's header and tensors; a tensor off its spec is reported on both ends."""
        kind, specs, cut = self.message_specs(action)
        mb, dst = action.microbatch, self.peer(action)
        if len(tensors) != len(specs):
            raise RuntimeFailure(f"{self.where}: {action} has {len(tensors)} tensors, cut {cut} expects {len(specs)}; "
                                 "build the stage from the same StagedProgram")
        problem = mismatch(tensors, specs)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors)
        delay_s = self._send_delay_s(cut, num_bytes)
        arrive_ns = time.monotonic_ns() + int(delay_s * 1e9) if delay_s > 0 else 0
        header = encode_header(stage=action.stage, kind=kind, microbatch=mb, arrive_ns=arrive_ns,
                               tensors=tensors)
        frame = pack_frame(header, tensors, specs, device=self.stage.device)
        tag = self.tag(kind, mb, cut)
        work = self.post(lambda: dist.isend(frame, dst, tag=tag), f"{action} to rank {dst}", f"is rank {dst} alive?")
        if problem:  # tell the receiver the truth (the header), then stop: the data would be misread
            self.wait(work, f"{action} to rank {dst}", f"is rank {dst} alive?")
            raise RuntimeFailure(f"{self.where}: {action}: micro-batch {mb}, {problem}; the stage produced another "
                                 "shape than split_stages propagated: feed micro-batches shaped like its example inputs")
        self.sends.append(Pending(action, dst, specs, frame, [work], self.recvs_done))
        self._on_bytes(action, num_bytes)  # the frame is a copy, held until the send is waited

    def wait_sends(self, before: Action | None = None, posted_before: int | None = None) -> None:
        """Wait until every posted send was received (bounded per message); ``before``: the RECV waiting;
        ``posted_before`` k: only the sends posted when at most k RECVs of this step had completed."""
        at = f" before {before}" if before is not None else ""
        due = [p for p in self.sends if posted_before is None or p.recvs_before <= posted_before]
        for p in due:
            for work in p.works:
                self.wait(work, f"{p.action} to be received by rank {p.peer}{at}", f"is rank {p.peer} alive?")
            self._on_bytes(p.action, None)
        self.sends = self.sends[len(due):]  # posted in order, so the due ones are a prefix


def mismatch(tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec]) -> str | None:
    """A description of the first tensor that differs from its spec, or None.

    Example:
        >>> mismatch([torch.zeros(2)], [TensorSpec("x", (3,), torch.float32, False)])
        "tensor 'x' is (2,) float32, the cut spec expects 'x' (3,) float32"
    """
    for t, spec in zip(tensors, specs):
        if not isinstance(t, torch.Tensor):
            return f"tensor {spec.name!r} is a {type(t).__name__}, the cut spec expects {spec.describe()}"
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            got = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            return f"tensor {spec.name!r} is {got}, the cut spec expects {spec.describe()}"
    return None
