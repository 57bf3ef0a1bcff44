"""Interleaved 1F1B over virtual stages (issue 17 item 2): builder, validator, replay == simulate, held moments."""

from __future__ import annotations

import dataclasses
import random

import pytest

from hetpipe.errors import ScheduleError
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.builders import format_grid, make_schedule, one_f_one_b, rank_actions
from hetpipe.schedule.held import replay_held
from hetpipe.schedule.held_virtual import INTERLEAVED_SEND_LAG, rank_held_terms, replay_held_by_stage
from hetpipe.schedule.interleaved import interleaved_1f1b
from hetpipe.schedule.replay import replay_iteration_s
from hetpipe.schedule.simulate import SimCosts, simulate, simulate_stages
from hetpipe.schedule.validate import validate_schedule

SIZES = [(1, 2, 1), (2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3), (3, 2, 6), (4, 2, 8), (4, 3, 4), (4, 4, 16)]


def test_hand_checked_grid() -> None:
    # p = 2, v = 2, m = 2: rank 0 runs virtual stages 0 and 2, rank 1 stages 1 and 3; forwards in
    # groups of p micro-batches per chunk, backwards with the chunks reversed (Megatron-LM's order)
    sched = interleaved_1f1b(2, 2, 2)
    assert [str(a) for a in sched[0] if a.op in (Op.F, Op.B)] == ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1",
                                                                   "0B0", "0B1"]
    assert [str(a) for a in sched[1] if a.op in (Op.F, Op.B)] == ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1",
                                                                   "1B0", "1B1"]
    assert format_grid(sched) == ("rank 0: F0 F1 F0 F1 .  B0 .  B1 B0 B1\n"
                                  "rank 1: .  F0 F1 F0 B0 F1 B1 B0 B1")
    assert sched[1][-1] == Action(1, Op.STEP) and make_schedule("interleaved:2", 2, 2) == sched
    assert rank_actions("interleaved:2", 2, 2, 1) == sched[1]


@pytest.mark.parametrize("p,v,m", SIZES)
def test_validator_accepts(p: int, v: int, m: int) -> None:
    sched = make_schedule(f"interleaved:{v}", p, m)
    validate_schedule(sched, num_stages=p, num_microbatches=m)
    validate_schedule(sched, num_stages=p, num_microbatches=m, chunks=v)


def test_one_chunk_is_one_f_one_b_order() -> None:
    # v = 1: warm-up 2 (p - r - 1) forwards, not p - r - 1, so only the order of the lists differs from
    # 1F1B's; both valid, and the iteration time of equal stages with free links is the same
    for p, m in ((2, 4), (3, 6)):
        validate_schedule(make_schedule("interleaved:1", p, m), num_stages=p, num_microbatches=m)
        costs = SimCosts(fwd_s=(1.0,) * p, bwd_s=(2.0,) * p, send_s=(0.0,) * (p - 1))
        assert simulate_stages(costs, m, schedule="interleaved:1").iteration_s == simulate(one_f_one_b(p, m), costs).iteration_s


@pytest.mark.parametrize("mutate,needle", [
    (lambda s: s[0].insert(0, s[0].pop(s[0].index(Action(2, Op.F, 0)))), "comes before"),  # chunk 1 before its input
    (lambda s: s[1].remove(Action(3, Op.B, 1)), "rank 1 has no 3B1"),
    (lambda s: s[0].__setitem__(0, Action(1, Op.F, 0)), "rank 0 runs stages [0, 2] only"),
    (lambda s: s[1].append(Action(3, Op.SEND_F, 0)), "no next stage"),
])
def test_validator_rejects_corrupted(mutate, needle: str) -> None:
    sched = interleaved_1f1b(2, 2, 2)
    mutate(sched)
    with pytest.raises(ScheduleError, match="invalid schedule") as err:
        validate_schedule(sched, num_stages=2, num_microbatches=2)
    assert needle in str(err.value)


