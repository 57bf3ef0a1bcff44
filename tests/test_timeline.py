"""Issue 17 item 5: the Gantt has a headline and no near-empty rows; the demo's trace holds both timelines."""

from __future__ import annotations

import pytest

from hetpipe.cli.timeline import LANE_MIN_SHARE, gantt_figure
from hetpipe.schedule.builders import one_f_one_b
from hetpipe.schedule.simulate import SimCosts, simulate


def _labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_yticklabels()]


def test_nearly_empty_link_rows_are_left_out_and_named_and_the_figure_has_a_headline() -> None:
    busy = simulate(one_f_one_b(2, 4), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,)))
    quiet = simulate(one_f_one_b(2, 4), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(1e-6,)))
    assert 8 * 1e-6 < LANE_MIN_SHARE * quiet.iteration_s  # both link rows are nearly empty
    fig = gantt_figure([("busy", busy)], labels=["a", "b"], suptitle="gpt on a + b: 1.5x")
    assert _labels(fig) == ["0: a", "1: b", "link 0->1", "link 1->0"] and fig._suptitle.get_text() == "gpt on a + b: 1.5x"
    fig = gantt_figure([("quiet", quiet)], labels=["a", "b"])
    assert _labels(fig) == ["0: a", "1: b"]
    assert "link 0->1" in fig.axes[0].get_title() and "not drawn" in fig.axes[0].get_title()


def test_a_long_headline_is_wrapped_inside_the_figure() -> None:
    """The review: a replica plan's headline (three card kinds, two speed-ups) ran off both sides of the PNG."""
    sim = simulate(one_f_one_b(2, 4), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,)))
    title = ("gpt-demo on rtx3090-mini + rtx4090-mini + rtx3060-mini: T = 0.270 s; 1.18x over the best hand-tuned "
             "baseline (uniform), 1.95x over uniform on every card")
    fig = gantt_figure([("predicted", sim)], labels=["a", "b"], suptitle=title)
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent()
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height
    assert fig._suptitle.get_text().replace("\n", " ") == title


def test_demo_headline_names_model_cards_and_both_speedups() -> None:
    from hetpipe.cli.demo import gantt_suptitle
    from hetpipe.models import build
    from hetpipe.plan.build import partition

    model, inputs = build("mlp-tiny", device="meta", batch=2)
    plan = partition(model, "examples/clusters/homelab.yaml", example_inputs=inputs, global_batch=8)
    text = gantt_suptitle(plan)
    assert text.startswith(f"{plan.model.name} on ") and "T = " in text
    assert "best hand-tuned baseline" in text or "no baseline fits" in text


# ----------------------------------------------------------------------------- measured beside predicted


def _one_node_plan():
    import dataclasses

    from hetpipe.partitioner.problem import Stage
    from tests.runtime_plans import plan_for
    from tests.synthetic import synthetic_cluster, synthetic_graph

    plan = plan_for(synthetic_graph(6), synthetic_cluster(), (Stage(0, 0, 2), Stage(1, 3, 5)), microbatches=1)
    return dataclasses.replace(plan, devices=tuple(dataclasses.replace(d, node="vm") for d in plan.devices))


def _two_rank_report(plan, *, emulate: bool = False, scale: float = 1.0):
    """One micro-batch through 2 stages; rank 1's step began 0.5 s after rank 0's (absolute times below)."""
    from hetpipe.runtime.report import ActionRecord, RankResult, build_report

    absolute = {0: [("0F0", 0.0, 1.0), ("0SEND_F0", 1.0, 1.01), ("0RECV_B0", 1.01, 4.3), ("0B0", 4.3, 6.3),
                    ("0STEP", 6.3, 6.5)],
                1: [("1RECV_F0", 0.5, 1.2), ("1F0", 1.2, 2.2), ("1B0", 2.2, 4.2), ("1SEND_B0", 4.2, 4.21),
                    ("1STEP", 4.21, 6.5)]}
    origin = {0: 100.0, 1: 100.0 + 0.5 * scale}  # real seconds on CLOCK_MONOTONIC
    results = [RankResult(rank=r, stage=r, device=plan.stages[r].device, kind="k", step_s=(6.5,),
                          losses=(1.0,) if r == 1 else (), fwd_s=(1.0,), bwd_s=(2.0,), fwd_compute_s=(1.0,),
                          bwd_compute_s=(2.0,), peak_bytes=1, time_scale=scale, step_origin_s=origin[r],
                          last_step_actions=tuple(ActionRecord(a, s * scale - (origin[r] - 100.0), (e - s) * scale)
                                                  for a, s, e in absolute[r]))
               for r in (0, 1)]
    return build_report(plan, results, schedule="1f1b", emulate=emulate)


