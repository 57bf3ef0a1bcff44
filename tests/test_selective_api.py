"""The selective recompute level wherever a user picks levers (issue 14): the Python API, ``--recompute selective``.

* `hetpipe.partition(recompute="auto")` offers the level through the CLI's code path
  (`plan.selective_plan.offer_for_options`) and returns the CLI's plan (gpt-tiny on two tight cards,
  tests/test_selective_cli.py's cluster);
* ``recompute="selective"`` forces the level on every stage, no whole unit (`partitioner.selective_mode`):
  the API and the CLI agree, `check` (and `check --model`) verify it, `show` prints it, and every solver
  equals brute-force enumeration of the forced contract; combinations the level is not priced for are
  one `error:` line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from hetpipe.cli.app import main
from hetpipe.errors import ConfigError
from hetpipe.partitioner.problem import evaluate
from hetpipe.partitioner.selective_mode import forced_problem, lift
from hetpipe.plan.check import check_plan
from hetpipe.plan.schema import Plan
from tests.instances import brute_force, close, selective_instance
from tests.test_selective_cli import tight_cluster


def _api_plan(cluster, recompute: str) -> Plan:
    """gpt-tiny through `hetpipe.partition`, captured as `hetpipe plan gpt-tiny` captures it (its loss costed)."""
    import hetpipe
    from hetpipe.models import build, training_loss

    model, inputs = build("gpt-tiny", device="meta")
    fn, targets = training_loss("gpt-tiny", inputs)
    return hetpipe.partition(model, cluster, example_inputs=inputs, name="gpt-tiny", loss_fn=fn, targets=targets,
                             solver="dp", recompute=recompute)


def _levers(plan: Plan) -> tuple:
    """What a plan decides: T, every stage's card, units and levers, and the recorded level."""
    return (plan.predicted.iteration_s, plan.model.fingerprint, plan.selective,
            tuple((s.device, s.first_unit, s.last_unit, s.recompute_units, s.offload, s.selective, s.memory_bytes)
                  for s in plan.stages))


def _cli_plan(tmp_path, cluster, recompute: str) -> tuple[Plan, str]:
    out = tmp_path / f"cli-{recompute}.json"
    assert main(["plan", "gpt-tiny", "--cluster", str(cluster), "--solver", "dp", "--recompute", recompute,
                 "-o", str(out)]) == 0
    return Plan.load(out), str(out)


@pytest.mark.parametrize("recompute, mb", [("auto", 7), ("selective", 8)])  # forced, 7 MB cards do not fit
def test_the_api_returns_the_cli_plan(tmp_path, capsys, recompute, mb):
    cluster = tight_cluster(tmp_path / "tight.yaml", mb)
    cli, path = _cli_plan(tmp_path, cluster, recompute)
    shown = capsys.readouterr().out
    api = _api_plan(cluster, recompute)
    assert _levers(api) == _levers(cli)
    assert api.selective is not None and check_plan(api).ok
    api.save(tmp_path / "api.json")
    assert main(["check", str(tmp_path / "api.json"), "--model", "gpt-tiny", "--cluster", str(cluster)]) == 0
    if recompute == "auto":  # the level where it is worth it: the first stage only (tests/test_selective_cli.py)
        assert [st.selective for st in api.stages] == [True, False]
        return
    assert all(st.selective and not st.recompute_units for st in api.stages)
    assert api.cost_model["recompute"].startswith("selective:") and api.version == 9
    assert "recompute selective" in shown and "selective -" in shown  # the table's title and levers column
    assert main(["check", path]) == 0
    assert main(["show", path]) == 0 and "recompute selective" in capsys.readouterr().out
    doc = json.loads(open(path).read())
    doc["stages"][1]["selective"] = False  # a stage that skips the forced level is caught
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert main(["check", str(bad)]) == 1
    assert "stage 1: selective is False, but recompute selective chooses True" in capsys.readouterr().out


def test_forcing_the_level_costs_time_where_auto_would_not_run_it(tmp_path):
    """On roomy cards auto runs nothing; forced, every stage pays its re-run nodes (T up) and holds less
    activation memory per stage that frees something."""
    cluster = tight_cluster(tmp_path / "roomy.yaml", 8)
    auto, forced = _api_plan(cluster, "auto"), _api_plan(cluster, "selective")
    assert not any(st.selective for st in auto.stages) and all(st.selective for st in forced.stages)
    assert forced.predicted.iteration_s > auto.predicted.iteration_s
    assert check_plan(forced).ok


@pytest.mark.parametrize("flags, words", [
    (["--tensor-parallel", "auto"], "'selective' with --tensor-parallel auto"),
    (["--schedule", "zb-h1"], "'selective' with --schedule zb-h1"),
    (["--schedule", "interleaved:2"], "'selective' with --schedule interleaved:2"),
    (["--replicas", "2"], "'selective' with --replicas 2"),
])
def test_combinations_the_level_is_not_priced_for_are_one_error_line(tmp_path, capsys, flags, words):
    cluster = tight_cluster(tmp_path / "tight.yaml", 6)
    assert main(["plan", "gpt-tiny", "--cluster", str(cluster), "--recompute", "selective", *flags,
                 "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: recompute (--recompute): ") and words in err and "use " in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "p.json").exists()