def test_validator_rejects_fifo_swap_and_deadlock() -> None:
    sched = interleaved_1f1b(2, 2, 2)
    i, j = sched[0].index(Action(2, Op.RECV_F, 0)), sched[0].index(Action(2, Op.RECV_F, 1))
    sched[0][i:j + 3] = sched[0][j:j + 3] + sched[0][i:j]  # chunk 1 takes micro-batch 1 before 0
    with pytest.raises(ScheduleError, match="link 1->2 .* FIFO channel: message #0 is micro-batch 0"):
        validate_schedule(sched, num_stages=2, num_microbatches=2)
    sched = interleaved_1f1b(2, 2, 2)  # rank 0 waits for chunk 1's input before sending chunk 0's outputs
    sends = [Action(0, Op.SEND_F, 0), Action(0, Op.SEND_F, 1)]
    sched[0] = [a for a in sched[0] if a not in sends]
    at = sched[0].index(Action(2, Op.F, 0)) + 1
    sched[0][at:at] = sends
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(sched, num_stages=2, num_microbatches=2)


def test_microbatches_must_be_a_multiple_of_ranks() -> None:
    with pytest.raises(ScheduleError, match="multiple of the 2 ranks.*use 2 or 4 micro-batches"):
        make_schedule("interleaved:2", 2, 3)
    with pytest.raises(ScheduleError, match="interleaved:2"):
        make_schedule("interleaved:x", 2, 2)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (2, 2, 8), (3, 2, 6), (4, 2, 8), (4, 4, 8), (3, 3, 9), (4, 3, 12)])
def test_bubble_is_one_over_v(p: int, v: int, m: int) -> None:
    # Narayanan et al. 2021: equal stages, free links: T = m (f + b) + (p - 1) (f + b) / v for a rank's
    # whole slice f + b, i.e. the 1F1B bubble (p - 1)(f + b) shrunk by v
    f, b = 1.0, 2.0
    virtual = p * v
    costs = SimCosts(fwd_s=(f / v,) * virtual, bwd_s=(b / v,) * virtual, send_s=(0.0,) * (virtual - 1))
    res = simulate_stages(costs, m, schedule=f"interleaved:{v}")
    assert res.iteration_s == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v, rel=1e-12)
    assert res.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)
    plain = simulate_stages(SimCosts(fwd_s=(f,) * p, bwd_s=(b,) * p, send_s=(0.0,) * (p - 1)), m)
    assert plain.iteration_s == pytest.approx(m * (f + b) + (p - 1) * (f + b), rel=1e-12)


def test_wrap_around_uses_the_link_back_to_rank_0() -> None:
    # p = 2, v = 2: cut 1 (virtual stage 1 on rank 1 -> stage 2 on rank 0) is the wrap-around; its
    # activations share the direction 1 -> 0 with the gradients of cuts 0 and 2
    costs = SimCosts(fwd_s=(1.0,) * 4, bwd_s=(1.0,) * 4, send_s=(0.0, 5.0, 0.0))
    res = simulate_stages(costs, 2, schedule="interleaved:2")
    back = [e.action for e in res.events if e.lane == "link 1->0"]
    assert {"1SEND_F0", "1SEND_F1", "1SEND_B0", "3SEND_B0", "3SEND_B1"} <= set(back)
    assert res.iteration_s > simulate_stages(SimCosts((1.0,) * 4, (1.0,) * 4, (0.0, 0.0, 0.0)), 2,
                                             schedule="interleaved:2").iteration_s + 5.0


def test_replay_equals_simulate_on_random_instances() -> None:
    rnd = random.Random(17)
    for _ in range(150):
        p, v = rnd.randint(1, 4), rnd.randint(1, 3)
        m, virtual = p * rnd.randint(1, 3), p * v
        costs = SimCosts(fwd_s=tuple(rnd.uniform(0.1, 2.0) for _ in range(virtual)),
                         bwd_s=tuple(rnd.uniform(0.1, 3.0) for _ in range(virtual)),
                         send_s=tuple(rnd.choice((0.0, rnd.uniform(0.0, 3.0))) for _ in range(virtual - 1)),
                         step_s=tuple(rnd.uniform(0.0, 1.0) for _ in range(virtual)))
        name = f"interleaved:{v}"
        want = simulate_stages(costs, m, schedule=name).iteration_s
        got = replay_iteration_s(name, p, m, fwd_s=costs.fwd_s, bwd_s=costs.bwd_s, send_s=costs.send_s,
                                 step_s=costs.step_s)
        assert got == want, (p, v, m, costs)


