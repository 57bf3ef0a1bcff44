"""Hand-written members of the model zoo (importable by name: worker processes build them as factories).

Each factory returns ``(model, example_inputs)`` with one micro-batch of `MICRO_BATCH`; the
matching loss is a module-level function here or in `hetpipe.models`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MICRO_BATCH = 2
VOCAB, SEQ, DIM = 64, 8, 16
IMAGE, CLASSES = 8, 5


class TiedLM(nn.Module):
    """Embedding -> 3 MLP blocks with skips -> head tied to the embedding (GPT-2's weight sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(),
                                                  nn.Linear(2 * DIM, DIM)) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class DenseMoE(nn.Module):
    """One dense mixture-of-experts layer: every expert runs, a softmax router weighs them."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)  # (batch, seq, experts)
        outs = torch.stack([e(x) for e in self.experts], dim=-1)  # (batch, seq, dim, experts)
        return x + (outs * gates.unsqueeze(-2)).sum(-1)


class MoELM(nn.Module):
    """Embedding -> 3 dense MoE layers -> untied head, returning a dict (a structured output)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(DenseMoE() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return {"logits": self.head(x)}


class BatchNormCNN(nn.Module):
    """Three conv -> BatchNorm -> ReLU blocks and a linear classifier (running statistics are buffers)."""

    def __init__(self) -> None:
        super().__init__()
        widths = (3, 8, 16, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b),
                                                  nn.ReLU()) for a, b in zip(widths, widths[1:]))
        self.fc = nn.Linear(widths[-1], CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


def tied_lm() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return TiedLM(), (torch.zeros(MICRO_BATCH, SEQ, dtype=torch.long),)


def moe_lm() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return MoELM(), (torch.zeros(MICRO_BATCH, SEQ, dtype=torch.long),)


def bn_cnn() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return BatchNormCNN(), (torch.zeros(MICRO_BATCH, 3, IMAGE, IMAGE),)


def logits_loss(output: dict[str, torch.Tensor] | torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every token of ``output["logits"]`` (or a logits tensor)."""
    logits = output["logits"] if isinstance(output, dict) else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
