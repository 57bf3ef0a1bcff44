"""The run report of an interleaved run: one row per virtual stage, the stage rows the card's sums, and
the simulated iteration over the interleaved action list (issue 17 item 2).  No launch: hand-made results."""

from __future__ import annotations

import dataclasses

import pytest

from hetpipe.plan.chunk_schema import PlanChunk
from hetpipe.plan.run_sim import simulated_iteration_s
from hetpipe.runtime.report import RankResult, RunReport, build_report
from hetpipe.schedule.actions import Op
from hetpipe.schedule.builders import rank_actions
from hetpipe.schedule.simulate import SimCosts, simulate_stages
from tests.runtime_plans import synthetic_plan

P, V, M, STEPS, SCALE = 3, 2, 6, 3, 2.0


def _plan():
    """The synthetic 3-stage plan re-cut into 2 chunks per card: virtual stage k = c p + r holds unit k."""
    base = synthetic_plan()
    stages = tuple(dataclasses.replace(st, first_unit=r, last_unit=r, chunks=tuple(
        PlanChunk(c * P + r, c * P + r, fwd_s=0.01 * (c * P + r + 1), bwd_s=0.02 * (c * P + r + 1),
                  send_s=0.001 if c * P + r < P * V - 1 else 0.0, step_s=0.003) for c in range(V)))
        for r, st in enumerate(base.stages))
    stages = tuple(dataclasses.replace(st, fwd_s=st.chunks[0].fwd_s, bwd_s=st.chunks[0].bwd_s, send_s=st.chunks[0].send_s)
                   for st in stages)  # a stage's own fields are its chunk 0's (plan version 6)
    training = dataclasses.replace(base.training, microbatches=M, schedule=f"interleaved:{V}")
    return dataclasses.replace(base, stages=stages, training=training)


def _result(plan, r: int) -> RankResult:
    """Every F / B took its chunk's predicted seconds x the time scale; step 0 (warm-up) 10x that."""
    acts = rank_actions(f"interleaved:{V}", P, M, r)
    pred = {c * P + r: ch for c, ch in enumerate(plan.stages[r].chunks)}
    def times(op: Op, field: str) -> tuple[float, ...]:
        return tuple(getattr(pred[a.stage], field) * SCALE * (10 if step == 0 else 1)
                     for step in range(STEPS) for a in acts if a.op is op)
    return RankResult(rank=r, stage=r, device=plan.stages[r].device, kind="k", step_s=(1.0,) * STEPS,
                      losses=(2.0, 1.5, 1.0) if r == P - 1 else (), fwd_s=times(Op.F, "fwd_s"),
                      bwd_s=times(Op.B, "bwd_s"), fwd_compute_s=times(Op.F, "fwd_s"),
                      bwd_compute_s=times(Op.B, "bwd_s"), time_scale=SCALE)