def test_held_one_chunk_equals_replay_held() -> None:
    for name, p, m in (("1f1b", 3, 5), ("zb-h1", 3, 4), ("gpipe", 2, 3), ("interleaved:1", 3, 6)):
        for r in range(p):
            actions = rank_actions(name, p, m, r)
            for prefetch in (0, 3):
                by_stage = replay_held_by_stage(actions, stages=(r,), prefetch=prefetch)
                assert [t[0] for t in by_stage] == replay_held(actions, prefetch=prefetch)


def test_held_moments_sum_the_chunks() -> None:
    # p = 2, v = 2, m = 4: rank 0's warm-up is 2 (p - 1) + (v - 1) p = 4 forwards: micro-batches 0, 1 of
    # chunk 0 and 0, 1 of chunk 1 (virtual stage 2) are in flight before any backward
    terms = rank_held_terms(2, 0, 2, 4, prefetch=0)
    peak = max(sum(c.microbatches for c in t) for t in terms)
    assert peak == 5  # the 5th forward (chunk 0, micro-batch 2) comes before the first backward
    assert all(len(t) == 2 and t[0].in_frames == 0 == t[0].in_grad_frames for t in terms)
    last = rank_held_terms(2, 1, 2, 4, prefetch=0)
    assert all(t[1].out_frames == 0 == t[1].out_grad_frames for t in last)  # virtual stage 3 is the last


# ----------------------------------------------------------------------------- the contract (Problem/evaluate)

from hetpipe.cost_models.chunk_memory import ChunkTerms, pipeline_rank_bytes  # noqa: E402
from hetpipe.cost_models.stage_memory import HeldCounts, pipeline_stage_bytes  # noqa: E402
from hetpipe.partitioner.interleave import price_interleaved  # noqa: E402
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate, stage_memory_terms  # noqa: E402


def _problem(schedule: str = "1f1b", m: int = 4) -> Problem:
    rnd = random.Random(5)
    n = 10
    devs = (DeviceSlot("fast", "a", "n0", 10**9), DeviceSlot("slow", "b", "n1", 10**9))
    return Problem(fwd_s={"a": tuple(rnd.uniform(0.5, 1.5) for _ in range(n)),
                          "b": tuple(rnd.uniform(1.0, 3.0) for _ in range(n))},
                   bwd_s={"a": tuple(rnd.uniform(1.0, 3.0) for _ in range(n)),
                          "b": tuple(rnd.uniform(2.0, 6.0) for _ in range(n))},
                   state_bytes=tuple(rnd.randint(100, 900) for _ in range(n)),
                   activation_bytes=tuple(rnd.randint(10, 90) for _ in range(n)),
                   boundary_bytes=tuple(rnd.randint(4, 40) for _ in range(n - 1)) + (0,),
                   grad_bytes=tuple(rnd.randint(10, 90) for _ in range(n)), devices=devs,
                   bandwidth_bytes_s=((1.0, 20.0), (5.0, 1.0)), latency_s=((0.0, 0.1), (0.3, 0.0)),
                   microbatches=m, schedule=schedule)


VIRTUAL = (Stage(0, 0, 2), Stage(1, 3, 4), Stage(0, 5, 7), Stage(1, 8, 9))


def test_evaluate_replays_the_interleaved_lists() -> None:
    prob = _problem("interleaved:2")
    ev = evaluate(prob, VIRTUAL)
    # C of each virtual cut over its own link: 1 -> 0 for the wrap-around cut after unit 4
    assert ev.stages[1].send_s == pytest.approx(0.3 + prob.boundary_bytes[4] / 5.0)
    assert ev.stages[0].send_s == pytest.approx(0.1 + prob.boundary_bytes[2] / 20.0)
    costs = SimCosts(fwd_s=tuple(c.fwd_s for c in ev.stages), bwd_s=tuple(c.bwd_s for c in ev.stages),
                     send_s=tuple(c.send_s for c in ev.stages[:-1]), step_s=tuple(c.step_s for c in ev.stages))
    assert ev.iteration_s == simulate_stages(costs, 4, schedule="interleaved:2").iteration_s


