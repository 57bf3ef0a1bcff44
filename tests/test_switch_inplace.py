"""Plans switched inside the running job (issue 16, item 3; `hetpipe.runtime.switch`).

One 3-rank gloo run of gpt-tiny moves, after step 2 of 4 (forced: ``switch_at``, so nothing depends on
timing), onto a plan with other cuts and the cards in another order, without a relaunch: its losses and
its final parameters and Adam state equal a plain single-device loop within 1e-5 (fp32).  The rest
is pure: which plans may switch in place, how a fired slowdown follows its card, the agreement
protocol's files.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hetpipe.errors import ConfigError
from hetpipe.models import build
from hetpipe.partitioner.capture.capture import capture
from hetpipe.partitioner.problem import Stage
from hetpipe.runtime.rank import DEFAULT_LR
from hetpipe.runtime.run import run
from hetpipe.runtime.switch import (SWITCH_REQUEST, SwitchPoint, final_plan, forced_switch, read_switches,
                                    request_switch, switch_refusal)
from tests.reference_loop import initial_state, reference_loop, seeded_batches
from tests.runtime_plans import plan_for
from tests.synthetic import synthetic_cluster
from tests.test_checkpoint import assert_checkpoint_is_the_reference
from tests.forked_launch import use_forked_launch
from tests.machine_load import guard_s

MODEL, BATCH, SEQ, MICROBATCHES, STEPS, SWITCH_AFTER = "gpt-tiny", 2, 16, 4, 4, 2
RTOL, ATOL = 1e-5, 1e-5  # fp32, the acceptance tolerances


@pytest.fixture(scope="module")
def plans():
    """(graph, 3-stage plan, the same cards re-cut and re-ordered, a 2-stage plan)."""
    meta, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(meta, inputs, name=MODEL)
    n, cluster = graph.num_units, synthetic_cluster()
    before = plan_for(graph, cluster, (Stage(0, 0, n // 3 - 1), Stage(1, n // 3, 2 * n // 3 - 1),
                                       Stage(2, 2 * n // 3, n - 1)), microbatches=MICROBATCHES)
    after = plan_for(graph, cluster, (Stage(2, 0, 1), Stage(0, 2, n - 3), Stage(1, n - 2, n - 1)),
                     microbatches=MICROBATCHES)
    two = plan_for(graph, cluster, (Stage(0, 0, n // 2), Stage(1, n // 2 + 1, n - 1)), microbatches=MICROBATCHES)
    return graph, before, after, two


@pytest.mark.slow
def test_an_in_place_switch_equals_a_single_device_run(plans, tmp_path, monkeypatch):
    # Numerics of the switch: the ranks fork from the test fork server (`tests.forked_launch`, ~10 s of CPU less);
    # tests/test_adapt_decisions.py's supervised run switches in place under torchrun.
    use_forked_launch(monkeypatch)
    graph, before, after, _ = plans
    state, batches = initial_state(MODEL, seed=3), seeded_batches(STEPS, seed=9)
    torch.save(state, tmp_path / "init.pt")
    rep = run(before, model=MODEL, seq=SEQ, steps=STEPS, data=batches, loss="hetpipe.models:lm_loss",
              weights=tmp_path / "init.pt", timeout_s=guard_s(60.0), run_dir=tmp_path / "run",
              checkpoint_dir=tmp_path / "ck", switch_at=(SWITCH_AFTER, after))
    ref_losses, ref_model, ref_opt = reference_loop(state, batches, lambda p: torch.optim.Adam(p, lr=DEFAULT_LR["adam"]),
                                                    model_name=MODEL)
    assert list(rep.losses) == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    (switch,) = read_switches(tmp_path / "run")
    assert switch.after_steps == SWITCH_AFTER and switch.seconds > 0
    # every rank released its old stage before building the new one: parameters and Adam's two moments at least
    meta, _ = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    assert switch.released_bytes >= 3 * sum(p.numel() * p.element_size() for p in meta.parameters())
    assert not (tmp_path / "run" / "switch" / f"step-{SWITCH_AFTER:06d}").exists()  # the hand-over is removed
    assert any(n.startswith("switched in place after step 2") for n in rep.notes)
    assert final_plan(tmp_path / "run", before).stages == after.stages
    assert [s.device for s in rep.stages] == [s.device for s in after.stages]  # the report is on the new plan
    # written at the end, on the new plan
    assert_checkpoint_is_the_reference(tmp_path / "ck" / f"step-{STEPS:06d}", graph, ref_model, ref_opt)


def test_only_plans_of_the_same_world_switch_in_place(plans, tmp_path):
    _, before, after, two = plans
    assert switch_refusal(before, after) is None
    assert "2 stages" in switch_refusal(before, two)
    other = dataclasses.replace(after, training=dataclasses.replace(after.training, optimizer="sgd"))
    assert "training.optimizer" in switch_refusal(before, other)
    with pytest.raises(ConfigError, match="cannot switch in place: the new plan has 2 stages"):
        forced_switch(tmp_path, before, (2, two))
    with pytest.raises(ConfigError, match="whole number >= 1"):
        forced_switch(tmp_path, before, (0, after))
    assert forced_switch(tmp_path, before, (3, after)).startswith("3=")


def test_rank_zero_takes_a_request_once(plans, tmp_path):
    _, before, after, _ = plans
    point = SwitchPoint(run_dir=tmp_path, rank=0, forced=None, listen=True)
    assert point._wanted(3) is None  # noqa: SLF001 - the decision alone, without a process group
    request_switch(tmp_path, after, "straggler")
    doc, reason = point._wanted(4)  # noqa: SLF001
    assert reason == "straggler" and doc["stages"] == after.to_dict()["stages"]
    assert not (tmp_path / SWITCH_REQUEST).exists() and point._wanted(5) is None  # noqa: SLF001


def _steps_files(run_dir: Path, build_s: tuple[float, ...], step_s: float) -> dict:
    from hetpipe.runtime.steps_done import StepsDone, read_steps, write_steps

    for rank, b in enumerate(build_s):
        write_steps(run_dir, StepsDone(rank, rank, 6, 1, (step_s,) * 3, 1.0, 0.0, b))
    return read_steps(run_dir)


def test_a_switch_is_priced_at_its_measured_parts_then_at_the_last_switch(plans, tmp_path, monkeypatch):
    from hetpipe.runtime import switch_price

    assert switch_price.switch_cost_s(tmp_path, tmp_path / "ck") is None  # nothing measured yet
    _steps_files(tmp_path, (1.5, 0.5, 0.7), 1.0)
    monkeypatch.setattr(switch_price, "newest_save_s", lambda root: 1.2)
    assert switch_price.switch_cost_s(tmp_path, tmp_path / "ck") == pytest.approx(1.2 + 1.5)
    (tmp_path / "switches.json").write_text(json.dumps([dict(
        after_steps=7, seconds=2.5, save_s=1.0, load_s=0.5, build_s=1.0, old_stages="a", new_stages="b",
        old_predicted_s=0.7, new_predicted_s=0.4, plan_file="p.json")]))
    assert switch_price.switch_cost_s(tmp_path, tmp_path / "ck") == 2.5


def test_the_supervisor_switches_in_place_only_on_the_same_world(plans, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from hetpipe.plan.replan import Replan
    from hetpipe.runtime import supervise, switch_price

    _, before, after, two = plans
    records = _steps_files(tmp_path, (1.0, 1.0, 1.0), 2.0)  # 6 steps done, 2 s each
    monkeypatch.setattr(switch_price, "newest_save_s", lambda root: 0.5)
    job = SimpleNamespace(plan=before, run_dir=tmp_path, first_step_at=10.0, started=0.0)
    straggler = supervise.Straggler(2, 2, before.stages[2].device, 3.0, 6)
    for new, in_place in ((after, True), (two, False)):
        monkeypatch.setattr(supervise.Straggler, "replan", lambda self, plan, new=new: Replan(new, 2.0, 1.0, 0.1))
        d = supervise.decide(job, straggler, records, steps=20, every=4, start=0, checkpoint_dir=tmp_path / "ck")
        assert d.in_place is in_place
        if in_place:  # next boundary; 13 steps x (2 - 1) s gained; the switch priced at 0.5 + 1.0 s
            assert (d.stop_step, d.gain_s, d.cost_s) == (7, pytest.approx(13.0), pytest.approx(0.1 + 1.5))
            assert "switching in place after step 7" in d.line() and "switch cost" in d.line()
        else:  # fewer cards: the relaunch at the next checkpoint, priced at this attempt's start-up
            assert (d.stop_step, d.cost_s) == (8, pytest.approx(0.1 + 10.0))


def test_the_report_lists_a_switch_with_predicted_and_measured_steps(plans, tmp_path):
    from types import SimpleNamespace

    from hetpipe.plan.replan import Replan
    from hetpipe.runtime import supervise
    from hetpipe.runtime.report import StepRecord

    _, before, after, _ = plans
    decision = supervise.Decision(supervise.Straggler(2, 2, "n1:2", 3.0, 7), Replan(after, 0.7, 0.4, 0.2), 9,
                                  gain_s=20.0, cost_s=5.0, in_place=True)
    (tmp_path / "switches.json").write_text(json.dumps([dict(
        after_steps=9, seconds=1.8, save_s=0.3, load_s=0.8, build_s=0.7, old_stages="a", new_stages="b",
        old_predicted_s=0.27, new_predicted_s=0.4, plan_file="p.json")]))
    steps = [StepRecord(i, 1.0, 1.0, 0.65 if i < 9 else 0.39 + 0.001 * i) for i in range(12)]
    job = SimpleNamespace(switched=[(decision, 0.65)], run_dir=tmp_path, report=SimpleNamespace(step_records=steps))
    (r,) = supervise._switch_restarts(job, 0)  # noqa: SLF001 - the records the supervisor attaches to the report
    assert (r.kind, r.failed_step, r.resumed_step, r.steps_redone, r.restart_s) == ("in-place", 9, 9, 0, 1.8)
    assert (r.old_predicted_s, r.new_predicted_s, r.old_measured_s) == (0.7, 0.4, 0.65)
    assert r.new_measured_s == pytest.approx(0.40)  # the median of the steps after the switch
    assert "switched in place (no relaunch): b, T 700 ms -> 400 ms; measured 650 ms -> 400 ms" in r.line()
