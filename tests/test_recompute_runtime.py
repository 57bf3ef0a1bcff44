"""Activation recomputation in the runtime (issue 14, part 2): a plan's ``recompute_units`` run exactly.

Fast tests build stages in one process and compare a stage whose chosen units run under
``torch.utils.checkpoint`` with the same stage without: same parameter names, outputs and
gradients; dropout draws the same masks on recompute; BatchNorm statistics update once per
micro-batch; the executor's ledger holds less and counts one recompute at the backward.
The slow tests train 3 steps on 3 stages (gloo) with recomputation on some units of every
stage and compare with a plain single-device loop, and check the held bytes against the
cost model's formula.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

from hetpipe.errors import PlanError, ScheduleError
from hetpipe.models import build, training_loss
from hetpipe.partitioner.capture.capture import capture
from hetpipe.runtime.stage.buffers import ModelBuffers
from hetpipe.runtime.stage.build import build_stage, split_stages
from tests.forked_launch import use_forked_launch
from tests.machine_load import guard_s
from tests.ledger_memory import ledger_bytes

log = logging.getLogger(__name__)
RTOL = ATOL = 1e-5  # fp32; the acceptance


def _one_stage(name: str, *, batch: int = 2, seq: int | None = 16):
    """(captured graph, one-stage program, CPU model, inputs, loss fn, targets) of a built-in model."""
    meta, example = build(name, device="meta", batch=batch, seq=seq)
    graph = capture(meta, example, name=name)
    program = split_stages(graph.module, {}, example_inputs=example, num_stages=1)
    torch.manual_seed(0)
    model, inputs = build(name, device="cpu", batch=batch, seq=seq)
    fn, targets = training_loss(name, inputs)
    return graph, program, model, inputs, fn, targets


def _stage(program, model, recompute=None):
    """Stage 0 of ``program`` with ``model``'s weights (non-persistent buffers from its own init)."""
    return build_stage(program, 0, state_dict=model.state_dict(), device="cpu", buffers=ModelBuffers(model),
                       recompute=recompute)


def _grads(stage, inputs, fn, targets) -> dict[str, torch.Tensor]:
    loss = fn(stage(*inputs), targets)
    loss.backward()
    return {n: p.grad.clone() for n, p in stage.named_parameters()}


def _units(graph, indices) -> dict[int, tuple[str, ...]]:
    return {i: tuple(graph.units[i].node_names) for i in indices}


@pytest.mark.parametrize("name", ["gpt-tiny", "hf-llama-tiny"])  # torch.fx and torch.export graphs
def test_recomputed_stage_has_the_same_names_outputs_and_gradients(name):
    graph, program, model, inputs, fn, targets = _one_stage(name)
    plain = _stage(program, model)
    chosen = (1, 2, graph.num_units - 1)  # two consecutive layers and the (tied) head
    rc = _stage(program, model, _units(graph, chosen))
    assert [r.unit for r in rc.recomputed] == list(chosen)
    assert list(rc.module.state_dict()) == list(plain.module.state_dict())  # names (and checkpoints) unchanged
    assert [n for n, _ in rc.named_parameters()] == [n for n, _ in plain.named_parameters()]
    want, got = _grads(plain, inputs, fn, targets), _grads(rc, inputs, fn, targets)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL)
    assert "recompute_unit_1" in rc.module.code
    assert all(r.saved_bytes > 0 for r in rc.recomputed)
    # the measured bytes a recompute allocates never exceed the capture's activation bytes of that unit
    assert all(r.saved_bytes <= graph.units[r.unit].activation_bytes for r in rc.recomputed)


class _DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.a(x)))
        h = self.drop(torch.relu(self.b(h)))
        return self.c(h)


