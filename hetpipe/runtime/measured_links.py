"""Measured transfer times per cut, from the ranks' recorded actions of one step (one host).

Every rank records its last step's actions relative to the step's start and that start on
CLOCK_MONOTONIC (`RankTimeline.origin_s`), which all processes of one host share: the
ranks' timelines line up exactly.  A message's transfer is measured where it can be
seen whole: when the receiver was already waiting in its RECV when the sender posted the
SEND, the transfer is ``RECV end - SEND start`` (posting, the wire, the receiver's header
check and unpacking -- everything the pipeline waits for).  A message that arrived
before its RECV began sat in a buffer for an unknown time and is not counted.  Nor is one whose
receiver was also waiting on a message of its own: a RECV first waits for the rank's earlier
sends (`hetpipe.runtime.execute.prefetch`, ``wait_sends_at_recv``), so when the receiving stage's
earlier send back to the sending stage was still unreceived as this SEND began (its RECV ended after;
an interleaved rank's other chunks are not checked),
the RECV's end also covers that other message's transfer (the other direction, posted only once
the sender reaches its RECV).  In a 2-stage 1F1B every steady-state forward message was such a
pair: the span measured two transfers and was priced as one.

Session 15: a 2-stage 1F1B step has just two messages seen whole (the first forward, the last
backward), so one step's median was of two figures, one of each direction, where the plan's C_s
prices the forward message (``boundary_bytes``; an HF Llama's forward cut carries its mask and
rotary tables besides the hidden states, 672 KiB in 4 tensors, its gradient 512 KiB in one).
`MessageLog` keeps every step's messages (`MESSAGE_STEPS_KEPT` at most), and the spans are
counted per direction (``kind``: "F" forward, "B" gradients) over all of them.

Example:
    >>> from types import SimpleNamespace as NS
    >>> sender = NS(origin_s=100.0, actions=(NS(action="0SEND_F0", start_s=0.010, duration_s=0.001),))
    >>> receiver = NS(origin_s=100.0, actions=(NS(action="1RECV_F0", start_s=0.000, duration_s=0.0125),))
    >>> {cut: [round(t, 6) for t in ts] for cut, ts in cut_transfers_s((sender, receiver)).items()}
    {0: [0.0025]}
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

#: Steps whose messages a rank keeps (`MessageLog`): the report's medians need a few steps, and a
#: long run must not grow its result file with every step (one step of 1F1B: ~4 records per micro-batch).
MESSAGE_STEPS_KEPT = 16
#: The actions a `MessageLog` records.
MESSAGE_OPS = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")


class _Action(Protocol):
    action: str
    start_s: float
    duration_s: float


class Timeline(Protocol):
    """What `hetpipe.runtime.report.RankTimeline` offers: the step's origin and its actions."""

    origin_s: float
    actions: Sequence[_Action]


_ACTION = re.compile(r"^(\d+)([A-Z_]+?)(\d+)$")


def _parse(name: str) -> tuple[int, str, int] | None:
    """``"1RECV_F3"`` -> (1, "RECV_F", 3); None for a name that is not stage-op-micro-batch."""
    m = _ACTION.match(name)
    return (int(m.group(1)), m.group(2), int(m.group(3))) if m else None


def _events(timelines: Sequence[Timeline]) -> dict[tuple[int, str, int], tuple[float, float]]:
    """(stage, op, micro-batch) -> (absolute start, absolute end) in CLOCK_MONOTONIC seconds."""
    out: dict[tuple[int, str, int], tuple[float, float]] = {}
    for tl in timelines:
        for a in tl.actions:
            key = _parse(a.action)
            if key is not None:
                start = tl.origin_s + a.start_s
                out[key] = (start, start + a.duration_s)
    return out


@dataclass(frozen=True)
class MessageSpan:
    """One message seen whole: from the sender's SEND to the waiting receiver's RECV end (CLOCK_MONOTONIC s)."""

    cut: int  # between stage cut and cut + 1
    src: int  # sending stage
    dst: int
    action: str  # the SEND, e.g. "0SEND_F3"
    microbatch: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def message_spans(timelines: Sequence[Timeline], kind: str | None = None) -> list[MessageSpan]:
    """Every message whose receiver was already waiting when it was sent, in send order.

    ``kind``: "F" only the forward messages (activations), "B" only the gradients, None both.

    Empty when any timeline lacks its origin (a report from before origins were recorded).
    """
    if not timelines or any(tl.origin_s <= 0.0 for tl in timelines):
        return []
    events = _events(timelines)
    spans = []
    for (stage, op, mb), (send_start, _) in sorted(events.items(), key=lambda kv: kv[1][0]):
        if op not in ("SEND_F", "SEND_B") or (kind is not None and op != f"SEND_{kind}"):
            continue
        if op == "SEND_F":
            dst, recv_op, cut = stage + 1, "RECV_F", stage
        else:
            dst, recv_op, cut = stage - 1, "RECV_B", stage - 1
        recv = events.get((dst, recv_op, mb))
        if recv is None or not recv[0] <= send_start <= recv[1]:  # the message waited for its receiver
            continue
        if _receiver_send_pending(events, sender=stage, receiver=dst, at_s=send_start):
            continue
        spans.append(MessageSpan(cut, stage, dst, f"{stage}{op}{mb}", mb, send_start, recv[1]))
    return spans


