"""The executor against a deep-copied single-device reference, over real gloo processes.

Numerics (issue #4, acceptance 1): for 2, 3 and 4 uneven stages, a skip-connection
net and a tied-embedding GPT, GPipe, 1F1B and ZB-H1, the loss and every parameter's
gradient after one step, and every parameter after three optimizer steps, equal
the unsplit model on the same global batch (fp32, rtol=1e-5, atol=4e-5).  One
spawned world per stage count runs all four (model, schedule) cases; the parent
computes the reference and asserts.  Then a dead peer, a hung peer and a wrong
tensor shape must each end every surviving rank with a `RuntimeFailure` that
names the rank, stage, action and peer, within the timeout.
"""

from __future__ import annotations

import copy
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from hetpipe.errors import RuntimeFailure, ScheduleError
from hetpipe.runtime.execute import comm
from hetpipe.schedule.actions import Action, Op
from hetpipe.runtime.execute.executor import ActionHooks, PipelineExecutor
from hetpipe.runtime.execute.options import ExecutorOptions
from hetpipe.schedule.builders import check_actions, make_schedule
from hetpipe.runtime.stage.build import build_stage, split_stages
from tests.dist_helpers import SkipNet, TinyGPT, gpt_loss, run_world, stage_mapping

RTOL, ATOL = 1e-5, 4e-5  # torch's pipelining test tolerances (fp32)
MICROBATCHES, MB_SIZE, STEPS = 4, 2, 3
WORLD_TIMEOUT_S = 240.0  # hard bound of one spawned world (start-up on 2 busy cores included)
SPLITS = {  # units per stage, deliberately uneven
    "skip": {1: [7], 2: [5, 2], 3: [1, 4, 2], 4: [2, 1, 2, 2]},
    "gpt": {1: [9], 2: [3, 6], 3: [4, 1, 4], 4: [3, 1, 2, 3]},
}


@dataclass(frozen=True)
class Case:
    """One (model, schedule) configuration and the training set-up both sides use."""

    model: str
    schedule: str
    optimizer: str  # "sgd" (momentum) or "adam"
    reduction: str = "mean"
    clip: float | None = None
    lr_schedule: bool = False
    broadcast_loss: bool = False


CASES = {
    "skip-gpipe": Case("skip", "gpipe", "sgd", lr_schedule=True),
    "skip-1f1b": Case("skip", "1f1b", "adam", reduction="sum"),
    "gpt-gpipe": Case("gpt", "gpipe", "sgd", broadcast_loss=True),
    "gpt-1f1b": Case("gpt", "1f1b", "adam", clip=0.5),
    # ZB-H1: B and W apart (issue 17 item 2); the tied embedding's W sums over two stages
    "skip-zb-h1": Case("skip", "zb-h1", "adam", reduction="sum"),
    "gpt-zb-h1": Case("gpt", "zb-h1", "adam", clip=0.5, broadcast_loss=True),
}


def _model(case: Case) -> tuple[nn.Module, tuple[str, ...]]:
    torch.manual_seed(1234)
    if case.model == "skip":
        return SkipNet(), SkipNet.UNITS
    model = TinyGPT()
    return model, model.units


def _batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    n = MICROBATCHES * MB_SIZE
    if case.model == "skip":
        return torch.randn(n, 8, generator=gen), torch.randn(n, 8, generator=gen)
    return torch.randint(0, 32, (n, 8), generator=gen), torch.randint(0, 32, (n, 8), generator=gen)


def _loss_fn(case: Case) -> Any:
    if case.model == "gpt":
        return gpt_loss
    return lambda out, y: F.mse_loss(out, y, reduction=case.reduction)