def _fx_units(gm: torch.fx.GraphModule) -> dict[int, tuple[str, ...]]:
    """Unit k = the k-th compute node (tests of hand-traced modules)."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return {k: (n.name,) for k, n in enumerate(nodes)}


def test_dropout_draws_the_same_masks_on_recompute_and_leaves_the_stream_as_without():
    net = _DropoutMLP()
    gm = torch.fx.symbolic_trace(net)
    x = torch.randn(16, 8)
    program = split_stages(gm, {}, example_inputs=(x,), num_stages=1)
    units = _fx_units(gm)
    plain = build_stage(program, 0, state_dict=net.state_dict(), device="cpu")
    rc = build_stage(program, 0, state_dict=net.state_dict(), device="cpu", recompute=units)
    results = []
    for stage in (plain, rc):
        torch.manual_seed(3)
        stage.module.train()
        out = stage(x)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in stage.named_parameters()}, torch.rand(4)))
    (out0, g0, after0), (out1, g1, after1) = results
    assert torch.equal(out0, out1) and torch.equal(after0, after1)  # same masks, same stream afterwards
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=RTOL, atol=ATOL)


def test_exported_hf_dropout_replays_on_recompute(tmp_path):
    """GPT-2 with dropout 0.3 through torch.export (``aten.dropout`` nodes): the recomputed layers give the
    same loss and gradients as without recomputation; the dropout is live (another seed, another loss)."""
    import json

    from hetpipe.models import hf

    config = dict(hf.HF_ZOO["hf-gpt2-tiny"][1], resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3,
                  architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = f"hf:{tmp_path}/config.json"
    meta, example = hf.build_hf(spec, device="meta", batch=2, seq=16)
    graph = capture(meta, example, name=spec)
    assert any("dropout" in str(n.target) for n in graph.module.graph.nodes)
    torch.manual_seed(0)
    model, inputs = hf.build_hf(spec, device="cpu", batch=2, seq=16)
    program = split_stages(graph.module, {}, example_inputs=example, num_stages=1)
    results = []
    for seed, rc in ((5, None), (5, _units(graph, range(1, graph.num_units - 1))), (6, None)):
        stage = _stage(program, model, rc)
        torch.manual_seed(seed)
        loss = hf.lm_loss(stage(*inputs), inputs[0])
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in stage.named_parameters()}))
    (plain, g0), (recomputed, g1), (other, _) = results
    assert torch.equal(plain, recomputed) and not torch.equal(plain, other)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=RTOL, atol=ATOL)


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_eager_checkpoint_alone_updates_batchnorm_statistics_twice():
    """The trap the runtime handles: torch's checkpoint re-runs BatchNorm's statistics update."""
    from torch.utils.checkpoint import checkpoint

    bn = nn.BatchNorm1d(3)
    out = checkpoint(bn, torch.randn(4, 3, requires_grad=True), use_reentrant=False)
    out.sum().backward()
    assert int(bn.num_batches_tracked) == 2


def test_batchnorm_statistics_update_once_per_microbatch_under_recomputation():
    net = _ConvBN()
    gm = torch.fx.symbolic_trace(net)
    xs = [torch.randn(4, 3, 6, 6) for _ in range(3)]
    program = split_stages(gm, {}, example_inputs=(xs[0],), num_stages=1)
    stages = [build_stage(program, 0, state_dict=copy.deepcopy(net.state_dict()), device="cpu", recompute=rc)
              for rc in (None, _fx_units(gm))]
    for stage in stages:
        outs = [stage(x) for x in xs]  # 1F1B-like: several forwards, then the backwards
        for out in reversed(outs):
            out.square().sum().backward()
    (plain, rc) = (dict(s.module.named_buffers()) for s in stages)
    bn_unit = next(r for r in stages[1].recomputed if r.mutated_buffers)
    assert len(bn_unit.mutated_buffers) == 3  # running mean, running var, num_batches_tracked
    assert int(rc["bn.num_batches_tracked"]) == 3 == int(plain["bn.num_batches_tracked"])
    for name in plain:
        torch.testing.assert_close(rc[name], plain[name], rtol=RTOL, atol=ATOL)
    for (n, p), (_, q) in zip(stages[0].named_parameters(), stages[1].named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)


class _SharedBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale  # mul saves the buffer for the backward
        return torch.tanh(h * self.scale)


def test_a_buffer_saved_earlier_and_read_by_a_recomputed_unit_keeps_its_version():
    """The first forward's dry run must not touch buffers it did not change (autograd checks their version)."""
    net = _SharedBuffer()
    gm = torch.fx.symbolic_trace(net)
    x = torch.randn(3, 4)
    program = split_stages(gm, {}, example_inputs=(x,), num_stages=1)
    names = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    rc = build_stage(program, 0, state_dict=net.state_dict(), device="cpu",
                     recompute={1: tuple(names[names.index("mul_1"):])})  # h * scale and tanh
    rc(x).sum().backward()
    net(x).sum().backward()
    assert rc.recomputed[0].mutated_buffers == ()
    for (_, p), (_, q) in zip(net.named_parameters(), rc.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL)


def test_a_unit_not_on_the_stage_is_refused_by_name():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.Tanh()))
    program = split_stages(gm, {"_0": 0, "_1": 1}, example_inputs=(torch.zeros(1, 2),))
    with pytest.raises(ScheduleError, match="unit 7"):
        build_stage(program, 0, state_dict=None, device="cpu", recompute={7: ("_1",)})


