"""Item 4 of issue 11: `--loss` is costed by `hetpipe plan/inspect` exactly like the Python API, and
`hetpipe run --data/--loss` mistakes are one `error:` line before anything is launched."""

from __future__ import annotations

import pytest

from hetpipe.cli import app
from hetpipe.plan.schema import Plan
from tests import user_code_helpers as h

FACTORY, DATA, LOSS = "tests.user_code_helpers:lm_factory", "tests.user_code_helpers:lm_data", \
    "tests.user_code_helpers:ce_loss"
CLUSTER = "examples/clusters/homelab-mini.yaml"


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = app.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _python_api_units(loss_fn=None):
    """The last unit as `capture(..., loss_fn=, targets=)` costs it (targets: the data's first micro-batch)."""
    from hetpipe.partitioner.capture.capture import capture

    model, inputs = h.lm_factory()
    _, targets = next(iter(h.lm_data()))
    with_loss = {} if loss_fn is None else {"loss_fn": loss_fn, "targets": targets[:h.MICRO]}
    return capture(model, inputs, name=FACTORY, **with_loss).units


@pytest.fixture(scope="module")
def factory_plan(tmp_path_factory) -> Plan:
    path = tmp_path_factory.mktemp("uc") / "plan.json"
    assert app.main(["plan", FACTORY, "--cluster", CLUSTER, "--loss", LOSS, "--data", DATA, "--global-batch",
                     str(h.GLOBAL), "-o", str(path)]) == 0
    return path


def test_plan_costs_the_loss_like_the_python_api(factory_plan):
    plan = Plan.load(factory_plan)
    api, bare = _python_api_units(h.ce_loss), _python_api_units()
    assert [u.activation_bytes for u in plan.units] == [u.activation_bytes for u in api]
    assert [u.fwd_flops for u in plan.units] == [u.fwd_flops for u in api]
    # the cross-entropy keeps micro x seq x vocab fp32 log-probabilities on the last unit
    assert api[-1].activation_bytes - bare[-1].activation_bytes >= h.MICRO * h.SEQ * h.VOCAB * 4


def test_check_model_recosts_the_recorded_loss_and_catches_a_shrunk_loss_table(factory_plan, tmp_path, capsys):
    import dataclasses
    import json

    plan = Plan.load(factory_plan)
    assert (plan.model.loss, plan.model.data, plan.version) == (LOSS, DATA, 9)  # 8: loss transient; 9: step tables
    assert json.loads(factory_plan.read_text())["model"]["loss"] == LOSS
    rc, out, _ = _cli(["check", str(factory_plan), "--model", FACTORY], capsys)
    assert rc == 0, out
    # the loss's log-probabilities dropped from the last unit: caught now that the loss is re-costed
    last = dataclasses.replace(plan.units[-1], activation_bytes=_python_api_units()[-1].activation_bytes)
    lied = tmp_path / "lied.json"
    dataclasses.replace(plan, units=(*plan.units[:-1], last)).save(lied)
    rc, out, err = _cli(["check", str(lied), "--model", FACTORY], capsys)
    assert rc == 2 and "activation_bytes" in err and "Traceback" not in err, (out, err)


def test_builtin_with_its_own_loss_named_equals_the_default(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    base = ["plan", "gpt-tiny", "--cluster", CLUSTER, "--batch", "2", "--seq", "16"]
    assert app.main([*base, "-o", str(a)]) == 0
    assert app.main([*base, "--loss", "hetpipe.models:lm_loss", "-o", str(b)]) == 0
    assert [u.activation_bytes for u in Plan.load(a).units] == [u.activation_bytes for u in Plan.load(b).units]


@pytest.mark.parametrize("extra, expected", [
    (["--loss", "tests.no_such_module:f", "--data", DATA], "--loss 'tests.no_such_module:f': cannot import module"),
    (["--loss", "tests.user_code_helpers:nope", "--data", DATA], "has no attribute 'nope'"),
    (["--loss", "tests.user_code_helpers:NOT_CALLABLE", "--data", DATA], "is a int, not a callable"),
    (["--loss", "tests.user_code_helpers:per_token_loss", "--data", DATA], "must return a scalar tensor"),
    (["--loss", "tests.user_code_helpers:wrong_args_loss", "--data", DATA], "failed on one micro-batch"),
    (["--loss", LOSS], "pass --data package.module:factory"),
    (["--loss", LOSS, "--data", "tests.user_code_helpers:wrong_shape_data"], "input 0 of the first batch is (8, 9)"),
    (["--loss", LOSS, "--data", "tests.user_code_helpers:single_tensor_data"], "each item must be (inputs, targets)"),
])
def test_plan_refuses_a_bad_loss_or_data_with_one_error_line(extra, expected, tmp_path, capsys):
    rc, _, err = _cli(["inspect", FACTORY, "--cluster", CLUSTER, *extra], capsys)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert expected in err, err


@pytest.mark.parametrize("extra, expected", [
    ([], "error: --data is missing: model 'tests.user_code_helpers:lm_factory' is not built in"),
    (["--data", DATA], "error: --loss is missing"),
    (["--data", "tests.user_code_helpers:wrong_shape_data", "--loss", LOSS], "the plan needs (8, 8) torch.int64"),
    (["--data", "tests.user_code_helpers:nope", "--loss", LOSS], "error: --data 'tests.user_code_helpers:nope'"),
    (["--data", DATA, "--loss", "tests.user_code_helpers:per_token_loss"], "must return a scalar tensor"),
    (["--data", DATA, "--loss", "tests.user_code_helpers:wrong_args_loss"], "error: --loss"),
])
def test_run_refuses_bad_data_or_loss_before_launch(factory_plan, extra, expected, tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc, _, err = _cli(["run", str(factory_plan), "--model", FACTORY, "--steps", "1", "--run-dir", str(run_dir),
                       *extra], capsys)
    assert rc == 2 and err.count("\n") == 1 and expected in err, err
    assert not (run_dir / "torchrun.log").exists()  # refused before launch


def test_run_of_a_builtin_checks_a_named_loss_before_launch(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert app.main(["plan", "gpt-tiny", "--cluster", CLUSTER, "--batch", "2", "--seq", "16", "-o", str(plan)]) == 0
    rc, _, err = _cli(["run", str(plan), "--model", "gpt-tiny", "--seq", "16", "--steps", "1", "--run-dir",
                       str(tmp_path / "run"), "--loss", "tests.user_code_helpers:per_token_loss"], capsys)
    assert rc == 2 and "must return a scalar tensor" in err
