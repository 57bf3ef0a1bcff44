"""ZeRO-1 with uneven shards on a running replica plan (issue 14, runtime half), against one device.

Replica A = 2 stages (m = 3), replica B = 1 stage (m = 1) of llama-tiny, both sync groups
sharded 0.7 / 0.3, Adam with global-norm clipping: every step's loss and every parameter after
3 steps equal the unsplit model trained with Adam on the concatenated global batch (fp32, rtol
1e-5), and each rank's optimizer holds only its shard's moments (f_r of Adam's two per parameter).  The same replicas unsharded with replica B's
stage offloading its optimizer state (issue 14's offload lever inside a replica plan) equal it too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from hetpipe.partitioner.problem import Stage
from hetpipe.plan.shard_schema import PlanShard
from hetpipe.runtime.replicas.shard import ShardGroup, ShardedOptimizer, shard_bounds
from hetpipe.runtime.replicas.trainer import ReplicaTrainer
from tests.dist_helpers import run_world
from tests.reference_loop import seeded_batches
from tests.runtime_plans import replica_plan_for
from tests.synthetic import synthetic_cluster

MODEL, SEQ, BATCH, STEPS, LR, CLIP = "llama-tiny", 16, 2, 3, 1e-2, 0.5
RTOL, ATOL = 1e-5, 4e-5  # as tests/test_replica_runtime.py (torch's pipelining tolerances, fp32)
FRACTIONS = (0.7, 0.3)
STAGE_RANKS = (1, 2, 0)  # replica A on ranks 1-2, replica B on rank 0


def _graph() -> tuple[Any, Any]:
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture

    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    return capture(model, inputs, name=MODEL), inputs


def sharded_plan() -> Any:
    """The replica layout above with both sync groups sharded 0.7 / 0.3 (the runtime reads the fractions)."""
    graph, _ = _graph()
    n = graph.num_units
    plan = replica_plan_for(graph, synthetic_cluster(), [((Stage(0, 0, n // 2), Stage(1, n // 2 + 1, n - 1)), 3),
                                                         ((Stage(2, 0, n - 1),), 1)])
    groups = tuple(dataclasses.replace(g, shard=PlanShard(FRACTIONS, 0, (0, 0), g.time_s)) for g in plan.sync.groups)
    return dataclasses.replace(plan, sync=dataclasses.replace(plan.sync, groups=groups))


#: Adam's eps.  Its default 1e-8 turns a gradient element of about 1e-8 (one that nearly cancels
#: over the batch) into a step of about lr whose size hangs on the gradient's last bits, so the
#: replicas' different summation order (weights 0.75 / 0.25 vs one mean of 4) moves such single
#: elements by up to 2e-4 -- with or without sharding (measured: the same elements, the same
#: differences).  With 1e-6 the step is smooth there (lr / eps x 1e-10 of rounding = 1e-6 < atol).
EPS = 1e-6


def _adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR, eps=EPS)


def _run(plan: Any) -> dict[str, Any]:
    trainer = ReplicaTrainer(plan, model=MODEL, seq=SEQ, optimizer=_adam, grad_clip_norm=CLIP, timeout_s=60.0,
                             stage_ranks=STAGE_RANKS)
    losses = [trainer.step(x if trainer.is_first else None, y if trainer.is_last else None).loss
              for x, y in seeded_batches(STEPS, seed=7)]
    named = trainer.stage.module.named_parameters(remove_duplicate=False)
    moments = sum(v.numel() for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step")
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in named}, "moments": moments,
            "stage_params": sum(p.numel() for p in trainer.stage.parameters()), "replica": trainer.place.replica,
            "host": bool(getattr(trainer.optimizer, "keeps_state_on_host", False))}


def offload_plan() -> Any:
    """The same replicas unsharded, replica B's only stage keeping its optimizer state on the host."""
    plan = sharded_plan()
    groups = tuple(dataclasses.replace(g, shard=None) for g in plan.sync.groups)
    stages = plan.stages[:2] + (dataclasses.replace(plan.stages[2], offload=True),)
    return dataclasses.replace(plan, stages=stages, sync=dataclasses.replace(plan.sync, groups=groups))


def _worker(rank: int, world: int, plans: Any) -> dict[str, Any]:
    """Every plan in turn in one spawned world (one start-up)."""
    return {name: _run(plan) for name, plan in plans.items()}


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    from hetpipe.models import build, loss_fn
    from hetpipe.runtime.stage.buffers import ModelBuffers
    from hetpipe.runtime.stage.build import build_stage, split_stages

    graph, inputs = _graph()
    lm_loss = loss_fn(MODEL)
    whole = build_stage(split_stages(graph.module, {}, example_inputs=inputs, num_stages=1), 0, state_dict=None,
                        device="cpu", seed=0, buffers=ModelBuffers(build(MODEL, device="meta", batch=BATCH,
                                                                          seq=SEQ)[0]))
    opt = _adam(list(whole.parameters()))
    losses = []
    for ids, targets in seeded_batches(STEPS, seed=7):
        opt.zero_grad(set_to_none=True)
        loss = sum(lm_loss(whole(x), y) for x, y in zip(ids.chunk(4), targets.chunk(4))) / 4
        loss.backward()
        torch.nn.utils.clip_grad_norm_(whole.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in whole.module.named_parameters(remove_duplicate=False)}


