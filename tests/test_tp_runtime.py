"""Tensor-parallel groups inside the pipeline runtime (issue 15).

1. The rank layout and the refusals, without processes.
2. One emulated `hetpipe run` of a plan whose stage 0 runs on a group of two cards at uneven shares
   0.7 / 0.3 (heads 3:1, MLP columns 179:77) and whose stage 1 is one card, on 3 gloo ranks: its
   per-step losses and its saved (gathered) parameters equal a plain single-device loop over the
   same weights and data (fp32, rtol 1e-5), and its report carries one row per member beside that
   member's own predicted F, B and M_s.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from hetpipe.errors import ConfigError, PlanError
from hetpipe.plan.group_run import (
    member_timings, rank_slots, refuse_group_supervision, refuse_unrunnable_groups)
from tests.machine_load import guard_s

MODEL, MICRO_BATCH, SEQ, MICROBATCHES, STEPS = "gpt-tiny", 2, 16, 4, 3
SHARES = (0.7, 0.3)
LR, MOMENTUM = 1e-2, 0.9  # the plan's optimizer "momentum" at the runtime's default rate (runtime/rank.py)


@functools.lru_cache(maxsize=None)
def tp_graph(model: str):
    """The captured model (cached: plans and graphs are immutable)."""
    from hetpipe.plan.build import capture_builtin

    return capture_builtin(model, batch=MICRO_BATCH, seq=SEQ, optimizer="momentum")


@functools.lru_cache(maxsize=None)
def tp_plan(model: str = MODEL, cut: int = 3, lead: int = 1):
    """Stage 0 (units 0-``cut``) on the group box:1 + box:0 (lead: the 3060), stage 1 (the rest) on box:2."""
    from hetpipe.cost_models.cluster import cluster_from_dict
    from hetpipe.partitioner.problem import Stage, evaluate
    from hetpipe.plan.build import assemble_plan, build_problem
    from hetpipe.plan.schema import SolverReport

    graph = tp_graph(model)
    cluster = cluster_from_dict({"nodes": [{"name": "box", "intra": "pcie-host", "devices": [
        {"gpu": "rtx3090"}, {"gpu": "rtx3060-12gb"}, {"gpu": "rtx4090"}]}]})
    problem = build_problem(graph, cluster, microbatches=MICROBATCHES, tensor_parallel="auto")
    stages = (Stage(lead, 0, cut, members=(lead, 1 - lead)), Stage(2, cut + 1, len(graph.units) - 1))
    ev = evaluate(problem, stages)
    plan = assemble_plan(graph, cluster, problem=problem, stages=stages, global_batch=MICRO_BATCH * MICROBATCHES,
                         solver=SolverReport("hand", "FEASIBLE", ev.iteration_s, 0.0, 0.0))
    # the planner's shares for this tiny model are near even (kernel launches dominate): run uneven ones
    return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], group_shares=SHARES),
                                             *plan.stages[1:]))


# ----------------------------------------------------------------------------- 1. layout and refusals


def test_one_rank_per_card_the_lead_first_and_what_does_not_run_yet_is_refused_naming_the_fix():
    plan = tp_plan()
    assert [(s.stage, s.member, s.device) for s in rank_slots(plan)] == [(0, 0, "box:1"), (0, 1, "box:0"),
                                                                          (1, 0, "box:2")]
    refuse_unrunnable_groups(plan, "1f1b")
    with pytest.raises(ConfigError, match="use --schedule 1f1b or gpipe"):
        refuse_unrunnable_groups(plan, "zb-h1")
    levers = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], recompute_units=(1,)),
                                               *plan.stages[1:]))
    with pytest.raises(PlanError, match=r"plan stages \[0\] are tensor-parallel groups that recompute or offload"):
        refuse_unrunnable_groups(levers, "1f1b")
    with pytest.raises(ConfigError, match="--adapt and --wait-for-return: plan stages .0. are tensor-parallel groups.*--max-restarts N alone"):
        refuse_group_supervision(plan)
    from hetpipe.plan.check import check_plan

    led_by_the_larger = tp_plan(lead=0)  # the stage records its tightest member's usable bytes, not the lead's
    assert led_by_the_larger.stages[0].usable_bytes < led_by_the_larger.devices[0].usable_bytes
    assert not [v for v in check_plan(led_by_the_larger).violations if "usable" in v]
    mine = member_timings(plan)  # each member at its own (recorded) share: the 0.7 member is the slower
    assert set(mine) == {(0, 0), (0, 1)} and mine[(0, 0)].fwd_s > mine[(0, 1)].fwd_s
    assert mine[(0, 0)].memory_bytes > mine[(0, 1)].memory_bytes


# ----------------------------------------------------------------------------- 2. a run


def _batches(model: torch.nn.Module, example: tuple[torch.Tensor, ...]) -> list:
    from hetpipe import models

    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, models.input_vocab(MODEL) or 64, (MICRO_BATCH * MICROBATCHES, SEQ), generator=gen)
        out.append(((x,), models.example_targets(MODEL, (x,))))
    return out


def group_reference(model: torch.nn.Module, batches: list, model_name: str = MODEL) -> list[float]:
    """Plain single-device training of ``model_name``: micro-batches accumulated, mean loss, SGD with momentum."""
    from hetpipe.models import loss_fn

    loss = loss_fn(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for (x,), y in batches:
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            value = loss(model(xs), ys)
            (value / MICROBATCHES).backward()
            total += float(value.detach())
        opt.step()
        losses.append(total / MICROBATCHES)
    return losses


def assert_gathered_equal(state: dict, reference: torch.nn.Module) -> None:
    """Every parameter gathered back from a group's members equals the single-device model's (rtol/atol 1e-5)."""
    params = dict(reference.named_parameters(remove_duplicate=False))
    assert {n for n, _ in reference.named_parameters()} <= set(state)
    for name, value in state.items():
        if name in params:
            torch.testing.assert_close(value, params[name].detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def grouped_run(tmp_path_factory):
    from hetpipe import models
    from hetpipe.runtime.run import run

    out = tmp_path_factory.mktemp("tp_run")
    plan = tp_plan()
    torch.manual_seed(0)
    resolved = models.resolve(MODEL, device="cpu", batch=MICRO_BATCH, seq=SEQ)
    torch.save(resolved.model.state_dict(), out / "weights.pt")
    batches = _batches(resolved.model, resolved.example_inputs)
    reference = copy.deepcopy(resolved.model)
    ref_losses = group_reference(reference, batches)
    report = run(plan, model=MODEL, steps=STEPS, seq=SEQ, data=batches, weights=out / "weights.pt",
                 save_weights=out / "saved", emulate=True, run_dir=out / "run", timeout_s=guard_s(120.0))
    return plan, report, ref_losses, reference, out / "saved"


@pytest.mark.slow
def test_a_group_stage_in_the_pipeline_trains_like_one_device(grouped_run):
    from tests.zoo_harness import saved_state

    plan, report, ref_losses, reference, saved = grouped_run
    assert report.world_size == 3
    torch.testing.assert_close(list(report.losses), ref_losses, rtol=1e-5, atol=0)
    state = saved_state(saved)  # every member's shards gathered back, written by the leads
    assert_gathered_equal(state, reference)


@pytest.mark.slow
def test_the_report_has_a_row_per_member_beside_its_own_prediction(grouped_run):
    plan, report, _, _, _ = grouped_run
    mine = member_timings(plan)
    rows = {(r.stage, r.member): r for r in report.members}
    assert set(rows) == set(mine) and [rows[k].device for k in sorted(rows)] == ["box:1", "box:0"]
    for key, row in rows.items():
        assert (row.predicted_fwd_s, row.predicted_bwd_s, row.predicted_memory_bytes) == (
            mine[key].fwd_s, mine[key].bwd_s, mine[key].memory_bytes)
        # stretched to at least its own F / B (the emulation sleeps up to the target, never less)
        assert row.fwd_emulated_s >= 0.99 * row.predicted_fwd_s and row.bwd_emulated_s >= 0.99 * row.predicted_bwd_s
        assert 0 < row.peak_bytes <= row.predicted_memory_bytes <= row.usable_bytes  # bytes: deterministic
    assert rows[(0, 0)].peak_bytes > rows[(0, 1)].peak_bytes  # the 0.7 member holds more of every block
    assert [s.stage for s in report.stages] == [0, 1]  # the stage rows: the leads


# ----------------------------------------------------------------------------- 3. Trainer, clipped


CLIP = 0.5  # below every step's global gradient norm here (2.3 on the first step): every step clips


def _trainer_rank(rank: int, world: int, plan, weights: str, batches: list, out: str) -> dict:
    from hetpipe.runtime.trainer import Trainer

    trainer = Trainer(plan, model=MODEL, seq=SEQ, weights=weights, grad_clip_norm=CLIP)
    norms, losses = [], []
    for (x,), y in batches:
        stats = trainer.step((x,) if trainer.is_first else None, y if trainer.is_last else None)
        norms.append(stats.grad_norm)
        if stats.loss is not None:
            losses.append(stats.loss)
    trainer.save_weights(out)
    return {"norms": norms, "losses": losses}


@pytest.mark.slow
def test_clipping_uses_the_global_norm_over_shards_counting_replicated_parameters_once(tmp_path):
    """The Trainer (the API that clips) on the same plan: every rank's pre-clip norm is the single
    device's, and the clipped training equals it."""
    from hetpipe import models
    from tests.dist_helpers import run_world
    from tests.zoo_harness import saved_state

    torch.manual_seed(0)
    resolved = models.resolve(MODEL, device="cpu", batch=MICRO_BATCH, seq=SEQ)
    torch.save(resolved.model.state_dict(), tmp_path / "weights.pt")
    batches = _batches(resolved.model, resolved.example_inputs)
    reference, loss = copy.deepcopy(resolved.model), models.loss_fn(MODEL)
    opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    ref_norms = []
    for (x,), y in batches:
        opt.zero_grad()
        for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            (loss(reference(xs), ys) / MICROBATCHES).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
        opt.step()
    assert min(ref_norms) > CLIP  # the test clips on every step
    outs = run_world(_trainer_rank, world_size=3, args=(tp_plan(), str(tmp_path / "weights.pt"), batches,
                                                        str(tmp_path / "saved")), timeout_s=240,
                     out_dir=tmp_path / "ranks")
    for o in outs:
        assert o.error is None, o.error
        torch.testing.assert_close(o.value["norms"], ref_norms, rtol=1e-5, atol=0)
    params = dict(reference.named_parameters(remove_duplicate=False))
    for name, value in saved_state(tmp_path / "saved").items():
        if name in params:
            torch.testing.assert_close(value, params[name].detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