def test_report_rows_per_virtual_stage_and_card_sums(tmp_path) -> None:
    plan = _plan()
    rep = build_report(plan, [_result(plan, r) for r in range(P)], schedule=plan.training.schedule, emulate=True)
    assert [c.stage for c in rep.chunks] == list(range(P * V))
    for c in rep.chunks:
        ch = plan.stages[c.stage % P].chunks[c.stage // P]
        assert (c.first_unit, c.last_unit) == (ch.first_unit, ch.last_unit) == (c.stage, c.stage)
        assert c.fwd_emulated_s == pytest.approx(ch.fwd_s, rel=1e-12) and c.predicted_fwd_s == ch.fwd_s
        assert c.bwd_emulated_s == pytest.approx(ch.bwd_s, rel=1e-12) and c.predicted_bwd_s == ch.bwd_s
    for st in rep.stages:  # the card's work per micro-batch: both chunks
        chunks = plan.stages[st.stage].chunks
        assert st.predicted_fwd_s == pytest.approx(sum(ch.fwd_s for ch in chunks), rel=1e-12)
        assert st.fwd_emulated_s == pytest.approx(st.predicted_fwd_s, rel=1e-12)
        assert st.bwd_emulated_s == pytest.approx(sum(ch.bwd_s for ch in chunks), rel=1e-12)
        assert st.predicted_step_s == pytest.approx(sum(ch.step_s for ch in chunks), rel=1e-12)  # one STEP
    path = tmp_path / "run.json"
    rep.save(path)
    assert RunReport.load(path) == rep


def test_simulated_iteration_replays_the_interleaved_list() -> None:
    plan = _plan()
    virtual = [plan.stages[k % P].chunks[k // P] for k in range(P * V)]
    costs = SimCosts(fwd_s=tuple(c.fwd_s for c in virtual), bwd_s=tuple(c.bwd_s for c in virtual),
                     send_s=tuple(c.send_s for c in virtual[:-1]), step_s=tuple(c.step_s for c in virtual))
    want = simulate_stages(costs, M, schedule=f"interleaved:{V}").iteration_s
    assert simulated_iteration_s(plan, plan.training.schedule) == pytest.approx(want, rel=1e-12)


def test_emulated_chunk_durations_are_in_chunk_0_seconds(monkeypatch) -> None:
    """Each chunk's F / B entry is its emulated target x chunk 0's target / its own: chunk 0's seconds."""
    from hetpipe.runtime.emulate import pipeline
    from hetpipe.runtime.emulate.pipeline import EmulationHooks, StageTiming
    from hetpipe.schedule.actions import Action

    monkeypatch.setattr(pipeline.time, "monotonic", lambda: 100.0)  # no real compute: elapsed 0, entry = target
    monkeypatch.setattr(pipeline.time, "sleep", lambda s: None)
    chunk0, chunk1 = StageTiming(0.01, 0.02), StageTiming(0.04, 0.06)
    hooks = EmulationHooks(rank=1, stage=1, device_label="d", usable_bytes=10**9, predicted=chunk0, links={},
                           time_scale=2.0, chunk_predicted={1: chunk0, 4: chunk1})
    for action in (Action(1, Op.F, 0), Action(4, Op.F, 0), Action(4, Op.B, 0), Action(1, Op.B, 0)):
        hooks.before(action)
        hooks.after(action, 0.0)
    assert hooks.fwd_device_s == pytest.approx([0.02, 0.02], rel=1e-12)  # 2 x 0.01 both: chunk 0's seconds
    assert hooks.bwd_device_s == pytest.approx([0.04, 0.04], rel=1e-12)


def test_the_straggler_watch_judges_interleaved_ranks_over_every_chunk(tmp_path) -> None:
    from types import SimpleNamespace

    from hetpipe.runtime.faults.inject import FaultSchedule
    from hetpipe.runtime.faults.watch import StepWatch

    plan = _plan()
    chunk0 = plan.stages[2].chunks[0]
    def watch(hooks) -> StepWatch:
        return StepWatch(plan=plan, stage=2, rank=2, stage_ranks=list(range(P)), hooks=hooks,
                         faults=FaultSchedule.from_specs(None), run_dir=tmp_path)
    plain = SimpleNamespace(fwd_s=[], bwd_s=[], time_scale=1.0)  # durations mixed across chunks: not judged
    assert not watch(plain).detect
    hooks = SimpleNamespace(fwd_s=[], bwd_s=[], fwd_device_s=[], bwd_device_s=[], time_scale=1.0,
                            chunk_predicted={})
    w = watch(hooks)
    # rank 2 runs virtual stages 2 and 5: cuts 2 -> rank 0 (the wrap-around), 1 and 4 -> rank 1; 5 is the last
    assert w.detect and w._cut_peers() == {2: 0, 1: 1, 4: 1}
    w.before_step(1)
    hooks.fwd_device_s += [1.5 * chunk0.fwd_s] * (M * V)  # 1.5x slower than planned, in chunk 0's seconds
    hooks.bwd_device_s += [1.5 * chunk0.bwd_s] * (M * V)
    assert w.ratios() == pytest.approx({"fwd": 1.5, "bwd": 1.5}, rel=1e-12)
