"""Checkpoints and resume of replica plans (issue 16, item 1): a checkpoint moves between one
pipeline, replicas with other counts and batch shares, and sharded and unsharded optimizer state.

One chain of ``hetpipe run`` calls on gpt-tiny (tied head), 6 global batches of 8 samples:

* steps 0-1 on a 2-stage pipeline (P2), checkpoint at 2 (one launch shared with
  tests/test_checkpoint_groups.py: the session fixture ``momentum_start``);
* steps 2-3 resumed on replicas R1 (a 2-stage pipeline with m = 3 beside a 1-stage one with m = 1),
  checkpoints at 3 and 4;
* steps 4-5 resumed on R3s (3 one-stage replicas, m = 2 / 1 / 1, optimizer state sharded
  0.5 / 0.25 / 0.25), checkpoints at 5 and 6;

every step's loss, and the parameters and optimizer state in the step-4 and step-6 checkpoints,
equal a plain single-device loop within fp32 tolerance.  From R3s's (sharded) step-5 checkpoint,
P2 continues equal to it too, and R3s itself continues bitwise (losses, every saved tensor).

The plans train with SGD + momentum: Adam's default eps (1e-8, what ``hetpipe run`` builds)
turns near-zero gradient elements into steps that hang on the replicas' summation order (see
tests/test_shard_runtime.py, EPS); SGD's update is linear in the gradient.  Adam's state
(with its 0-d ``step``) through the sharded gather is checked without processes below.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hetpipe.partitioner.problem import Stage
from hetpipe.plan.shard_schema import PlanShard
from hetpipe.runtime.report import RunReport
from tests.checkpoint_runs import MICROBATCHES, MODEL, SEQ, momentum_plan, run_with_checkpoints
from tests.runtime_plans import replica_plan_for
from tests.synthetic import synthetic_cluster
from tests.test_checkpoint import read_checkpoint

RTOL, ATOL = 1e-5, 1e-5  # fp32, the acceptance tolerances
FRACTIONS = (0.5, 0.25, 0.25)


def _plans(graph) -> dict[str, object]:
    """The replica plans R1 and R3s (P2 is the shared start's, `tests.checkpoint_runs.start_momentum_chain`)."""
    n, cluster = graph.num_units, synthetic_cluster()
    two = (Stage(0, 0, n // 2), Stage(1, n // 2 + 1, n - 1))
    r1 = replica_plan_for(graph, cluster, [(two, 3), ((Stage(2, 0, n - 1),), 1)])
    r3 = replica_plan_for(graph, cluster, [((Stage(d, 0, n - 1),), m) for d, m in ((0, 2), (1, 1), (2, 1))])
    groups = tuple(dataclasses.replace(g, shard=PlanShard(FRACTIONS, 0, (0, 0, 0), g.time_s)) for g in r3.sync.groups)
    r3s = dataclasses.replace(r3, sync=dataclasses.replace(r3.sync, groups=groups))
    return {"R1": momentum_plan(r1), "R3s": momentum_plan(r3s)}


@pytest.fixture(scope="module")
def setup(momentum_inputs):
    """The shared folder (P2, inputs) with R1 and R3s saved beside P2; the graph; the reference loop."""
    folder, graph = momentum_inputs.folder, momentum_inputs.graph
    assert momentum_inputs.p2.training.microbatches == MICROBATCHES
    for name, plan in _plans(graph).items():
        plan.save(folder / f"{name}.json")
    return folder, graph, momentum_inputs.reference


def _run(folder: Path, plan: str, out: Path, *, steps: int, resume: Path | None, every: int | None = None,
         forked: bool = False) -> RunReport:
    return run_with_checkpoints(folder, plan, out, model=MODEL, seq=SEQ, steps=steps, resume=resume, every=every,
                                forked=forked, timeout_s=60)


@pytest.fixture(scope="module")
def chain(setup, momentum_start, tmp_path_factory):
    """P2 (steps 0-1, the shared start) -> R1 (2-3) -> R3s (4-5), each resumed from the one before.  The chain's
    two resumes fork their ranks from the test fork server (`tests.forked_launch`: what they check is what the
    ranks compute); the shared start and the bitwise resume below are torchrun launches."""
    folder, *_ = setup
    tmp = tmp_path_factory.mktemp("chain")
    r1 = _run(folder, "R1", tmp / "r1", steps=4, resume=momentum_start.checkpoint, every=1, forked=True)
    r3s = _run(folder, "R3s", tmp / "r3s", steps=6, resume=tmp / "r1" / "ck" / "step-000004", every=1, forked=True)
    return tmp, {"P2": momentum_start.report, "R1": r1, "R3s": r3s}


def _assert_is_reference(folder: Path, graph, snapshot) -> None:
    """The checkpoint holds the reference's parameters and momentum, each tensor once, by the model's names."""
    params, momentum = snapshot
    saved = read_checkpoint(folder)
    head = graph.tied[0].qualified_names[-1]
    assert sorted(k for k in saved if k.startswith("model/")) == sorted(f"model/{n}" for n in params if n != head)
    for name, value in params.items():
        if name != head:  # the tie is saved once, under the embedding's name
            torch.testing.assert_close(saved[f"model/{name}"], value, rtol=RTOL, atol=ATOL, msg=name)
    for name, value in momentum.items():
        torch.testing.assert_close(saved[f"optim/{name}/momentum_buffer"], value, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.slow
def test_pipeline_to_replicas_to_sharded_replicas_equals_a_single_device_run(setup, chain):
    _, graph, (ref_losses, snapshots) = setup
    tmp, reports = chain
    assert (reports["R1"].world_size, reports["R3s"].world_size) == (3, 3)
    got = [*reports["P2"].losses, *reports["R1"].losses, *reports["R3s"].losses]
    assert got == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    assert sorted(p.name for p in (tmp / "r1" / "ck").iterdir()) == ["step-000003", "step-000004"]
    _assert_is_reference(tmp / "r1" / "ck" / "step-000004", graph, snapshots[4])  # written by replicas
    _assert_is_reference(tmp / "r3s" / "ck" / "step-000006", graph, snapshots[6])  # by sharded replicas
    moved = max(float((snapshots[6][0][n] - v).abs().max()) for n, v in snapshots[2][0].items())
    assert moved > 100 * ATOL, "the steps must move the parameters well beyond the tolerance"


@pytest.mark.slow
def test_sharded_replicas_resumed_on_their_own_plan_continue_bitwise(setup, chain, tmp_path):
    folder, *_ = setup
    tmp, reports = chain
    again = _run(folder, "R3s", tmp_path, steps=6, resume=tmp / "r3s" / "ck" / "step-000005")
    assert list(again.losses) == list(reports["R3s"].losses[1:])  # exactly: same cuts, same order of operations
    ended = read_checkpoint(tmp / "r3s" / "ck" / "step-000006")
    resumed = read_checkpoint(tmp_path / "ck" / "step-000006")
    assert sorted(ended) == sorted(resumed)
    for key, value in ended.items():  # parameters, momentum, every rank's random generators
        assert torch.equal(value, resumed[key]), key


@pytest.mark.slow
def test_a_sharded_replica_checkpoint_resumes_on_a_pipeline_equal_to_a_single_device_run(setup, chain, tmp_path):
    folder, graph, (ref_losses, snapshots) = setup
    tmp, _ = chain
    other = _run(folder, "P2", tmp_path, steps=6, resume=tmp / "r3s" / "ck" / "step-000005", forked=True)
    assert other.world_size == 2
    assert list(other.losses) == pytest.approx(ref_losses[5:], rel=RTOL, abs=ATOL)
    _assert_is_reference(tmp_path / "ck" / "step-000006", graph, snapshots[6])


# ----------------------------------------------------------------------------- no processes


def test_adam_state_of_a_sharded_group_gathers_whole_and_slices_back():
    """One holder owning 0.6 of a group cut inside its second parameter: the gathered state is the plain
    Adam's on the owned elements (0 elsewhere, the absent holders' part), ``step`` per parameter, and
    loading it back gives each piece its own slice and its own ``step`` (Adam increments it in place)."""
    from hetpipe.runtime.replicas.shard import ShardGroup, ShardedOptimizer, shard_bounds
    from hetpipe.runtime.replicas.shard_state import gather_full_state, load_full_state

    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(s)) for s in ((3, 4), (5,), (2,)))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in (a, b)]
    adam = lambda ps: torch.optim.Adam(ps, lr=0.1)  # noqa: E731
    opt = ShardedOptimizer([a, b, c], [ShardGroup("units 0-0", [a, b], None, (0.8, 0.2), 0, (0, 1))], adam)
    plain = adam(ref)
    for p, q in zip((a, b, c), (*ref, None)):
        p.grad = torch.ones_like(p)
        if q is not None:
            q.grad = torch.ones_like(q)
    opt.step()
    plain.step()
    full = gather_full_state(opt)
    assert set(full) == {a, b, c} and float(full[b]["step"]) == 1.0
    lo, hi = shard_bounds(17, (0.8, 0.2))[0]
    for key in ("exp_avg", "exp_avg_sq"):
        got = torch.cat([full[a][key].reshape(-1), full[b][key].reshape(-1)])
        want = torch.cat([plain.state[q][key].reshape(-1) for q in ref])
        assert torch.equal(got[lo:hi], want[lo:hi]) and not got[hi:].any()
    again = ShardedOptimizer([a, b, c], [ShardGroup("units 0-0", [a, b], None, (0.8, 0.2), 0, (0, 1))], adam)
    load_full_state(again, full)
    steps = [s["step"] for s in again.state.values()]
    assert len(steps) == 3 and len({id(t) for t in steps}) == 3
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    again.step()
    assert all(float(s["step"]) == 2.0 for s in again.state.values())


def test_adapting_a_replica_plan_is_one_error_naming_the_fix(setup, tmp_path):
    """Re-planning (`hetpipe.plan.replan`) solves one pipeline: ``--adapt`` of a replica plan is refused before
    launch (``--max-restarts`` relaunches the same plan: tests/test_supervise_replicas.py)."""
    from hetpipe.errors import ConfigError
    from hetpipe.runtime.run import run

    folder, *_ = setup
    with pytest.raises(ConfigError, match="--adapt re-plans single-pipeline plans only.*--resume DIR"):
        run(folder / "R1.json", model=MODEL, steps=2, checkpoint_dir=tmp_path / "ck", adapt=True)
