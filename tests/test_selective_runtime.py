"""The selective recompute level end to end (issue 14): plan field (version 7), check, runtime, gloo training.

The plan here is gpt-tiny in three stages (tests/test_trainer.py's cut) on cards whose usable memory is the
selective stage's M_s: the planner's own lever choice (`with_recompute`) then runs the level on the stages
where it frees something, and `check` re-derives that choice; ``--recompute selective`` plans the same
placement with the level forced (`forced_plan`), which the gloo ranks train.  The runtime drops exactly the outputs the
planner frees (`runtime/stage/selective.py`): the ledger holds the planner's freed bytes less per
micro-batch; 3 gloo ranks train like the unsplit model (fp32, rtol = atol = 1e-5).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from hetpipe.partitioner.problem import Stage, evaluate
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan
from tests import test_trainer as tt
from tests.plan_docs import as_memory_model_4

RTOL = ATOL = 1e-5  # fp32, the acceptance


@functools.lru_cache(maxsize=1)
def _graphs():
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture

    # priced for the optimizer the ranks run (`tt.sgd`: SGD with momentum, whose step allocates nothing, memory
    # model 5), so each card's usable bytes are its stage's moments with the level, not an Adam step's
    meta, example = build(tt.MODEL, device="meta", batch=tt.BATCH, seq=tt.SEQ)
    return (capture(meta, example, name=tt.MODEL, optimizer="momentum"),
            capture(meta, example, name=tt.MODEL, granularity="node", optimizer="momentum"))


def _tight_cards():
    """(cluster, the level's tables, its record, the hand cut): gpt-tiny's 3 stages, each card's usable bytes its
    stage's M_s with the level and no whole-unit prefix."""
    from hetpipe.plan.build import build_problem
    from hetpipe.plan.selective_plan import selective_offer
    from tests.synthetic import synthetic_cluster

    graph, nodes = _graphs()
    n = graph.num_units
    cluster = synthetic_cluster()
    tables, record = selective_offer(graph, nodes, cluster)
    stages = (Stage(0, 0, 1, selective=True), Stage(1, 2, n - 3, selective=True), Stage(2, n - 2, n - 1, selective=True))
    problem = dataclasses.replace(build_problem(graph, cluster, microbatches=tt.MICROBATCHES, recompute="auto"),
                                  selective=tables)
    need = [c.memory_bytes for c in evaluate(problem, stages).stages]
    devices = tuple(dataclasses.replace(d, reserve_bytes=d.profile.memory_bytes - m) for d, m in zip(cluster.devices, need))
    return dataclasses.replace(cluster, devices=devices), tables, record, stages


def selective_plan() -> Plan:
    """gpt-tiny on 3 synthetic cards, each card's usable bytes its stage's M_s with the level and no
    whole-unit prefix: the planner's choice (`with_recompute`) runs the level wherever it frees bytes."""
    from hetpipe.plan.build import assemble_plan, build_problem
    from hetpipe.plan.schema import SolverReport

    graph, _ = _graphs()
    cluster, tables, record, stages = _tight_cards()
    problem = dataclasses.replace(build_problem(graph, cluster, microbatches=tt.MICROBATCHES, recompute="auto"),
                                  selective=tables)
    chosen = with_recompute(problem, stages)
    ev = evaluate(problem, chosen)
    solver = SolverReport("hand", "FEASIBLE", ev.iteration_s, 0.0, 0.0)
    return assemble_plan(graph, cluster, problem=problem, stages=chosen, solver=solver,
                         global_batch=graph.micro_batch_size * tt.MICROBATCHES, selective=record)


@functools.lru_cache(maxsize=1)
def forced_plan() -> Plan:
    """The planner's own ``--recompute selective`` plan on the same cards (`partition_graph`, the exact DP):
    the level on every stage, no whole unit; only 3 stages fit."""
    from hetpipe.plan.build import partition_graph

    graph, _ = _graphs()
    cluster, tables, record, _ = _tight_cards()
    return partition_graph(graph, cluster, global_batch=graph.micro_batch_size * tt.MICROBATCHES, solver="dp",
                           recompute="selective", selective=(tables, record))


def test_the_plan_records_the_level_and_round_trips(tmp_path):
    from hetpipe.plan.check import check_plan

    plan = selective_plan()
    assert plan.version == 9 and plan.selective is not None  # 7: the level; 9: step tables
    assert [st.selective for st in plan.stages] == [True, True, True]  # the planner's choice on tight cards
    assert all(not st.recompute_units for st in plan.stages)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    assert check_plan(plan).ok, check_plan(plan).violations
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["selective"]["units"][0]["nodes"] == ["transformer_h_0_ln_1", "transformer_h_0_ln_2", "gelu"]
    # a version-6 plan (no level) still loads: no stage runs it, no tables
    old = as_memory_model_4({k: v for k, v in doc.items() if k != "selective"})  # no step tables (version 9)
    old["version"] = 6
    old["stages"] = [{k: v for k, v in st.items() if k != "selective"} for st in doc["stages"]]
    loaded = Plan.from_dict(old)
    assert loaded.selective is None and not any(st.selective for st in stages_from_plan(loaded))
    assert problem_from_plan(loaded).selective is None
    doc["version"] = 6  # a file that claims less than its fields need is refused
    with pytest.raises(Exception, match="version"):
        Plan.from_dict(doc)


def test_check_rederives_the_level_and_refuses_a_tampered_one():
    from hetpipe.plan.check import check_plan
    from hetpipe.plan.selective_plan import selective_mismatch

    plan = selective_plan()
    graph, nodes = _graphs()
    assert selective_mismatch(plan.selective, graph, nodes) is None
    off = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], selective=False), *plan.stages[1:]))
    found = check_plan(off).violations
    assert any(v.startswith("stage 0: selective is False, but recompute auto chooses True") for v in found), found
    sel = plan.selective
    unit = dataclasses.replace(sel.units[0], freed_bytes=sel.units[0].freed_bytes * 2)
    more = dataclasses.replace(plan, selective=dataclasses.replace(sel, units=(unit, *sel.units[1:])))
    found = check_plan(more).violations
    assert any("memory_bytes" in v for v in found), found  # the stage's M_s no longer what it records
    assert "freeing" in selective_mismatch(more.selective, graph, nodes)
    renamed = dataclasses.replace(sel.units[0], nodes=("transformer_h_0_ln_1",))
    assert "drops" in selective_mismatch(dataclasses.replace(sel, units=(renamed, *sel.units[1:])), graph, nodes)
    foreign = dataclasses.replace(sel.units[0], nodes=("transformer_ln_f",))
    bad = dataclasses.replace(plan, selective=dataclasses.replace(sel, units=(foreign, *sel.units[1:])))
    assert any("not a node of the unit" in v for v in check_plan(bad).violations)


