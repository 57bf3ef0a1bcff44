"""The memory model counts what the runtime really holds: the loss's saved tensors on the last stage,
and the replica of a tied parameter (GPT-2's wte = lm_head) on a stage that does not own it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetpipe.cost_models.cluster import cluster_from_dict
from hetpipe.cost_models.memory import state_bytes_per_param
from hetpipe.models import build, training_loss
from hetpipe.plan.build import build_problem, partition_graph
from hetpipe.partitioner.capture.capture import capture
from hetpipe.plan.check import check_plan
from hetpipe.plan.schema import Plan, problem_from_plan
from hetpipe.partitioner.problem import Stage, evaluate, stage_memory_bytes

BATCH, SEQ = 2, 16


def _graphs():
    model, inputs = build("gpt-tiny", device="meta", batch=BATCH, seq=SEQ)
    fn, targets = training_loss("gpt-tiny", inputs)
    return (capture(model, inputs, name="gpt-tiny"),
            capture(model, inputs, name="gpt-tiny", loss_fn=fn, targets=targets), model)


def _saved_by_real_cross_entropy(vocab: int) -> int:
    """Bytes autograd keeps for F.cross_entropy on real CPU tensors of the LM's logits shape."""
    logits = torch.randn(BATCH * SEQ, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (BATCH * SEQ,))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(logits, targets)
    return sum(seen.values())


def test_loss_saved_tensors_are_added_to_the_last_unit_only() -> None:
    plain, with_loss, model = _graphs()
    vocab = model.lm_head.out_features if hasattr(model, "lm_head") else None
    assert vocab
    extra = [b.activation_bytes - a.activation_bytes for a, b in zip(plain.units, with_loss.units)]
    assert extra[:-1] == [0] * (len(extra) - 1)
    assert extra[-1] == _saved_by_real_cross_entropy(vocab)  # log-probs b*s*V fp32, targets, total weight
    assert with_loss.fingerprint == plain.fingerprint  # the loss does not change which model it is


def test_tied_replica_is_counted_on_the_stage_without_the_owner(tmp_path) -> None:
    _, graph, _ = _graphs()
    assert graph.tied, "gpt-tiny ties its embedding and LM head"
    tie = graph.tied[0]
    cluster = cluster_from_dict({"name": "two", "nodes": [{"name": "n", "devices": [{"gpu": "rtx3090", "count": 2}]}]})
    problem = build_problem(graph, cluster, microbatches=4)
    (copy,) = problem.tied
    assert copy.state_bytes == round(tie.numel * state_bytes_per_param(graph.optimizer, graph.precision))
    n, owner, user = graph.num_units, tie.unit_indices[0], tie.unit_indices[-1]
    split = (Stage(0, 0, n // 2 - 1), Stage(1, n // 2, n - 1))
    assert owner < n // 2 <= user
    ev = evaluate(problem, split)
    stepless = problem.__class__(**{**problem.__dict__, "step_transient": {}})  # no step moment (memory model 4)
    without = stage_memory_bytes(problem.__class__(**{**stepless.__dict__, "tied": ()}), split, 1)
    held = stage_memory_bytes(stepless, split, 1)
    assert held == without + copy.state_bytes  # the replica on the head's stage
    # memory model 5: at the step the head's stage also steps the replica (Adam foreach: its fp32 bytes in the list)
    units = range(n // 2, n)
    step = sum(problem.state_bytes[u] + problem.step_param_bytes[u] for u in units) + copy.state_bytes + copy.step_bytes
    assert copy.step_bytes == 4 * tie.numel and ev.stages[1].memory_bytes == max(held, step)
    assert ev.stages[0].memory_bytes == stage_memory_bytes(problem, split, 0)  # the owner stage: no extra
    one = evaluate(problem, (Stage(0, 0, n - 1),))
    assert one.stages[0].memory_bytes == stage_memory_bytes(problem.__class__(**{**problem.__dict__, "tied": ()}),
                                                             (Stage(0, 0, n - 1),), 0)
    plan = partition_graph(graph, cluster, global_batch=BATCH * 4)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.model.tied[0].state_bytes == copy.state_bytes
    assert problem_from_plan(loaded).tied == problem.tied
    assert check_plan(loaded).ok