def _initial() -> dict[str, torch.Tensor]:
    from hetpipe.models import build
    from hetpipe.runtime.stage.buffers import ModelBuffers
    from hetpipe.runtime.stage.build import build_stage, split_stages

    graph, inputs = _graph()
    whole = build_stage(split_stages(graph.module, {}, example_inputs=inputs, num_stages=1), 0, state_dict=None,
                        device="cpu", seed=0, buffers=ModelBuffers(build(MODEL, device="meta", batch=BATCH,
                                                                          seq=SEQ)[0]))
    return {n: p.detach() for n, p in whole.module.named_parameters(remove_duplicate=False)}


def test_shard_bounds_tile_the_elements_by_fraction():
    for numel in (1, 7, 10, 1001):
        for fr in ((0.7, 0.3), (0.5, 0.25, 0.25), (1.0, 0.0), (0.0, 1.0)):
            b = shard_bounds(numel, fr)
            assert b[0][0] == 0 and b[-1][1] == numel and all(x[1] == y[0] for x, y in zip(b, b[1:]))
            assert all(abs((e - s) - f * numel) <= 1 for (s, e), f in zip(b, fr))


def test_a_lone_holder_steps_its_slice_in_place_like_the_plain_optimizer():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in (a, b)]
    plain = _adam(ref)
    # replica 0 owns the first 80% of the 17 elements: all of a (12) and 2 of b (the boundary cuts b)
    sharded = ShardedOptimizer([a, b], [ShardGroup("units 0-0", [a, b], None, (0.8, 0.2), 0, (0, 1))], _adam)
    for _ in range(2):
        g = [torch.randn_like(p) for p in (a, b)]
        for p, q, x in zip((a, b), ref, g):
            p.grad, q.grad = x.clone(), x.clone()
        sharded.step()
        plain.step()
    lo, hi = shard_bounds(17, (0.8, 0.2))[0]
    flat, want = torch.cat([a.reshape(-1), b.reshape(-1)]), torch.cat([p.reshape(-1) for p in ref])
    torch.testing.assert_close(flat[lo:hi], want[lo:hi], rtol=0, atol=0)  # the owned slice: bitwise
    assert sum(v.numel() for s in sharded.state.values() for k, v in s.items() if k != "step") == 2 * (hi - lo)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Any:
    plans = {"sharded": sharded_plan(), "offload": offload_plan()}
    out = run_world(_worker, world_size=3, args=(plans,), timeout_s=300.0, out_dir=tmp_path_factory.mktemp("zero"))
    for o in out:
        assert o.error is None and o.value is not None, f"rank {o.rank} (exit {o.exitcode}): {o.error}"
    return out


def _equal_reference(outcomes: Any, name: str, ref_losses: list[float], ref_params: dict[str, torch.Tensor]) -> None:
    for o in outcomes:
        got = o.value[name]
        torch.testing.assert_close(got["losses"], ref_losses, rtol=RTOL, atol=ATOL)
        for p, value in got["params"].items():
            torch.testing.assert_close(value, ref_params[p], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, q=p, k=o.rank: f"{name}: rank {k} param {q}: {m}")


@pytest.mark.slow
def test_an_offloading_replica_stage_equals_single_device_adam(outcomes):
    """Offload inside a replica plan: replica B steps on host copies; the run still equals one device."""
    ref_losses, ref_params = _reference()
    _equal_reference(outcomes, "offload", ref_losses, ref_params)
    b = next(o.value["offload"] for o in outcomes if o.value["offload"]["replica"] == 1)
    assert b["host"] and b["moments"] == 2 * b["stage_params"]  # the whole state, on the host copies
    assert not any(o.value["offload"]["host"] for o in outcomes if o.value["offload"]["replica"] == 0)


@pytest.mark.slow
def test_uneven_shards_over_two_replicas_equal_single_device_adam(outcomes):
    ref_losses, ref_params = _reference()
    _equal_reference(outcomes, "sharded", ref_losses, ref_params)
    for o in outcomes:
        got = o.value["sharded"]
        share = FRACTIONS[got["replica"]]
        assert abs(got["moments"] - 2 * share * got["stage_params"]) <= 2 * 2, (o.rank, got["moments"])
    moved = max(float((ref_params[n] - v).abs().max()) for n, v in _initial().items())
    assert moved > 100 * ATOL, "the steps must move the parameters well beyond the tolerance"