def test_plan_recompute_units_outside_the_stage_are_refused():
    from hetpipe.runtime.rank import recompute_nodes
    from tests.runtime_plans import synthetic_plan

    plan = synthetic_plan()
    stages = list(plan.stages)
    stages[1] = dataclasses.replace(stages[1], recompute_units=(3, 4))
    ok = dataclasses.replace(plan, stages=tuple(stages))
    assert recompute_nodes(ok, 1) == {3: tuple(plan.units[3].node_names), 4: tuple(plan.units[4].node_names)}
    stages[1] = dataclasses.replace(stages[1], recompute_units=(5,))
    with pytest.raises(PlanError, match="recompute_units lists unit 5"):
        recompute_nodes(dataclasses.replace(plan, stages=tuple(stages)), 1)


def test_executor_ledger_holds_only_inputs_of_recomputed_units_and_counts_one_recompute():
    from hetpipe.runtime.execute.executor import PipelineExecutor
    from hetpipe.runtime.execute.options import ExecutorOptions
    from hetpipe.schedule.builders import make_schedule

    graph, program, model, inputs, fn, targets = _one_stage("gpt-tiny")
    peaks = {}
    for label, rc in (("plain", None), ("recompute", _units(graph, range(1, graph.num_units - 1)))):
        stage = build_stage(program, 0, state_dict=model.state_dict(), device="cpu", recompute=rc)
        ex = PipelineExecutor(stage, rank=0, num_stages=1, schedule_actions=make_schedule("1f1b", 1, 2)[0],
                              optimizer=torch.optim.SGD(stage.parameters(), lr=0.0), microbatches=2, loss_fn=fn,
                              options=ExecutorOptions(timeout_s=5.0, track_saved_every_step=True))
        stats = ex.step([inputs, inputs], [targets, targets])
        peaks[label] = (stats.memory.peak_activation_bytes, stage.recompute_bytes)
    (plain, _), (rc_peak, transient) = peaks["plain"], peaks["recompute"]
    units = graph.units[1:graph.num_units - 1]
    # 1F1B on one stage: one micro-batch in flight at a time
    kept = sum(u.activation_bytes for u in units) - sum(graph.units[u.index - 1].boundary_bytes for u in units)
    assert 0 < transient <= max(u.activation_bytes for u in units)
    assert rc_peak < plain
    assert rc_peak == pytest.approx(plain - kept + transient, rel=0.05)


# ----------------------------------------------------------------------------- multi-process (gloo, 3 ranks)


