"""Llama-architecture language models, written from the Llama papers' descriptions.

Architecture (Touvron et al. 2023, "LLaMA", section 2.2; "Llama 2", section 2.2;
Llama 3 model card): pre-normalisation with RMSNorm (Zhang & Sennrich 2019), rotary
position embeddings (Su et al. 2021, "RoFormer"), SwiGLU feed-forward
``down(silu(gate(x)) * up(x))`` (Shazeer 2020), grouped-query attention
(Ainslie et al. 2023: ``n_kv_head`` key/value heads each shared by
``n_head / n_kv_head`` query heads), no biases, a final RMSNorm and a vocabulary
head that is untied unless ``tie_embeddings`` (Llama 3.2 1B/3B tie it).

Rotary embeddings: ``cos``/``sin`` tables of shape ``(max_seq, head_dim)`` are
non-persistent buffers precomputed at construction and cut to the input's
length with ``torch.narrow(table, 0, 0, seq)``.  ``narrow`` is a torch function,
so ``torch.fx.symbolic_trace`` records it with the traced length (a Python slice
``table[:seq]`` of a buffer by a traced size fails there) and
``torch.export.export`` records an ``aten.slice``; both tracers work.  The halves
convention is ``rotate_half`` (pair ``i`` with ``i + head_dim/2``), as in the HF
implementation of Llama.  Llama 3's long-context RoPE frequency scaling is not
modelled (it changes no shape, parameter or FLOP).

Module names follow the Hugging Face layout (``model.layers.3.self_attn.q_proj``,
``model.norm``, ``lm_head``).  Parameter count, with ``d = head_dim``:
``V h (1 or 2) + L (2 h^2 + 2 h n_kv d + 3 h f + 2 h) + h``; Llama-2-7B is 6,738,415,616.

Example:
    >>> import torch
    >>> cfg = LlamaConfig(n_layer=2, dim=32, n_head=4, n_kv_head=2, ffn_dim=64, vocab_size=50, max_seq=16)
    >>> model = Llama(cfg)
    >>> model(torch.zeros(2, 7, dtype=torch.long)).shape
    torch.Size([2, 7, 50])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Llama initialiser (HF `initializer_range`): N(0, 0.02) for every weight matrix and the embedding.
INIT_STD = 0.02


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style model.

    Attributes:
        n_layer: decoder layers.
        dim: hidden size ``h``.
        n_head: query heads (``head_dim = dim / n_head``).
        n_kv_head: key/value heads; divides ``n_head`` (equal to it: plain multi-head attention).
        ffn_dim: SwiGLU inner width ``f``.
        vocab_size: vocabulary ``V``.
        max_seq: longest sequence the rotary tables cover.
        rope_theta: rotary base (Llama 2: 10000, Llama 3: 500000).
        norm_eps: RMSNorm epsilon (Llama 2: 1e-5).
        tie_embeddings: share the head's weight with the token embedding.

    Example:
        >>> LlamaConfig(n_layer=1, dim=4096, n_head=32, n_kv_head=8, ffn_dim=1).n_rep
        4
    """

    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    ffn_dim: int
    vocab_size: int = 32000
    max_seq: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_head != 0 or (self.dim // self.n_head) % 2 != 0:
            raise ValueError(f"dim={self.dim} must split into n_head={self.n_head} heads of even width")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        """Per-head width ``dim / n_head``."""
        return self.dim // self.n_head

    @property
    def n_rep(self) -> int:
        """Query heads per key/value head."""
        return self.n_head // self.n_kv_head

    def param_count(self) -> int:
        """Closed-form parameter count (a tied head counted once).

        Example:
            >>> LlamaConfig(n_layer=32, dim=4096, n_head=32, n_kv_head=32, ffn_dim=11008).param_count()
            6738415616
        """
        h, kv = self.dim, self.n_kv_head * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.ffn_dim + 2 * h  # q,o; k,v; gate,up,down; 2 norms
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layer * per_layer + h


class RMSNorm(nn.Module):
    """Root-mean-square LayerNorm without centring or bias: ``x / rms(x) * weight``.

    Example:
        >>> bool(RMSNorm(4)(torch.full((1, 4), 3.0)).detach().allclose(torch.ones(1, 4)))
        True
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (as the reference implementation does) then cast back.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the last dimension's two halves.

    Example:
        >>> rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        tensor([-3., -4.,  1.,  2.])
    """
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Precomputed rotary ``cos``/``sin`` tables, cut to the input's sequence length.

    Example:
        >>> rope = RotaryEmbedding(head_dim=8, max_seq=16)
        >>> cos, sin = rope(torch.zeros(2, 4, 5, 8))
        >>> cos.shape, bool(cos[0].eq(1).all())
        (torch.Size([5, 8]), True)
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_seq: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq = max_seq
        self.theta = theta
        self.register_buffer("cos", torch.empty(max_seq, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the tables in place, e.g. after ``model.to_empty(device=...)`` from meta.

        Frequencies ``theta^(-2i/d)`` for ``i < d/2`` (RoFormer eq. 15), repeated for both halves.

        Example:
            >>> rope = RotaryEmbedding(head_dim=4, max_seq=2)
            >>> rope.reset_buffers()
            >>> rope.sin[0].abs().sum().item()
            0.0
        """
        device = self.cos.device
        inv_freq = self.theta ** (
            -torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        )
        angles = torch.outer(torch.arange(self.max_seq, dtype=torch.float32, device=device), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (max_seq, head_dim)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: (batch, heads, seq, head_dim); returns cos, sin: (seq, head_dim) in x's dtype.
        seq = x.shape[2]
        cos = torch.narrow(self.cos, 0, 0, seq)  # not self.cos[:seq]: see the module docstring
        sin = torch.narrow(self.sin, 0, 0, seq)
        return cos.to(x.dtype), sin.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary position embeddings.

    Example:
        >>> cfg = LlamaConfig(n_layer=1, dim=16, n_head=4, n_kv_head=2, ffn_dim=8, max_seq=8)
        >>> Attention(cfg)(torch.zeros(1, 3, 16)).shape
        torch.Size([1, 3, 16])
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.dim, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_seq, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, h); q: (batch, n_head, seq, d); k, v: (batch, n_kv_head, seq, d)
        # Head counts come from the projections' widths (-1), not from n_head / n_kv_head, so a
        # tensor-parallel shard holding some key/value groups runs this same code.
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(q)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.n_kv_head != self.n_head:  # static config branch, not data-dependent
            rep = self.n_head // self.n_kv_head
            k = k.repeat_interleave(rep, dim=1)  # kv head j serves query heads j*rep .. j*rep+rep-1
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    Example:
        >>> FeedForward(dim=8, hidden=16)(torch.zeros(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Example:
        >>> cfg = LlamaConfig(n_layer=1, dim=16, n_head=2, n_kv_head=1, ffn_dim=32, max_seq=8)
        >>> DecoderLayer(cfg)(torch.zeros(1, 4, 16)).shape
        torch.Size([1, 4, 16])
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """Token embedding, the decoder layers (an ``nn.ModuleList``) and the final norm.

    Example:
        >>> cfg = LlamaConfig(n_layer=3, dim=16, n_head=2, n_kv_head=2, ffn_dim=8, vocab_size=10, max_seq=8)
        >>> len(LlamaBody(cfg).layers)
        3
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)  # (batch, seq) -> (batch, seq, h)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Llama(nn.Module):
    """Llama-architecture causal LM: token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``.

    Example:
        >>> cfg = LlamaConfig(n_layer=1, dim=16, n_head=2, n_kv_head=1, ffn_dim=8, vocab_size=10,
        ...                   max_seq=8, tie_embeddings=True)
        >>> m = Llama(cfg)
        >>> m.lm_head.weight is m.model.embed_tokens.weight
        True
        >>> sum(p.numel() for p in m.parameters()) == cfg.param_count()
        True
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise weights N(0, 0.02), norms to one, and recompute the rotary tables.

        Example:
            >>> m = Llama(LlamaConfig(n_layer=1, dim=8, n_head=2, n_kv_head=2, ffn_dim=8, vocab_size=4, max_seq=4))
            >>> m.reset_parameters()
            >>> m.model.norm.weight.detach().sum().item()
            8.0
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, RotaryEmbedding):
                module.reset_buffers()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))
