"""The plain single-device loop that multi-process runs of gpt-tiny are compared with.

Every run test (checkpoints, supervised restarts, weights, replica checkpoints) trains the
same way: global batches of ``BATCH * MICROBATCHES`` sequences, each split into
``MICROBATCHES`` micro-batches whose losses are divided by ``MICROBATCHES`` and summed (the
runtime's mean over the plan's micro-batches), one optimizer step per global batch.

Example:
    >>> import torch
    >>> state = initial_state("gpt-tiny", seed=3)
    >>> same_batch_twice = seeded_batches(1) * 2
    >>> losses, model, opt = reference_loop(state, same_batch_twice, lambda p: torch.optim.SGD(p, lr=0.1))
    >>> len(losses), losses[1] < losses[0]
    (2, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from hetpipe.models import build, lm_loss

BATCH, SEQ, MICROBATCHES, VOCAB = 2, 16, 4, 256

Batch = tuple[torch.Tensor, torch.Tensor]
MakeOptimizer = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
OnStep = Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]


def seeded_batches(n: int, seed: int = 9) -> list[Batch]:
    """``n`` global batches of token ids and their next-token targets, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH * MICROBATCHES, SEQ), generator=gen)
        out.append((ids, torch.roll(ids, -1, 1)))
    return out


def initial_state(model_name: str, seed: int) -> dict[str, torch.Tensor]:
    """The model's own initialisation under ``torch.manual_seed(seed)``, detached copies by name."""
    torch.manual_seed(seed)
    model, _ = build(model_name, device="cpu", batch=BATCH, seq=SEQ)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_loop(state: dict[str, torch.Tensor], batches: Sequence[Batch], make_optimizer: MakeOptimizer, *,
                   model_name: str = "gpt-tiny", on_step: OnStep | None = None,
                   ) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """Train a fresh ``model_name`` from ``state`` on ``batches``; (losses per step, model, optimizer).

    ``on_step(step, model, opt)`` runs after each optimizer step (steps count from 1), e.g. to
    snapshot parameters and optimizer state for a checkpoint comparison.
    """
    model, _ = build(model_name, device="cpu", batch=BATCH, seq=SEQ)
    model.load_state_dict(state)
    opt = make_optimizer(model.parameters())
    losses = []
    for step, (ids, targets) in enumerate(batches, 1):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(ids.chunk(MICROBATCHES), targets.chunk(MICROBATCHES)):
            loss = lm_loss(model(x), y) / MICROBATCHES
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
        if on_step is not None:
            on_step(step, model, opt)
    return losses, model, opt
