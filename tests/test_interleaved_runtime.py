"""Interleaved 1F1B run by the executor: 2 ranks x 2 chunks against a single-device loop (issue 17 item 2).

Rank r holds virtual stages r and r + 2 of the skip-connection net (uneven: 2, 1, 2, 2 units), so
every micro-batch crosses the wrap-around link 1 -> 0 and each rank keeps micro-batches in flight on
both of its chunks.  m = 4 > p = 2 is the case whose "receive waits for earlier sends" mode would
deadlock (`hetpipe.runtime.execute.prefetch`): the executor waits one receive behind instead.  Losses, the global
gradient norm (clipping), every gradient after step 1 and every parameter after three Adam steps equal
the unsplit model's (fp32, rtol 1e-5).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx

from hetpipe.runtime.execute.executor import PipelineExecutor
from hetpipe.runtime.execute.options import ExecutorOptions
from hetpipe.runtime.stage.build import build_stage, split_stages
from hetpipe.schedule.builders import make_schedule
from tests.dist_helpers import run_world, stage_mapping
from tests.test_executor import (MB_SIZE, MICROBATCHES, STEPS, WORLD_TIMEOUT_S, Case, _batch, _loss_fn, _model,
                                 _optimizer, _reference, _split)

RTOL, ATOL = 1e-5, 4e-5  # as tests/test_executor.py (fp32)
RANKS, CHUNKS = 2, 2
SPLIT = [2, 1, 2, 2]  # units per virtual stage of SkipNet's 7
CASE = Case("skip", f"interleaved:{CHUNKS}", "adam", clip=0.5, broadcast_loss=True)


def _worker(rank: int, world: int) -> dict[str, Any]:
    model, units = _model(CASE)
    gm = fx.symbolic_trace(model)
    x, _ = _batch(CASE, 0)
    program = split_stages(gm, stage_mapping(gm, units, SPLIT), example_inputs=(x[:MB_SIZE],))
    chunks = [build_stage(program, c * world + rank, state_dict=model.state_dict(), device="cpu")
              for c in range(CHUNKS)]
    params = [p for s in chunks for p in s.parameters()]
    opt, sched = _optimizer(CASE, params)
    actions = make_schedule(CASE.schedule, world, MICROBATCHES)[rank]
    ex = PipelineExecutor(chunks, rank=rank, num_stages=world * CHUNKS, schedule_actions=actions,
                          loss_fn=_loss_fn(CASE), optimizer=opt, microbatches=MICROBATCHES, lr_scheduler=sched,
                          options=ExecutorOptions(timeout_s=60.0, cut_specs=program.cuts, grad_clip_norm=CASE.clip,
                                                  broadcast_loss=True))
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "wait_sends": (ex.comm.wait_sends_at_recv,
                                                                          ex.comm.send_wait_lag)}
    named = {n: p for s in chunks for n, p in s.named_parameters()}
    for step in range(STEPS):
        xb, yb = _batch(CASE, step)
        stats = ex.step(_split(xb) if rank == 0 else None, _split(yb) if rank == world - 1 else None)
        out["losses"].append(stats.loss)
        out["grad_norms"].append(stats.grad_norm)
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in named.items()}
            out["stats"] = stats
    out["params"] = {n: p.detach().clone() for n, p in named.items()}
    out["buffer_bytes"] = sum(b.numel() * b.element_size() for s in chunks for b in s.module.buffers())
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    outcomes = run_world(_worker, world_size=RANKS, timeout_s=WORLD_TIMEOUT_S,
                         out_dir=tmp_path_factory.mktemp("interleaved"))
    failed = [f"rank {o.rank} (exit {o.exitcode}): {o.error}" for o in outcomes if o.error or o.value is None]
    assert not failed, "; ".join(failed)
    return [o.value for o in outcomes]


@pytest.mark.slow
def test_interleaved_matches_single_device_reference(results):
    ref = _reference(CASE)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], rtol=RTOL, atol=ATOL)
        assert r["grads"], f"rank {rank} holds no parameters"
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, p=name, k=rank: f"rank {k} grad {p}: {m}")
        for name, value in r["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, p=name, k=rank: f"rank {k} param {p}: {m}")
    assert {n for r in results for n in r["params"]} == set(ref["params"])


@pytest.mark.slow
def test_interleaved_stats_and_send_mode(results):
    for rank, r in enumerate(results):
        assert r["wait_sends"] == (True, 1)  # one receive behind: lag 0 deadlocks interleaved lists with m > p
        stats = r["stats"]
        assert [a.action for a in stats.actions] == [str(a) for a in make_schedule(CASE.schedule, RANKS,
                                                                                    MICROBATCHES)[rank]]
        assert len(stats.forward_s) == MICROBATCHES and all(t > 0 for t in stats.forward_s + stats.backward_s)
        mem = stats.memory  # the rank's ledger: both chunks' parameters (and buffers), Adam's two moments each
        assert mem.param_bytes == sum(t.numel() * t.element_size() for t in r["params"].values()) + r["buffer_bytes"]
        assert mem.grad_bytes == mem.param_bytes - r["buffer_bytes"]
        assert mem.optimizer_state_bytes == 2 * mem.grad_bytes
        assert mem.peak_activation_bytes > 0 and mem.peak_comm_bytes > 0
