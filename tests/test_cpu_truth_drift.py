"""Issue 17 item 4: host drift separated from the cost model's error in the CPU truth benchmark.

The arithmetic only, on fake timings and synthetic plans: a plan's stages priced again on another
calibration's tables, the mean of two pricings, the reference workload's drift per core group and the
ratios three ways (`benchmarks/cpu_truth_drift.py`).  What the drift is on this machine is a benchmark.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace as NS

import pytest

from benchmarks.cpu_truth_drift import (
    Prices, RunDrift, drift_section, drifted, iteration_drift, mean_prices, plan_prices, ratio_rows, round_rows,
    stage_drifts,
)
from hetpipe.cost_models.host_reference import (
    REFERENCE_PARTS, HostDrift, ReferenceTiming, host_drift, time_reference,
)
from hetpipe.errors import ConfigError
from hetpipe.plan.schema import UnitTimes
from tests.runtime_plans import synthetic_plan


def _ref(cores: tuple[int, ...], wall_s: float, cpu_s: float | None = None, *, at_s: float = 0.0,
         parts: tuple[tuple[str, float], ...] = ()) -> ReferenceTiming:
    return ReferenceTiming(cores, wall_s, wall_s if cpu_s is None else cpu_s, parts, at_s)


def test_drift_is_the_mean_at_the_run_over_the_mean_at_the_calibration_per_group() -> None:
    cal = [_ref((0,), 0.010, parts=(("matmul", 0.004), ("stream", 0.006))), _ref((1,), 0.020),
           _ref((0,), 0.014, 0.012, parts=(("matmul", 0.004), ("stream", 0.010))), _ref((2,), 0.5)]
    run = [_ref((0,), 0.018, 0.0066, parts=(("matmul", 0.006), ("stream", 0.012))), _ref((1,), 0.010)]
    by = {d.cores: d for d in host_drift(cal, run)}
    assert set(by) == {(0,), (1,)}  # core group 2 has no sample at the run
    assert by[(0,)].wall_ratio == pytest.approx(0.018 / 0.012) and by[(0,)].cpu_ratio == pytest.approx(0.0066 / 0.011)
    assert dict(by[(0,)].parts_wall_ratio) == pytest.approx({"matmul": 1.5, "stream": 1.5})
    assert by[(1,)].wall_ratio == pytest.approx(0.5) and by[(1,)].parts_wall_ratio == ()
    with pytest.raises(ConfigError, match=r"cores \(3,\).*every sample must be positive"):
        host_drift([_ref((3,), 0.0)], [_ref((3,), 0.01)])


def test_reference_workload_times_its_parts() -> None:
    """Structure only (one pass, no bound on the figures)."""
    t = time_reference(1, cores=(5,))
    assert t.cores == (5,) and [p for p, _ in t.parts_wall_s] == list(REFERENCE_PARTS)
    assert t.wall_s == pytest.approx(sum(s for _, s in t.parts_wall_s)) and t.cpu_s > 0 and t.taken_at_s > 0
    with pytest.raises(ConfigError, match="reference repeats: 0; pass 1 or more"):
        time_reference(0)


def test_stage_drifts_follow_each_stage_s_cores() -> None:
    cal, run = [_ref((0,), 0.01), _ref((1,), 0.01)], [_ref((1,), 0.013), _ref((0,), 0.009)]
    got = stage_drifts([[1], (0,), (7,)], cal, run)  # stage 0 ran on core 1, stage 1 on core 0
    assert [d and round(d.wall_ratio, 6) for d in got] == [1.3, 0.9, None]
    assert iteration_drift(got) == pytest.approx(1.1) and iteration_drift([None]) is None
    assert drifted(1.43, 1.3) == pytest.approx(1.1) and drifted(None, 1.2) is None and drifted(1.0, 0.0) is None


def test_a_plan_priced_on_its_own_tables_is_its_own_figures() -> None:
    plan = synthetic_plan()
    own = plan_prices(plan)
    assert own.iteration_s == pytest.approx(plan.predicted.iteration_s)
    for st, got in zip(plan.stages, own.per_stage):
        assert (got["F"], got["B"], got["C"], got["S"]) == pytest.approx((st.fwd_s, st.bwd_s, st.send_s, st.step_s))
    assert own.per_stage[-1]["Cb"] == 0.0 and own.per_stage[0]["Cb"] > 0


def test_a_plan_priced_on_a_slower_calibration_and_the_mean() -> None:
    plan = synthetic_plan()
    slower_units = tuple(dataclasses.replace(u, time_s={k: UnitTimes(t.fwd * 2, t.bwd * 2, t.step * 2)
                                                        for k, t in u.time_s.items()}) for u in plan.units)
    slower = dataclasses.replace(plan, units=slower_units)  # the same stages' units, every kind twice as slow
    other = plan_prices(plan, slower)
    own = plan_prices(plan)
    for a, b in zip(own.per_stage, other.per_stage):
        assert (b["F"], b["B"]) == pytest.approx((2 * a["F"], 2 * a["B"])) and b["C"] == pytest.approx(a["C"])
    assert other.iteration_s > own.iteration_s
    mean = mean_prices(own, other)
    assert mean.per_stage[0]["F"] == pytest.approx(1.5 * own.per_stage[0]["F"])
    assert mean.iteration_s == pytest.approx((own.iteration_s + other.iteration_s) / 2)
    fewer = dataclasses.replace(plan, units=plan.units[:-1])
    with pytest.raises(ValueError, match="not of the same model's units"):
        plan_prices(plan, fewer)


def _outcome(round_: int, f_measured: float, drift: float) -> NS:
    """A fake one-stage run: F priced 0.1 s on its calibration, 0.12 s on the next; its core group's drift."""
    own, nxt = Prices(({"F": 0.1, "B": 0.2, "S": 0.01},), 1.0), Prices(({"F": 0.12, "B": 0.2, "S": 0.01},), 1.2)
    refs = {"calibration": (_ref((0,), 0.010),), "run": (_ref((0,), 0.010 * drift),), "next": (_ref((0,), 0.011),)}
    stage = NS(measured={"F": f_measured, "B": 0.2, "S": None}, predicted={"F": 0.1, "B": 0.2, "S": 0.01})
    return NS(model="m", round=round_, stages=(stage,), measured_iteration_s=1.1 * drift, predicted_iteration_s=1.0,
              load_before=0.5, drift=RunDrift(nxt, own, (HostDrift((0,), drift, 1.0),), refs))


