"""Issue 17 item 2: ZB-H1 (backward split into B and W) as data, simulated, replayed and held.

* the builder's lists are valid (also when each RECV first waits for the rank's sends), every
  micro-batch's W comes after its B, and a list without some W or with W before B is refused;
* uniform stages, free links, m >= p: ``T = m (F + B) + (p - 1)(F + B_in - W)`` with B = B_in + W
  (Qi et al. 2023, §3.1: the bubble shrinks from 1F1B's (p-1)(F+B)), and every stage holds at most
  min(p, m) micro-batches: the pipeline's peak is 1F1B's;
* the compiled replay equals the event simulator on random stages with weight shares;
* the held moments: micro-batches stay in flight until their W;
* `evaluate` under ``Problem.schedule = "zb-h1"`` replays the split lists.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.cost_models.backward_split import WEIGHT_GRAD_SHARE
from hetpipe.errors import ScheduleError
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.builders import make_schedule, one_f_one_b, validate_schedule, zb_h1
from hetpipe.schedule.held import replay_held, stage_held_terms
from hetpipe.schedule.replay import replay_iteration_s
from hetpipe.schedule.simulate import SimCosts, simulate


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24))
def test_zb_h1_lists_are_valid_and_split_every_backward(p, m):
    sched = zb_h1(p, m)
    validate_schedule(sched, num_stages=p, num_microbatches=m, sends_wait_at_recv=True)
    for rank, actions in sched.items():
        order = [a.op for a in actions if a.op in (Op.F, Op.B, Op.W)]
        assert order.count(Op.W) == order.count(Op.B) == order.count(Op.F) == m
        # stage s defers at most s W's behind its B's (none on stage 0)
        pending = 0
        for op in order:
            pending += (op is Op.B) - (op is Op.W)
            assert pending <= rank + 1 and (op is not Op.F or pending <= rank)


def test_a_missing_or_early_w_is_refused_naming_rank_and_step():
    sched = zb_h1(2, 2)
    sched[1].remove(Action(1, Op.W, 1))
    with pytest.raises(ScheduleError, match=r"rank 1 has no 1W1; fix: add it after 1B1"):
        validate_schedule(sched, num_stages=2, num_microbatches=2)
    sched = zb_h1(2, 2)
    acts = sched[0]
    i, j = acts.index(Action(0, Op.B, 0)), acts.index(Action(0, Op.W, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match=r"rank 0, step \d+ \(0W0\) comes before 0B0"):
        validate_schedule(sched, num_stages=2, num_microbatches=2)


@pytest.mark.parametrize("p, m", [(2, 2), (3, 4), (4, 8), (4, 16), (6, 6)])
def test_uniform_stages_lose_only_f_plus_b_minus_w_per_stage(p, m):
    f, b, w = 1.0, 2.0, 1.0
    costs = SimCosts(fwd_s=(f,) * p, bwd_s=(b,) * p, send_s=(0.0,) * (p - 1), bwd_weight_s=(w,) * p)
    zb, base = simulate(zb_h1(p, m), costs), simulate(one_f_one_b(p, m), costs)
    assert zb.iteration_s == pytest.approx(m * (f + b) + (p - 1) * (f + (b - w) - w))
    assert base.iteration_s == pytest.approx((m + p - 1) * (f + b))
    assert max(zb.peak_in_flight_microbatches) == max(base.peak_in_flight_microbatches) == min(p, m)


def test_a_list_without_w_ignores_the_weight_share():
    costs = SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,), bwd_weight_s=(1.0, 1.0))
    plain = SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,))
    assert simulate(one_f_one_b(2, 4), costs).iteration_s == simulate(one_f_one_b(2, 4), plain).iteration_s


def test_replay_equals_the_event_simulator_with_split_backwards() -> None:
    rng = random.Random(2311)
    for _ in range(300):
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        f = [rng.uniform(0.0, 1.0) for _ in range(p)]
        b = [rng.uniform(0.0, 2.0) for _ in range(p)]
        w = [x * rng.uniform(0.0, 1.0) for x in b]
        c = [rng.choice((0.0, rng.uniform(0.0, 3.0))) for _ in range(p - 1)]
        s = [rng.uniform(0.0, 1.0) for _ in range(p)]
        for name in ("zb-h1", "1f1b"):
            want = simulate(make_schedule(name, p, m), SimCosts(tuple(f), tuple(b), tuple(c), tuple(s), tuple(w)))
            got = replay_iteration_s(name, p, m, fwd_s=f, bwd_s=b, send_s=c, step_s=s, bwd_weight_s=w)
            assert got == want.iteration_s


def test_a_micro_batch_is_held_until_its_w():
    for p in range(1, 6):
        for s in range(p):
            for m in range(1, 9):
                actions = zb_h1(p, m)[s]
                counts = [c for c in replay_held(actions, prefetch=0) if not c.backward]  # after each action
                inflight = 0
                for a, c in zip(actions, counts):
                    inflight += (a.op is Op.F) - (a.op is Op.W)
                    assert c.microbatches == inflight
                # the pipeline's peak stays 1F1B's: min(p, m) micro-batches
                assert max(t.microbatches for t in stage_held_terms(p, s, m, schedule="zb-h1")) <= min(p, m)


def _two_stage_problem(schedule: str) -> Problem:
    inf = float("inf")
    return Problem(fwd_s={"a": (1.0, 1.0, 1.0)}, bwd_s={"a": (2.0, 2.0, 2.0)}, state_bytes=(10, 0, 10),
                   activation_bytes=(1, 1, 1), boundary_bytes=(0, 0, 0),
                   devices=(DeviceSlot("d0", "a", "n", 1000), DeviceSlot("d1", "a", "n", 1000)),
                   bandwidth_bytes_s=((inf, inf), (inf, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
                   microbatches=4, schedule=schedule)


def test_evaluate_replays_the_problems_schedule_with_the_weight_share():
    stages = (Stage(0, 0, 1), Stage(1, 2, 2))  # unit 1 has no parameters: no W
    zb = evaluate(_two_stage_problem("zb-h1"), stages)
    assert [c.bwd_weight_s for c in zb.stages] == [WEIGHT_GRAD_SHARE * 2.0, WEIGHT_GRAD_SHARE * 2.0]
    want = replay_iteration_s("zb-h1", 2, 4, fwd_s=(2.0, 1.0), bwd_s=(4.0, 2.0), send_s=(0.0,),
                              bwd_weight_s=(1.0, 1.0))
    assert zb.iteration_s == want
    assert zb.iteration_s < evaluate(_two_stage_problem("1f1b"), stages).iteration_s
    with pytest.raises(ValueError, match="Problem.schedule is 'zb'"):
        _two_stage_problem("zb")


# ----------------------------------------------------------------------------- the executor's split


def _split_model_grads(model, x, g):
    import torch

    from hetpipe.runtime.execute.split_backward import backward_input, backward_weight
    from torch.utils.flop_counter import FlopCounterMode

    params = list(model.parameters())
    y = model(x)
    with FlopCounterMode(display=False) as b_count:
        dx, pending = backward_input([y], [g], [x], params)
    no_grads_yet = all(p.grad is None for p in params)
    with FlopCounterMode(display=False) as w_count:
        backward_weight(pending, params)
    return dx[0], no_grads_yet, b_count.get_total_flops(), w_count.get_total_flops()


def test_b_then_w_equals_one_backward_with_the_same_flops():
    """A residual MLP with a weight used twice: B gives dX and no parameter gradient, W the
    parameters', both equal to one full backward, and B + W do exactly its FLOPs (W does not
    recompute the input-gradient chain)."""
    import copy

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            h = x + self.b(torch.tanh(self.a(x)))
            return self.c(h) + h @ self.c.weight  # c.weight twice: one group

    torch.manual_seed(0)
    net, ref = Net(), None
    ref = copy.deepcopy(net)
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    g = torch.randn(4, 8)
    dx, no_grads_yet, b_flops, w_flops = _split_model_grads(net, x, g)
    y_ref = ref(x_ref)
    with FlopCounterMode(display=False) as full:
        y_ref.backward(g)
    assert no_grads_yet
    torch.testing.assert_close(dx, x_ref.grad, rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert b_flops + w_flops == full.get_total_flops() and 0 < w_flops < full.get_total_flops()


def test_one_stage_runs_a_split_list_like_one_backward():
    import torch

    from hetpipe.runtime.execute.executor import PipelineExecutor
    from hetpipe.runtime.execute.options import ExecutorOptions
    from hetpipe.runtime.stage.build import build_stage, split_stages

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    prog = split_stages(torch.fx.symbolic_trace(net), {}, example_inputs=(torch.zeros(2, 3),))
    stage = build_stage(prog, 0, state_dict=net.state_dict(), device="cpu")
    acts = zb_h1(1, 2)[0]
    assert [str(a) for a in acts] == ["0F0", "0B0", "0W0", "0F1", "0B1", "0W1", "0STEP"]
    ex = PipelineExecutor(stage, rank=0, num_stages=1, schedule_actions=acts, microbatches=2,
                          optimizer=torch.optim.SGD(stage.parameters(), lr=0.0),
                          loss_fn=torch.nn.functional.mse_loss, options=ExecutorOptions(timeout_s=5.0))
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    stats = ex.step([x[:2], x[2:]], [y[:2], y[2:]])
    torch.nn.functional.mse_loss(net(x), y).backward()
    assert stats.loss == pytest.approx(torch.nn.functional.mse_loss(net(x), y).item(), rel=1e-6)
    for p, q in zip(stage.parameters(), net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    assert len(stats.backward_s) == 2 and stats.memory.peak_activation_bytes > 0 and stats.memory.grad_bytes > 0
