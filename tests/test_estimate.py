"""`hetpipe run --emulate` estimates its wall time before launching and refuses runs above --max-minutes."""

from __future__ import annotations

import math

import pytest

from hetpipe.plan.schema import Plan
from hetpipe.runtime.emulate.pipeline import DEFAULT_SAFETY_FACTOR
from hetpipe.runtime.estimate import (
    BASE_TIMEOUT_S,
    CALIBRATION_PASSES,
    STARTUP_PER_RANK_S,
    TIMEOUT_ITERATIONS,
    WallEstimate,
    default_timeout_s,
    estimate_wall,
    refuse_if_too_long,
)
from hetpipe.errors import ConfigError
from tests.runtime_plans import synthetic_plan

FLOPS_S = 1e9  # a pretend CPU: 1 GFLOP/s per core


def _by_hand(plan: Plan, *, steps: int, cores: int) -> tuple[float, float]:
    """(time scale, total wall s) from the module's formula, written out."""
    contention = max(1.0, len(plan.stages) / cores)
    scale, calib = 0.0, 0.0
    for st in plan.stages:
        units = plan.units[st.first_unit:st.last_unit + 1]
        f = sum(u.fwd_flops for u in units) / FLOPS_S
        b = sum(u.bwd_flops for u in units) / FLOPS_S
        calib += f + b
        for real, pred in ((f, st.fwd_s), (b, st.bwd_s)):
            scale = max(scale, max(DEFAULT_SAFETY_FACTOR * contention * real, 2e-3) / pred)
    total = STARTUP_PER_RANK_S * len(plan.stages) + CALIBRATION_PASSES * calib + steps * scale * plan.predicted.iteration_s
    return scale, total


def test_estimate_is_the_time_scale_formula_applied_to_the_plans_flops():
    plan = synthetic_plan()
    est = estimate_wall(plan, steps=5, flops_s=FLOPS_S, num_cores=2)
    scale, total = _by_hand(plan, steps=5, cores=2)
    assert math.isclose(est.time_scale, scale, rel_tol=1e-12)
    assert math.isclose(est.total_s, total, rel_tol=1e-12)
    assert "estimated wall time: at least" in est.line()


def test_default_timeout_covers_three_iterations_and_never_drops_below_60_s():
    plan = synthetic_plan()
    slow = estimate_wall(plan, steps=1, flops_s=1e3, num_cores=2)  # a very slow CPU: long iterations
    assert default_timeout_s(slow) == pytest.approx(TIMEOUT_ITERATIONS * max(
        slow.step_s, slow.calibration_s / CALIBRATION_PASSES))
    assert default_timeout_s(slow) > BASE_TIMEOUT_S
    fast = estimate_wall(plan, steps=1, flops_s=1e15, num_cores=2)
    assert default_timeout_s(fast) == BASE_TIMEOUT_S


def test_refusal_names_the_steps_that_fit_and_the_other_ways_to_shrink():
    plan = synthetic_plan()
    est = estimate_wall(plan, steps=1000, flops_s=1e7, num_cores=2)
    limit = (est.startup_s + est.calibration_s + 10.5 * est.step_s) / 60  # room for 10 steps
    with pytest.raises(ConfigError) as err:
        refuse_if_too_long(est, plan, max_minutes=limit)
    msg = str(err.value)
    assert "--steps 10 " in msg and "--global-batch" in msg and "homelab-mini" in msg and "--max-minutes" in msg
    refuse_if_too_long(est, plan, max_minutes=est.total_s / 60 * 1.01)  # within the limit: no error
    with pytest.raises(ConfigError, match="--max-minutes must be a positive"):
        refuse_if_too_long(est, plan, max_minutes=0)


@pytest.mark.parametrize(("step_s", "shown"), [(0.556, "0.556 s"), (0.0123, "0.0123 s"), (45.26, "45.3 s"),
                                               (600.0, "10.0 min")])
def test_refusal_shows_the_step_time_it_estimated(step_s, shown):
    """The step time the refusal names is the estimate's own (0.556 s is not "about 1 s")."""
    est = WallEstimate(startup_s=7.0, calibration_s=1.0, step_s=step_s, steps=100_000, time_scale=1.0,
                       cpu_flops_s=5e10, iteration_s=step_s)
    with pytest.raises(ConfigError) as err:
        refuse_if_too_long(est, None, max_minutes=5)
    msg = str(err.value)
    assert f"takes about {shown})" in msg or f"one step alone takes {shown};" in msg, msg
    assert f"x {step_s:.3g} s:" in msg  # the same figure in the breakdown


@pytest.fixture(scope="module")
def gpt2_small_homelab(tmp_path_factory):
    """The issue's case: gpt2-small planned on the full-size home lab (runs for hours emulated on a CPU)."""
    from hetpipe.cli import app

    path = tmp_path_factory.mktemp("gpt2") / "plan.json"
    assert app.main(["plan", "gpt2-small", "--cluster", "examples/clusters/homelab.yaml", "-o", str(path)]) == 0
    return path


def test_cli_prints_the_estimate_and_refuses_before_launch(gpt2_small_homelab, tmp_path, capsys):
    from hetpipe.cli import app

    capsys.readouterr()
    rc = app.main(["run", str(gpt2_small_homelab), "--model", "gpt2-small", "--steps", "3", "--emulate",
                   "--max-minutes", "1", "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "estimated wall time: at least" in out
    assert err.startswith("error: --max-minutes 1: the emulated run needs at least") and err.count("\n") == 1
    assert "not --steps: one step alone takes" in err and "--global-batch" in err and "to allow it" in err
    assert not (tmp_path / "run").exists()  # nothing was launched
