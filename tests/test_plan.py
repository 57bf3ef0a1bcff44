"""Plan document: round-trip, self-check from recorded tables, and refusal of bad files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hetpipe.errors import ConfigError, PlanError
from hetpipe.plan.build import assemble_plan, build_problem, microbatches_for
from hetpipe.plan.check import check_plan
from hetpipe.cost_models.stage_memory import MEMORY_MODEL
from hetpipe.plan.schema import PLAN_VERSION, PLAN_VERSION_MEMORY, PLAN_VERSION_OBJECTIVE, Plan, SolverReport, verify_model
from hetpipe.partitioner.problem import Stage, evaluate
from tests.synthetic import synthetic_cluster, synthetic_graph


def _plan() -> Plan:
    graph = synthetic_graph(6)
    cluster = synthetic_cluster()
    problem = build_problem(graph, cluster, microbatches=8)
    stages = (Stage(0, 0, 2), Stage(1, 3, 4), Stage(2, 5, 5))
    ev = evaluate(problem, stages)
    solver = SolverReport("hand", "FEASIBLE", ev.iteration_s, 0.0, 0.0)
    return assemble_plan(graph, cluster, problem=problem, stages=stages, solver=solver, global_batch=16)


def test_round_trip_is_exact(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    doc = json.loads(path.read_text())
    assert list(doc)[:2] == ["format", "version"]
    assert doc["format"] == "hetpipe.plan" and doc["version"] == PLAN_VERSION_OBJECTIVE == 4 and doc["objective"] == "schedule"
    assert doc["memory_model"] == MEMORY_MODEL
    for key in ("model", "training", "devices", "links", "units", "stages", "predicted", "solver", "baselines"):
        assert key in doc
    assert set(doc["units"][0]["time_s"]) == {"fast", "mid", "slow"}
    assert set(doc["units"][0]["time_s"]["fast"]) == {"fwd", "bwd", "step"}


def test_check_recomputes_objective_and_memory():
    plan = _plan()
    report = check_plan(plan)
    assert report.ok, report.violations
    assert report.iteration_s == pytest.approx(plan.predicted.iteration_s, rel=1e-12)
    # Utilisation and bubble are consistent with the stage times.
    m = plan.training.microbatches
    busy = sum(m * (s.fwd_s + s.bwd_s) for s in plan.stages)
    assert plan.predicted.bubble_fraction == pytest.approx(1 - busy / (3 * plan.predicted.iteration_s))


def test_check_reports_edited_tables():
    plan = _plan()
    # A user edits a unit's time: the recorded stage time and T no longer match the tables.
    u = plan.units[1]
    slower = {k: dataclasses.replace(t, fwd=t.fwd * 2) for k, t in u.time_s.items()}
    units = list(plan.units)
    units[1] = dataclasses.replace(u, time_s=slower)
    edited = dataclasses.replace(plan, units=tuple(units))
    report = check_plan(edited)
    assert not report.ok
    assert any("stage 0: recorded fwd_s" in v for v in report.violations)
    assert any("predicted.iteration_s" in v for v in report.violations)


def test_check_reports_memory_overflow():
    plan = _plan()
    devices = list(plan.devices)
    devices[2] = dataclasses.replace(devices[2], usable_bytes=10)
    # the stage records its device's usable bytes; a stage that contradicts its device is refused outright
    stages = tuple(dataclasses.replace(st, usable_bytes=10) if st.device == "n1:2" else st for st in plan.stages)
    report = check_plan(dataclasses.replace(plan, devices=tuple(devices), stages=stages))
    assert any("stage 2 on n1:2: needs" in v and "usable" in v for v in report.violations)


def test_truncated_plan_refused(tmp_path):
    path = tmp_path / "plan.json"
    _plan().save(path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(PlanError, match="not valid JSON.*truncated"):
        Plan.load(path)


def test_newer_version_refused(tmp_path):
    path = tmp_path / "plan.json"
    doc = _plan().to_dict()
    doc["version"] = PLAN_VERSION + 1
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="newer hetpipe"):
        Plan.load(path)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format="something.else"), "not a hetpipe plan"),
        (lambda d: d["stages"][1].update(device=7), r"stages\[1\]\.device: expected str"),
        (lambda d: d["training"].pop("microbatches"), "missing field 'microbatches'"),
        (lambda d: d.update(units="oops"), "plan.units: expected a list"),
    ],
)
def test_corrupted_plan_refused(tmp_path, mutate, message):
    doc = _plan().to_dict()
    mutate(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=message):
        Plan.load(path)


def test_plan_for_another_model_refused():
    plan = _plan()
    other = dataclasses.replace(synthetic_graph(6), fingerprint="0" * 64, model_name="other")
    with pytest.raises(PlanError, match="made for model 'synthetic'.*re-plan"):
        verify_model(plan, other)
    verify_model(plan, synthetic_graph(6))  # same fingerprint: accepted


def test_global_batch_must_be_a_multiple_of_the_micro_batch():
    graph = synthetic_graph(4, micro_batch_size=3)
    with pytest.raises(ConfigError, match="not a positive multiple of the micro-batch size 3"):
        microbatches_for(graph, 10, 2)
    assert microbatches_for(graph, 12, 2) == (12, 4)
    assert microbatches_for(graph, None, 3) == (18, 6)


def test_cli_plans_a_user_factory_and_refuses_one_without_inputs(tmp_path, capsys):
    from hetpipe.cli import app as cli

    root = Path(__file__).resolve().parents[1]
    cluster = str(root / "examples" / "clusters" / "homelab.yaml")
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "tests.factory_models:stack_of_linears", "--cluster", cluster, "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.model.name == "tests.factory_models:stack_of_linears" and plan.training.micro_batch_size == 2
    assert check_plan(plan).ok
    capsys.readouterr()
    assert cli.main(["plan", "tests.factory_models:module_only", "--cluster", cluster, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model factory") and "example inputs" in err[0]
