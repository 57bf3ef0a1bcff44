"""The token embedding and the LM head split by vocabulary over a tensor-parallel group (issue 15).

1. Capture marks them (a tied pair's state counted once, where it is owned).
2. The cost model prices their own all-reduces: embedding one (b, s, h) forward; head three
   (b, s) fp32 vectors forward (the vocab-parallel cross-entropy) and one (b, s, h) backward.
3. The group DP with vocabulary blocks equals brute force on small instances.
4. A run (slow): gpt-tiny with its tied head on a group of two cards at 0.7 / 0.3 (vocabulary rows
   179:77) after a width-1 stage, 3 gloo ranks, equals a plain single-device loop (losses rtol 1e-5,
   gathered parameters rtol/atol 1e-5), each member's measured peak within its M_s (the tied head's
   replica priced at its rows).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import random

import pytest
import torch

from hetpipe.cost_models.sync import ring_allreduce_s
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.partitioner.solvers.group_dp import solve_groups
from hetpipe.partitioner.tp_tables import BlockSplit, StagePosition, UnitSplit, group_stage
from tests.forked_launch import use_forked_launch
from tests.instances import random_problem
from tests.machine_load import guard_s
from tests.test_tp_solver import brute_force_groups

from tests.test_tp_runtime import (  # the same model, shares and optimizer as the group runtime test
    MICRO_BATCH, MICROBATCHES, MODEL, SEQ, SHARES, STEPS, assert_gathered_equal, group_reference, tp_graph)


# ----------------------------------------------------------------------------- 1. capture


@pytest.mark.parametrize("model, tied", [("gpt-tiny", True), ("llama-tiny", False)])
def test_capture_marks_the_token_embedding_and_the_lm_head_split_by_vocabulary(model, tied):
    g = tp_graph(model)
    (emb,), (head,) = g.units[0].tensor_parallel, g.units[-1].tensor_parallel
    vocab, hidden, tokens = 256, 64, MICRO_BATCH * SEQ
    assert (emb.kind, emb.division, emb.parts, emb.column[0].dim, emb.row) == ("embedding", "vocabulary", vocab, 0, None)
    assert (head.kind, head.parts) == ("head", vocab)
    assert emb.allreduce_bytes == head.allreduce_bytes == tokens * hidden * 4  # (b, s, h) fp32
    assert head.loss_allreduce_bytes == tokens * 4 and head.activation_bytes == tokens * vocab * 4  # log-probs
    assert emb.param_numel == vocab * hidden
    assert head.param_numel == (0 if tied else vocab * hidden)  # a tied head's state is the owner's
    assert 0.9 < g.units[-1].tp_flops_fraction <= 1.0 and g.units[0].tp_flops_fraction == 0.0  # a lookup


# ----------------------------------------------------------------------------- 2. prices


def _problem(block: BlockSplit, *, first: bool) -> Problem:
    inf = float("inf")
    return Problem(fwd_s={"a": (1.0,)}, bwd_s={"a": (2.0,)}, state_bytes=(400,), activation_bytes=(8,),
                   boundary_bytes=(0,), devices=(DeviceSlot("d0", "a", "n", 10**6), DeviceSlot("d1", "a", "n", 10**6)),
                   bandwidth_bytes_s=((inf, 1e6), (1e6, inf)), latency_s=((0.0, 1e-4), (1e-4, 0.0)),
                   microbatches=2, tensor_parallel=(UnitSplit(30, 1.0, 1.0, (block,)),), group_max=2)


@pytest.mark.parametrize("kind, fwd, bwd", [("embedding", (1000,), ()), ("head", (40, 40, 40), (1000,)),
                                            ("", (1000,), (1000,))])
def test_each_block_kind_pays_its_own_allreduces(kind, fwd, bwd):
    block = BlockSplit(parts=64, fwd_flops=10, allreduce_bytes=1000, activation_bytes=8, kind=kind,
                       loss_allreduce_bytes=40 if kind == "head" else 0)
    pos = StagePosition(0, True, 2, 0, 0, 0, 0, 8)  # the only stage: no broadcast of a received message
    g = group_stage(_problem(block, first=True), first=0, last=0, members=(0, 1), position=pos)

    def ring(sizes):
        return sum(ring_allreduce_s(num_bytes=n, ranks=2, bandwidth_bytes_s=1e6, latency_s=1e-4) for n in sizes)

    assert g.shares == (0.5, 0.5)  # 32 of 64 rows each: half of the forward and backward
    assert g.fwd_s == pytest.approx(0.5 + ring(fwd), rel=1e-12)
    assert g.bwd_s == pytest.approx(1.0 + ring(bwd), rel=1e-12)
    assert g.allreduce_s == pytest.approx(ring(fwd) + ring(bwd), rel=1e-12)


def test_a_tied_heads_replica_is_priced_at_each_members_rows():
    """Unit 1 holds a replica of unit 0's tied weight (1000 state bytes): on a group, a head block splits it
    3:1 at shares 0.75 / 0.25; a Megatron pair does not (the replica stays whole on each member)."""
    from hetpipe.partitioner.problem import TiedCopy

    def member_bytes(kind: str) -> tuple[int, ...]:
        block = BlockSplit(parts=64, fwd_flops=10, allreduce_bytes=0, activation_bytes=0, kind=kind)
        prob = dataclasses.replace(_problem(block, first=False), tied=(TiedCopy(0, (0, 1), 1000),))
        prob = dataclasses.replace(prob, fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(0, 400),
                                   activation_bytes=(0, 8), boundary_bytes=(0, 0),
                                   tensor_parallel=(UnitSplit(30, 0.0, 0.0), *prob.tensor_parallel))
        pos = StagePosition(0, False, 2, 0, 0, 0, 0, 8, tied_bytes=1000)
        return group_stage(prob, first=1, last=1, members=(0, 1), position=pos, shares=(0.75, 0.25)).memory_bytes

    whole, rows = member_bytes(""), member_bytes("head")
    assert (whole[0] - rows[0], whole[1] - rows[1]) == (1000 - 750, 1000 - 250)


# ----------------------------------------------------------------------------- 3. the group DP


def _vocab_instance(seed: int) -> Problem:
    """A random instance whose first unit is an embedding (memory splits, no FLOPs) and last an LM head."""
    rng = random.Random(seed)
    prob = random_problem(rng, units=rng.randint(4, 5), devices=rng.randint(2, 3), tight_memory=rng.random() < 0.5,
                          recompute="none", activation_max=rng.choice((3, 6)))
    n, splits = prob.num_units, []
    for u in range(n):
        vocab = rng.choice((16, 64, 256))
        if u == 0:
            splits.append(UnitSplit(10, 0.0, rng.uniform(0.5, 1.0), (BlockSplit(
                vocab, 0, rng.randint(1, 6), 0, kind="embedding"),)))
        elif u == n - 1:
            splits.append(UnitSplit(10, rng.uniform(0.7, 1.0), rng.uniform(0.0, 1.0), (BlockSplit(
                vocab, 5, rng.randint(1, 6), rng.randint(0, 3), kind="head", loss_allreduce_bytes=rng.randint(0, 2)),)))
        else:
            splits.append(UnitSplit(10, rng.uniform(0.5, 0.95), rng.uniform(0.3, 0.9), tuple(
                BlockSplit(rng.choice((2, 4, 8)), rng.randint(1, 5), rng.randint(0, 6), rng.randint(0, 2))
                for _ in range(2))))
    return dataclasses.replace(prob, tensor_parallel=tuple(splits), group_max=rng.choice((2, 3)))


def test_group_dp_equals_brute_force_with_vocabulary_blocks():
    grouped_head = 0
    for seed in range(100, 120):
        prob = _vocab_instance(seed)
        want, got = brute_force_groups(prob), solve_groups(prob)
        if math.isinf(want):
            assert got is None, seed
            continue
        assert got is not None and got.iteration_s == pytest.approx(want, rel=1e-9, abs=1e-12), seed
        assert evaluate(prob, got.stages, objective="estimate").fits
        grouped_head += bool(got.stages[-1].members)
    assert grouped_head >= 2  # not vacuous: the head's stage is a group in some optima


# ----------------------------------------------------------------------------- 4. a run


@functools.lru_cache(maxsize=None)
def vocab_plan(cut: int = 3):
    """Stage 0 (units 0-``cut``) on box:2 alone; stage 1 (the last blocks and the tied head) on the group
    box:1 + box:0 at 0.7 / 0.3."""
    from hetpipe.cost_models.cluster import cluster_from_dict
    from hetpipe.plan.build import assemble_plan, build_problem
    from hetpipe.plan.schema import SolverReport

    graph = tp_graph(MODEL)
    cluster = cluster_from_dict({"nodes": [{"name": "box", "intra": "pcie-host", "devices": [
        {"gpu": "rtx3090"}, {"gpu": "rtx3060-12gb"}, {"gpu": "rtx4090"}]}]})
    problem = build_problem(graph, cluster, microbatches=MICROBATCHES, tensor_parallel="auto")
    stages = (Stage(2, 0, cut), Stage(1, cut + 1, len(graph.units) - 1, members=(1, 0)))
    ev = evaluate(problem, stages)
    plan = assemble_plan(graph, cluster, problem=problem, stages=stages, global_batch=MICRO_BATCH * MICROBATCHES,
                         solver=SolverReport("hand", "FEASIBLE", ev.iteration_s, 0.0, 0.0))
    return dataclasses.replace(plan, stages=(plan.stages[0], dataclasses.replace(plan.stages[1], group_shares=SHARES)))


def test_a_custom_loss_for_a_head_split_by_vocabulary_is_refused_before_the_launch():
    from hetpipe.errors import ConfigError
    from hetpipe.runtime.tp_run import check_shardable

    check_shardable(vocab_plan(), tp_graph(MODEL), loss="hetpipe.models:lm_loss")  # the built-in loss runs vocab-parallel
    with pytest.raises(ConfigError, match="runs only the built-in language-model loss .* re-plan with --tensor-par"):
        check_shardable(vocab_plan(), tp_graph(MODEL), loss="tests.dist_helpers:gpt_loss")


@pytest.mark.slow
def test_a_head_split_by_vocabulary_trains_like_one_device(tmp_path, monkeypatch):
    from hetpipe import models
    from hetpipe.runtime.run import run
    from tests.zoo_harness import saved_state

    plan = vocab_plan()
    assert plan.stages[1].group_devices and not plan.stages[0].group_devices
    torch.manual_seed(0)
    resolved = models.resolve(MODEL, device="cpu", batch=MICRO_BATCH, seq=SEQ)
    torch.save(resolved.model.state_dict(), tmp_path / "weights.pt")
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        x = torch.randint(0, 256, (MICRO_BATCH * MICROBATCHES, SEQ), generator=gen)
        batches.append(((x,), models.example_targets(MODEL, (x,))))
    reference = copy.deepcopy(resolved.model)
    ref_losses = group_reference(reference, batches)
    # The group's numerics: the same rank code on ranks forked from the test fork server (`tests.forked_launch`,
    # ~10 s of CPU less); tests/test_tp_runtime.py's grouped run is the torchrun launch of a group.
    use_forked_launch(monkeypatch)
    report = run(plan, model=MODEL, steps=STEPS, seq=SEQ, data=batches, weights=tmp_path / "weights.pt",
                 save_weights=tmp_path / "saved", emulate=True, run_dir=tmp_path / "run", timeout_s=guard_s(120.0))
    assert report.world_size == 3
    assert len(report.members) == 2
    for row in report.members:  # each member's held bytes (its rows of the tied head) within its priced M_s
        assert 0 < row.peak_bytes <= row.predicted_memory_bytes, row
    torch.testing.assert_close(list(report.losses), ref_losses, rtol=1e-5, atol=0)
    state = saved_state(tmp_path / "saved")  # the head's rows gathered back, the tied weight whole
    assert_gathered_equal(state, reference)
