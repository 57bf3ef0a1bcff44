"""Issue 17, item 1: the objective is the schedule the runtime runs, optimizer step included.

* `replay_iteration_s` (what `evaluate` calls) equals the event simulator on random stages;
* the optimizer step's bytes per parameter and its time (`cost_models.optimizer_step`);
* every plan's T is its simulation, to float noise, on random instances with slow links (the
  issue's goal: within 2%), and never slower than the H-1F1B estimate's own answer simulated;
* plans record the objective (version 4) and `check` re-derives it; a version-3 plan (estimate)
  still loads and checks with its own objective.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from hetpipe.cost_models.optimizer_step import step_time_s, step_traffic_bytes_per_param
from hetpipe.errors import ConfigError
from hetpipe.partitioner.placement import simulate_placement
from hetpipe.partitioner.problem import evaluate
from hetpipe.partitioner.solvers.solve import solve, solve_estimate
from hetpipe.plan.check import check_plan
from hetpipe.plan.schema import Plan
from hetpipe.schedule.replay import replay_iteration_s
from hetpipe.schedule.simulate import SimCosts, simulate_stages
from tests.instances import random_problem
from tests.plan_docs import as_memory_model_4

#: Float noise between two evaluations of the same max-plus recurrence.
NOISE = 1e-9


def test_replay_equals_the_event_simulator_on_random_stages() -> None:
    rng = random.Random(17)
    for _ in range(500):
        p, m, name = rng.randint(1, 6), rng.randint(1, 12), rng.choice(("1f1b", "gpipe"))
        f = [rng.uniform(0.0, 1.0) for _ in range(p)]
        b = [rng.uniform(0.0, 2.0) for _ in range(p)]
        c = [rng.choice((0.0, rng.uniform(0.0, 3.0))) for _ in range(p - 1)]
        s = [rng.uniform(0.0, 1.0) for _ in range(p)]
        want = simulate_stages(SimCosts(tuple(f), tuple(b), tuple(c), tuple(s)), m, schedule=name).iteration_s
        assert replay_iteration_s(name, p, m, fwd_s=f, bwd_s=b, send_s=c, step_s=s) == want


def test_optimizer_step_bytes_and_time() -> None:
    # Adam fp32: read p, g, m, v (16 B), write p, m, v (12 B); mixed: fp32 master, bf16 grad, + bf16 copy
    assert step_traffic_bytes_per_param("adam", "fp32") == 16 + 12
    assert step_traffic_bytes_per_param("adamw", "bf16-mixed") == (4 + 2 + 8) + (4 + 8 + 2)
    assert step_traffic_bytes_per_param("sgd", "fp32") == 8 + 4
    assert step_traffic_bytes_per_param("momentum", "fp32") == 12 + 8
    # 124M parameters of Adam on a 1008 GB/s card at 0.8 of peak: 124e6 * 28 / 806.4e9 = 4.3 ms + 8 launches
    t = step_time_s(params=124_000_000, optimizer="adam", precision="fp32", memory_bandwidth_bytes_s=1008e9,
                    bandwidth_efficiency=0.8, kernel_overhead_s=5e-6)
    assert t == pytest.approx(124e6 * 28 / (1008e9 * 0.8) + 8 * 5e-6, rel=1e-12)
    with pytest.raises(ConfigError, match="unknown optimizer 'lamb'"):
        step_traffic_bytes_per_param("lamb", "fp32")


@pytest.mark.parametrize("seed", range(3))
def test_every_plan_predicts_its_simulation_on_slow_links(seed: int) -> None:
    rng = random.Random(seed)
    checked = 0
    for i in range(40):
        prob = random_problem(rng, units=rng.randint(2, 7), devices=rng.randint(1, 4),
                              microbatches=rng.randint(1, 12), objective="schedule")
        slow = rng.choice((1.0, 10.0, 100.0))  # links up to 100x slower: the regime the estimate misses
        prob = dataclasses.replace(prob, bandwidth_bytes_s=tuple(tuple(b / slow for b in row)
                                                                 for row in prob.bandwidth_bytes_s))
        sol = solve(prob)
        simulated = simulate_placement(prob, sol.stages).iteration_s
        assert sol.iteration_s == pytest.approx(simulated, rel=NOISE), (seed, i)  # the goal asks 2%
        assert sol.bound_s <= sol.iteration_s * (1 + NOISE)
        # the old objective's own answer, simulated, is never better than the new plan
        old = solve_estimate(dataclasses.replace(prob, objective="estimate"))
        assert simulate_placement(prob, old.stages).iteration_s >= sol.iteration_s * (1 - NOISE), (seed, i)
        checked += 1
    assert checked == 40


def _plan() -> Plan:
    from hetpipe.models import build
    from hetpipe.plan.build import partition

    model, inputs = build("gpt-tiny", device="meta", batch=2, seq=16)
    return partition(model, "examples/clusters/homelab-mini.yaml", example_inputs=inputs, global_batch=8,
                     time_limit_s=5.0)


def test_plan_records_the_schedule_objective_and_check_rederives_it() -> None:
    plan = _plan()
    assert plan.version == 9 and plan.objective == "schedule"  # 4: the objective; 9: step tables
    assert all(st.step_s > 0 for st in plan.stages)  # every stage holds parameters: Adam steps them
    assert plan.predicted.iteration_s == pytest.approx(plan.predicted.simulated_iteration_s, rel=NOISE)
    assert plan.predicted.t_1f1b_estimate_s > 0 and plan.solver.objective_s == plan.predicted.iteration_s
    report = check_plan(plan)
    assert report.ok and report.objective == "schedule", report
    edited = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], step_s=0.0), *plan.stages[1:]))
    assert any("step_s" in v for v in check_plan(edited).violations)


def test_a_version_3_plan_checks_with_its_own_objective(tmp_path) -> None:
    plan = _plan()
    doc = as_memory_model_4(plan.to_dict())  # without memory model 5's step tables (version 9)
    # a version-3 file: no objective, no step tables, T = the H-1F1B estimate
    doc["version"] = 3
    for key in ("objective", "step_launch_s"):
        doc.pop(key, None)
    for unit in doc["units"]:
        for times in unit["time_s"].values():
            times.pop("step", None)
    for st in doc["stages"]:
        st.pop("step_s", None)
    estimate = doc["predicted"].pop("t_1f1b_estimate_s")
    doc["predicted"]["iteration_s"] = doc["solver"]["objective_s"] = estimate
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(doc))
    old = Plan.load(path)
    report = check_plan(old)
    assert old.objective_name == "estimate" and report.objective == "estimate"
    assert [v for v in report.violations if "iteration_s" in v or "objective_s" in v] == [], report
    assert math.isclose(report.iteration_s, estimate, rel_tol=NOISE)
    assert evaluate(*_problem_and_stages(old)).objective == "estimate"


def _problem_and_stages(plan: Plan):
    from hetpipe.plan.schema import problem_from_plan, stages_from_plan

    return problem_from_plan(plan), stages_from_plan(plan)


def test_a_faster_recorded_baseline_is_adopted() -> None:
    from hetpipe.partitioner.problem import Stage
    from hetpipe.partitioner.solvers.solve import solve_fixed
    from hetpipe.plan.adopt import adopt_faster_baselines
    from hetpipe.plan.schema import BaselineReport, BaselineStage, BestBaselineReport

    rng = random.Random(5)
    prob = random_problem(rng, units=6, devices=3, microbatches=8, objective="schedule")
    good = solve(prob)
    worst = max(((Stage(d, 0, 5),) for d in range(3)), key=lambda st: evaluate(prob, st).iteration_s)
    slow = dataclasses.replace(solve_fixed(prob, worst), bound_s=good.bound_s)
    assert slow.iteration_s > good.iteration_s
    rec = tuple(BaselineStage(prob.devices[s.device].id, s.first_unit, s.last_unit) for s in good.stages)
    base = {"uniform": BaselineReport(1.0, True, "", BestBaselineReport(good.iteration_s, True, "exact", rec, ""))}
    adopted = adopt_faster_baselines(prob, slow, base, limit_s=1.0)
    assert adopted.iteration_s <= good.iteration_s * (1 + NOISE)
    assert adopted.iteration_s == pytest.approx(evaluate(prob, adopted.stages).iteration_s, rel=NOISE)