def test_ratios_three_ways_over_rounds() -> None:
    outcomes = [_outcome(0, 0.132, 1.2), _outcome(1, 0.11, 1.0), _outcome(2, 0.121, 1.1)]
    stage_rows, it_rows, verdicts = ratio_rows(outcomes)
    # F raw 1.32, 1.10, 1.21; both: / 0.11 -> 1.20, 1.00, 1.10; drift out: 1.10 each
    assert stage_rows[0][:5] == ["m", 0, "1.21 (1.10-1.32)", "1.10 (1.00-1.20)", "1.10 (1.10-1.10)"]
    assert stage_rows[0][-3:] == ["-", "-", "-"]  # S never measured
    assert it_rows == [["m", "1.21 (1.10-1.32)", "1.10 (1.00-1.20)", "1.10 (1.10-1.10)"]]
    assert verdicts == ["- m: worst stage F/B off by 21% raw, 10% on both calibrations, 10% with the drift divided "
                        "out (goal 15%); iteration off by 21%, 10%, 10% (goal 10%)"]
    rows = round_rows(outcomes)
    assert rows[0][:7] == [1, "m", "0", "10.00", "12.00", "11.00", "1.20 (1.00)"]
    assert rows[0][8] == f"{0.012 / 0.0105:.2f}"  # against the mean of both calibrations
    text = drift_section(outcomes)
    assert "| round | model | cores |" in text and "F drift out" in text and "iteration both cal." in text