def _optimizer(case: Case, params: Any) -> tuple[torch.optim.Optimizer, Any]:
    # Adam's eps bounds d(update)/d(grad) by lr/eps, so fp32 rounding of the gradient sum
    # (~1e-9) cannot move a parameter by more than ~1e-6.
    if case.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(params, lr=1e-2, eps=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if case.lr_schedule else None
    return opt, sched


def _program(case: Case, num_stages: int):
    model, units = _model(case)
    gm = fx.symbolic_trace(model)
    x, _ = _batch(case, 0)
    mapping = stage_mapping(gm, units, SPLITS[case.model][num_stages])
    return model, split_stages(gm, mapping, example_inputs=(x[:MB_SIZE],))


def _executor(case: Case, rank: int, world: int, *, hooks: Any = None, start_together: bool = False,
              **options: Any) -> tuple[Any, PipelineExecutor]:
    """The rank's stage and executor; ``start_together``: every rank built its stage before any starts the
    executor's handshake (which a short ``timeout_s`` bounds: a rank seconds late to build is not a hang)."""
    model, program = _program(case, world)
    stage = build_stage(program, rank, state_dict=model.state_dict(), device="cpu")
    opt, sched = _optimizer(case, stage.parameters())
    if start_together:
        dist.barrier()  # bounded by the group's PG_TIMEOUT_S (tests/dist_helpers.py)
    actions = make_schedule(case.schedule, world, MICROBATCHES)[rank]
    opts = ExecutorOptions(**{"timeout_s": 60.0, "cut_specs": program.cuts, "grad_clip_norm": case.clip,
                              "loss_reduction": case.reduction, "broadcast_loss": case.broadcast_loss, **options})
    ex = PipelineExecutor(stage, rank=rank, num_stages=world, schedule_actions=actions, loss_fn=_loss_fn(case),
                          optimizer=opt, microbatches=MICROBATCHES, options=opts, hooks=hooks, lr_scheduler=sched)
    return stage, ex


def _split(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.split(MB_SIZE))


def _run_case(case: Case, rank: int, world: int) -> dict[str, Any]:
    stage, ex = _executor(case, rank, world)
    out: dict[str, Any] = {"losses": [], "grad_norms": []}
    for step in range(STEPS):
        x, y = _batch(case, step)
        stats = ex.step(_split(x), _split(y))
        out["losses"].append(stats.loss)
        out["grad_norms"].append(stats.grad_norm)
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in stage.named_parameters()}
            out["stats"] = stats
    out["params"] = {n: p.detach().clone() for n, p in stage.named_parameters()}
    return out


def _numerics_worker(rank: int, world: int) -> dict[str, Any]:
    out = {name: _run_case(case, rank, world) for name, case in CASES.items()}
    if world == len(PERMUTED_STAGE_RANKS):  # the permuted-ranks case on the same world: one start-up less
        out[PERMUTED] = _permuted_worker(rank, world)
    return out