def test_rank_memory_is_the_largest_sum_over_its_chunks() -> None:
    prob = _problem("interleaved:2")
    ev = evaluate(prob, VIRTUAL)
    for rank in (0, 1):
        mine = (rank, rank + 2)
        terms = [stage_memory_terms(prob, VIRTUAL, k) for k in mine]
        moments = replay_held_by_stage(rank_actions("interleaved:2", 2, 4, rank), stages=mine, prefetch=3,
                                       send_lag=INTERLEAVED_SEND_LAG)
        fixed = sum(t.state_bytes - t.grad_bytes for t in terms)
        # every moment of the full replay, none inside a backward (no recompute), first/last cuts dropped
        brute = max(sum(t.moment_bytes(HeldCounts(c.grads, c.microbatches,
                                                   c.in_frames if k else 0, c.in_grad_frames if k else 0,
                                                   c.out_frames if k != 3 else 0, c.out_grad_frames if k != 3 else 0))
                        for t, c, k in zip(terms, moment, mine))
                    for moment in moments if not any(c.backward for c in moment))
        assert ev.stages[rank].memory_bytes == ev.stages[rank + 2].memory_bytes == fixed + brute


def test_one_chunk_rank_bytes_equal_stage_bytes() -> None:
    rnd = random.Random(3)
    for _ in range(50):
        held = [HeldCounts(rnd.randint(0, 1), rnd.randint(0, 4), rnd.randint(0, 3), rnd.randint(0, 2),
                           rnd.randint(0, 3), rnd.randint(0, 3), rnd.randint(0, 1)) for _ in range(5)]
        held.append(HeldCounts(1, 1))
        terms = ChunkTerms(state_bytes=5000, grad_bytes=rnd.randint(0, 999), activation_bytes=rnd.randint(50, 500),
                           in_bytes=rnd.randint(0, 99), out_bytes=rnd.randint(0, 99), in_grad_bytes=rnd.randint(0, 50),
                           out_grad_bytes=rnd.randint(0, 50), recompute_saved_bytes=rnd.choice((0, 20)),
                           recompute_peak_bytes=rnd.choice((0, 40)))
        assert pipeline_rank_bytes((terms,), [(c,) for c in held]) == pipeline_stage_bytes(**vars(terms), held=held)


def test_evaluate_refuses_chunks_off_their_rank() -> None:
    with pytest.raises(ValueError, match="not chunks of ranks"):
        evaluate(_problem("interleaved:2"), (Stage(0, 0, 2), Stage(1, 3, 4), Stage(1, 5, 7), Stage(0, 8, 9)))
    with pytest.raises(ValueError, match="not chunks of ranks"):
        evaluate(_problem("interleaved:2"), VIRTUAL[:3] + (Stage(1, 8, 8), Stage(0, 9, 9)))


def test_price_interleaved_beats_1f1b_on_equal_layers_and_fits() -> None:
    prob = _problem(m=8)
    plain = (Stage(0, 0, 5), Stage(1, 6, 9))
    found = price_interleaved(prob, plain, chunks=2, limit_s=10.0)
    assert found is not None and found.evaluation.fits and len(found.stages) == 4
    assert found.problem.schedule == "interleaved:2"
    assert [st.device for st in found.stages] == [0, 1, 0, 1]
    assert found.evaluation.iteration_s == evaluate(found.problem, found.stages).iteration_s
    assert price_interleaved(prob, plain[:1] + (Stage(1, 6, 9),), chunks=2) is not None
    assert price_interleaved(_problem(m=3), plain, chunks=2) is None  # m % p != 0
    assert price_interleaved(prob, (Stage(0, 0, 9),), chunks=2) is None  # one card: nothing to interleave