def test_runs_without_drift_records_keep_their_raw_ratios() -> None:
    plain = NS(model="m", round=0, stages=(NS(measured={"F": 0.2}, predicted={"F": 0.1}),), measured_iteration_s=2.0,
               predicted_iteration_s=1.0, load_before=1.0, drift=None)
    stage_rows, it_rows, _ = ratio_rows([plain], measures=("F",))
    assert stage_rows == [["m", 0, "2.00", "-", "-"]] and it_rows == [["m", "2.00", "-", "-"]]
    assert round_rows([plain]) == []



def test_the_load_robust_check_s_rows_carry_their_drift() -> None:
    from benchmarks.cpu_truth_drift import row_drift

    def ref(cpu_s: float, matmul_s: float) -> dict:
        return {"cores": [1], "wall_s": 2 * cpu_s, "cpu_s": cpu_s, "parts_wall_s": [["matmul", 2 * matmul_s]],
                "taken_at_s": 0.0, "parts_cpu_s": [["matmul", matmul_s]]}

    row = {"reference": {"calibration": [ref(0.010, 0.004), ref(0.012, 0.006)], "measure": [ref(0.0143, 0.006)]}}
    d = row_drift(row)
    assert d.cpu_ratio == pytest.approx(1.3) and dict(d.parts_cpu_ratio) == pytest.approx({"matmul": 1.2})
    assert d.wall_ratio == pytest.approx(1.3) and row_drift({"measured": {}}) is None  # a row from before session 16


def test_the_run_s_own_cpu_time_beside_its_wall_time() -> None:
    from benchmarks.cpu_truth_drift import cpu_time_rows

    def run(f_wall: float, f_cpu: float | None) -> NS:
        stage = NS(measured={"F": f_wall, "Fcpu": f_cpu, "B": 0.2, "Bcpu": None}, predicted={"F": 0.1, "B": 0.2})
        return NS(model="m", stages=(stage,))

    rows = cpu_time_rows([run(0.2, 0.1), run(0.12, 0.1), run(0.1, None)])  # the last: a report from before
    assert rows == [["m", 0, "1.60 (1.20-2.00)", "1.00 (1.00-1.00)", "-", "-"]]


def test_rounds_chain_their_calibrations(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Calibration 0, round 1's runs, calibration 1, ...: each run's plans are the calibration's before it and after."""
    import contextlib

    import benchmarks.cpu_truth as ct

    order: list[str] = []
    monkeypatch.setattr(ct, "ReferenceProbes", lambda groups: contextlib.nullcontext("probes"))
    monkeypatch.setattr(ct, "calibrate", lambda tmp, i, probes, clock: order.append(f"cal{i} {clock}") or f"c{i}")
    monkeypatch.setattr(ct, "plan_on", lambda m, cal, tmp, i: order.append(f"plan {m} on {cal}") or f"p{m}{i}")
    monkeypatch.setattr(ct, "run_plan", lambda m, plan, **kw: order.append(f"run {plan}") or plan)
    monkeypatch.setattr(ct, "_outcome", lambda m, i, done, plans, cals: (m, i, done, plans, cals))
    got = ct.rounds(["a", "b"], count=2, steps=3, tmp=tmp_path, clock="cpu")
    assert order == ["cal0 cpu", "plan a on c0", "plan b on c0", "run pa0", "run pb0", "cal1 cpu", "plan a on c1",
                     "plan b on c1", "run pa1", "run pb1", "cal2 cpu", "plan a on c2", "plan b on c2"]
    assert got == [("a", 0, "pa0", ("pa0", "pa1"), ("c0", "c1")), ("b", 0, "pb0", ("pb0", "pb1"), ("c0", "c1")),
                   ("a", 1, "pa1", ("pa1", "pa2"), ("c1", "c2")), ("b", 1, "pb1", ("pb1", "pb2"), ("c1", "c2"))]
