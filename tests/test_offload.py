"""The optimizer-offload lever: DP (with its outer tail walk) == CP-SAT == brute force over
placements x recompute x offload, including instances only offloading makes fit."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from hetpipe.cost_models.offload import offload_rates, offload_tail_s
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate, stage_memory_bytes
from hetpipe.partitioner.solvers.dp import solve_exact
from hetpipe.partitioner.solvers.offload_walk import tail_walk
from hetpipe.partitioner.solvers.solve import solve
from tests.instances import assert_solvers_match_brute_force, brute_force, random_problem, with_offload

REL = 1e-9


def _close(a: float, b: float, rel: float = REL) -> bool:
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


def _exact(prob: Problem):
    return tail_walk(prob, lambda p, _: solve_exact(p))


@pytest.mark.parametrize("recompute,mode", [("none", "auto"), ("auto", "auto"), ("none", "all"), ("auto", "all")])
def test_offload_lever_dp_and_cpsat_equal_brute_force(recompute: str, mode: str) -> None:
    rng = random.Random(714)
    used = only_with = 0
    for i in range(48):  # 48, not 40, since the instances carry backward transients (fewer offload to fit)
        base = random_problem(rng, units=rng.randint(1, 5), devices=rng.randint(1, 3), tight_memory=True,
                              recompute=recompute, activation_max=20)
        prob = with_offload(rng, base, mode)
        exact = _exact(prob)
        if not assert_solvers_match_brute_force(prob, exact, i):
            continue
        used += any(st.offload for st in exact.stages)
        only_with += math.isinf(brute_force(replace(prob, offload="never")))
    assert used >= 8 and (mode == "all" or only_with >= 3), (used, only_with)


def test_auto_never_slower_than_never_and_equal_when_memory_is_ample() -> None:
    rng = random.Random(5)
    for _ in range(30):
        base = random_problem(rng, units=rng.randint(2, 6), devices=rng.randint(1, 3), tight_memory=True,
                              recompute="auto", activation_max=20)
        prob = with_offload(rng, base, "auto")
        auto, never = _exact(prob), solve_exact(replace(prob, offload="never"))
        if never is not None:
            assert auto is not None and auto.iteration_s <= never.iteration_s * (1 + 1e-9)
        roomy = replace(prob, devices=tuple(replace(d, usable_bytes=10**6) for d in prob.devices))
        a, n = _exact(roomy), solve_exact(replace(roomy, offload="never"))
        assert _close(a.iteration_s, n.iteration_s) and not any(st.offload for st in a.stages)


def test_contract_terms_by_hand() -> None:
    """M_s drops by P * host bytes; T_est gains max_s O_s; in the schedule T each offloading stage's step
    is its O_s (fp32 Adam: 8 of 16 bytes per parameter)."""
    rates = offload_rates("adam", "fp32")
    dev = DeviceSlot("d0", "a", "n", 10**6, 32e9, 51.2e9)
    prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(16_000, 32_000),
                   activation_bytes=(0, 0), boundary_bytes=(0, 0), grad_bytes=(4_000, 8_000),
                   devices=(dev, replace(dev, id="d1")), bandwidth_bytes_s=((1.0, 1e9), (1e9, 1.0)),
                   latency_s=((0.0, 0.0), (0.0, 0.0)), microbatches=2, offload="auto", offload_rates=rates)
    plain = (Stage(0, 0, 0), Stage(1, 1, 1))
    both = (Stage(0, 0, 0, offload=True), Stage(1, 1, 1, offload=True))
    assert stage_memory_bytes(prob, plain, 1) - stage_memory_bytes(prob, both, 1) == 2_000 * 8
    tail = offload_tail_s(2_000, rates, host_link_bytes_s=32e9, host_memory_bytes_s=51.2e9)
    assert _close(evaluate(prob, both).estimate_s - evaluate(prob, plain).estimate_s, tail)
    assert _close(evaluate(prob, both).tail_s, tail)
    # the schedule: stage 0's last backward ends at 9 s, then its step O_0 (1,000 parameters); stage 1's
    # ends at 7 s and its O_1 (2,000 parameters) is over long before
    o_0 = offload_tail_s(1_000, rates, host_link_bytes_s=32e9, host_memory_bytes_s=51.2e9)
    assert [c.step_s for c in evaluate(prob, both).stages] == [o_0, tail]
    assert _close(evaluate(prob, both).iteration_s, 9.0 + o_0) and evaluate(prob, plain).iteration_s == 9.0


def test_solve_plans_only_offload_makes_fit() -> None:
    """One card, too small for the fp32 Adam state: `solve` offloads, `never` is infeasible."""
    rates = offload_rates("adam", "fp32")
    prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(160, 160),
                   activation_bytes=(1, 1), boundary_bytes=(1, 0), grad_bytes=(40, 40),
                   devices=(DeviceSlot("d0", "a", "n", 200, 80.0, 280.0),), bandwidth_bytes_s=((1.0,),),
                   latency_s=((0.0,),), microbatches=1, offload="auto", offload_rates=rates)
    sol = solve(prob)  # the schedule: one stage, its step is O_s after its last backward
    assert sol.stages[0].offload and _close(sol.iteration_s, 6.0 + 20 * (8 / 80 + 28 / 280))
    # the schedule bound counts each unit's least step, here the free on-card one (memory is not in it)
    assert sol.status == "FEASIBLE" and sol.bound_s == 6.0
    est = solve(replace(prob, objective="estimate"))  # the estimate's DP + tail walk proves it
    assert est.status == "OPTIMAL" and _close(est.iteration_s, sol.iteration_s) and est.stages == sol.stages
    from hetpipe.errors import InfeasibleError
    with pytest.raises(InfeasibleError):
        solve(replace(prob, offload="never"))


SMALL_LAB = "examples/clusters/smalllab-mini.yaml"


def _plan(tmp_path, capsys, *flags: str) -> tuple[int, str]:
    from hetpipe.cli import app

    out = tmp_path / "plan.json"
    rc = app.main(["plan", "gpt-demo", "--cluster", SMALL_LAB, "--batch", "1", "--seq", "32", "--global-batch", "4",
                   "--recompute", "none", "-o", str(out), *flags])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_cli_plans_with_offload_writes_version_4_and_check_and_show_agree(tmp_path, capsys):
    from hetpipe.cli import app
    from hetpipe.plan.check import check_plan
    from hetpipe.plan.schema import Plan

    rc, text = _plan(tmp_path, capsys)  # --offload never (the default): the state does not fit
    assert rc == 2 and "no plan fits" in text
    rc, text = _plan(tmp_path, capsys, "--offload", "auto")
    assert rc == 0, text
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.version >= 4 and any(st.offload for st in plan.stages)  # 8 with the loss's transient
    assert all(d.host_link_bytes_s == 32e6 and d.host_memory_bytes_s == 51.2e6 for d in plan.devices)
    assert check_plan(plan).ok
    st = next(st for st in plan.stages if st.offload)
    assert st.offload_bytes > 0 and st.offload_s > 0
    assert app.main(["show", str(tmp_path / "plan.json")]) == 0
    assert "offload -" in capsys.readouterr().out
    # tampering: a stage that does not offload under the recorded 'auto' would not fit -> check says so
    bad = replace(plan, stages=tuple(replace(s, offload=False) for s in plan.stages))
    assert not check_plan(bad).ok
    never = replace(plan, cost_model={k: v for k, v in plan.cost_model.items() if k != "offload"})
    assert any("setting is 'never'" in v for v in check_plan(never).violations)


def test_offload_option_errors_are_one_line(tmp_path, capsys):
    rc, text = _plan(tmp_path, capsys, "--offload", "yes")
    assert rc == 2 and "offload (--offload): 'yes' is not a setting" in text


def test_cluster_host_figures_default_to_pcie_and_ddr4_and_are_validated():
    from hetpipe.cost_models.cluster import cluster_from_dict
    from hetpipe.cost_models.offload import HOST_MEMORY_BYTES_S
    from hetpipe.errors import ConfigError

    doc = {"nodes": [{"name": "a", "devices": [{"gpu": "rtx3090"}, {"gpu": "rtx3090", "pcie_bandwidth": "16GB/s"}]}]}
    c = cluster_from_dict(doc)
    assert [d.host_link_bytes_s for d in c.devices] == [32e9, 16e9]
    assert all(d.host_memory_bytes_s == HOST_MEMORY_BYTES_S for d in c.devices)
    doc["nodes"][0]["host_link"] = "12GB/s"
    assert {d.host_link_bytes_s for d in cluster_from_dict(doc).devices} == {12e9}
    doc["nodes"][0]["host_link"] = "-3GB/s"
    with pytest.raises(ConfigError, match="host_link"):
        cluster_from_dict(doc)


@pytest.mark.parametrize("seed", range(6))
def test_offloading_a_stage_changes_only_its_memory_and_the_tail(seed):
    """On random placements: offloading stage s lowers its M_s by P_s * host bytes and nothing else's;
    T rises by exactly max_s O_s over the offloading stages (the contract's `step_tail_s`)."""
    from hetpipe.partitioner.problem import can_offload, offload_if, stage_params
    from tests.instances import TEST_RATES, all_placements

    rng = random.Random(seed)
    prob = with_offload(rng, random_problem(rng, units=4, devices=3), "auto")
    for placement in list(all_placements(prob))[::7]:
        plain = evaluate(prob, placement)
        for s, st in enumerate(placement):
            if not can_offload(prob, st):
                continue
            moved = tuple(replace(x, offload=(k == s)) for k, x in enumerate(placement))
            ev = evaluate(prob, moved)
            for k in range(len(placement)):
                drop = stage_params(prob, st) * TEST_RATES.host_bytes_per_param if k == s else 0
                assert plain.stages[k].memory_bytes - ev.stages[k].memory_bytes == drop
            assert _close(ev.iteration_s - plain.iteration_s, offload_if(prob, st).tail_s, 1e-9)


@pytest.mark.parametrize("mode", ["auto", "all"])
def test_solve_brackets_the_enumerated_schedule_optimum_with_offload(mode: str) -> None:
    """Under the schedule objective an offloading stage's step is its O_s: `evaluate` equals the event
    simulator with those steps, and `solve`'s bound <= the enumerated optimum <= its answer."""
    from hetpipe.errors import InfeasibleError
    from hetpipe.partitioner.placement import simulate_placement
    from tests.instances import all_placements, recompute_choices

    rng = random.Random(1417)
    used = 0
    for i in range(40):
        base = random_problem(rng, units=rng.randint(1, 4), devices=rng.randint(1, 3), tight_memory=True,
                              recompute=rng.choice(("none", "auto")), activation_max=20, objective="schedule")
        prob = with_offload(rng, base, mode)
        best = math.inf
        for placement in all_placements(prob):
            for choice in recompute_choices(prob, placement):
                ev = evaluate(prob, choice)
                assert _close(ev.iteration_s, simulate_placement(prob, choice).iteration_s, 1e-9), (i, choice)
                if ev.fits:
                    best = min(best, ev.iteration_s)
        if math.isinf(best):
            with pytest.raises(InfeasibleError):
                solve(prob)
            continue
        sol = solve(prob)
        assert evaluate(prob, sol.stages).fits and _close(evaluate(prob, sol.stages).iteration_s, sol.iteration_s)
        assert sol.bound_s <= best * (1 + REL) and best <= sol.iteration_s * (1 + REL), (i, sol, best)
        assert (sol.status == "OPTIMAL") == (sol.bound_s >= sol.iteration_s * (1 - 1e-9)), (i, sol)
        used += any(st.offload for st in sol.stages)
    assert used >= 5, used