def with_recompute(plan, choose):
    """``plan`` with ``recompute_units = choose(plan, stage)`` on every stage (the plan takes the version
    that carries them itself)."""
    stages = tuple(dataclasses.replace(st, recompute_units=tuple(choose(plan, st))) for st in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def heaviest_half(plan, st) -> list[int]:
    """The stage's units with the most saved bytes, half of them (at least one)."""
    units = sorted(range(st.first_unit, st.last_unit + 1), key=lambda u: -plan.units[u].activation_bytes)
    return sorted(units[:max(1, len(units) // 2)])


def all_but_last(plan, st) -> list[int]:
    """Every unit of the stage but its last (consecutive recomputed units next to a kept one), or its only one."""
    return list(range(st.first_unit, max(st.first_unit + 1, st.last_unit)))


def worth_recomputing(plan, st) -> list[int]:
    """`heaviest_half`, without units that save nothing but their input (an embedding saves its ids:
    checkpointing it keeps the same ids and frees nothing)."""
    units = plan.units
    return [u for u in heaviest_half(plan, st) if u > 0 and units[u].activation_bytes > units[u - 1].boundary_bytes]


def predicted_recompute_bytes(plan, plain_memory_bytes: int, st) -> int:
    """M_s with recomputation, from the plain stage's M_s (the cost model rcplan implements):
    each recomputed unit keeps its input (nothing extra for the stage's first unit) instead of
    its saved activations, per in-flight micro-batch; one recompute's activations once."""
    p, m = len(plan.stages), plan.training.microbatches
    k = min(p - st.index, m)
    units = plan.units
    own = [u.recompute_bytes or u.activation_bytes for u in units]  # memory model 2: what the unit saves itself
    kept = sum(own[u] - (units[u - 1].boundary_bytes if u > st.first_unit else 0) for u in st.recompute_units)
    return plain_memory_bytes - k * kept + max(own[u] for u in st.recompute_units)


_GPT = "gpt-tiny"
#: The recomputing run launched by torchrun (an exported Hugging Face graph); the other two run the same rank
#: code on ranks forked from the test fork server (`tests.forked_launch`: ~10 s of CPU less each).
TORCHRUN_MODEL = "hf-llama-tiny"


@pytest.mark.slow
@pytest.mark.parametrize("model", [_GPT, "hf-llama-tiny", "tests.zoo_models:bn_cnn"])
def test_three_stages_with_recompute_train_like_a_single_device_loop(model, tmp_path, monkeypatch):
    """3 steps, 3 stages, recomputation on all but the last unit of every stage: losses, parameters
    and buffers (BatchNorm statistics of the CNN) equal a plain single-device PyTorch loop (fp32,
    rtol = atol = 1e-5).  The GPT case runs 1F1B with extra warm-ups (``1f1b@1,1,0``), the pairing
    `--schedule auto` chooses on slow links (issue 17: recomputation pays for the micro-batches in flight)."""
    from hetpipe.plan.schema import Plan
    from hetpipe.runtime.run import run
    from tests import zoo_harness as zh

    if model != TORCHRUN_MODEL:
        use_forked_launch(monkeypatch)
    family = zh.Family("GPT (built-in)", model, "hetpipe.models:lm_loss", True) if model == _GPT else zh.by_model(model)
    plan_path, _ = zh.plan_family(family, tmp_path)
    plan = with_recompute(Plan.load(plan_path), all_but_last)
    assert len(plan.stages) == 3 and all(st.recompute_units for st in plan.stages)
    ref_model, example = zh.reference_model(family)
    weights = zh.write_weights(family, ref_model, tmp_path)
    batches = zh.make_batches(family, example)
    report = run(plan, model=model, steps=zh.STEPS, seq=family.seq, weights=weights, data=batches,
                 loss=family.loss, save_weights=tmp_path / "trained", timeout_s=guard_s(120.0),
                 schedule="1f1b@1,1,0" if model == _GPT else None)
    ref = zh.reference_losses(family, ref_model, batches)
    assert [s.recompute_units for s in report.stages] == [st.recompute_units for st in plan.stages]
    assert report.schedule == ("1f1b@1,1,0" if model == _GPT else plan.training.schedule)
    torch.testing.assert_close(torch.tensor(report.losses), torch.tensor(ref), rtol=RTOL, atol=ATOL)
    saved = zh.saved_state(tmp_path / "trained")
    reference = dict(ref_model.named_parameters(remove_duplicate=False))
    reference.update(ref_model.named_buffers(remove_duplicate=False))
    for name, value in saved.items():
        torch.testing.assert_close(value.float(), reference[name].detach().float(), rtol=RTOL, atol=ATOL)
    worst, missing = zh.state_difference(ref_model, saved)
    assert not missing
    log.info("%s: recompute %s; max loss diff %.1e, max parameter/buffer diff %.1e over %d tensors", model,
             [st.recompute_units for st in plan.stages], max(abs(a - b) for a, b in zip(report.losses, ref)),
             worst, len(saved))


@pytest.mark.slow
@pytest.mark.parametrize("model, batch, seq", [("gpt-demo", 2, 32), ("hf-llama-tiny", 2, 32)])
def test_recomputing_stages_hold_less_and_match_the_cost_model(plain_peak_run, model, batch, seq, monkeypatch):
    """Peak held bytes (the executor's ledger) of each recomputing stage: below the same stage without
    recomputation, never above the planner's M_s with recomputation (`evaluate`; the formula spelled out
    in `predicted_recompute_bytes`), and within 5% of it."""
    from hetpipe.partitioner.problem import evaluate
    from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan
    from hetpipe.runtime.run import run
    from tests.test_memory_truth import TOLERANCE

    plain_path, plain_report = plain_peak_run(model, batch, seq)  # the run tests/test_memory_truth.py checks
    use_forked_launch(monkeypatch)  # the ledger's bytes: the same ranks' code, forked (tests/forked_launch.py)
    plain = Plan.load(plain_path)
    rc = with_recompute(plain, worth_recomputing)
    assert sum(1 for st in rc.stages if st.recompute_units) >= 2
    recomputing = run(rc, model=model, steps=2, seq=seq, timeout_s=guard_s(90.0))
    peaks = {"plain": [s.peak_bytes for s in plain_report.stages],
             "recompute": [s.peak_bytes for s in recomputing.stages]}
    # the ledger holds no backward transient (memory model 4's T_s): compare it with M_s priced without them
    evaluated = evaluate(dataclasses.replace(problem_from_plan(rc), transient_bwd_bytes=(), step_transient={}),
                         stages_from_plan(rc)).stages
    plain_held = ledger_bytes(plain)
    for st, held, without in zip(rc.stages, peaks["recompute"], peaks["plain"]):
        if not st.recompute_units:
            assert held == without
            continue
        predicted = evaluated[st.index].memory_bytes  # the planner's M_s with recomputation
        # memory model 2 prices the recompute at the moments inside a backward (`pipeline_stage_bytes`),
        # so the spelled-out plain-M_s formula (`predicted_recompute_bytes`) is only a reading aid now
        if predicted < plain_held[st.index]:  # the last stage (one micro-batch in flight) gains
            assert held < without, (st.index, held, without)  # nothing: the recompute needs what it freed
        assert held <= predicted, (st.index, held, predicted)
        assert held >= (1 - TOLERANCE) * predicted, (st.index, held / predicted)
        log.info("%s stage %d: held %d B with recompute %s, %d B without; predicted %d B (ratio %.4f)", model,
                 st.index, held, st.recompute_units, without, predicted, held / predicted)


def _trainer_worker(rank: int, world: int, plan_path: str) -> dict:
    from hetpipe.models import lm_loss
    from hetpipe.runtime.trainer import Trainer
    from tests import test_trainer as tt

    trainer = Trainer(plan_path, model=tt.MODEL, seq=tt.SEQ, loss=lm_loss, optimizer=tt.sgd, lr_scheduler=tt.halve,
                      grad_clip_norm=1.0, timeout_s=60.0)
    losses = [trainer.step(x if trainer.is_first else None, y if trainer.is_last else None).loss
              for x, y in tt._loader(256)]
    return {"losses": losses, "recomputed": [r.unit for r in trainer.stage.recomputed],
            "params": {n: p.detach().clone() for n, p in trainer.stage.named_parameters()}}


@pytest.mark.slow
def test_trainer_runs_a_recompute_plan_unchanged(trainer_world):
    """`hetpipe.Trainer` in a user loop builds each stage with the plan's recomputed units and matches the
    unsplit model (the `tests/test_trainer.py` loop: SGD with momentum, clipping, an LR schedule; its
    stages, every one recomputing all but its last unit; one world shared with that file's test,
    tests/conftest.py)."""
    from tests import test_trainer as tt

    plan, results = trainer_world["recompute"]
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}: {res['error']}"
    values = [res["value"] for res in results]
    assert [v["recomputed"] for v in values] == [list(st.recompute_units) for st in plan.stages]
    ref_losses, ref_params = tt._reference()
    torch.testing.assert_close(values[2]["losses"], ref_losses, rtol=tt.RTOL, atol=tt.ATOL)
    for v in values:
        for name, value in v["params"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=tt.RTOL, atol=tt.ATOL)


def _replica_worker(rank: int, world: int, plan) -> dict:
    from hetpipe.runtime.replicas.trainer import ReplicaTrainer
    from tests import test_replica_runtime as tr

    trainer = ReplicaTrainer(plan, model=tr.MODEL, seq=tr.SEQ, optimizer=tr._sgd, grad_clip_norm=tr.CLIP,
                             timeout_s=60.0, stage_ranks=tr.STAGE_RANKS)  # sync overlapped with the backward
    losses = [trainer.step(x if trainer.is_first else None, y if trainer.is_last else None).loss
              for x, y in tr._num_batches()]
    return {"losses": losses, "recomputed": [r.unit for r in trainer.stage.recomputed],
            "params": {n: p.detach().clone() for n, p in trainer.stage.module.named_parameters(remove_duplicate=False)}}


@pytest.mark.slow
def test_replica_plan_with_recompute_equals_single_device_training(replica_numerics):
    """Uneven replicas (a 2-stage and a 1-stage pipeline), every stage recomputing all but its last unit,
    gradient sync launched from hooks during the recomputing backward: equal to one device.  Run on the
    3-rank world of tests/test_replica_runtime.py's numerics, after its cases (tests/conftest.py)."""
    from tests import test_replica_runtime as tr

    plan = with_recompute(tr._numerics_plan(), all_but_last)
    for o in replica_numerics:
        assert "error" not in o.value[tr.RECOMPUTE], f"rank {o.rank}: {o.value[tr.RECOMPUTE]['error']}"
    outcomes = [dataclasses.replace(o, value=o.value[tr.RECOMPUTE]["value"]) for o in replica_numerics]
    by_rank = {r: list(plan.stages[s].recompute_units) for s, r in enumerate(tr.STAGE_RANKS)}
    assert {o.rank: o.value["recomputed"] for o in outcomes} == by_rank
    ref_losses, ref_params, _ = tr._numerics_reference()
    for o in outcomes:
        torch.testing.assert_close(o.value["losses"], ref_losses, rtol=tr.RTOL, atol=tr.ATOL)
        for name, value in o.value["params"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=tr.RTOL, atol=tr.ATOL)
