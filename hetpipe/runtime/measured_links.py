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

Example:
    >>> from types import SimpleNamespace as NS
    >>> sender = NS(origin_s=100.0, actions=(NS(action="0SEND_F0", start_s=0.010, duration_s=0.001),))
    >>> receiver = NS(origin_s=100.0, actions=(NS(action="1RECV_F0", start_s=0.000, duration_s=0.0125),))
    >>> {cut: [round(t, 6) for t in ts] for cut, ts in cut_transfers_s((sender, receiver)).items()}
    {0: [0.0025]}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, Sequence


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


def message_spans(timelines: Sequence[Timeline]) -> list[MessageSpan]:
    """Every message whose receiver was already waiting when it was sent, in send order.

    Empty when any timeline lacks its origin (a report from before origins were recorded).
    """
    if not timelines or any(tl.origin_s <= 0.0 for tl in timelines):
        return []
    events = _events(timelines)
    spans = []
    for (stage, op, mb), (send_start, _) in sorted(events.items(), key=lambda kv: kv[1][0]):
        if op == "SEND_F":
            dst, recv_op, cut = stage + 1, "RECV_F", stage
        elif op == "SEND_B":
            dst, recv_op, cut = stage - 1, "RECV_B", stage - 1
        else:
            continue
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


def cut_transfers_s(timelines: Sequence[Timeline]) -> dict[int, list[float]]:
    """Cut index (between stage c and c + 1) -> the measured one-way transfers on it, both directions."""
    found: dict[int, list[float]] = {}
    for span in message_spans(timelines):
        found.setdefault(span.cut, []).append(span.duration_s)
    return found