def test_measured_timeline_lines_up_ranks_and_draws_the_messages_it_saw_whole() -> None:
    from hetpipe.cli.timeline import measured_timeline

    plan = _one_node_plan()
    for emulate, scale in ((False, 1.0), (True, 4.0)):  # emulated: real seconds / time scale
        res = measured_timeline(_two_rank_report(plan, emulate=emulate, scale=scale))
        spans = {e.action: (round(e.start_s, 6), round(e.end_s, 6), e.lane) for e in res.events}
        assert spans["1F0"] == (1.2, 2.2, "rank 1") and spans["0B0"] == (4.3, 6.3, "rank 0")
        link = {e.lane: (round(e.start_s, 6), round(e.end_s, 6)) for e in res.events if e.lane.startswith("link")}
        assert link == {"link 0->1": (1.0, 1.2), "link 1->0": (4.2, 4.3)}
        assert res.iteration_s == pytest.approx(6.5)


def test_run_trace_holds_predicted_and_measured_as_two_named_processes() -> None:
    from hetpipe.cli.timeline import row_names, run_trace, stage_labels

    plan = _one_node_plan()
    trace = run_trace(plan, _two_rank_report(plan))
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert procs == {1: "predicted (simulated)", 2: "measured (real s, last step, not emulated)"}
    rows = row_names(trace)
    labels = stage_labels(plan)
    for pid in (1, 2):
        slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
        shown = {rows[(pid, e["tid"])] for e in slices}
        assert {f"0: {labels[0]}", f"1: {labels[1]}", "link 0->1", "link 1->0"} <= shown
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    measured = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 2 and e["name"] == "0SEND_F0"]
    # the send posted on rank 0's row and its transfer on the link row, in microseconds on the aligned clock
    assert sorted(rows[(2, e["tid"])] for e in measured) == [f"0: {labels[0]}", "link 0->1"]
    assert [round(e["ts"]) for e in measured] == [1_000_000, 1_000_000]


def test_show_draws_a_run_under_its_plan_and_refuses_another_models_run(tmp_path, capsys) -> None:
    import dataclasses
    import json

    from hetpipe.cli import app as cli
    from hetpipe.cli.timeline import row_names

    plan = _one_node_plan()
    plan.save(tmp_path / "plan.json")
    report = _two_rank_report(plan)
    report.save(tmp_path / "run.json")
    gantt, trace = tmp_path / "g.png", tmp_path / "t.json"
    assert cli.main(["show", str(tmp_path / "plan.json"), "--run", str(tmp_path / "run.json"), "--gantt", str(gantt),
                     "--trace", str(trace)]) == 0
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {name for (pid, _), name in row_names(json.loads(trace.read_text())).items() if pid == 2} >= {"link 0->1"}
    dataclasses.replace(report, fingerprint="0" * 64).save(tmp_path / "other.json")
    capsys.readouterr()
    assert cli.main(["show", str(tmp_path / "plan.json"), "--run", str(tmp_path / "other.json"), "--trace",
                     str(tmp_path / "t2.json")]) == 2
    assert "error: the run report is of model" in capsys.readouterr().err


def test_run_gantt_draws_only_rows_with_something_to_show(tmp_path) -> None:
    from hetpipe.cli.timeline import measured_timeline, stage_labels, write_run_timelines

    plan = _one_node_plan()
    report = _two_rank_report(plan)
    png, = write_run_timelines(plan, report, gantt=tmp_path / "g.png", suptitle="x on a + b: 1.2x")
    assert png.stat().st_size > 10_000
    measured = measured_timeline(report)  # link 0->1 busy 0.2 s of 6.5 s (3%), link 1->0 0.1 s (1.5%)
    assert 0.1 < LANE_MIN_SHARE * measured.iteration_s < 0.2
    fig = gantt_figure([("measured", measured)], labels=stage_labels(plan), suptitle="x on a + b: 1.2x")
    labels = stage_labels(plan)
    assert _labels(fig) == [f"0: {labels[0]}", f"1: {labels[1]}", "link 0->1"]
    assert "not drawn" in fig.axes[0].get_title() and "link 1->0" in fig.axes[0].get_title()
