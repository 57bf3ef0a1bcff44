"""Emulate a plan's devices on one CPU box: stretched compute, delayed links, a memory ledger.

Each rank pretends to be the device its stage was planned on (issue #4, "Emulated cluster"):

* **Time scale.**  ``time_scale`` is *real seconds per emulated second*.  A compute
  action (F or B of one micro-batch) must last ``time_scale * predicted_s`` of real
  time, where ``predicted_s`` is the plan's per-micro-batch ``fwd_s`` / ``bwd_s`` of
  the stage on its device.  `choose_time_scale` picks the smallest scale at which
  every action's target is at least `DEFAULT_SAFETY_FACTOR` times what the CPU
  really needs for it when every rank computes at once on the shared cores::

      time_scale = safety * contention * max_{s, op} measured_s[s, op] / predicted_s[s, op]
      contention = max(1, num_ranks / num_cores)

  ``measured_s`` is one uncontended (serialised) real F or B of each stage.  If an
  action still overruns its target, `ComputeStretch` counts it: the emulation is
  then measuring CPU contention rather than the plan, and the run report says so.
* **Links.**  A send of n bytes over the plan's link ``src -> dst`` arrives
  ``time_scale * (latency_s + n / bandwidth_bytes_s)`` after the link direction is
  free (alpha-beta model, cost_formulas.md §3.4; one transfer at a time per
  direction, FIFO, as `hetpipe.schedule.simulate` assumes).  The sender does not
  wait: `LinkClock` computes the arrival time (CLOCK_MONOTONIC, system-wide on one
  host), the timestamp travels with the tensor, and the receiver sleeps until it.
* **Memory.**  `MemoryLedger` accounts the bytes the stage really holds --
  parameters (and module buffers), gradients, optimizer state, the tensors autograd
  saved for backward (unique storages, via ``torch.autograd.graph.saved_tensors_hooks``)
  and communication buffers -- against the device's ``usable_bytes``, and raises an
  emulated out-of-memory `RuntimeFailure` with the numbers when it is exceeded.  A unit
  the plan recomputes (``torch.utils.checkpoint``) shows up with only its inputs saved (the
  checkpoint's own hooks take the tensors inside it), and its backward adds one unit's
  activations while it re-runs the forward (`hetpipe.runtime.stage.recompute`).
* **Offload time**: an offloading stage's STEP (gradients to the host, the host step, weights
  back) lasts at least ``time_scale * offload_s`` (the plan's O_s); its optimizer state is on
  the host, so the ledger counts none of it (`hetpipe.runtime.stage.offload`).
* **Tensor-parallel groups**: each member is stretched to its own F / B (its share's integer parts
  plus the group's all-reduces and the lead's broadcast, `hetpipe.plan.group_run.member_timings`);
  the real all-reduces run inside them, and its ledger holds its own card's usable bytes.
* **Recomputation time** needs nothing special: the plan's ``bwd_s`` includes the recompute
  (the forward of the recomputed units), and the calibration's real backward does too.

The math (`choose_time_scale`, `LinkClock`, `ComputeStretch`, `MemoryLedger`) is pure
Python and unit-tested alone; `RecordingHooks` and `EmulationHooks` subclass the
executor's `ActionHooks` to plug it into a run.

Example:
    >>> ts = choose_time_scale([StageTiming(0.010, 0.020)], [StageTiming(1.0, 2.0)],
    ...                        num_ranks=1, num_cores=2, safety_factor=2.0)
    >>> round(ts.real_s_per_emulated_s, 6), ts.limiting
    (0.02, '0F')
    >>> clock = LinkClock(time_scale=1.0)
    >>> clock.arrival_s(send_at_s=0.0, num_bytes=100, bandwidth_bytes_s=100.0, latency_s=0.5)
    1.5
    >>> clock.arrival_s(send_at_s=1.0, num_bytes=100, bandwidth_bytes_s=100.0, latency_s=0.5)  # queued
    3.0
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from hetpipe.errors import ConfigError, RuntimeFailure
from hetpipe.runtime.measured_links import MESSAGE_OPS, MessageLog

log = logging.getLogger(__name__)

# Every emulated action gets at least this many times the real CPU time it needs
# when all ranks compute at once.  2x leaves the other half of each target for
# what the single-process measurement misses: Python/dispatcher jitter, cache
# effects of co-running ranks, gloo threads and the optimizer step's share of the
# cores.  Measured: with 2x, 3-rank gpt-demo runs on 2 cores report no overruns
# (benchmarks/results/runtime_emulated.md).
DEFAULT_SAFETY_FACTOR = 2.0
# Shortest real duration an emulated action may be given: time.sleep() on Linux
# overshoots by ~50-100 us, so targets below 2 ms would be dominated by that error.
MIN_ACTION_REAL_S = 2e-3
# An action counts as an overrun only if it exceeds its target by more than this
# fraction (sleep granularity and clock reads are not overruns).
OVERRUN_TOLERANCE = 0.02

# A message is "late" if its receiver really waited this long past the emulated arrival
# time.  Below it is the wake-up latency of a rank on an oversubscribed CPU box
# (measured: at most 3.3 ms over 48 messages, 3 ranks on 2 cores), not the transport.
LATE_TOLERANCE_S = 5e-3

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class StageTiming:
    """Forward and backward seconds of one micro-batch on one stage."""

    fwd_s: float
    bwd_s: float
    step_s: float = 0.0  # the offload tail O_s its STEP lasts (`hetpipe.cost_models.offload`); 0 = unstretched
    bwd_weight_s: float = 0.0  # W_s of a split schedule (ZB): its B lasts bwd_s - bwd_weight_s, its W bwd_weight_s


def emulated_s(timing: StageTiming, op: str) -> float:
    """Emulated seconds of one ``op`` ("F", "B" or "W") under ``timing``: a split B lasts bwd_s - W_s.

    Example:
        >>> emulated_s(StageTiming(1.0, 2.0, bwd_weight_s=0.5), "B")
        1.5
    """
    return {"F": timing.fwd_s, "B": timing.bwd_s - timing.bwd_weight_s, "W": timing.bwd_weight_s}[op]


@dataclass(frozen=True)
class TimeScale:
    """The chosen time scale and what it was derived from.

    Attributes:
        real_s_per_emulated_s: multiply an emulated (plan) duration by this to get real seconds.
        safety_factor: the margin over contended real compute (`DEFAULT_SAFETY_FACTOR`).
        contention_factor: ``max(1, num_ranks / num_cores)``.
        limiting: the action kind that set the scale, e.g. ``"2B"`` (stage 2's backward).
        measured: real uncontended seconds per micro-batch, per stage.
        predicted: the plan's seconds per micro-batch, per stage.
    """

    real_s_per_emulated_s: float
    safety_factor: float
    contention_factor: float
    limiting: str
    measured: tuple[StageTiming, ...]
    predicted: tuple[StageTiming, ...]

    def real_s(self, emulated_s: float) -> float:
        """Real seconds for an emulated duration: ``ts.real_s(0.5)``."""
        return self.real_s_per_emulated_s * emulated_s


def choose_time_scale(
    measured: Sequence[StageTiming],
    predicted: Sequence[StageTiming],
    *,
    num_ranks: int,
    num_cores: int,
    safety_factor: float = DEFAULT_SAFETY_FACTOR,
    min_action_real_s: float = MIN_ACTION_REAL_S,
) -> TimeScale:
    """The smallest time scale at which every F/B target exceeds its contended real cost.

    See the module docstring for the formula; additionally no target is shorter than
    ``min_action_real_s``.

    Example:
        >>> ts = choose_time_scale([StageTiming(0.01, 0.02), StageTiming(0.03, 0.03)],
        ...                        [StageTiming(1.0, 2.0), StageTiming(1.0, 1.0)],
        ...                        num_ranks=4, num_cores=2, safety_factor=2.0)
        >>> round(ts.real_s_per_emulated_s, 6), ts.contention_factor, ts.limiting
        (0.12, 2.0, '1F')
    """
    if len(measured) != len(predicted) or not measured:
        raise ConfigError(f"time scale needs one measurement per stage: got {len(measured)} measured, "
                          f"{len(predicted)} predicted stages")
    if num_ranks < 1 or num_cores < 1 or safety_factor < 1.0:
        raise ConfigError(f"time scale needs num_ranks >= 1, num_cores >= 1, safety_factor >= 1; got "
                          f"{num_ranks}, {num_cores}, {safety_factor}")
    contention = max(1.0, num_ranks / num_cores)
    best, limiting = 0.0, ""
    for s, (real, pred) in enumerate(zip(measured, predicted)):
        for op, r, p in (("F", real.fwd_s, pred.fwd_s), ("B", real.bwd_s, pred.bwd_s)):
            if not (p > 0 and math.isfinite(p)):
                raise ConfigError(f"stage {s}: predicted {op} time {p!r} s must be positive and finite; "
                                  "re-plan with `hetpipe plan`")
            if not (r >= 0 and math.isfinite(r)):
                raise ConfigError(f"stage {s}: measured {op} time {r!r} s is not a duration")
            # The larger of the contention bound and the sleep-granularity floor.
            need = max(safety_factor * contention * r, min_action_real_s) / p
            if need > best:
                best, limiting = need, f"{s}{op}"
    return TimeScale(best, safety_factor, contention, limiting, tuple(measured), tuple(predicted))


def transfer_s(num_bytes: int, *, bandwidth_bytes_s: float, latency_s: float) -> float:
    """Alpha-beta time of one message (cost_formulas.md §3.4); 0 for an empty message.

    Example:
        >>> transfer_s(1000, bandwidth_bytes_s=1e6, latency_s=1e-3)
        0.002
    """
    if num_bytes <= 0:
        return 0.0
    return latency_s + num_bytes / bandwidth_bytes_s


@dataclass
class LinkClock:
    """One direction of one emulated link, owned by its (only) sender.

    `arrival_s` queues transfers FIFO: a message starts when it is sent or when the
    previous one has arrived, whichever is later, and takes the scaled alpha-beta time.
    Times are real CLOCK_MONOTONIC seconds.
    """

    time_scale: float
    busy_until_s: float = -math.inf
    messages: int = 0
    queued_s: float = 0.0  # real seconds messages waited for the link to be free
    factor: float = 1.0  # injected slowdown of the link (`hetpipe.runtime.faults.inject`); finite here
    transfers: list[tuple[int, float]] = field(default_factory=list)  # (bytes, real s on the wire) per message

    def arrival_s(self, *, send_at_s: float, num_bytes: int, bandwidth_bytes_s: float, latency_s: float) -> float:
        """Real time at which a message sent at ``send_at_s`` has fully arrived."""
        start = max(send_at_s, self.busy_until_s)
        self.queued_s += start - send_at_s
        self.messages += 1
        wire_s = self.factor * self.time_scale * transfer_s(num_bytes, bandwidth_bytes_s=bandwidth_bytes_s,
                                                            latency_s=latency_s)
        self.transfers.append((num_bytes, wire_s))
        arrive = start + wire_s
        self.busy_until_s = arrive
        return arrive


@dataclass
class ComputeStretch:
    """Stretches compute actions to their targets and counts overruns.

    ``remaining_s(elapsed_s, target_s)`` is how long to sleep after an action that
    really took ``elapsed_s``; an action slower than its target (beyond
    `OVERRUN_TOLERANCE`) is counted in ``overruns`` and gets no sleep.  ``factor`` (an
    injected slowdown, `hetpipe.runtime.faults.inject`) multiplies every target.

    Example:
        >>> c = ComputeStretch()
        >>> c.remaining_s("F", elapsed_s=0.2, target_s=1.0), c.remaining_s("B", elapsed_s=2.0, target_s=1.0)
        (0.8, 0.0)
        >>> c.overruns, round(c.worst_overrun_ratio, 2)
        ({'F': 0, 'B': 1}, 2.0)
    """

    overruns: dict[str, int] = field(default_factory=lambda: {"F": 0, "B": 0})
    actions: int = 0
    worst_overrun_ratio: float = 0.0  # largest elapsed / target among overruns
    busy_fraction_max: float = 0.0  # largest elapsed / target among all actions
    factor: float = 1.0  # injected: the device computes this many times slower

    def remaining_s(self, op: str, *, elapsed_s: float, target_s: float) -> float:
        self.actions += 1
        target_s *= self.factor
        ratio = elapsed_s / target_s if target_s > 0 else math.inf
        self.busy_fraction_max = max(self.busy_fraction_max, ratio)
        if ratio > 1.0 + OVERRUN_TOLERANCE:
            self.overruns[op] = self.overruns.get(op, 0) + 1
            self.worst_overrun_ratio = max(self.worst_overrun_ratio, ratio)
        return max(0.0, target_s - elapsed_s)


LEDGER_CATEGORIES = ("params", "grads", "optimizer", "activations", "comm")


def format_bytes(num_bytes: float) -> str:
    """GiB above 1 GiB, MiB otherwise (emulated miniature clusters live in MiB).

    Example:
        >>> format_bytes(13.1 * 2**30), format_bytes(3 * 2**20)
        ('13.1 GiB', '3.0 MiB')
    """
    if abs(num_bytes) >= GIB:
        return f"{num_bytes / GIB:.1f} GiB"
    return f"{num_bytes / MIB:.1f} MiB"


@dataclass
class MemoryLedger:
    """Bytes a stage holds, by category, checked against the emulated device's usable memory.

    The executor accounts what the stage really holds (`LEDGER_CATEGORIES`: parameters and
    buffers, gradients, optimizer state, the unique storages autograd saved for backward
    plus in-flight stage inputs/outputs, communication buffers) and reports the totals
    after every action; `update` takes them and `check` raises the emulated OOM.

    Example:
        >>> led = MemoryLedger(usable_bytes=100, rank=2, stage=2, device="n1:0 (rtx3060-12gb)")
        >>> led.update({"params": 40, "activations": 30}); led.check("2F0")
        >>> led.held_bytes, led.peak_action
        (70, '2F0')
        >>> led.update({"params": 40, "activations": 70}); led.check("2F1")
        Traceback (most recent call last):
        ...
        hetpipe.errors.RuntimeFailure: emulated OOM on rank 2 (stage 2, n1:0 (rtx3060-12gb)) at 2F1: 110 B held > 100 B usable (params 40 B, grads 0 B, optimizer 0 B, activations 70 B, comm 0 B); fix: give this stage fewer units or micro-batches in flight (re-plan with `hetpipe plan`), or run it on a card with more memory
    """

    usable_bytes: int
    rank: int
    stage: int
    device: str
    totals: dict[str, int] = field(default_factory=lambda: {c: 0 for c in LEDGER_CATEGORIES})
    peak_bytes: int = 0
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    peak_action: str = ""

    @property
    def held_bytes(self) -> int:
        return sum(self.totals.values())

    def update(self, held_bytes: Mapping[str, int]) -> None:
        """Replace the totals with the executor's (categories it does not report are 0)."""
        self.totals = {c: int(held_bytes.get(c, 0)) for c in LEDGER_CATEGORIES}

    def _fmt(self, num_bytes: int) -> str:
        return format_bytes(num_bytes) if self.usable_bytes >= MIB else f"{num_bytes} B"

    def check(self, action: str) -> None:
        """Update the peak after ``action``; raise the emulated OOM if over the limit."""
        held = self.held_bytes
        if held > self.peak_bytes:
            self.peak_bytes, self.peak_breakdown, self.peak_action = held, dict(self.totals), action
        if held <= self.usable_bytes:
            return None
        parts = ", ".join(f"{c} {self._fmt(self.totals[c])}" for c in LEDGER_CATEGORIES)
        raise RuntimeFailure(
            f"emulated OOM on rank {self.rank} (stage {self.stage}, {self.device}) at {action}: "
            f"{self._fmt(held)} held > {self._fmt(self.usable_bytes)} usable ({parts}); fix: give this stage "
            "fewer units or micro-batches in flight (re-plan with `hetpipe plan`), or run it on a card with "
            "more memory"
        )


# ----------------------------------------------------------------------------- executor hooks


def _hooks_base() -> type:
    from hetpipe.runtime.execute.executor import ActionHooks

    return ActionHooks


class RecordingHooks(_hooks_base()):  # type: ignore[misc]
    """Remembers the last action started (for error reports) and every F/B's whole duration.

    ``fwd_s`` / ``bwd_s`` are real seconds of the whole action (with any emulation sleep), ``fwd_compute_s`` /
    ``bwd_compute_s`` the executor's measured compute, ``fwd_cpu_s`` / ``bwd_cpu_s`` the calling thread's CPU
    seconds over it (`time.thread_time`: other processes' time on the core and a sleep do not count).
    """

    cpu_clock = True  # read the thread's CPU clock around F/B (a syscall, ~1-6 us; EmulationHooks read none)

    def __init__(self) -> None:
        self.current: str = "start-up"
        self.fwd_s: list[float] = []
        self.bwd_s: list[float] = []
        self.fwd_compute_s: list[float] = []
        self.bwd_compute_s: list[float] = []
        self.fwd_cpu_s: list[float] = []
        self.bwd_cpu_s: list[float] = []
        self._start_s = 0.0
        self._cpu_start_s = 0.0
        self._b_entry: dict[int, int] = {}  # micro-batch -> its B's index in bwd_s, until its W (split lists)
        self.message_log = MessageLog()  # every step's SENDs and RECVs on CLOCK_MONOTONIC (measured C)

    def before(self, action: Any) -> None:
        self.current = str(action)
        self._start_s = time.monotonic()
        self._cpu_start_s = time.thread_time() if self.cpu_clock else 0.0

    def stretch(self, action: Any, compute_s: float) -> None:
        """Hook for subclasses: called after a compute action, before its duration is recorded."""

    def after(self, action: Any, seconds: float) -> None:
        op = action.op.value
        if op in MESSAGE_OPS:
            self.message_log.record(str(action), self._start_s, time.monotonic())
        if op == "STEP":
            self.stretch(action, seconds)
        if op in ("F", "B", "W"):
            self.stretch(action, seconds)
            whole = time.monotonic() - self._start_s
            cpu = time.thread_time() - self._cpu_start_s if self.cpu_clock else 0.0
            if op == "W":  # a split backward: one entry per micro-batch, B's seconds plus W's
                at = self._b_entry.pop(action.microbatch)
                self.bwd_s[at] += whole
                self.bwd_compute_s[at] += seconds
                if self.cpu_clock:
                    self.bwd_cpu_s[at] += cpu
                return
            (self.fwd_s if op == "F" else self.bwd_s).append(whole)
            (self.fwd_compute_s if op == "F" else self.bwd_compute_s).append(seconds)
            (self.fwd_cpu_s if op == "F" else self.bwd_cpu_s).extend([cpu] if self.cpu_clock else [])
            if op == "B":
                self._b_entry[action.microbatch] = len(self.bwd_s) - 1


class EmulationHooks(RecordingHooks):
    """Make this rank behave like its plan device (see the module docstring).

    Args:
        rank, stage: who this is (stage == rank).
        device_label: e.g. ``"n1:0 (rtx3060-12gb)"`` for messages.
        usable_bytes: the emulated device's usable memory.
        predicted: the plan's per-micro-batch F/B seconds of this stage on its device.
        links: cut index -> (bandwidth_bytes_s, latency_s) of the link this rank sends
            over on that cut (cut == stage: activations forward; cut == stage - 1: gradients back).
        time_scale: real seconds per emulated second.
        origin: how the time scale was chosen (kept for the run report).
        chunk_predicted: virtual stage -> its F/B seconds, for a rank holding several chunks of an
            interleaved plan (each action is stretched to its own chunk's; ``predicted`` is chunk 0's).
    """

    exact_memory = True  # the limit is enforced on what the stage really holds, every step
    cpu_clock = False  # a ~1 ms emulated step cannot spare the CPU clock's ~2 x 1-6 us per F/B (stretched anyway)

    def __init__(self, *, rank: int, stage: int, device_label: str, usable_bytes: int, predicted: StageTiming,
                 links: Mapping[int, tuple[float, float]], time_scale: float,
                 origin: TimeScale | None = None, chunk_predicted: Mapping[int, StageTiming] | None = None) -> None:
        super().__init__()
        self.predicted, self.time_scale, self.origin = predicted, time_scale, origin
        self.chunk_predicted = dict(chunk_predicted or {})
        self.late_messages = 0
        self.worst_late_s = 0.0  # longest real wait past a message's emulated arrival
        # every real wait past an emulated arrival, summed (s): waits under LATE_TOLERANCE_S are not "late"
        # messages, yet on a loaded box their sum can stretch a step (issue 12: +15.5% with none counted)
        self.late_total_s = 0.0
        self.compute = ComputeStretch()
        self.ledger = MemoryLedger(usable_bytes=usable_bytes, rank=rank, stage=stage, device=device_label)
        self.links = dict(links)
        self.clocks = {cut: LinkClock(time_scale) for cut in self.links}
        self.fwd_device_s: list[float] = []  # per F / B: max(real compute, target), real s (chunk 0's: `stretch`)
        self.bwd_device_s: list[float] = []
        self.link_names: dict[int, str] = {}  # cut -> "src -> dst" device ids, for a cut link's message
        self.cut_timeout_s = 60.0  # how long a send over a cut link blocks (the run's --timeout)

    def stretch(self, action: Any, compute_s: float) -> None:
        op = action.op.value
        if op == "STEP":  # an offloading stage's copies and host step: at least O_s, emulated
            remaining = self.time_scale * self.predicted.step_s - (time.monotonic() - self._start_s)
            if remaining > 0:
                time.sleep(remaining)
            return
        pred = self.chunk_predicted.get(action.stage, self.predicted)
        emulated = emulated_s(pred, op)
        target = self.time_scale * emulated
        elapsed = time.monotonic() - self._start_s
        remaining = self.compute.remaining_s(op, elapsed_s=elapsed, target_s=target)
        # What the emulated device took (real s): the stretched target, or the compute if it overran.
        # The host's wake-up latency after the sleep is not the device's (`hetpipe.runtime.faults.watch`).
        # A chunk's entry in chunk 0's seconds (x chunk 0's target / its own): a median over the rank's
        # chunks is then its factor over the plan (`hetpipe.runtime.faults.watch`); x 1 on a plain stage.
        own = emulated_s(self.predicted, op) / emulated if emulated > 0 and pred is not self.predicted else 1.0
        if op == "W":  # joins its B's entry (`RecordingHooks.after` has not popped it yet)
            self.bwd_device_s[self._b_entry[action.microbatch]] += (elapsed + remaining) * own
        else:
            (self.fwd_device_s if op == "F" else self.bwd_device_s).append((elapsed + remaining) * own)
        if remaining > 0:
            time.sleep(remaining)

    def send_delay_s(self, cut: int, num_bytes: int) -> float:
        if cut not in self.clocks:
            raise RuntimeFailure(f"emulation: stage {self.ledger.stage} has no outgoing link on cut {cut}; "
                                 "this is a bug in the schedule/executor pairing")
        if math.isinf(self.clocks[cut].factor):
            self.link_cut(cut)
        bandwidth, latency = self.links[cut]
        now = time.monotonic()
        arrive = self.clocks[cut].arrival_s(send_at_s=now, num_bytes=num_bytes, bandwidth_bytes_s=bandwidth,
                                            latency_s=latency)
        return arrive - now

    def memory(self, action: Any, held_bytes: Mapping[str, int]) -> None:
        self.ledger.update(held_bytes)
        self.ledger.check(str(action))

    def arrived(self, action: Any, late_s: float) -> None:
        """A received message's data is complete ``late_s`` after its emulated arrival time.

        The executor reports this when the RECV's data has arrived, measured from the
        emulated arrival; a message only counts as late if the receiver really *waited*
        for it past that time (it was not just busy computing until then).
        """
        done = time.monotonic()
        arrive = done - late_s
        waited_past = done - max(self._start_s, arrive)
        if late_s > 0:
            self.worst_late_s = max(self.worst_late_s, waited_past)
            self.late_total_s += max(0.0, waited_past)
            if waited_past > LATE_TOLERANCE_S:
                self.late_messages += 1

    def link_cut(self, cut: int) -> None:
        """A send over a cut link (injected): block for ``cut_timeout_s`` like a lost network, then fail.

        The message names the link by its plan devices; `link_names` (cut -> ``"a:0 -> b:0"``)
        is set by `hetpipe.runtime.faults.watch`, which also sets ``cut_timeout_s`` to the run's timeout.
        """
        name = self.link_names.get(cut, f"on cut {cut}")
        time.sleep(self.cut_timeout_s)
        raise RuntimeFailure(f"rank {self.ledger.rank} (stage {self.ledger.stage}) could not send {self.current}: "
                             f"the emulated link {name} is cut (--inject) and nothing arrived within the timeout "
                             f"{self.cut_timeout_s:.1f} s; restore the link or re-plan without it")

    @property
    def messages(self) -> int:
        return sum(c.messages for c in self.clocks.values())