def _reference(case: Case) -> dict[str, Any]:
    model, _ = _model(case)
    ref = copy.deepcopy(model)
    opt, sched = _optimizer(case, ref.parameters())
    out: dict[str, Any] = {"losses": [], "grad_norms": []}
    for step in range(STEPS):
        x, y = _batch(case, step)
        opt.zero_grad(set_to_none=True)
        loss = _loss_fn(case)(ref(x), y)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(ref.parameters(), case.clip) if case.clip is not None else None
        out["losses"].append(loss.item())
        out["grad_norms"].append(None if norm is None else float(norm))
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in ref.named_parameters(remove_duplicate=False)}
        opt.step()
        if sched is not None:
            sched.step()
    out["params"] = {n: p.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """``get(world)``: every rank's `_numerics_worker` results, each world size launched once per module
    (`world_results` and the permuted-ranks test read the same 3-rank world)."""
    cache: dict[int, list[Any]] = {}

    def get(world: int) -> list[Any]:
        if world not in cache:
            outcomes = run_world(_numerics_worker, world_size=world, timeout_s=WORLD_TIMEOUT_S,
                                 out_dir=tmp_path_factory.mktemp(f"numerics{world}"))
            for o in outcomes:
                assert o.error is None and o.value is not None, f"rank {o.rank} (exit {o.exitcode}): {o.error}"
            cache[world] = [o.value for o in outcomes]
        return cache[world]

    return get


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"{w}stages")
def world_results(request, worlds):
    return request.param, worlds(request.param)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_single_device_reference(world_results, name):
    world, results = world_results
    case, ref = CASES[name], _reference(CASES[name])
    last = results[-1][name]
    torch.testing.assert_close(last["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
    for rank, res in enumerate(results):
        r = res[name]
        if case.broadcast_loss or rank == world - 1:
            torch.testing.assert_close(r["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
        else:
            assert r["losses"] == [None] * STEPS
        if case.clip is not None:  # every rank sees the same global norm
            torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], rtol=RTOL, atol=ATOL)
        assert r["grads"], f"rank {rank} holds no parameters"
        for pname, grad in r["grads"].items():  # tied replicas included: both hold the summed gradient
            torch.testing.assert_close(grad, ref["grads"][pname], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, p=pname, k=rank: f"{name} rank {k} grad {p}: {m}")
        for pname, value in r["params"].items():
            torch.testing.assert_close(value, ref["params"][pname], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, p=pname, k=rank: f"{name} rank {k} param {p}: {m}")
    held = {p for res in results for p in res[name]["params"]}
    assert held == set(ref["params"])  # every parameter (both names of the tied one) lives on some stage


@pytest.mark.slow
def test_step_stats_are_measured(world_results):
    world, results = world_results
    for rank, res in enumerate(results):
        stats = res["gpt-1f1b"]["stats"]
        assert stats.rank == rank and stats.stage == rank
        assert len(stats.forward_s) == len(stats.backward_s) == MICROBATCHES
        assert all(t > 0 for t in stats.forward_s + stats.backward_s)
        assert [a.action for a in stats.actions] == [str(a) for a in make_schedule("1f1b", world, MICROBATCHES)[rank]]
        mem = stats.memory  # TinyGPT has no buffers: params are all parameters
        assert mem.param_bytes > 0 and mem.grad_bytes == mem.param_bytes
        assert mem.optimizer_state_bytes >= 2 * mem.param_bytes  # Adam: two moments per parameter
        assert mem.peak_activation_bytes > 0 and mem.peak_bytes >= mem.param_bytes + mem.peak_activation_bytes
        assert mem.peak_comm_bytes > 0


# Global rank of each stage when the rendezvous numbers nodes out of pipeline order (multi-node
# torchrun): stage 0 on rank 2, stage 1 on rank 0, stage 2 on rank 1.  The tied embedding's
# gradient all-reduce then runs between ranks 2 and 1.
PERMUTED_STAGE_RANKS = (2, 0, 1)
PERMUTED = "permuted-ranks"  # its key in `_numerics_worker`'s results


def _permuted_worker(rank: int, world: int) -> dict[str, Any]:
    from hetpipe.runtime.rank import stage_ranks

    case = CASES["gpt-1f1b"]
    stage_index = PERMUTED_STAGE_RANKS.index(rank)
    every: list[Any] = [None] * world
    torch.distributed.all_gather_object(every, stage_index)  # what the worker does after joining
    ranks = stage_ranks(every, world)
    model, program = _program(case, world)
    stage = build_stage(program, stage_index, state_dict=model.state_dict(), device="cpu")
    opt, _ = _optimizer(case, stage.parameters())
    ex = PipelineExecutor(stage, rank=rank, num_stages=world,
                          schedule_actions=make_schedule(case.schedule, world, MICROBATCHES)[stage_index],
                          loss_fn=_loss_fn(case), optimizer=opt, microbatches=MICROBATCHES, stage_ranks=ranks,
                          options=ExecutorOptions(timeout_s=60.0, grad_clip_norm=case.clip))
    losses = []
    for step in range(2):
        x, y = _batch(case, step)
        losses.append(ex.step(_split(x), _split(y)).loss)
    return {"stage": stage_index, "ranks": ranks, "losses": losses,
            "params": {n: p.detach().clone() for n, p in stage.named_parameters()}}


@pytest.mark.slow
def test_stages_on_permuted_ranks_match_the_reference(worlds):
    # run after the numerics cases on the same 3 ranks (`_numerics_worker`), each rank on its own stage
    outcomes = [SimpleNamespace(rank=rank, value=res[PERMUTED]) for rank, res in enumerate(worlds(3))]
    case = CASES["gpt-1f1b"]
    model, _ = _model(case)
    ref = copy.deepcopy(model)
    opt, _ = _optimizer(case, ref.parameters())
    ref_losses = []
    for step in range(2):
        x, y = _batch(case, step)
        opt.zero_grad(set_to_none=True)
        loss = _loss_fn(case)(ref(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(ref.parameters(), case.clip)
        ref_losses.append(loss.item())
        opt.step()
    expected = dict(ref.named_parameters(remove_duplicate=False))
    for o in outcomes:
        assert o.value["ranks"] == list(PERMUTED_STAGE_RANKS) and o.value["stage"] == PERMUTED_STAGE_RANKS.index(o.rank)
        for name, value in o.value["params"].items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m, p=name, k=o.rank: f"rank {k} param {p}: {m}")
    last = outcomes[PERMUTED_STAGE_RANKS[-1]].value
    torch.testing.assert_close(last["losses"], ref_losses, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- failures


class _DieAt(ActionHooks):
    """Kill this process (no clean-up at all) right before its ``index``-th action."""

    def __init__(self, index: int, *, hang: bool = False) -> None:
        self.index, self.hang, self.seen = index, hang, 0

    def before(self, action: Action) -> None:
        if self.seen == self.index:
            if self.hang:
                time.sleep(600)
            os._exit(17)
        self.seen += 1


def _fault_worker(rank: int, world: int, victim: int, index: int, hang: bool, timeout_s: float,
                  folder: str = "") -> None:
    """Step once (rank ``victim`` dies or hangs before its ``index``-th action); into ``folder`` (if given) the
    seconds from the call to the executor's start, ``build-rank<r>.txt``: what RankOutcome.error_at_s adds."""
    called = time.monotonic()
    hooks = _DieAt(index, hang=hang) if rank == victim else None
    _, ex = _executor(CASES["skip-1f1b"], rank, world, timeout_s=timeout_s, hooks=hooks, start_together=True)
    if folder:
        Path(folder, f"build-rank{rank}.txt").write_text(repr(time.monotonic() - called))
    x, y = _batch(CASES["skip-1f1b"], 0)
    ex.step(_split(x), _split(y))


@pytest.mark.slow
def test_a_dead_peer_ends_every_other_rank_with_a_named_failure(tmp_path):
    timeout_s = 30.0
    outcomes = run_world(_fault_worker, world_size=3, args=(2, 4, False, timeout_s, str(tmp_path)),
                         timeout_s=WORLD_TIMEOUT_S, out_dir=tmp_path)
    assert outcomes[2].exitcode == 17 and outcomes[2].value is None and outcomes[2].error is None
    one, zero = outcomes[1], outcomes[0]
    assert one.error_type == "RuntimeFailure", one.error
    assert re.match(r"rank 1 \(stage 1\) failed waiting on 1RECV_B\d from rank 2 \(.*\); is rank 2 alive\?",
                    one.error), one.error
    assert zero.error_type == "RuntimeFailure", zero.error
    assert re.match(r"rank 0 \(stage 0\) (failed|timed out).* waiting on 0(RECV_B|SEND_F)\d.* rank 1", zero.error), \
        zero.error
    # A dead peer is noticed at once: well before the rank's own timeout, counted from the executor's start
    # (error_at_s also counts building the stage: 43 s of wall time once at load 17 on 2 cores).
    for o in (one, zero):
        assert o.error_at_s - float((tmp_path / f"build-rank{o.rank}.txt").read_text()) < timeout_s, o


@pytest.mark.slow
def test_a_hung_peer_times_out_with_the_action_and_peer_named(tmp_path):
    timeout_s = 3.0
    outcomes = run_world(_fault_worker, world_size=2, args=(1, 2, True, timeout_s), timeout_s=WORLD_TIMEOUT_S,
                         out_dir=tmp_path, wait_for=[0])
    zero = outcomes[0]
    # On gloo a RECV of the built-in 1F1B first waits for the rank's earlier sends (wait_sends_at_recv).
    assert zero.error == ("rank 0 (stage 0) timed out after 3.0 s waiting on 0SEND_F1 to be received by rank 1 "
                          "before 0RECV_B0; is rank 1 alive? (if it is only slow, raise timeout_s)"), zero.error
    # The rank's own timeout fired (the message says so, and not before timeout_s); no upper bound on the
    # wall time: error_at_s counts from the worker's start, so it includes building the stage, which took
    # 10 s under load 11 on 2 cores (a hang would end in run_world's kill, not in this message).
    assert timeout_s <= zero.error_at_s


def _mismatch_worker(rank: int, world: int) -> None:
    stage, ex = _executor(CASES["skip-gpipe"], rank, world, timeout_s=30.0)
    if rank == 0:  # the stage now emits a tensor one column short of its cut spec
        stage.module.register_forward_hook(lambda m, a, out: (*out[:-1], out[-1][:, :-1]))
    x, y = _batch(CASES["skip-gpipe"], 0)
    ex.step(_split(x), _split(y))


@pytest.mark.slow
def test_a_wrong_shape_is_named_on_both_ends(tmp_path):
    outcomes = run_world(_mismatch_worker, world_size=2, timeout_s=WORLD_TIMEOUT_S, out_dir=tmp_path)
    spec = "the cut spec expects 'cat_1' (2, 32) float32"
    assert outcomes[0].error == (
        f"rank 0 (stage 0): 0SEND_F0: micro-batch 0, tensor 'cat_1' is (2, 31) float32, {spec}; the stage produced "
        "another shape than split_stages propagated: feed micro-batches shaped like its example inputs")
    assert outcomes[1].error.startswith(
        f"rank 1 (stage 1) received a wrong message on 1RECV_F0 from rank 0 (stage 0): micro-batch 0, tensor "
        f"'cat_1' is (2, 31) float32, {spec}"), outcomes[1].error


# ----------------------------------------------------------------------------- one process


def _single(case: Case, **kwargs: Any) -> tuple[Any, PipelineExecutor]:
    return _executor(case, 0, 1, **kwargs)


def test_one_stage_equals_the_reference_with_clipping_and_schedule():
    case = Case("gpt", "1f1b", "adam", clip=0.5, lr_schedule=True)
    stage, ex = _single(case)
    assert stage.module.lm_head.weight is stage.module.wte.weight
    ref = _reference(case)
    losses = []
    for step in range(STEPS):
        x, y = _batch(case, step)
        losses.append(ex.step(_split(x), _split(y)).loss)
    torch.testing.assert_close(losses, ref["losses"], rtol=RTOL, atol=ATOL)
    for n, p in stage.named_parameters():
        torch.testing.assert_close(p.detach(), ref["params"][n], rtol=RTOL, atol=ATOL)


class _Recorder(ActionHooks):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.held: list[dict[str, int]] = []

    def before(self, action: Action) -> None:
        self.calls.append(("before", str(action)))

    def after(self, action: Action, seconds: float) -> None:
        assert seconds >= 0
        self.calls.append(("after", str(action)))

    def memory(self, action: Action, held_bytes: Any) -> None:
        self.held.append(dict(held_bytes))


def test_hooks_see_every_action_and_the_memory_categories():
    hooks = _Recorder()
    _, ex = _single(CASES["skip-gpipe"], hooks=hooks)
    x, y = _batch(CASES["skip-gpipe"], 0)
    ex.step(_split(x), _split(y))
    names = [str(a) for a in ex.actions]
    assert hooks.calls == [(w, a) for a in names for w in ("before", "after")]
    assert set(hooks.held[0]) == {"params", "grads", "optimizer", "activations", "comm"}
    activations = [h["activations"] for h in hooks.held]
    assert activations[MICROBATCHES - 1] == max(activations) > 0  # GPipe holds every micro-batch after the forwards
    assert activations[-1] == 0 and hooks.held[-1]["optimizer"] > 0  # SGD momentum buffers after the step


@pytest.mark.parametrize("name", ["skip-gpipe", "gpt-1f1b"])
def test_saved_bytes_measured_on_the_first_step_equal_measuring_every_step(name):
    """After step 1 the executor drops saved_tensors_hooks and reuses each micro-batch's measured bytes;
    the held-bytes trace of every later action must equal the exact, every-step accounting."""
    traces = {}
    for every in (True, False):
        hooks = _Recorder()
        _, ex = _single(CASES[name], hooks=hooks, track_saved_every_step=every)
        for step in range(3):
            x, y = _batch(CASES[name], step)
            stats = ex.step(_split(x), _split(y))
        traces[every] = ([h["activations"] for h in hooks.held], stats.memory.peak_activation_bytes)
    assert traces[True] == traces[False] and traces[True][1] > 0


def test_bad_inputs_are_named_before_anything_runs():
    _, ex = _single(CASES["skip-gpipe"])
    x, y = _batch(CASES["skip-gpipe"], 0)
    with pytest.raises(RuntimeFailure, match=r"rank 0 \(stage 0\): step\(\) needs inputs_mb with 4 micro-batches"):
        ex.step(_split(x)[:3], _split(y))
    bad = _split(x)
    bad[2] = bad[2][:, :5]
    with pytest.raises(RuntimeFailure, match=r"micro-batch 2 input 'x' is \(2, 5\) float32, the cut spec expects "
                                             r"'x' \(2, 8\) float32"):
        ex.step(bad, _split(y))
    model, program = _program(CASES["skip-gpipe"], 2)
    stage = build_stage(program, 0, state_dict=None, device="cpu")
    with pytest.raises(RuntimeFailure, match="needs torch.distributed"):
        PipelineExecutor(stage, rank=0, num_stages=2, schedule_actions=make_schedule("gpipe", 2, 1)[0],
                         loss_fn=F.mse_loss, optimizer=torch.optim.SGD(stage.parameters(), lr=0.1), microbatches=1)
    with pytest.raises(RuntimeFailure, match="cuts differ from the cut_specs"):
        PipelineExecutor(stage, rank=0, num_stages=2, schedule_actions=make_schedule("gpipe", 2, 1)[0],
                         loss_fn=F.mse_loss, optimizer=torch.optim.SGD(stage.parameters(), lr=0.1), microbatches=1,
                         options=ExecutorOptions(cut_specs=_program(CASES["skip-gpipe"], 3)[1].cuts))


@pytest.mark.parametrize("actions,message", [
    ("1RECV_F0 1F0 1B0 1SEND_B0 1STEP", r"step 0 \(1RECV_F0\): names stage 1, but rank 0 runs stage 0 only"),
    ("0F0 0SEND_F0 0B0 0STEP", r"no 0RECV_B0; fix: add it before 0B0"),
    ("0F0 0SEND_F0 0B0 0RECV_B0 0STEP", r"step 2 \(0B0\) comes before 0RECV_B0 \(step 3\) .*fix: move 0B0 after"),
    ("0F0 0SEND_F0 0RECV_B0 0B0 0STEP 0F0", r"duplicate of step 0"),
    ("0F0 0SEND_F0 0RECV_B0 0B0", r"no 0STEP; fix: append it as the last action"),
    ("0F5 0SEND_F0 0RECV_B0 0B0 0STEP", r"\(0F5\): micro-batch 5 is outside 0..0"),
])
def test_local_action_lists_are_checked(actions, message):
    with pytest.raises(ScheduleError, match=message):
        check_actions([Action.parse(a) for a in actions.split()], stage=0, num_stages=2, num_microbatches=1)
    for name in ("gpipe", "1f1b"):
        for rank, acts in make_schedule(name, 3, 4).items():
            check_actions(acts, stage=rank, num_stages=3, num_microbatches=4)


def test_wire_headers_round_trip_and_bools_travel_as_bytes():
    tensors = [torch.zeros(2, 3, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bool), torch.zeros(())]
    h = comm.decode_header(comm.encode_header(stage=2, kind=comm.KIND_ACT, microbatch=7, arrive_ns=11, tensors=tensors))
    assert h == comm.WireHeader(2, 0, 7, 11, ((torch.bfloat16, (2, 3)), (torch.bool, (4,)), (torch.float32, ())))
    wire = comm.wire_view(tensors[1])
    assert wire.dtype == torch.uint8 and torch.equal(comm.from_wire(wire, torch.bool), tensors[1])
    tags = {comm.message_tag(k, microbatch=mb, index=i) for k in (0, 1) for mb in range(64) for i in range(5)}
    assert len(tags) == 2 * 64 * 5 and max(tags) < comm.HANDSHAKE_TAG
