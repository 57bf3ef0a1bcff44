"""Tensor-parallel groups on Hugging Face Llama, GPT-2 and Qwen2 (``torch.export`` graphs), issue 15.

1. Each member re-exports its model at its own widths (`hetpipe.runtime.tp_export`): the layers
   shrink to its parts (GPT-2's ``split_size`` with them), and its graph is aligned with the full
   one although export drops a no-op ``contiguous`` of a single head and renumbers the later ones.
2. One emulated `hetpipe run` per model on 3 gloo ranks, a group of two at uneven shares 0.7 / 0.3:
   ``hf-llama-tiny`` with the group on stage 0 (the token embedding split by vocabulary, key/value
   groups 1:1, MLP columns 45:19), ``hf-gpt2-tiny`` with the group on the last stage (heads 3:1,
   MLP columns 90:38, the LM head split by vocabulary 90:38 and tied to stage 0's whole embedding).
   Per-step losses and every parameter gathered back equal a plain single-device loop over the
   same weights and data (fp32, rtol 1e-5).  ``hf-qwen2-tiny`` (``Qwen2ForCausalLM`` from the built-in
   config, tied embedding) as Llama: its q/k/v biases split with their key/value groups, its tied
   embedding by vocabulary on the group and whole as the head on stage 1.
3. Checkpoints of those runs (after step 2) hold every parameter and its momentum whole under the
   model's names; resumed on another plan (Llama: the group at 0.4 / 0.6; GPT-2: no group), step 3's
   loss and every parameter equal the single-device loop.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools

import pytest
import torch

from tests.forked_launch import forked_launches
from tests.test_tp_runtime import (MICRO_BATCH, MICROBATCHES, SEQ, SHARES, STEPS, assert_gathered_equal,
                                   group_reference, tp_graph)
from tests.machine_load import guard_s

#: The grouped run launched by torchrun (Llama's); GPT-2's and Qwen2's, and every resume, run the same rank
#: code on ranks forked from the test fork server (`tests.forked_launch`: what they check is what the ranks
#: compute; ~10 s of CPU less per launch).
TORCHRUN_MODEL = "hf-llama-tiny"



@functools.lru_cache(maxsize=None)
def hf_plan(model: str, *, cut: int, group_last: bool, shares: tuple[float, ...] | None = SHARES):
    """Two stages split after unit ``cut``; the group (box:1 lead, box:0) first or last at ``shares``, box:2
    the other; ``shares=None``: no group (box:1 alone in its place)."""
    from hetpipe.cost_models.cluster import cluster_from_dict
    from hetpipe.partitioner.problem import Stage, evaluate
    from hetpipe.plan.build import assemble_plan, build_problem
    from hetpipe.plan.schema import SolverReport

    graph = tp_graph(model)
    cluster = cluster_from_dict({"nodes": [{"name": "box", "intra": "pcie-host", "devices": [
        {"gpu": "rtx3090"}, {"gpu": "rtx3060-12gb"}, {"gpu": "rtx4090"}]}]})
    problem = build_problem(graph, cluster, microbatches=MICROBATCHES, tensor_parallel="auto")
    last = len(graph.units) - 1
    members = (1, 0) if shares is not None else ()
    stages = ((Stage(2, 0, cut), Stage(1, cut + 1, last, members=members)) if group_last
              else (Stage(1, 0, cut, members=members), Stage(2, cut + 1, last)))
    ev = evaluate(problem, stages)
    plan = assemble_plan(graph, cluster, problem=problem, stages=stages, global_batch=MICRO_BATCH * MICROBATCHES,
                         solver=SolverReport("hand", "FEASIBLE", ev.iteration_s, 0.0, 0.0))
    if shares is None:
        return plan
    g = 1 if group_last else 0  # the planner's shares for this tiny model are near even: run uneven ones
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, group_shares=shares) if s.index == g else s
                                                  for s in plan.stages))


# ----------------------------------------------------------------------------- 1. the member's export


def _blocks(model: str, units: slice) -> list:
    return [b for u in tp_graph(model).units[units] for b in u.tensor_parallel]


def test_a_member_is_the_same_model_at_its_widths_and_its_graph_aligns_with_the_full_one():
    from hetpipe.models import build
    from hetpipe.partitioner.capture.export import export_for_training
    from hetpipe.runtime.rank import node_to_stage
    from hetpipe.runtime.tp_export import local_model, member_node_stage
    from hetpipe.runtime.tp_shard import MemberShare

    llama, _ = build("hf-llama-tiny", device="meta", batch=MICRO_BATCH, seq=SEQ)
    local_model(llama, _blocks("hf-llama-tiny", slice(1, 3)), MemberShare(0, SHARES))
    attn, mlp = llama.model.layers[0].self_attn, llama.model.layers[0].mlp  # 1 of 2 key/value groups, 45 of 64
    assert [tuple(m.weight.shape) for m in (attn.q_proj, attn.k_proj, attn.o_proj, mlp.up_proj, mlp.down_proj)] == [
        (16, 32), (8, 32), (32, 16), (45, 32), (32, 45)]
    assert tuple(llama.model.layers[2].mlp.up_proj.weight.shape) == (64, 32)  # not in the blocks: whole

    model = "hf-gpt2-tiny"
    plan = hf_plan(model, cut=1, group_last=True)
    gpt2, batch = build(model, device="meta", batch=MICRO_BATCH, seq=SEQ)
    local_model(gpt2, _blocks(model, slice(2, 3)), MemberShare(1, SHARES))  # h.1: 1 of 4 heads, 38 of 128 columns
    assert (gpt2.transformer.h[1].attn.split_size, tuple(gpt2.transformer.h[1].attn.c_attn.weight.shape)) == (8, (32, 24))
    full, local = tp_graph(model).module, export_for_training(gpt2, batch)
    names = {n.name for n in local.graph.nodes}
    assert "contiguous_2" not in names and "contiguous_1" in names  # one head: no-op dropped, h.2's renumbered
    mapping, planned = member_node_stage(full, node_to_stage(plan, full), local), node_to_stage(plan, full)
    computed = {n.name for n in local.graph.nodes if n.op == "call_function"}
    assert computed <= set(mapping) and mapping["contiguous"] == planned["contiguous"] == 0  # h.0: stage 0
    assert mapping["contiguous_1"] == planned["contiguous_2"] == 1  # h.2's, aligned by op and module, not name


def test_qwen2_units_are_detected_with_their_biases():
    blocks = {b.kind: b for b in tp_graph("hf-qwen2-tiny").units[1].tensor_parallel}
    assert set(blocks) == {"attention", "mlp"} and blocks["attention"].parts == 2  # 2 key/value groups
    split = {p.name.rsplit(".", 2)[-2] + "." + p.name.rsplit(".", 1)[-1]: p.dim for p in blocks["attention"].parameters}
    assert {k: split[k] for k in ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.weight")} == {
        "q_proj.bias": 0, "k_proj.bias": 0, "v_proj.bias": 0, "o_proj.weight": 1}
    assert [b.kind for b in tp_graph("hf-qwen2-tiny").units[0].tensor_parallel] == ["embedding"]


def test_hf_groups_pass_the_pre_launch_check():
    from hetpipe.runtime.tp_run import check_shardable

    check_shardable(hf_plan("hf-gpt2-tiny", cut=1, group_last=True), tp_graph("hf-gpt2-tiny"))
    check_shardable(hf_plan("hf-llama-tiny", cut=2, group_last=False), tp_graph("hf-llama-tiny"))
    check_shardable(hf_plan("hf-qwen2-tiny", cut=2, group_last=False), tp_graph("hf-qwen2-tiny"))


# ----------------------------------------------------------------------------- 2. runs


def _batches(model: str) -> list:
    from hetpipe import models

    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, models.input_vocab(model) or 64, (MICRO_BATCH * MICROBATCHES, SEQ), generator=gen)
        out.append(((x,), models.example_targets(model, (x,))))
    return out


def _reference(model_name: str, model: torch.nn.Module, batches: list) -> list[float]:
    """Plain single-device Hugging Face training (`test_tp_runtime.group_reference`)."""
    return group_reference(model, batches, model_name)


RUNS = {"hf-llama-tiny": dict(cut=2, group_last=False), "hf-gpt2-tiny": dict(cut=1, group_last=True),
        "hf-qwen2-tiny": dict(cut=2, group_last=False)}
#: The plan a model's step-2 checkpoint is resumed on: Llama's group at other shares (its lead now
#: the smaller share: vocabulary rows 51:77, MLP columns 26:38), GPT-2 with no group at all.  Qwen2's
#: checkpoint is only read back here (its group's layers are Llama's plus q/k/v biases): one launch less.
RESUME_SHARES = {"hf-llama-tiny": (0.4, 0.6), "hf-gpt2-tiny": None}
CHECKPOINT_STEP = 2


@dataclasses.dataclass(frozen=True)
class HFRun:
    """A model's grouped run (3 steps, a checkpoint after step 2) and its resume (step 3, on `RESUME_SHARES`)."""

    name: str
    report: object  # RunReport of the grouped run
    ref_losses: list  # the single-device loop's 3 losses
    reference: torch.nn.Module  # the single-device model after 3 steps
    state: dict  # the grouped run's gathered weights
    checkpoint: object  # Path of its step-2 checkpoint
    params_at_checkpoint: dict  # the single-device parameters after 2 steps
    resumed: object  # RunReport of the resumed run (None for Qwen2)
    resumed_state: dict | None  # its gathered weights