def test_interleaving_a_one_card_answer_is_one_error_naming_the_fix() -> None:
    from types import SimpleNamespace

    from hetpipe.errors import ConfigError
    from hetpipe.partitioner.interleave import choose_interleaved

    one_card = SimpleNamespace(stages=(Stage(0, 0, 9),), iteration_s=1.0)
    with pytest.raises(ConfigError, match="uses one card.*--schedule 1f1b"):
        choose_interleaved(_problem(m=8), one_card, chunks=2, limit_s=1.0)


# ----------------------------------------------------------------------------- plan format (version 6), check, run


def test_a_plan_lists_each_cards_chunks_and_check_rederives_them(tmp_path) -> None:
    from hetpipe.errors import ConfigError
    from hetpipe.models import build
    from hetpipe.plan.build import partition
    from hetpipe.plan.check import check_plan
    from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan
    from hetpipe.runtime.run import preflight

    model, inputs = build("gpt-tiny", device="meta", batch=2, seq=16)
    plan = partition(model, "examples/clusters/homelab-mini.yaml", example_inputs=inputs, global_batch=12,
                     time_limit_s=2.0, schedule="interleaved:2")  # m = 6, a multiple of the 3 cards
    assert plan.version == 9 and plan.training.schedule == "interleaved:2"  # 6: chunks; 9: step tables
    p = len(plan.stages)
    assert all(len(st.chunks) == 2 and (st.first_unit, st.last_unit) == (st.chunks[0].first_unit, st.chunks[0].last_unit)
               for st in plan.stages)
    virtual = stages_from_plan(plan)
    assert [v.first_unit for v in virtual] == [0] + [v.last_unit + 1 for v in virtual[:-1]]  # model order
    assert [v.device for v in virtual] == [v.device for v in virtual[:p]] * 2  # chunk c of rank r = stage c p + r
    ev = evaluate(problem_from_plan(plan), virtual)
    assert plan.predicted.iteration_s == ev.iteration_s == pytest.approx(plan.predicted.simulated_iteration_s, rel=1e-9)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan and check_plan(again).ok, check_plan(again).violations
    chunk = dataclasses.replace(again.stages[1].chunks[1], fwd_s=again.stages[1].chunks[1].fwd_s * 2)
    edited = dataclasses.replace(again, stages=(again.stages[0], dataclasses.replace(again.stages[1], chunks=(
        again.stages[1].chunks[0], chunk)), *again.stages[2:]))
    assert any("stage 1 chunk 1: recorded fwd_s" in v for v in check_plan(edited).violations)
    preflight(again, model="gpt-tiny", seq=16, schedule=again.training.schedule)  # runs (test_interleaved_runtime)
    with pytest.raises(ConfigError, match="runs 1 chunk per card, the plan was cut into 2"):
        preflight(again, model="gpt-tiny", seq=16, schedule="1f1b")  # its chunks are its cut
    from hetpipe.runtime.run import run
    with pytest.raises(ConfigError, match="--resume: an interleaved plan"):  # refused before any launch
        run(again, model="gpt-tiny", seq=16, steps=1, resume=str(tmp_path))