def test_a_model_without_the_level_is_refused():
    from hetpipe.models import build
    import hetpipe

    model, inputs = build("mlp-tiny", device="meta", batch=2)  # Linear + ReLU: nothing the level drops
    with pytest.raises(ConfigError, match="offers no selective level"):
        hetpipe.partition(model, "examples/clusters/homelab.yaml", example_inputs=inputs, global_batch=8,
                          recompute="selective")


def test_every_solver_on_the_forced_level_equals_brute_force():
    """The exact DP, CP-SAT and `solve` on `forced_problem`, lifted, and `solve` on the forced problem itself,
    against enumeration of placements with the level forced on every stage (tests/instances.py: no reduction)."""
    from hetpipe.partitioner.solvers.cpsat import solve_cpsat
    from hetpipe.partitioner.solvers.dp import solve_exact
    from hetpipe.partitioner.solvers.offload_walk import tail_walk
    from hetpipe.partitioner.solvers.solve import solve

    rng = random.Random(1416)
    fitted = differs = 0
    for i in range(40):
        prob = selective_instance(rng, i, recompute="selective")
        ref, reduced = brute_force(prob), forced_problem(prob)
        dp = tail_walk(reduced, lambda p, _: solve_exact(p))  # the offload lever's outer walk, as `solve` runs it
        cp = solve_cpsat(reduced, time_limit_s=20.0, seed=0)
        if math.isinf(ref):
            assert dp is None and cp.status == "INFEASIBLE", (i, dp, cp)
            continue
        assert cp.status == "OPTIMAL" and cp.bound_s <= ref * (1 + 1e-9), (i, cp, ref)
        # CP-SAT too on the reduced problem of an offload instance (recompute none, offload auto): before session 14
        # its offload tail left out tied replicas' parameters and it said OPTIMAL above the optimum (case 0 here:
        # 113.14 against 112.12; tests/test_cpsat_offload_exact.py)
        for res in (dp, solve(reduced, solver="auto", time_limit_s=5.0, seed=0), cp):
            ev = evaluate(prob, lift(res.stages))  # priced on the forced problem: the level on every stage
            assert ev.fits and close(ev.iteration_s, res.iteration_s, 1e-9) and close(ev.iteration_s, ref, 1e-5)
        direct = solve(prob, solver="auto", time_limit_s=5.0, seed=0)  # `solve` passes the mode to the reduction
        assert all(st.selective and not st.recompute_units for st in direct.stages)
        assert close(evaluate(prob, direct.stages).iteration_s, ref, 1e-5), (i, direct, ref)
        fitted += 1
        differs += not close(ref, brute_force(dataclasses.replace(prob, recompute="auto")), 1e-9)
    assert fitted >= 20 and differs >= 3, (fitted, differs)  # forcing is a setting of its own, not auto's answer


def test_nothing_fits_forced_says_the_usable_memory_it_names_is_less_the_peak(tmp_path, capsys):
    from hetpipe.errors import InfeasibleError

    cluster = tight_cluster(tmp_path / "tight.yaml", 6)  # auto fits here with a whole unit too
    with pytest.raises(InfeasibleError, match=r"--recompute selective: the figures above are with the level on"):
        _api_plan(cluster, "selective")
    assert main(["plan", "gpt-tiny", "--cluster", str(cluster), "--recompute", "selective",
                 "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "less the level's peak" in err and "These settings fit" not in err


def test_replanning_a_forced_plan_keeps_the_level_on_every_stage(tmp_path):
    """`plan.replan` (a straggler's slowdown) solves the forced problem again: the level on every stage, its
    seconds on the slowed card's kind recorded (`replan.scale_device` scales them too), and `check` accepts
    the result."""
    from hetpipe.plan.replan import replan

    plan = _api_plan(tight_cluster(tmp_path / "roomy.yaml", 8), "selective")
    card = plan.stages[0].device
    new = replan(plan, slowdown={card: 1.5}, time_limit_s=5.0).plan
    assert all(st.selective and not st.recompute_units for st in new.stages)
    assert new.predicted.iteration_s > plan.predicted.iteration_s
    kinds = {d.kind for d in new.devices}
    assert all(set(u.time_s) == kinds for u in new.selective.units) and len(kinds) == 2
    assert check_plan(new).ok, check_plan(new).violations


def test_the_baselines_best_cards_are_priced_with_the_level_as_check_prices_them(tmp_path):
    """Under ``auto`` the baselines' best-card search (`partitioner.baseline_search`) chooses each stage's levers
    as `check` re-derives them (`choose_levers`, the level included): a slowed card's re-plan of gpt-tiny on the
    tight cards recorded a uniform baseline 0.7% slower than `check` recomputed before."""
    from hetpipe.plan.replan import replan

    plan = _api_plan(tight_cluster(tmp_path / "tight.yaml", 6), "auto")
    new = replan(plan, slowdown={plan.stages[0].device: 1.5}, time_limit_s=5.0).plan
    assert check_plan(new).ok, check_plan(new).violations
