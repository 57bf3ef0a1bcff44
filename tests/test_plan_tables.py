"""`check --model` proves a plan's tables: a consistently edited plan passes `check` but not `check --model`.

Each lie edits the unit tables and then re-computes every stage, the predicted T and the baselines from
the edited tables, as a careful forger would, so that the plain `check` (which only
recomputes T and M_s from the plan's own tables) passes.  `check --model` re-captures the
model and refuses the plan naming the unit and the field; `--cluster` also re-derives
every unit's time.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from hetpipe.cli.app import main
from hetpipe.partitioner.problem import evaluate
from hetpipe.plan.baseline_report import baseline_reports
from hetpipe.plan.check import check_plan
from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples/clusters/homelab-mini.yaml"


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tables") / "plan.json"
    assert main(["plan", "gpt-tiny", "--cluster", str(CLUSTER), "-o", str(path), "--time-limit", "5"]) == 0
    return path


def _consistent(plan: Plan, edit: Callable[[Any], Any]) -> Plan:
    """`plan` with its units edited by `edit` and every stage, T and baseline recomputed from the edited tables."""
    plan = dataclasses.replace(plan, units=tuple(edit(u) for u in plan.units),
                               model=dataclasses.replace(plan.model, tied=tuple(edit(t) for t in plan.model.tied)))
    ev = evaluate(problem_from_plan(plan), stages_from_plan(plan))
    stages = tuple(dataclasses.replace(st, fwd_s=c.fwd_s, bwd_s=c.bwd_s, send_s=c.send_s, memory_bytes=c.memory_bytes,
                                       step_s=c.step_s)
                   for st, c in zip(plan.stages, ev.stages))
    return dataclasses.replace(plan, stages=stages, baselines=baseline_reports(problem_from_plan(plan)),
                               predicted=dataclasses.replace(plan.predicted, iteration_s=ev.iteration_s,
                                                             t_1f1b_estimate_s=ev.estimate_s),
                               solver=dataclasses.replace(plan.solver, objective_s=ev.iteration_s))


def _units_only(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda x: fn(x) if hasattr(x, "activation_bytes") else x


def _tied_zero(x: Any) -> Any:
    return dataclasses.replace(x, state_bytes=0) if hasattr(x, "names") else x


LIES = [
    ("activations-zero", _units_only(lambda u: dataclasses.replace(u, activation_bytes=0)), "activation_bytes"),
    ("state-quartered", _units_only(lambda u: dataclasses.replace(u, state_bytes=u.state_bytes // 4,
                                                                  param_bytes=u.param_bytes // 4)), "param_bytes"),
    ("state-quartered-only", _units_only(lambda u: dataclasses.replace(
        u, state_bytes=max(u.param_bytes, u.state_bytes // 4))), "state_bytes"),
    ("boundary-halved", _units_only(lambda u: dataclasses.replace(u, boundary_bytes=u.boundary_bytes // 2)),
     "boundary_bytes"),
    ("flops-halved", _units_only(lambda u: dataclasses.replace(u, fwd_flops=u.fwd_flops // 2)), "fwd_flops"),
    ("tied-state-zero", _tied_zero, "model.tied"),
]


@pytest.mark.parametrize("edit, field", [c[1:] for c in LIES], ids=[c[0] for c in LIES])
def test_a_consistent_lie_passes_check_but_not_check_model(planned: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str], edit: Any,
                                                           field: str) -> None:
    lie = _consistent(Plan.load(planned), edit)
    assert check_plan(lie).ok  # the plain check recomputes from the (edited) tables: it cannot tell
    path = tmp_path / "lie.json"
    lie.save(path)
    assert main(["check", str(path)]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--model", "gpt-tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and field in err, err
    assert field == "model.tied" or "unit " in err  # names the unit


def test_negative_bytes_never_get_that_far(planned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = Plan.load(planned).to_dict()
    doc["units"][1]["activation_bytes"] = -4096
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(doc))
    assert main(["check", str(path), "--model", "gpt-tiny"]) == 2
    assert "plan.units[1].activation_bytes" in capsys.readouterr().err


def test_check_model_accepts_the_real_plan_and_rederives_times(planned: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(planned), "--model", "gpt-tiny", "--cluster", str(CLUSTER)]) == 0
    plan = Plan.load(planned)
    kind = plan.devices[0].kind
    u0 = plan.units[0]
    slower = dataclasses.replace(u0, time_s={**u0.time_s, kind: dataclasses.replace(u0.time_s[kind],
                                                                                    fwd=u0.time_s[kind].fwd * 2)})
    lie = _consistent(plan, lambda u: slower if getattr(u, "index", None) == 0 and hasattr(u, "time_s") else u)
    path = tmp_path / "slow.json"
    lie.save(path)
    capsys.readouterr()
    assert main(["check", str(path), "--model", "gpt-tiny"]) == 0  # without the cluster, times are not derivable
    assert main(["check", str(path), "--model", "gpt-tiny", "--cluster", str(CLUSTER)]) == 2
    assert f"unit 0 ({u0.name}): time_s.{kind}.fwd" in capsys.readouterr().err


def test_run_refuses_a_consistent_lie_before_launch(planned: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    lie = _consistent(Plan.load(planned), LIES[0][1])  # activations set to 0 everywhere
    path = tmp_path / "lie.json"
    lie.save(path)
    assert main(["run", str(path), "--model", "gpt-tiny", "--steps", "1", "--emulate",
                 "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unit 0" in err and "activation_bytes" in err, err
    assert not (tmp_path / "run" / "torchrun.log").exists()  # refused before anything was launched


def test_a_replica_plan_names_each_stage_levers_and_its_replicas(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The second review: `--replicas 2 --offload all` printed no offload column and "3 stages" for two replicas."""
    out = tmp_path / "rep.json"
    cluster = str(Path(__file__).resolve().parents[1] / "examples/clusters/homelab-mini.yaml")
    assert main(["plan", "gpt-demo", "--cluster", cluster, "--batch", "1", "--global-batch", "4", "--replicas", "2",
                 "--offload", "all", "-o", str(out), "--time-limit", "5"]) == 0
    plan = Plan.load(out)
    assert len(plan.replicas) == 2 and all(st.offload for st in plan.stages)
    text = capsys.readouterr().out
    assert f"2 replicas, {len(plan.stages)} stages in all" in text
    assert text.count("optimizer state offloaded") >= len(plan.stages)
