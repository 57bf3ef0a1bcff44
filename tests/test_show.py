"""`hetpipe show`, `simulate` and `compare` on a saved plan; Gantt and trace structure; measured timelines.

Plans come from the synthetic graph and cluster (planned by the DP in well under a second, no launch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetpipe.cli import app as cli
from hetpipe.cli.timeline import chrome_trace, gantt_figure, row_names, save_gantt_compare, timeline_from_actions
from hetpipe.plan.analysis import PlanSimulation, compare_plan, divergence_reason, simulate_plan
from hetpipe.plan.build import partition_graph
from hetpipe.plan.schema import Plan
from hetpipe.schedule.actions import Op
from hetpipe.schedule.builders import make_schedule, one_f_one_b
from hetpipe.schedule.simulate import SimCosts, simulate
from hetpipe.cli.tables import memory_bar
from tests.synthetic import synthetic_cluster, synthetic_graph

#: The 3060-like slow card of the synthetic cluster, shrunk so two units (the baselines' split) do not fit.
SMALL_SLOW = (("n0", "fast", 40.0, 24.0), ("n0", "mid", 30.0, 24.0), ("n1", "slow", 10.0, 4.0))


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("plans")
    paths = {}
    for name, spec in (("fits", None), ("oom", SMALL_SLOW)):
        cluster = synthetic_cluster(spec) if spec else synthetic_cluster()
        plan = partition_graph(synthetic_graph(6), cluster, global_batch=16)
        paths[name] = out / f"{name}.json"
        plan.save(paths[name])
    return paths


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_show_prints_stages_memory_bars_baselines_and_writes_timelines(plans, tmp_path, capsys):
    plan = Plan.load(plans["oom"])
    gantt, trace = tmp_path / "g.png", tmp_path / "t.json"
    code, out, _ = _run(capsys, "show", str(plans["oom"]), "--gantt", str(gantt), "--trace", str(trace))
    assert code == 0
    assert "\x1b[" not in out  # piped (captured): plain text, no terminal escapes
    for st in plan.stages:
        assert st.device in out and memory_bar(st.memory_bytes, st.usable_bytes) in out
    assert f"{plan.predicted.iteration_s:.3f} s" in out
    for name, b in plan.baselines.items():
        assert name in out and not b.fits  # the slow card is too small for the baselines' two units
    assert out.count("NO (out of memory)") == len(plan.baselines)
    assert gantt.stat().st_size > 10_000
    doc = json.loads(trace.read_text())
    assert {e["ph"] for e in doc["traceEvents"]} == {"X", "M"}  # slices, and the metadata naming their rows
    events, rows = [e for e in doc["traceEvents"] if e["ph"] == "X"], row_names(doc)
    assert all(set(e) >= {"name", "ts", "dur", "pid", "tid"} and e["dur"] >= 0 for e in events)
    shown = {rows[(e["pid"], e["tid"])] for e in events}
    devices_in_trace = {row.split(": ")[1].split(" ")[0] for row in shown if not row.startswith("link")}
    assert devices_in_trace == {st.device for st in plan.stages}


def test_simulate_matches_the_library_and_recomputes_t_for_other_microbatches(plans, capsys):
    plan = Plan.load(plans["fits"])
    sim = simulate_plan(plan, microbatches=16)
    assert sim.analytic_s != pytest.approx(plan.predicted.iteration_s)  # T re-evaluated at m=16
    code, out, _ = _run(capsys, "simulate", str(plans["fits"]), "--microbatches", "16")
    assert code == 0
    assert "m=16" in out and f"simulated {sim.simulated_s:.3f} s" in out
    assert f"analytic T {sim.analytic_s:.3f} s" in out
    p = len(plan.stages)
    # 1F1B keeps min(p - s, m) micro-batches in flight on stage s.
    assert sim.result.peak_in_flight_microbatches == tuple(min(p - s, 16) for s in range(p))
    gp = simulate_plan(plan, microbatches=16, schedule="gpipe")
    assert gp.result.peak_in_flight_microbatches == (16,) * p and gp.simulated_s >= sim.simulated_s


def test_simulate_at_the_plans_own_microbatches_uses_the_recorded_t(plans):
    plan = Plan.load(plans["fits"])
    sim = simulate_plan(plan)
    assert sim.analytic_s == pytest.approx(plan.predicted.iteration_s, rel=1e-12)
    assert sim.microbatches == plan.training.microbatches
    steps = sum(st.step_s for st in plan.stages)  # busy: m (F + B) and one optimizer step per stage
    assert sum(sim.result.busy_s) == pytest.approx(sim.microbatches * sum(sim.stage_work_s) + steps)


def test_compare_reproduces_recorded_baselines_and_simulates_each(plans, capsys):
    plan = Plan.load(plans["fits"])
    rows = compare_plan(plan)
    assert [r.name for r in rows] == ["hetpipe", *(f"{n}{s}" for n in plan.baselines for s in ("", " (best cards)"))]
    assert rows[0].analytic_s == pytest.approx(plan.predicted.iteration_s, rel=1e-12)
    for r in rows[1::2]:  # forced onto every card
        assert r.placement == "forced"
        assert r.analytic_s == pytest.approx(plan.baselines[r.name].iteration_s, rel=1e-12)
        assert r.fits == plan.baselines[r.name].fits
        assert r.simulated_s > rows[0].simulated_s  # the plan still wins when simulated
    for r in rows[2::2]:  # on the recorded best cards: the recorded T, never below the plan's
        best = plan.baselines[r.name.removesuffix(" (best cards)")].best
        assert r.placement == "best" and r.fits and best.fits
        assert r.analytic_s == pytest.approx(best.iteration_s, rel=1e-12)
        assert rows[0].analytic_s <= r.analytic_s * (1 + 1e-9)
    other_m = compare_plan(plan, microbatches=32)  # searched again at another m
    assert [r.name for r in other_m] == [r.name for r in rows]
    assert all(other_m[0].analytic_s <= r.analytic_s * (1 + 1e-9) for r in other_m[1:] if r.fits)
    code, out, _ = _run(capsys, "compare", str(plans["fits"]), "--baselines")
    assert code == 0 and "over the best hand-tuned baseline" in out
    for r in rows:
        assert f"{r.simulated_s:.3f} s" in out and f"{r.analytic_s / rows[0].analytic_s:.2f}x" in out
    code, out, _ = _run(capsys, "compare", str(plans["oom"]), "--baselines", "uniform")
    assert code == 0 and "NO (out of memory)" in out and "parameters" not in out and "rtx" not in out


@pytest.mark.parametrize("argv, message", [
    (["simulate", "{plan}", "--microbatches", "0"], "--microbatches: must be a whole number >= 1, got 0"),
    (["simulate", "{plan}", "--schedule", "zero-bubble"], "unknown schedule 'zero-bubble'"),
    (["compare", "{plan}", "--baselines", "pipedream"], "unknown baseline 'pipedream'"),
    (["show", "{missing}"], "cannot read plan"),
])
def test_bad_input_is_one_error_line_with_the_fix(plans, tmp_path, capsys, argv, message):
    argv = [a.format(plan=plans["fits"], missing=tmp_path / "nope.json") for a in argv]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_gantt_has_one_row_per_device_then_links_and_stacks_panels(tmp_path):
    res = simulate(one_f_one_b(3, 4), SimCosts(fwd_s=(1.0, 2.0, 1.0), bwd_s=(2.0, 4.0, 2.0), send_s=(0.5, 0.5)))
    labels = ["a", "b", "c"]
    fig = gantt_figure([("predicted", res), ("measured", res)], labels=labels)
    for ax in fig.axes[:2]:
        rows = [t.get_text() for t in ax.get_yticklabels()]
        assert rows[:3] == ["0: a", "1: b", "2: c"] and sorted(rows[3:]) == sorted(
            f"link {a}->{b}" for a, b in ((0, 1), (1, 0), (1, 2), (2, 1)))
        assert len(ax.patches) + len(ax.collections) > 0  # bars were drawn
    png = save_gantt_compare([("predicted", res), ("measured", res)], tmp_path / "pair.png", labels=labels)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_measured_action_timings_rebuild_the_same_timeline():
    res = simulate(one_f_one_b(3, 4), SimCosts(fwd_s=(1.0, 2.0, 1.0), bwd_s=(2.0, 4.0, 2.0), send_s=(0.5, 0.5),
                                               step_s=(0.3, 0.3, 0.3)))

    class Timing:  # the shape of hetpipe.runtime.execute.executor.ActionTiming
        def __init__(self, action: str, start_s: float, duration_s: float) -> None:
            self.action, self.start_s, self.duration_s = action, start_s, duration_s

    per_rank: dict[int, list[Timing]] = {}
    for e in res.events:
        if e.lane.startswith("rank "):
            per_rank.setdefault(e.rank, []).append(Timing(e.action, e.start_s, e.duration_s))
    rebuilt = timeline_from_actions(per_rank)
    assert rebuilt.busy_s == pytest.approx(res.busy_s)
    assert rebuilt.iteration_s == pytest.approx(max(e.end_s for e in res.events if e.lane.startswith("rank ")))
    trace = chrome_trace(rebuilt, labels=["a", "b", "c"], process="measured", pid=2)
    assert {e["pid"] for e in trace["traceEvents"]} == {2}
    assert [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"] == ["measured"]
    assert sum(1 for e in rebuilt.events if e.op is Op.STEP) == 3
    with pytest.raises(ValueError, match="rank 1"):
        timeline_from_actions({1: [Timing("1X9", 0.0, 1.0)]})


def _sim_of(fwd: list[float], bwd: list[float], comm: list[float], m: int, schedule: str) -> PlanSimulation:
    work = [f + b for f, b in zip(fwd, bwd)]
    formula = sum(work) + 2 * sum(comm) + (m - 1) * max(work + [2 * c for c in comm])
    result = simulate(make_schedule(schedule, len(work), m), SimCosts(fwd_s=fwd, bwd_s=bwd, send_s=comm))
    return PlanSimulation("x", schedule, m, (), (), tuple(work), tuple(comm), formula, True, "", result)


@pytest.mark.parametrize("fwd, bwd, comm, schedule, expect", [
    ([0.5] * 4, [0.5] * 4, [0.0] * 3, "1f1b", ""),  # uniform, no comm: exact
    ([0.5] * 4, [0.5] * 4, [0.0, 1.5, 0.0], "1f1b", "faster: a link's 2C"),  # slow middle link
    ([1.0, 3.0, 1.0, 1.0], [1.0, 3.0, 1.0, 1.0], [0.0] * 3, "1f1b", "faster: the formula counts the fill"),
    ([0.5] * 4, [0.5] * 4, [0.0, 0.5, 0.0], "1f1b", "slower: 1F1B keeps at most p - s"),  # 2C = F+B on a cut
    # GPipe with F heavy on stage 0 and B on stage 1: all forwards take 2m + 1, all backwards 2m + 1 more.
    ([2.0, 1.0], [1.0, 2.0], [0.0], "gpipe", "slower: the formula is 1F1B's"),
])
def test_divergence_reason_names_the_mechanism(fwd, bwd, comm, schedule, expect):
    sim = _sim_of(fwd, bwd, comm, 8, schedule)
    reason = divergence_reason(sim)
    assert (reason == "") == (abs(sim.gap) <= 0.02)
    assert expect in reason if expect else reason == ""
