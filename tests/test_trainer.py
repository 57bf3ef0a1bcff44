"""`hetpipe.Trainer`: one rank of a plan inside the user's own loop, with a torch DataLoader and a custom
optimizer, loss and LR scheduler, against the unsplit model on the same batches (3 gloo ranks, gpt-tiny
with its tied embedding/head split over the first and last stages)."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hetpipe.errors import ConfigError

MODEL, BATCH, SEQ, MICROBATCHES, STEPS = "gpt-tiny", 2, 16, 4, 3
RTOL, ATOL = 1e-5, 4e-5
LR = 0.05
WORLD_TIMEOUT_S = 240.0


def _loader(vocab: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (STEPS * BATCH * MICROBATCHES, SEQ), generator=gen)
    data = torch.utils.data.TensorDataset(ids, torch.roll(ids, -1, 1))
    return torch.utils.data.DataLoader(data, batch_size=BATCH * MICROBATCHES, shuffle=False)


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def halve(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _trainer_worker(rank: int, world: int, plan_path: str) -> dict[str, Any]:
    from hetpipe.models import lm_loss
    from hetpipe.runtime.trainer import Trainer

    trainer = Trainer(plan_path, model=MODEL, seq=SEQ, loss=lm_loss, optimizer=sgd, lr_scheduler=halve,
                      grad_clip_norm=1.0, timeout_s=60.0)
    losses = []
    for inputs, targets in _loader(256):
        stats = trainer.step(inputs if trainer.is_first else None, targets if trainer.is_last else None)
        losses.append(stats.loss)
    refused = ""
    if trainer.is_first:
        try:
            trainer.step(None, None)
        except ConfigError as err:
            refused = str(err)
    bad = torch.zeros(BATCH * MICROBATCHES - 1, SEQ, dtype=torch.long)  # one row short: no 4 equal micro-batches
    try:  # passed on every rank: each refuses it itself, the middle one too (it does not wait for a message)
        trainer.step(bad, bad)
        bad_batch = ""
    except ConfigError as err:
        bad_batch = str(err)
    return {"stage": trainer.stage.stage, "losses": losses, "refused": refused, "bad_batch": bad_batch,
            "params": {n: p.detach().clone() for n, p in trainer.stage.named_parameters()}}


@functools.lru_cache(maxsize=1)  # read by this file's and test_recompute_runtime's Trainer tests; never mutated
def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    from hetpipe.models import build, lm_loss
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.runtime.stage.build import build_stage, split_stages

    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(model, inputs, name=MODEL)
    whole = build_stage(split_stages(graph.module, {}, example_inputs=inputs, num_stages=1), 0, state_dict=None,
                        device="cpu", seed=0)  # the seeded init every partition reproduces
    opt = sgd(list(whole.parameters()))
    sched = halve(opt)
    losses = []
    for ids, targets in _loader(256):
        opt.zero_grad(set_to_none=True)
        loss = sum(lm_loss(whole(x), y) for x, y in zip(ids.chunk(MICROBATCHES), targets.chunk(MICROBATCHES)))
        loss = loss / MICROBATCHES
        loss.backward()
        torch.nn.utils.clip_grad_norm_(whole.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    params = {n: p.detach() for n, p in whole.module.named_parameters(remove_duplicate=False)}
    return losses, params


@pytest.mark.slow
def test_trainer_in_a_user_loop_matches_the_unsplit_model(trainer_world):
    # the plan: stages 2 | n-4 | 2 units (tests/conftest.py, one world shared with the recompute plan's test)
    _, results = trainer_world["plain"]
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}: {res['error']}"
    outcomes = [SimpleNamespace(rank=rank, value=res["value"]) for rank, res in enumerate(results)]
    ref_losses, ref_params = _reference()
    assert [o.value["stage"] for o in outcomes] == [0, 1, 2]
    torch.testing.assert_close(outcomes[2].value["losses"], ref_losses, rtol=RTOL, atol=ATOL)
    assert outcomes[0].value["losses"] == [None] * STEPS
    assert "rank 0 (stage 0) needs the inputs of every step" in outcomes[0].value["refused"]
    for o in outcomes:  # a bad batch given to every rank is refused on every rank, before any message
        assert f"batch of {BATCH * MICROBATCHES - 1} is not divisible into {MICROBATCHES}" in o.value["bad_batch"]
    held = set()
    for o in outcomes:
        for name, value in o.value["params"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, p=name, k=o.rank: f"rank {k} param {p}: {m}")
            held.add(name)
    assert held >= {n for n in ref_params if not n.startswith("lm_head")}  # every parameter lives on some stage
