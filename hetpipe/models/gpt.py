"""GPT-2-architecture language models, written from the GPT-2 paper's description.

Architecture (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", section 2.3, on top of the GPT-1 decoder): learned token and
position embeddings, ``n_layer`` pre-LayerNorm blocks (LN -> causal
self-attention -> residual, LN -> GELU MLP of width ``4 * n_embd`` ->
residual), a final LayerNorm and a language-model head whose weight is the
token embedding (tied).  Residual output projections are initialised with
std ``0.02 / sqrt(2 * n_layer)`` as the paper describes.

Deliberate differences from a checkpoint-compatible GPT-2: no dropout (the
pipeline correctness tests compare losses and gradients bit-for-bit against an
unsplit reference, and dropout would make that impossible), and attention uses
``F.scaled_dot_product_attention(is_causal=True)`` instead of a sliced mask
buffer so that ``torch.fx.symbolic_trace`` works.  Module names follow the
Hugging Face layout (``transformer.h.3.attn.c_attn``, ``lm_head``) so unit names
read the same as for HF models; HF's ``Conv1D`` weights are the transpose of
these ``nn.Linear`` weights.

Parameter count (tied head counted once), per block ``12 h^2 + 13 h``:
``V h + T h + L (12 h^2 + 13 h) + 2 h``; for GPT-2 small (L=12, h=768,
V=50257, T=1024) that is 124,439,808, the number HF reports.

Example:
    >>> import torch
    >>> cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_ctx=16)
    >>> model = GPT(cfg)
    >>> model(torch.zeros(3, 8, dtype=torch.long)).shape
    torch.Size([3, 8, 64])
    >>> model.lm_head.weight is model.transformer.wte.weight
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# GPT-2's initialiser: N(0, 0.02) for every weight matrix and embedding (GPT-1 paper, section 4.1).
INIT_STD = 0.02
# GPT-2 LayerNorm epsilon (HF `layer_norm_epsilon`).
LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-style model.

    Attributes:
        n_layer: number of transformer blocks.
        n_embd: hidden size ``h``.
        n_head: attention heads; must divide ``n_embd``.
        vocab_size: token vocabulary ``V`` (GPT-2: 50257).
        n_ctx: maximum sequence length (size of the position embedding).

    Example:
        >>> GPTConfig(n_layer=12, n_embd=768, n_head=12).head_dim
        64
    """

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int = 50257
    n_ctx: int = 1024

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        """Per-head width ``h / n_head``."""
        return self.n_embd // self.n_head

    def param_count(self) -> int:
        """Closed-form parameter count with the tied head counted once.

        Example:
            >>> GPTConfig(n_layer=12, n_embd=768, n_head=12).param_count()
            124439808
        """
        h = self.n_embd
        per_block = 12 * h * h + 13 * h  # qkv 3h^2+3h, proj h^2+h, fc 4h^2+4h, proj 4h^2+h, 2 LN 4h
        return self.vocab_size * h + self.n_ctx * h + self.n_layer * per_block + 2 * h


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection.

    Example:
        >>> attn = CausalSelfAttention(GPTConfig(n_layer=1, n_embd=16, n_head=2))
        >>> attn(torch.zeros(1, 5, 16)).shape
        torch.Size([1, 5, 16])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, h) -> q, k, v: (batch, heads, seq, head_dim).  The head count is
        # read from the projection's width (chunk, -1), not from n_head, so a tensor-parallel
        # shard holding some of the heads runs this same code (hetpipe.runtime.tensor_parallel).
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(h, 4h) -> GELU (tanh form, as GPT-2) -> Linear(4h, h).

    Example:
        >>> MLP(GPTConfig(n_layer=1, n_embd=8, n_head=2))(torch.zeros(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """One pre-LN transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.

    Example:
        >>> Block(GPTConfig(n_layer=1, n_embd=16, n_head=2))(torch.zeros(1, 4, 16)).shape
        torch.Size([1, 4, 16])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=LAYER_NORM_EPS)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=LAYER_NORM_EPS)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTBody(nn.Module):
    """Embeddings, the block stack and the final LayerNorm (HF's ``transformer``).

    Example:
        >>> body = GPTBody(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=10, n_ctx=8))
        >>> len(body.h)
        1
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_ctx, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=LAYER_NORM_EPS)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # idx: (batch, seq) int64 token ids -> (batch, seq, h) hidden states
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)  # traced as a node under symbolic_trace
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT(nn.Module):
    """GPT-2-architecture causal LM: token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``.

    The head's weight *is* ``transformer.wte.weight`` (one ``nn.Parameter`` reachable
    under two names), so ``model.parameters()`` yields it once.

    Example:
        >>> m = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=10, n_ctx=8))
        >>> sum(p.numel() for p in m.parameters()) == m.cfg.param_count()
        True
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = GPTBody(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied (GPT-2 shares input and output embeddings)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise every weight as GPT-2 does (cheap no-op work on the meta device).

        Example:
            >>> m = GPT(GPTConfig(n_layer=1, n_embd=8, n_head=2, vocab_size=10, n_ctx=4))
            >>> m.reset_parameters()
            >>> m.transformer.ln_f.weight.detach().sum().item()
            8.0
        """
        resid_std = INIT_STD / math.sqrt(2 * self.cfg.n_layer)  # GPT-2 paper, section 2.3
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith("c_proj") else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(idx))
