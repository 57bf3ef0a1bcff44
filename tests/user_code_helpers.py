"""Factories, data and losses named on the command line by `tests/test_user_code.py` (importable by name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, MICRO, SEQ, GLOBAL = 1000, 16, 2, 8, 8  # a big vocabulary next to a tiny model: the loss dominates


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids)))


def lm_factory() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The model and one micro-batch of token ids (built on whatever device hetpipe asks for)."""
    return TinyLM(), (torch.zeros(MICRO, SEQ, dtype=torch.int64),)


def lm_data():  # noqa: ANN201 - an iterable of (inputs, targets) global batches
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        ids = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=gen)
        yield ids, torch.roll(ids, -1, 1)


def ce_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def per_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forgets to reduce: a tensor per token."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")


def wrong_args_loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.mean()


def wrong_shape_data():  # noqa: ANN201
    yield torch.zeros(GLOBAL, SEQ + 1, dtype=torch.int64), torch.zeros(GLOBAL, SEQ + 1, dtype=torch.int64)


def single_tensor_data():  # noqa: ANN201
    yield torch.zeros(GLOBAL, SEQ, dtype=torch.int64)


NOT_CALLABLE = 3
