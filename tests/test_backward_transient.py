"""Memory model 4: a backward's transient bytes (the LM loss's 2 x logits) are measured at capture and
priced in M_s, so the plain torch step's peak is under M_s (it was over it under memory model 3)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hetpipe.cost_models.cluster import cluster_from_dict
from hetpipe.cost_models.stage_memory import HeldCounts, pipeline_stage_bytes
from hetpipe.models import build, training_loss
from hetpipe.partitioner.capture.capture import capture
from hetpipe.partitioner.capture.transients import BackwardPeak
from hetpipe.partitioner.problem import Stage, evaluate
from hetpipe.plan.build import build_problem

#: ``loss.backward()``'s seed: a one-element fp32 gradient of the scalar loss, allocated in the backward too.
SEED_BYTES = 4
ONE_CARD = {"name": "one", "nodes": [{"name": "n", "devices": [{"gpu": "rtx3090", "count": 1}]}]}


def _graph(name: str, batch: int, seq: int):
    model, inputs = build(name, device="meta", batch=batch, seq=seq)
    fn, targets = training_loss(name, inputs)
    return capture(model, inputs, name=name, loss_fn=fn, targets=targets), model(*inputs)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_the_loss_units_transient_is_twice_its_logits(name: str) -> None:
    """Cross-entropy's backward holds the log-probabilities' and the logits' gradients at once (what the
    H200 measured beyond the ledger: benchmarks/results/gpu_check.md); no other unit records one yet."""
    graph, logits = _graph(name, batch=2, seq=16)
    logits_bytes = logits.numel() * 4  # fp32
    assert graph.units[-1].transient_bwd_bytes == 2 * logits_bytes + SEED_BYTES
    assert all(u.transient_bwd_bytes == 0 for u in graph.units[:-1])


def test_backward_peak_counts_live_storages_not_views_and_frees_them() -> None:
    a = torch.empty(8, 8, device="meta")
    with BackwardPeak("fp32") as peak:
        b = a * 2  # 256 bytes
        v = b.t()  # a view: nothing new
        del b
        c = torch.empty(8, 8, device="meta")  # b's storage still held by v: 512 live
        del v, c
        d = torch.empty(16, 8, device="meta")  # both freed: 512 again, not 1024
    assert peak.peak_bytes == 512 and d.numel() == 128


def test_inside_a_backward_the_transient_adds_once_and_only_there() -> None:
    held = (HeldCounts(0, 1), HeldCounts(1, 1, backward=1), HeldCounts(1, 0))
    kw = dict(state_bytes=1000, grad_bytes=200, activation_bytes=300, in_bytes=0, out_bytes=0, held=held)
    old = pipeline_stage_bytes(**kw)  # model 3: the backward's moment does not count without a recompute
    assert old == 800 + 300
    assert pipeline_stage_bytes(**kw, transient_bwd_bytes=50) == 800 + 200 + 300 + 50
    assert pipeline_stage_bytes(**kw, transient_bwd_bytes=50, recompute_peak_bytes=7) == 800 + 200 + 300 + 57


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    seen = {}
    for t in [*model.parameters(), *model.buffers(),
              *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _plain_step_peak_bytes(name: str, batch: int, seq: int) -> int:
    """Bytes a plain single-device fp32 Adam step holds at its peak: parameters, Adam state, buffers, the
    micro-batch and, live at once during forward + loss + backward, what autograd allocates (`BackwardPeak`
    over real CPU tensors).  The step itself runs after the activations are freed (not the peak here)."""
    torch.manual_seed(0)
    model, inputs = build(name, device="cpu", batch=batch, seq=seq)
    fn, targets = training_loss(name, inputs)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    for _ in range(2):  # the second step: Adam's state exists; gradients freed at its start, as the runtime does
        opt.zero_grad(set_to_none=True)
        with BackwardPeak("fp32") as peak:
            fn(model(*inputs), targets).backward()
        opt.step()
    held = sum(t.untyped_storage().nbytes() for t in (*inputs, targets))
    return _state_bytes(model, opt) + held + peak.peak_bytes


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_a_plain_torch_step_peaks_under_model_4_and_over_model_3(name: str) -> None:
    """One card, one micro-batch, a shape whose logits outweigh the gradients (8 x 64 tokens, vocab 256):
    the loss's backward is the peak, which memory model 3 left out and model 4 covers."""
    batch, seq = 8, 64
    graph, _ = _graph(name, batch, seq)
    problem = build_problem(graph, cluster_from_dict(ONE_CARD), microbatches=1)
    whole = (Stage(0, 0, graph.num_units - 1),)
    new = evaluate(problem, whole).stages[0].memory_bytes
    old = evaluate(dataclasses.replace(problem, transient_bwd_bytes=()), whole).stages[0].memory_bytes
    real = _plain_step_peak_bytes(name, batch, seq)
    assert old < real <= new, (old, real, new)