def test_schedule_option_and_auto_with_interleaving(monkeypatch) -> None:
    from hetpipe.errors import ConfigError
    from hetpipe.partitioner import schedule_choice
    from hetpipe.partitioner.interleave import work_bound_s
    from hetpipe.partitioner.schedule_choice import check_schedule_option, choose_schedule
    from hetpipe.partitioner.solvers.solve import solve

    check_schedule_option("interleaved:3")
    for bad in ("interleaved:0", "interleaved:1", "interleaved:two", "interleaved"):
        with pytest.raises(ConfigError, match=f"--schedule is '{bad}'; .* interleaved:V with V >= 2 chunks per card"):
            check_schedule_option(bad)  # one form says what is accepted: not ">= 1", which then refuses 1
    prob = dataclasses.replace(_problem(m=8), objective="schedule")
    sol = solve(prob, time_limit_s=2.0)
    chosen, got = choose_schedule(prob, sol, option="interleaved:2", limit_s=2.0)
    ev = evaluate(chosen, got.stages)
    assert chosen.schedule == "interleaved:2" and ev.fits and ev.iteration_s == got.iteration_s
    assert work_bound_s(prob) <= got.bound_s <= got.iteration_s
    picked, best = choose_schedule(prob, sol, option="auto", limit_s=1.0)
    monkeypatch.setattr(schedule_choice, "AUTO_INTERLEAVE_CHUNKS", ())  # auto without the interleaving lever
    _, plain = choose_schedule(prob, sol, option="auto", limit_s=1.0)
    assert best.iteration_s <= min(plain.iteration_s, got.iteration_s) * (1 + 1e-9)
    assert (picked.schedule == "interleaved:2") == (best.iteration_s < plain.iteration_s)
    with pytest.raises(ConfigError, match="not a multiple of the plan's"):
        choose_schedule(dataclasses.replace(prob, microbatches=3), dataclasses.replace(sol), option="interleaved:2",
                        limit_s=1.0)


def _parameter_free_blocks(num_units: int = 10):
    """`synthetic_graph` whose blocks own no parameters: their backward has no weight-gradient part
    (W = 0), so splitting it gains nothing there and interleaving is the lever that shrinks the bubble."""
    from tests.synthetic import synthetic_graph

    g = synthetic_graph(num_units)
    units = tuple(u if u.index in (0, num_units - 1) else
                  dataclasses.replace(u, param_count=0, param_bytes=0, state_bytes=0, grad_bytes=0) for u in g.units)
    return dataclasses.replace(g, units=units, param_count=sum(u.param_count for u in units))


@pytest.mark.parametrize("link_bytes_s,wins", [(125e9, True), (5e6, False)])
def test_auto_interleaves_where_it_prices_lower_and_check_accepts_it(tmp_path, link_bytes_s: float, wins: bool) -> None:
    from hetpipe.partitioner.interleave import price_interleaved
    from hetpipe.plan.build import partition_graph
    from hetpipe.plan.check import check_plan
    from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan
    from tests.synthetic import synthetic_cluster

    # two equal cards on two nodes; 8 MiB cut tensors: free at 125 GB/s, 1.7 s per cut at 5 MB/s (each
    # micro-batch crosses 3 cuts each way interleaved, 1 under 1F1B)
    cluster = synthetic_cluster((("n0", "a", 20.0, 24.0), ("n1", "a", 20.0, 24.0)), inter_bytes_s=link_bytes_s)
    plan = partition_graph(_parameter_free_blocks(), cluster, global_batch=8, time_limit_s=2.0, schedule="auto")
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert check_plan(again).ok, check_plan(again).violations
    problem, stages = problem_from_plan(again), stages_from_plan(again)
    assert evaluate(problem, stages).iteration_s == pytest.approx(again.predicted.iteration_s, rel=1e-9)
    plain = partition_graph(_parameter_free_blocks(), cluster, global_batch=8, time_limit_s=2.0, schedule="1f1b")
    inter = price_interleaved(problem_from_plan(plain), stages_from_plan(plain), chunks=2)  # 1F1B's cards re-cut
    assert inter is not None and inter.evaluation.fits
    if wins:  # interleaving prices lower than every other schedule auto tried: chosen
        assert again.training.schedule == "interleaved:2" and again.version == 6
        # recorded with the plan's recompute lever, so that check prices the baselines as they were planned
        assert problem.recompute == problem_from_plan(plain).recompute == "auto"
        assert again.predicted.iteration_s <= inter.evaluation.iteration_s * (1 + 1e-9)
        assert again.predicted.iteration_s < plain.predicted.iteration_s
    else:  # three slow crossings per micro-batch each way: interleaving loses to 1F1B and is not chosen
        assert inter.evaluation.iteration_s > plain.predicted.iteration_s
        assert "interleaved" not in again.training.schedule
        assert again.predicted.iteration_s <= plain.predicted.iteration_s
