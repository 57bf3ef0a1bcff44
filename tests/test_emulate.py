"""Emulation math: time-scale choice, link queueing, compute stretch, memory ledger, and the hooks."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.errors import ConfigError, RuntimeFailure
from hetpipe.schedule.actions import Action, Op
from hetpipe.runtime.emulate.pipeline import (
    MIN_ACTION_REAL_S,
    ComputeStretch,
    EmulationHooks,
    LinkClock,
    MemoryLedger,
    StageTiming,
    choose_time_scale,
    format_bytes,
    transfer_s,
)

durations = st.floats(min_value=1e-5, max_value=10.0, allow_nan=False)
timings = st.builds(StageTiming, durations, durations)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(timings, timings), min_size=1, max_size=5),
       st.integers(1, 8), st.integers(1, 4), st.floats(1.0, 4.0))
def test_time_scale_is_the_smallest_that_covers_every_action(pairs, ranks, cores, safety):
    measured, predicted = [m for m, _ in pairs], [p for _, p in pairs]
    ts = choose_time_scale(measured, predicted, num_ranks=ranks, num_cores=cores, safety_factor=safety)
    contention = max(1.0, ranks / cores)
    assert ts.contention_factor == contention
    slack = []
    for real, pred in zip(measured, predicted):
        for r, p in ((real.fwd_s, pred.fwd_s), (real.bwd_s, pred.bwd_s)):
            target = ts.real_s(p)
            # Every emulated action gets at least safety x its contended real cost, and the sleep floor.
            assert target >= safety * contention * r * (1 - 1e-12)
            assert target >= MIN_ACTION_REAL_S * (1 - 1e-12)
            slack.append(target / max(safety * contention * r, MIN_ACTION_REAL_S))
    # ... and no smaller scale would do: the limiting action is exactly at its bound.
    assert min(slack) == pytest.approx(1.0, rel=1e-9)
    stage, op = int(ts.limiting[:-1]), ts.limiting[-1]
    assert op in "FB" and 0 <= stage < len(pairs)


def test_time_scale_worked_example():
    # Stage 1's F: 0.03 s real for 1.0 s predicted, 4 ranks on 2 cores, 2x safety -> 0.12.
    ts = choose_time_scale([StageTiming(0.01, 0.02), StageTiming(0.03, 0.03)],
                           [StageTiming(1.0, 2.0), StageTiming(1.0, 1.0)], num_ranks=4, num_cores=2,
                           safety_factor=2.0)
    assert ts.real_s_per_emulated_s == pytest.approx(0.12)
    assert ts.limiting == "1F"
    # With tiny real costs the sleep-granularity floor decides: 2 ms for the shortest target.
    ts = choose_time_scale([StageTiming(1e-9, 1e-9)], [StageTiming(0.5, 1.0)], num_ranks=1, num_cores=2)
    assert ts.real_s(0.5) == pytest.approx(MIN_ACTION_REAL_S)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_time_scale_refuses_bad_predictions(bad):
    with pytest.raises(ConfigError, match="stage 0: predicted F time"):
        choose_time_scale([StageTiming(0.1, 0.1)], [StageTiming(bad, 1.0)], num_ranks=1, num_cores=1)
    with pytest.raises(ConfigError, match="one measurement per stage"):
        choose_time_scale([StageTiming(0.1, 0.1)], [], num_ranks=1, num_cores=1)


def test_transfer_time_is_alpha_beta():
    assert transfer_s(0, bandwidth_bytes_s=1.0, latency_s=5.0) == 0.0
    assert transfer_s(125_000_000, bandwidth_bytes_s=125e6, latency_s=2e-4) == pytest.approx(1.0002)


def test_link_clock_queues_one_transfer_at_a_time():
    clock = LinkClock(time_scale=10.0)  # 10 real s per emulated s
    kw = dict(num_bytes=100, bandwidth_bytes_s=1000.0, latency_s=0.01)  # 0.11 emulated s = 1.1 real s
    assert clock.arrival_s(send_at_s=0.0, **kw) == pytest.approx(1.1)
    # Sent while the first is on the wire: starts when the link is free.
    assert clock.arrival_s(send_at_s=0.5, **kw) == pytest.approx(2.2)
    assert clock.queued_s == pytest.approx(0.6)
    # Sent after the link went idle: no queueing.
    assert clock.arrival_s(send_at_s=5.0, **kw) == pytest.approx(6.1)
    assert clock.messages == 3 and clock.queued_s == pytest.approx(0.6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(0, 10**6)), min_size=1, max_size=20))
def test_link_clock_fifo_invariants(sends):
    clock = LinkClock(time_scale=2.0)
    t, prev_arrival, busy = 0.0, -math.inf, 0.0
    for gap, nbytes in sends:
        t += gap
        arrive = clock.arrival_s(send_at_s=t, num_bytes=nbytes, bandwidth_bytes_s=1e6, latency_s=1e-3)
        cost = 2.0 * transfer_s(nbytes, bandwidth_bytes_s=1e6, latency_s=1e-3)
        assert arrive >= t + cost - 1e-9  # never faster than the link
        assert arrive >= prev_arrival  # FIFO: a later message never overtakes
        assert arrive == pytest.approx(max(t, prev_arrival) + cost)
        prev_arrival, busy = arrive, busy + cost


def test_compute_stretch_counts_overruns_beyond_tolerance():
    c = ComputeStretch()
    assert c.remaining_s("F", elapsed_s=0.25, target_s=1.0) == pytest.approx(0.75)
    assert c.remaining_s("F", elapsed_s=1.01, target_s=1.0) == 0.0  # within the 2% tolerance: not an overrun
    assert c.remaining_s("B", elapsed_s=3.0, target_s=1.0) == 0.0
    assert c.overruns == {"F": 0, "B": 1}
    assert c.worst_overrun_ratio == pytest.approx(3.0) and c.actions == 3


def test_memory_ledger_tracks_peak_and_raises_named_oom():
    gib = 2**30
    led = MemoryLedger(usable_bytes=10 * gib, rank=2, stage=2, device="n1:0 (rtx3060-12gb)")
    led.update({"params": 2 * gib, "grads": 2 * gib, "optimizer": 4 * gib, "activations": 1 * gib})
    led.check("2F0")
    led.update({"params": 2 * gib, "grads": 2 * gib, "optimizer": 4 * gib, "activations": 0})
    led.check("2B0")
    assert led.peak_bytes == 9 * gib and led.peak_action == "2F0"
    assert led.peak_breakdown["activations"] == gib
    led.update({"params": 2 * gib, "grads": 2 * gib, "optimizer": 4 * gib, "activations": int(5.1 * gib)})
    with pytest.raises(RuntimeFailure) as err:
        led.check("2F3")
    msg = str(err.value)
    assert msg.startswith("emulated OOM on rank 2 (stage 2, n1:0 (rtx3060-12gb)) at 2F3: 13.1 GiB held > 10.0 GiB usable")
    assert "activations 5.1 GiB, comm 0.0 MiB" in msg and "fix:" in msg
    assert led.peak_bytes == int(13.1 * gib)  # the peak includes the failing action


def test_format_bytes():
    assert format_bytes(3 * 2**20) == "3.0 MiB" and format_bytes(2**31) == "2.0 GiB"


def _hooks(**kw):
    args = dict(rank=0, stage=0, device_label="n0:0 (x)", usable_bytes=10**9, predicted=StageTiming(0.02, 0.04),
                links={0: (1e6, 1e-3)}, time_scale=1.0)
    args.update(kw)
    return EmulationHooks(**args)


def test_hooks_stretch_compute_to_the_scaled_prediction(monkeypatch):
    import types

    from hetpipe.runtime.emulate import pipeline

    # A clock that moves only by the hooks' sleeps and the compute below: the stretch is checked exactly,
    # whatever the machine's load (a real sleep's single-sample upper bound can fail on a stalled box).
    now = [100.0]

    def sleep(seconds: float) -> None:
        assert seconds > 0, seconds
        now[0] += seconds

    monkeypatch.setattr(pipeline, "time", types.SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    hooks = _hooks(time_scale=2.0)  # F target 0.04 real s, B 0.08
    for op in (Op.F, Op.B):
        a = Action(0, op, 0)
        hooks.before(a)
        now[0] += 0.01  # 10 ms of real compute: the hooks sleep the rest of the target
        hooks.after(a, 0.01)
    assert hooks.fwd_s == [pytest.approx(0.04, rel=1e-9)] and hooks.bwd_s == [pytest.approx(0.08, rel=1e-9)]
    assert hooks.fwd_device_s == [pytest.approx(0.04, rel=1e-9)] and hooks.fwd_compute_s == [0.01]
    assert hooks.compute.overruns == {"F": 0, "B": 0}
    # Compute slower than its target is counted, not slept on.
    a = Action(0, Op.F, 1)
    hooks.before(a)
    now[0] += 0.05
    hooks.after(a, 0.05)
    assert hooks.compute.overruns["F"] == 1 and hooks.fwd_s[1] == pytest.approx(0.05, rel=1e-9)


def test_hooks_delay_sends_by_link_without_blocking(monkeypatch):
    import types

    from hetpipe.runtime.emulate import pipeline

    hooks = _hooks(time_scale=1.0)

    def waited(seconds: float) -> None:
        raise AssertionError(f"the sender slept {seconds} s")

    # A frozen clock and a sleep that fails: "did not wait" and the delays are exact, whatever the machine's load
    # (a wall-time bound of a few ms here failed on a loaded 2-core box).
    monkeypatch.setattr(pipeline, "time", types.SimpleNamespace(monotonic=lambda: 100.0, sleep=waited))
    d1 = hooks.send_delay_s(0, 10_000)  # 1 ms + 10 ms
    d2 = hooks.send_delay_s(0, 10_000)  # queued behind the first
    assert d1 == pytest.approx(0.011, rel=1e-9)
    assert d2 == pytest.approx(0.022, rel=1e-9)
    with pytest.raises(RuntimeFailure, match="no outgoing link on cut 3"):
        hooks.send_delay_s(3, 1)


def test_hooks_memory_raises_emulated_oom():
    hooks = _hooks(usable_bytes=1000)
    hooks.memory(Action(0, Op.F, 0), {"params": 400, "activations": 500})
    with pytest.raises(RuntimeFailure, match=r"emulated OOM on rank 0 \(stage 0, n0:0 \(x\)\) at 0F1"):
        hooks.memory(Action(0, Op.F, 1), {"params": 400, "activations": 1000})


def test_late_messages_count_only_real_waits_past_the_emulated_arrival():
    hooks = _hooks()
    recv = Action(1, Op.RECV_F, 0)
    hooks.before(recv)
    hooks.arrived(recv, 0.5)  # the receiver got here long after the arrival time and found the data: not late
    assert hooks.late_messages == 0
    hooks.before(recv)
    time.sleep(0.03)
    hooks.arrived(recv, 0.02)  # waited ~30 ms, of which ~20 ms past the emulated arrival: late
    assert hooks.late_messages == 1 and hooks.worst_late_s == pytest.approx(0.02, abs=1e-9)  # float rounding of the clock
    hooks.before(recv)
    hooks.arrived(recv, -0.01)  # early: the receiver will sleep until the arrival time
    assert hooks.late_messages == 1


def test_waits_past_the_emulated_arrival_add_up_even_under_the_late_threshold():
    """Each wake-up under LATE_TOLERANCE_S is no late message, yet their sum is what stretches a loaded
    step: every real wait past an arrival is summed (issue 12: a run at +15.5% with no late message)."""
    hooks = _hooks()
    recv = Action(1, Op.RECV_F, 0)
    for _ in range(3):
        hooks.before(recv)
        time.sleep(0.004)
        hooks.arrived(recv, 0.002)  # waited ~4 ms, ~2 ms of it past the arrival: a wake-up, not late
    hooks.before(recv)
    hooks.arrived(recv, 0.5)  # arrived long before the receiver asked: only the call's own microseconds
    hooks.before(recv)
    hooks.arrived(recv, -0.01)  # early: nothing
    assert hooks.late_messages == 0
    assert 0.006 - 1e-9 <= hooks.late_total_s < 0.006 + 5e-4  # 3 x 2 ms, plus the second call's own duration