def _receiver_send_pending(events: dict[tuple[int, str, int], tuple[float, float]], *, sender: int,
                           receiver: int, at_s: float) -> bool:
    """Had `receiver` posted a send to `sender` before `at_s` that `sender` received only after it?"""
    back_op, back_recv = ("SEND_B", "RECV_B") if receiver > sender else ("SEND_F", "RECV_F")
    for (stage, op, mb), (start, _) in events.items():
        if stage == receiver and op == back_op and start < at_s:
            got = events.get((sender, back_recv, mb))
            if got is None or got[1] > at_s:
                return True
    return False


def cut_transfers_s(timelines: Sequence[Timeline], kind: str | None = None) -> dict[int, list[float]]:
    """Cut index (between stage c and c + 1) -> the measured one-way transfers on it (``kind``: `message_spans`)."""
    found: dict[int, list[float]] = {}
    for span in message_spans(timelines, kind):
        found.setdefault(span.cut, []).append(span.duration_s)
    return found


def steps_cut_transfers_s(steps: Iterable[Sequence[Timeline]], kind: str | None = None) -> dict[int, list[float]]:
    """`cut_transfers_s` of each step's timelines (one per rank), gathered over the steps.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> def step(at):
        ...     return (NS(origin_s=at, actions=(NS(action="0SEND_F0", start_s=0.01, duration_s=0.001),)),
        ...             NS(origin_s=at, actions=(NS(action="1RECV_F0", start_s=0.0, duration_s=0.012),)))
        >>> {c: [round(t, 6) for t in ts] for c, ts in steps_cut_transfers_s([step(1.0), step(2.0)], "F").items()}
        {0: [0.002, 0.002]}
    """
    found: dict[int, list[float]] = {}
    for timelines in steps:
        for cut, spans in cut_transfers_s(timelines, kind).items():
            found.setdefault(cut, []).extend(spans)
    return found


def run_message_steps(ranks: Sequence[tuple[int, Sequence[Timeline]]], *, steps: int) -> list[list[Timeline]]:
    """Per step of the run that every rank kept, after the first (warm-up) of a run of `steps`: the ranks'
    timelines of that step.  ``ranks``: per rank (the run's step its first kept timeline is, its timelines).

    Example:
        >>> run_message_steps([(0, ("a0", "a1", "a2")), (1, ("b1", "b2"))], steps=3)
        [['a1', 'b1'], ['a2', 'b2']]
        >>> run_message_steps([(0, ("a0",)), (0, ())], steps=1)
        []
    """
    if not ranks or any(not kept for _, kept in ranks):
        return []
    first = max(start for start, _ in ranks)
    last = min(start + len(kept) for start, kept in ranks)
    skip = 1 if steps > 1 else 0
    return [[kept[i - start] for start, kept in ranks] for i in range(max(first, skip), last)]


@dataclass(frozen=True)
class LoggedAction:
    """One SEND or RECV of a rank: its name and its start and end on CLOCK_MONOTONIC (s)."""

    action: str
    start_s: float
    end_s: float


class MessageLog:
    """A rank's SEND and RECV actions, step by step, the last `MESSAGE_STEPS_KEPT` steps.

    A step's list holds each action once, so an action seen again begins the next step.

    Example:
        >>> log = MessageLog()
        >>> for at in (1.0, 2.0):
        ...     log.record("0SEND_F0", at, at + 0.001)
        >>> [[a.start_s for a in step] for step in log.steps()]
        [[1.0], [2.0]]
    """

    def __init__(self, keep: int = MESSAGE_STEPS_KEPT) -> None:
        self._steps: deque[list[LoggedAction]] = deque(maxlen=keep)
        self._names: set[str] = set()
        self.steps_seen = 0  # every step begun, kept or not

    def record(self, action: str, start_s: float, end_s: float) -> None:
        """Log one SEND or RECV that ran from `start_s` to `end_s` (CLOCK_MONOTONIC s)."""
        if not self._steps or action in self._names:
            self._steps.append([])
            self._names = set()
            self.steps_seen += 1
        self._names.add(action)
        self._steps[-1].append(LoggedAction(action, start_s, end_s))

    def steps(self) -> list[list[LoggedAction]]:
        """The kept steps, oldest first."""
        return [list(step) for step in self._steps]
