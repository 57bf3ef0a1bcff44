"""Hand-edited plans whose structure is broken: every plan command refuses them with one ``error:`` line.

A real plan of mlp-tiny on the mini home lab is edited as a new user did (a schedule name, an optimizer,
a stage's ``last_unit`` that overlaps the next stage or leaves a gap); ``check``, ``show``, ``simulate``,
``compare`` and ``run`` refuse it alike, naming the field, the value and the fix (`hetpipe.plan.structure`),
while ``check`` keeps exit 1 for a well-formed plan whose recorded figures were tampered with.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from hetpipe.cli.app import main
from hetpipe.errors import PlanError
from hetpipe.plan.check import check_plan
from hetpipe.plan.chunk_schema import PlanChunk
from hetpipe.plan.schema import Plan, PlanReplica
from hetpipe.plan.structure import validate_structure
from tests.runtime_plans import synthetic_plan

ROOT = Path(__file__).resolve().parents[1]
FIX = "re-create it with `hetpipe plan`"


@pytest.fixture(scope="module")
def good_plan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real plan of mlp-tiny on the mini home lab: two stages, the first of at least two units."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", "mlp-tiny", "--cluster", str(ROOT / "examples/clusters/homelab-mini.yaml"),
                 "-o", str(path), "--time-limit", "5"]) == 0
    doc = json.loads(path.read_text())
    first, second = doc["stages"][:2]
    assert first["last_unit"] > first["first_unit"] and second["first_unit"] == first["last_unit"] + 1
    return doc


def _edited(tmp_path: Path, good: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> Path:
    doc = copy.deepcopy(good)
    edit(doc)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def _overlap(doc: dict[str, Any]) -> None:
    doc["stages"][0]["last_unit"] = doc["stages"][1]["first_unit"]  # the next stage's first unit runs twice


def _gap(doc: dict[str, Any]) -> None:
    doc["stages"][0]["last_unit"] -= 1  # its old last unit runs nowhere


def _one_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[str, str]:
    """Run the CLI in-process: exit 2 and one ``error:`` line on stderr; return it and stdout."""
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (code, out[-500:], err[-500:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out + err, err
    return lines[0], out


@pytest.mark.parametrize("command", ["check", "simulate"])
def test_unknown_schedule_is_one_error_naming_the_field(tmp_path, capsys, good_plan, command) -> None:
    # was: ValueError: Problem.schedule is 'zb-9' (a traceback, exit 1)
    path = _edited(tmp_path, good_plan, lambda d: d["training"].update(schedule="zb-9"))
    line, _ = _one_error(capsys, [command, str(path)])
    assert f"{path}: plan.training.schedule is 'zb-9'" in line and "1f1b" in line and FIX in line


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_overlapping_stages_are_one_error_in_simulate_and_compare(tmp_path, capsys, good_plan, command) -> None:
    # was: ValueError: stage 1 covers units [...], expected to start at ... (a traceback, exit 1)
    path = _edited(tmp_path, good_plan, _overlap)
    u = good_plan["stages"][1]["first_unit"]
    line, _ = _one_error(capsys, [command, str(path)])
    assert (f"plan.stages[0].last_unit is {u} but plan.stages[1].first_unit is {u}: unit {u} would run on two "
            f"stages" in line and f"set plan.stages[1].first_unit to {u + 1}" in line and FIX in line), line


@pytest.mark.parametrize("edit, what", [(_overlap, "two stages"), (_gap, "no stage")], ids=["overlap", "gap"])
def test_run_refuses_a_broken_split_before_launch(tmp_path, capsys, good_plan, edit, what) -> None:
    # was: the overlap trained 2 steps after a warning (exit 0); the gap failed inside rank 1 (KeyError)
    path = _edited(tmp_path, good_plan, edit)
    report = tmp_path / "run.json"
    line, _ = _one_error(capsys, ["run", str(path), "--model", "mlp-tiny", "--steps", "1", "--emulate",
                                  "--report", str(report)])
    assert "plan.stages[0].last_unit" in line and what in line and FIX in line, line
    assert not report.exists()


def test_run_refuses_a_broken_split_edited_in_code(good_plan) -> None:
    from hetpipe.runtime.run import loaded_plan

    plan = Plan.from_dict(good_plan)
    edited = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], last_unit=plan.stages[1].first_unit),
                                               *plan.stages[1:]))
    assert loaded_plan(plan) is plan
    with pytest.raises(PlanError, match=r"plan\.stages\[0\]\.last_unit .* would run on two stages"):
        loaded_plan(edited)  # what `hetpipe.run(plan_object, ...)` does first
    with pytest.raises(PlanError, match="would run on two stages"):
        check_plan(edited)


@pytest.mark.parametrize("edit, what", [(_overlap, "two stages"), (_gap, "no stage")], ids=["overlap", "gap"])
def test_show_and_check_refuse_a_broken_split(tmp_path, capsys, good_plan, edit, what) -> None:
    # was: show printed the overlapping split as valid (exit 0); check listed it as a violation (exit 1)
    path = _edited(tmp_path, good_plan, edit)
    for command in ("show", "check"):
        line, out = _one_error(capsys, [command, str(path)])
        assert "plan.stages[0].last_unit" in line and what in line and out == "", (command, line)


def test_unknown_optimizer_names_the_file_and_field(tmp_path, capsys, good_plan) -> None:
    # was: error: unknown optimizer 'adamw2'; use one of: ... (no file, no field)
    path = _edited(tmp_path, good_plan, lambda d: d["training"].update(optimizer="adamw2"))
    for command in ("check", "show"):
        line, _ = _one_error(capsys, [command, str(path)])
        assert (line.startswith(f"error: {path}: plan.training.optimizer is 'adamw2'") and "adam, adamw" in line
                and "--optimizer" in line and FIX in line), line
    path = _edited(tmp_path, good_plan, lambda d: d["training"].update(precision="fp8"))
    line, _ = _one_error(capsys, ["check", str(path)])
    assert "plan.training.precision is 'fp8'" in line and "bf16-mixed" in line, line


def test_show_checks_the_run_report_before_printing(tmp_path, capsys, good_plan) -> None:
    # was: every table printed, then the error about --run
    path = _edited(tmp_path, good_plan, lambda d: None)
    line, out = _one_error(capsys, ["show", str(path), "--run", str(tmp_path / "nosuch.json")])
    assert "cannot read run report" in line and out == "", out[:300]


def test_check_still_exits_1_for_a_tampered_figure(tmp_path, capsys, good_plan) -> None:
    path = _edited(tmp_path, good_plan, lambda d: d["predicted"].update(iteration_s=d["predicted"]["iteration_s"] * 2))
    assert main(["check", str(path)]) == 1
    assert "predicted.iteration_s" in capsys.readouterr().out


def _shape(plan: Plan, **changes: Any) -> SimpleNamespace:
    """What `validate_structure` reads of `plan`, with `changes` (a replica list needs no sync record here)."""
    fields = {"training": plan.training, "units": plan.units, "stages": plan.stages, "replicas": plan.replicas}
    return SimpleNamespace(**{**fields, **changes})


def test_warmup_interleaved_and_replica_splits() -> None:
    base = synthetic_plan()  # stages 0-2, 3-4, 5-5 of six units
    validate_structure(base)
    warm = dataclasses.replace(base.training, schedule="zb-1f1b@1,1,0")
    validate_structure(_shape(base, training=warm))
    with pytest.raises(PlanError, match=r"plan\.training\.schedule: schedule 'zb-1f1b@1,0': .*extra warm-up"):
        validate_structure(_shape(base, training=dataclasses.replace(warm, schedule="zb-1f1b@1,0")))
    with pytest.raises(PlanError, match=r"plan\.stages\[1\]\.last_unit is 4 but the model has 6 units"):
        validate_structure(_shape(base, stages=base.stages[:2]))  # unit 5 on no stage
    # interleaved:2 over three cards: chunk c of card r is virtual stage 3c + r, here unit 3c + r
    inter = dataclasses.replace(base.training, schedule="interleaved:2")
    chunked = tuple(dataclasses.replace(st, first_unit=r, last_unit=r, chunks=(
        PlanChunk(r, r, 0.1, 0.2, 0.01), PlanChunk(3 + r, 3 + r, 0.1, 0.2, 0.01))) for r, st in enumerate(base.stages))
    validate_structure(_shape(base, training=inter, stages=chunked))
    late = dataclasses.replace(chunked[0], chunks=(chunked[0].chunks[0], PlanChunk(4, 4, 0.1, 0.2, 0.01)))
    with pytest.raises(PlanError, match=r"plan\.stages\[2\]\.chunks\[0\]\.last_unit is 2 but "
                                        r"plan\.stages\[0\]\.chunks\[1\]\.first_unit is 4: unit 3 would run on no"):
        validate_structure(_shape(base, training=inter, stages=(late, *chunked[1:])))
    with pytest.raises(PlanError, match=r"plan\.stages\[0\]\.chunks: the stage lists 2 chunks but .*'1f1b'"):
        validate_structure(_shape(base, stages=chunked))
    # two replicas of the same split: each must run every unit on its own
    reps = (PlanReplica(0, 0, 3, 2, 2, 0.5, 1.0), PlanReplica(1, 3, 3, 2, 2, 0.5, 1.0))
    validate_structure(_shape(base, stages=base.stages * 2, replicas=reps))
    with pytest.raises(PlanError, match=r"plan\.stages\[3\]\.first_unit is 1, but the first stage starts at unit 0"):
        validate_structure(_shape(base, replicas=reps, stages=(
            *base.stages, dataclasses.replace(base.stages[0], first_unit=1), *base.stages[1:])))
    with pytest.raises(PlanError, match=r"plan\.replicas cover 6 stages but plan\.stages lists 7"):
        validate_structure(_shape(base, replicas=reps, stages=base.stages * 2 + base.stages[:1]))