@pytest.fixture(scope="module", params=sorted(RUNS))
def hf_grouped_run(request, tmp_path_factory):
    """The grouped run (3 steps, a checkpoint after step 2), then step 3 resumed from that checkpoint on
    the model's `RESUME_SHARES` plan (`HFRun`)."""
    from hetpipe import models
    from tests.zoo_harness import saved_state

    name = request.param
    out = tmp_path_factory.mktemp(f"tp_{name}")
    torch.manual_seed(0)
    resolved = models.resolve(name, device="cpu", batch=MICRO_BATCH, seq=SEQ)
    torch.save(resolved.model.state_dict(), out / "weights.pt")
    batches = _batches(name)
    at_checkpoint = copy.deepcopy(resolved.model)
    _reference(name, at_checkpoint, batches[:CHECKPOINT_STEP])
    reference = copy.deepcopy(resolved.model)
    ref_losses = _reference(name, reference, batches)
    with contextlib.ExitStack() as launches:
        if name != TORCHRUN_MODEL:
            launches.enter_context(forked_launches())
        report, resumed = _grouped_and_resumed(name, out, batches)
    checkpoint = out / "ck" / f"step-{CHECKPOINT_STEP:06d}"
    params_at_checkpoint = {n: p.detach() for n, p in at_checkpoint.named_parameters()}
    return HFRun(name, report, ref_losses, reference, saved_state(out / "saved"), checkpoint, params_at_checkpoint,
                 resumed, saved_state(out / "resumed") if resumed is not None else None)


