"""Item 8 of issue 11: `hetpipe plan --replicas auto|N` makes mixed data-parallel replica plans from the CLI,
`hetpipe check` and `hetpipe show` read them, and `hetpipe run --emulate` trains one."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetpipe.cli import app
from hetpipe.plan.check import check_plan
from hetpipe.plan.schema import Plan
from hetpipe.runtime.report import RunReport

HOMELAB = "examples/clusters/homelab.yaml"


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = app.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def homelab_plans(tmp_path_factory) -> dict[str, Path]:
    """gpt2-small on the home lab: one pipeline, --replicas auto and --replicas 2."""
    out = {}
    for r in ("1", "auto", "2"):
        path = tmp_path_factory.mktemp("rep") / f"plan-{r}.json"
        assert app.main(["plan", "gpt2-small", "--cluster", HOMELAB, "--replicas", r, "-o", str(path)]) == 0
        out[r] = path
    return out


def test_two_replicas_give_the_faster_card_the_larger_batch(homelab_plans):
    plan = Plan.load(homelab_plans["2"])
    assert len(plan.replicas) == 2 and check_plan(plan).ok
    kinds = {d.id: d.kind for d in plan.devices}
    share = {kinds[plan.stages[r.first_stage].device]: r.samples for r in plan.replicas if r.num_stages == 1}
    assert share.get("rtx4090", 0) > share.get("rtx3090", 0)  # "a 3090 should not get a 4090's batch"
    assert sum(r.samples for r in plan.replicas) == plan.training.global_batch


def test_auto_picks_the_faster_of_one_pipeline_and_replicas(homelab_plans):
    one, auto, two = (Plan.load(homelab_plans[r]) for r in ("1", "auto", "2"))
    assert auto.predicted.iteration_s <= one.predicted.iteration_s * (1 + 1e-9)
    assert bool(auto.replicas) == (auto.predicted.iteration_s < one.predicted.iteration_s)
    # on the home lab two single-card replicas beat the pipeline (gpt2-small fits one card)
    assert two.predicted.iteration_s < one.predicted.iteration_s and len(auto.replicas) >= 2


def test_check_and_show_read_the_replica_plan(homelab_plans, capsys):
    rc, out, _ = _cli(["check", str(homelab_plans["2"]), "--model", "gpt2-small"], capsys)
    assert rc == 0 and "ok" in out
    rc, out, _ = _cli(["show", str(homelab_plans["2"])], capsys)
    assert rc == 0 and "2 replicas" in out and "gradient weight" in out


@pytest.mark.parametrize("value, expected", [("0", "is not 'auto' or a positive number"),
                                             ("many", "is not 'auto' or a positive number"),
                                             ("4", "each replica needs at least one of each")])
def test_bad_replica_counts_are_one_error_line(value, expected, tmp_path, capsys):
    rc, _, err = _cli(["plan", "gpt-tiny", "--cluster", HOMELAB, "--replicas", value, "-o",
                       str(tmp_path / "p.json")], capsys)
    assert rc == 2 and err.startswith("error: --replicas") and err.count("\n") == 1 and expected in err, err


@pytest.mark.slow
def test_emulated_run_of_a_cli_replica_plan(tmp_path, capsys):
    """plan --replicas 2 -> check -> run --emulate: every replica trains, one loss per step."""
    from tests.test_run_cli import hetpipe_run

    path = tmp_path / "plan.json"
    rc, _, err = _cli(["plan", "gpt-tiny", "--batch", "2", "--seq", "16", "--global-batch", "8", "--cluster",
                       "examples/clusters/homelab-mini.yaml", "--replicas", "2", "-o", str(path)], capsys)
    assert rc == 0, err
    plan = Plan.load(path)
    assert len(plan.replicas) == 2 and check_plan(plan).ok
    report = tmp_path / "run.json"
    rc = hetpipe_run([str(path), "--model", "gpt-tiny", "--seq", "16", "--steps", "2", "--emulate", "--report",
                      str(report), "--run-dir", str(tmp_path / "run")])
    assert rc == 0, capsys.readouterr().err
    rep = RunReport.load(report)
    assert rep.emulate and len(rep.losses) == 2 and rep.world_size == len(plan.stages)


def test_sync_diloco_is_asked_for_on_the_cli(tmp_path, capsys):
    """`hetpipe plan --replicas 2 --sync diloco` writes a DiLoCo replica plan (once reachable only through
    `solve_n_replicas(policy='diloco')`); `--sync` without replicas or with an unknown policy is one error line."""
    path = tmp_path / "plan.json"
    rc, _, err = _cli(["plan", "gpt-tiny", "--batch", "2", "--seq", "16", "--global-batch", "8", "--cluster",
                       "examples/clusters/homelab-mini.yaml", "--replicas", "2", "--sync", "diloco", "-o",
                       str(path)], capsys)
    assert rc == 0, err
    plan = Plan.load(path)
    assert len(plan.replicas) == 2 and plan.sync.policy == "diloco" and check_plan(plan).ok
    for argv, expected in ((["--sync", "diloco"], "applies to replica plans only"),
                           (["--replicas", "2", "--sync", "often"], "is not a sync policy")):
        rc, _, err = _cli(["plan", "gpt-tiny", "--cluster", HOMELAB, *argv, "-o", str(tmp_path / "p.json")], capsys)
        assert rc == 2 and err.startswith("error: --sync") and err.count("\n") == 1 and expected in err, err


@pytest.mark.slow
def test_replica_run_reports_each_stages_optimizer_step(tmp_path, capsys):
    """A sharded replica run (--replicas 2 --sharding auto): every stage's S (`update_real_s`) is its measured
    optimizer step (it was 0.0: replica ranks attached no step timer), and the report says why step_ratios
    stay empty (the straggler judge runs on single pipelines only)."""
    from tests.test_run_cli import hetpipe_run

    path = tmp_path / "plan.json"
    rc, _, err = _cli(["plan", "gpt-demo", "--batch", "1", "--global-batch", "4", "--cluster",
                       "examples/clusters/homelab-mini.yaml", "--replicas", "2", "--sharding", "auto", "-o",
                       str(path)], capsys)
    assert rc == 0, err
    plan = Plan.load(path)
    assert len(plan.replicas) == 2 and any(g.shard for g in plan.sync.groups)  # the sharded optimizer's path
    report = tmp_path / "run.json"
    rc = hetpipe_run([str(path), "--model", "gpt-demo", "--steps", "3", "--emulate", "--report", str(report),
                      "--run-dir", str(tmp_path / "run")])
    assert rc == 0, capsys.readouterr().err
    rep = RunReport.load(report)
    assert len(rep.stages) == 2 and all(st.update_real_s > 0.0 for st in rep.stages), rep.stages
    assert any("no stage has step_ratios" in note for note in rep.notes)