def test_a_selective_stage_has_the_same_gradients_and_holds_the_freed_bytes_less():
    """One process, the whole model as one stage: same loss and gradients as without the level; the saved
    tensors the ledger counts are the planner's freed bytes fewer; each dropped node re-runs once."""
    from hetpipe.models import build, training_loss
    from hetpipe.plan.selective_schema import dropped_nodes
    from hetpipe.runtime.execute.held import HeldBytes
    from hetpipe.runtime.stage.buffers import ModelBuffers
    from hetpipe.runtime.stage.build import build_stage, split_stages

    graph, _ = _graphs()
    plan = selective_plan()
    program = split_stages(graph.module, {}, example_inputs=build(tt.MODEL, device="meta", batch=tt.BATCH,
                                                                  seq=tt.SEQ)[1], num_stages=1)
    torch.manual_seed(0)
    model, inputs = build(tt.MODEL, device="cpu", batch=tt.BATCH, seq=tt.SEQ)
    fn, targets = training_loss(tt.MODEL, inputs)

    def run(selective):
        stage = build_stage(program, 0, state_dict=model.state_dict(), device="cpu", buffers=ModelBuffers(model),
                            selective=selective)
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = fn(stage(*inputs), targets)
        held = HeldBytes({p.untyped_storage().data_ptr() for p in stage.parameters()}).add(0, saved + list(inputs))
        saved.clear()
        loss.backward()
        return stage, held, loss.item(), {n: p.grad for n, p in stage.named_parameters()}

    _, plain_held, plain_loss, plain_grads = run(None)
    stage, held, loss, grads = run(dropped_nodes(plan.selective, 0, graph.num_units - 1))
    assert loss == plain_loss
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=RTOL, atol=ATOL)
    assert plain_held - held == sum(u.freed_bytes for u in plan.selective.units)
    assert [lv.recomputes for lv in stage.selective] == [len(u.nodes) for u in plan.selective.units]
    assert stage.selective_bytes == max(lv.dropped_bytes for lv in stage.selective) > 0
    assert "transformer_h_0_ln_1" in {n.name for n in stage.module.graph.nodes}  # the plan's node names kept


def _selective_worker(rank: int, world: int, plan_path: str) -> dict:
    from hetpipe.models import lm_loss
    from hetpipe.runtime.trainer import Trainer

    trainer = Trainer(plan_path, model=tt.MODEL, seq=tt.SEQ, loss=lm_loss, optimizer=tt.sgd, lr_scheduler=tt.halve,
                      grad_clip_norm=1.0, timeout_s=60.0)
    losses = [trainer.step(x if trainer.is_first else None, y if trainer.is_last else None).loss
              for x, y in tt._loader(256)]
    return {"losses": losses, "levels": [(lv.unit, lv.recomputes > 0) for lv in trainer.stage.selective],
            "params": {n: p.detach().clone() for n, p in trainer.stage.named_parameters()}}


def _runtime_view(plan: Plan) -> tuple:
    """What the runtime reads of a plan's placement and levers (the recompute setting's note it does not)."""
    return plan.selective, plan.training, plan.stages, plan.units


@pytest.mark.slow
def test_three_gloo_ranks_with_selective_stages_train_like_the_unsplit_model(tmp_path):
    """3 ranks, every stage running the level (tests/test_trainer.py's loop: SGD with momentum, clipping,
    an LR schedule): losses and every parameter equal the unsplit model's (fp32, rtol = atol = 1e-5).  The
    plan is the planner's ``--recompute selective`` answer, which here is the ``auto`` hand plan's placement
    and levers exactly: one launch runs both."""
    from hetpipe.plan.check import check_plan
    from tests.dist_helpers import run_world

    plan = forced_plan()
    assert plan.cost_model["recompute"].startswith("selective:") and check_plan(plan).ok
    assert _runtime_view(plan) == _runtime_view(selective_plan())
    plan.save(tmp_path / "plan.json")
    outcomes = run_world(_selective_worker, world_size=3, args=(str(tmp_path / "plan.json"),),
                         timeout_s=tt.WORLD_TIMEOUT_S, out_dir=tmp_path / "ranks")
    for o in outcomes:
        assert o.value is not None, f"rank {o.rank} (exit {o.exitcode}): {o.error}"
    want = [[(u.index, True) for u in plan.selective.units if st.first_unit <= u.index <= st.last_unit]
            for st in plan.stages]
    assert [o.value["levels"] for o in outcomes] == want
    ref_losses, ref_params = tt._reference()
    torch.testing.assert_close(outcomes[2].value["losses"], ref_losses, rtol=RTOL, atol=ATOL)
    for o in outcomes:
        for name, value in o.value["params"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL)
