"""ZeRO-1 sharding of a tied parameter (GPT-2's wte = lm_head) with the sync group that holds all its units.

Two one-card replicas of gpt-tiny (m = 2 each) hold every unit, so the one sync group holds both
aliases of the tied embedding on one card per replica: the plan counts its Adam state in the
group's O_g, and the runtime shards it with the group (0.7 / 0.3).  Every step's loss and every
parameter after 3 steps equal the unsplit model trained with Adam on the global batch (fp32,
rtol 1e-5), and each rank's optimizer holds f_r of Adam's two moments of *all* its parameters.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hetpipe.partitioner.problem import Stage
from hetpipe.plan.shard_schema import PlanShard
from hetpipe.runtime.replicas.trainer import ReplicaTrainer
from tests.reference_loop import seeded_batches
from tests.runtime_plans import replica_plan_for
from tests.synthetic import synthetic_cluster

MODEL, SEQ, BATCH, STEPS, LR, EPS = "gpt-tiny", 16, 2, 3, 1e-2, 1e-6  # eps: tests/test_shard_runtime.py
RTOL, ATOL = 1e-5, 4e-5  # as tests/test_shard_runtime.py (fp32)
FRACTIONS = (0.7, 0.3)


def _graph() -> tuple[Any, Any]:
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture

    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    return capture(model, inputs, name=MODEL), inputs


def test_a_group_holding_every_use_of_a_tied_parameter_shards_its_state():
    from hetpipe.cost_models.offload import offload_rates
    from hetpipe.partitioner.replica_shard import evaluate_sharding, group_optimizer_bytes
    from hetpipe.partitioner.replica_types import ReplicaProblem
    from hetpipe.plan.build import build_problem

    graph, _ = _graph()
    assert graph.tied and graph.tied[0].unit_indices == (0, graph.num_units - 1)
    n = graph.num_units
    base = dataclasses.replace(build_problem(graph, synthetic_cluster(), microbatches=4),
                               offload_rates=offload_rates("adam", "fp32"))
    rp = ReplicaProblem(base, grad_bytes=tuple(u.param_bytes for u in graph.units), sharding="all")
    ev = evaluate_sharding(rp, [((Stage(0, 0, n - 1),), 2), ((Stage(1, 0, n - 1),), 2)], [0])
    assert ev.shards[0].optimizer_bytes == 8 * graph.param_count  # Adam's two fp32 moments of every parameter
    # split over two stages, no group holds both ends: the tied state stays whole on each copy
    assert group_optimizer_bytes(base, 0, n // 2) + group_optimizer_bytes(base, n // 2 + 1, n - 1) \
        == 8 * (graph.param_count - graph.tied[0].numel)


def sharded_plan() -> Any:
    graph, _ = _graph()
    n = graph.num_units
    plan = replica_plan_for(graph, synthetic_cluster(), [((Stage(0, 0, n - 1),), 2), ((Stage(1, 0, n - 1),), 2)])
    groups = tuple(dataclasses.replace(g, shard=PlanShard(FRACTIONS, 0, (0, 0), g.time_s)) for g in plan.sync.groups)
    return dataclasses.replace(plan, sync=dataclasses.replace(plan.sync, groups=groups))


def _adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR, eps=EPS)


def _worker(rank: int, world: int, plan: Any) -> dict[str, Any]:
    trainer = ReplicaTrainer(plan, model=MODEL, seq=SEQ, optimizer=_adam, timeout_s=60.0, stage_ranks=(0, 1))
    losses = [trainer.step(x, y).loss for x, y in seeded_batches(STEPS, seed=11)]
    named = trainer.stage.module.named_parameters(remove_duplicate=False)
    moments = sum(v.numel() for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step")
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in named}, "moments": moments,
            "stage_params": sum(p.numel() for p in trainer.stage.parameters()), "replica": trainer.place.replica}


def _reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from hetpipe.models import build, loss_fn
    from hetpipe.runtime.stage.buffers import ModelBuffers
    from hetpipe.runtime.stage.build import build_stage, split_stages

    graph, inputs = _graph()
    lm_loss = loss_fn(MODEL)
    whole = build_stage(split_stages(graph.module, {}, example_inputs=inputs, num_stages=1), 0, state_dict=None,
                        device="cpu", seed=0, buffers=ModelBuffers(build(MODEL, device="meta", batch=BATCH,
                                                                          seq=SEQ)[0]))
    start = {n: p.detach().clone() for n, p in whole.module.named_parameters(remove_duplicate=False)}
    opt = _adam(list(whole.parameters()))
    losses = []
    for ids, targets in seeded_batches(STEPS, seed=11):
        opt.zero_grad(set_to_none=True)
        loss = sum(lm_loss(whole(x), y) for x, y in zip(ids.chunk(4), targets.chunk(4))) / 4
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in whole.module.named_parameters(remove_duplicate=False)}, start


@pytest.mark.slow
def test_a_sharded_tied_embedding_equals_single_device_adam(replica_pair_world):
    results = replica_pair_world["shard_tied"]  # _worker on 2 ranks, after the DiLoCo case (tests/conftest.py)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result['error']}"
    out = [SimpleNamespace(rank=rank, value=result["value"]) for rank, result in enumerate(results)]
    ref_losses, ref_params, start = _reference()
    for o in out:
        got = o.value
        torch.testing.assert_close(got["losses"], ref_losses, rtol=RTOL, atol=ATOL)
        for p, value in got["params"].items():
            torch.testing.assert_close(value, ref_params[p], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, q=p, k=o.rank: f"rank {k} param {q}: {m}")
        share = FRACTIONS[got["replica"]]
        # f_r of the moments of every parameter, the tied embedding included (unsharded it would add its whole 2x)
        assert abs(got["moments"] - 2 * share * got["stage_params"]) <= 2 * 2, (o.rank, got["moments"])
    tied = "transformer.wte.weight"
    assert float((ref_params[tied] - start[tied]).abs().max()) > 100 * ATOL, "the steps must move the tied weight"