def _grouped_and_resumed(name: str, out, batches):
    """(the grouped run's report, the resumed run's or None) of `hf_grouped_run`."""
    from hetpipe.runtime.run import run

    report = run(hf_plan(name, **RUNS[name]), model=name, steps=STEPS, seq=SEQ, data=batches,
                 weights=out / "weights.pt", save_weights=out / "saved", emulate=True, run_dir=out / "run",
                 checkpoint_dir=out / "ck", checkpoint_every=CHECKPOINT_STEP, timeout_s=guard_s(180.0))
    if name not in RESUME_SHARES:
        return report, None
    with forked_launches():  # every resume: the ranks' numbers (tests/test_checkpoint.py resumes under torchrun)
        resumed = run(hf_plan(name, **RUNS[name], shares=RESUME_SHARES[name]), model=name, steps=STEPS, seq=SEQ,
                      data=batches, save_weights=out / "resumed",
                      resume=out / "ck" / f"step-{CHECKPOINT_STEP:06d}", run_dir=out / "run2",
                      timeout_s=guard_s(180.0))
    return report, resumed


@pytest.mark.slow
def test_a_hugging_face_group_trains_like_one_device(hf_grouped_run):
    run = hf_grouped_run
    assert run.report.world_size == 3 and len(run.report.members) == 2
    torch.testing.assert_close(list(run.report.losses), run.ref_losses, rtol=1e-5, atol=0)
    assert_gathered_equal(run.state, run.reference)  # every member's slices gathered back, written by the leads


@pytest.mark.slow
def test_a_hugging_face_group_checkpoint_is_whole_and_resumes_on_another_plan(hf_grouped_run):
    """The group's step-2 checkpoint holds the reference's parameters whole under the model's names (each
    member's slices gathered); resumed on other shares (Llama) or with no group (GPT-2), step 3's loss and
    every parameter equal the single-device loop (the momentum read back as slices moves them)."""
    from tests.test_checkpoint import read_checkpoint

    run, params_at_checkpoint = hf_grouped_run, hf_grouped_run.params_at_checkpoint
    saved = read_checkpoint(run.checkpoint)
    written = [p for p in params_at_checkpoint if f"model/{p}" in saved]  # a tied head: under its embedding's name
    assert len(written) >= len(params_at_checkpoint) - 1
    for param in written:
        torch.testing.assert_close(saved[f"model/{param}"], params_at_checkpoint[param], rtol=1e-5, atol=1e-5,
                                   msg=param)
        assert saved[f"optim/{param}/momentum_buffer"].shape == params_at_checkpoint[param].shape, param
    if run.name not in RESUME_SHARES:
        return  # Qwen2: the checkpoint only (see RESUME_SHARES)
    assert run.resumed.world_size == (3 if RESUME_SHARES[run.name] else 2)
    torch.testing.assert_close(list(run.resumed.losses), run.ref_losses[CHECKPOINT_STEP:], rtol=1e-5, atol=0)
    assert_gathered_equal(run.resumed_state, run.reference)
    after = dict(run.reference.named_parameters())
    moved = max(float((after[n].detach() - v).abs().max()) for n, v in params_at_checkpoint.items())
    assert moved > 30 * 1e-5, "step 3 must move the parameters well beyond the tolerance (6e-4 on Llama)"
