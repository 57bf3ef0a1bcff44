"""What autograd saves for backward, measured on meta tensors.

`SavedTensorMeter` installs `torch.autograd.graph.saved_tensors_hooks` and records
every tensor autograd packs.  Bytes are counted per *storage*: views of one storage
(a transpose, a reshape, a slice) and a tensor saved by two ops count once, and
storages of parameters and buffers (module state, not activations) are skipped.  A
storage is identified by its C++ StorageImpl, which meta tensors share between views
exactly as real tensors do.  Under the mixed precisions floating storages count 2 bytes
per element (`hetpipe.cost_models.memory.element_bytes`).

Attention: on the meta device (and on CPU with dropout) ``scaled_dot_product_attention``
takes the math path, which saves the b·a·s² attention probabilities.  GPUs, the
targets of a plan, run fused kernels that save only q, k, v, the output and a
log-sum-exp (Korthikanti et al. 2022: FlashAttention removes the 5·a·s/h term;
``shared/reference/cost_formulas.md`` section 3.2).  `fused_sdpa` therefore replays an
SDPA node with the flash kernel (no mask) or the memory-efficient kernel (with a mask,
passed as an additive float bias as SDPA itself does) whose meta kernels and autograd
formulas torch ships; FLOPs then come from torch's SDPA formulas.  Grouped-query
attention is replayed with k and v expanded to the query heads (saves slightly more
than a GQA-aware kernel).  Attention written out as matmul + softmax is measured as is.

Example:
    >>> x = torch.empty(4, 8, device="meta", requires_grad=True)
    >>> with SavedTensorMeter(set()) as meter:
    ...     y = x.t().exp()          # exp saves its output; x.t() is a view, not saved
    ...     z = (y * y).sum()        # mul saves y twice: one storage
    >>> meter.total_bytes
    128
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

from hetpipe.cost_models.memory import element_bytes

logger = logging.getLogger(__name__)

aten = torch.ops.aten

#: Callables that compute scaled-dot-product attention in an fx graph.
SDPA_TARGETS: frozenset[Any] = frozenset(
    {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
)


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (shared by all its views, on meta too).

    Example:
        >>> a = torch.empty(3, 3, device="meta")
        >>> storage_key(a) == storage_key(a.t()) != storage_key(a.clone())
        True
    """
    # `_cdata` is the address of the C++ StorageImpl; meta storages have no data
    # pointer, so this is the only identity that works on meta.
    return int(t.untyped_storage()._cdata)


def storage_bytes(t: torch.Tensor, precision: str = "fp32") -> int:
    """Bytes of the whole storage behind ``t`` in ``precision``.

    Example:
        >>> storage_bytes(torch.empty(4, 4, device="meta")[:1], "bf16-mixed")
        32
    """
    size = max(t.element_size(), 1)
    return t.untyped_storage().nbytes() // size * element_bytes(t.dtype, precision)


class SavedTensorMeter:
    """Context manager: unique storages autograd saves, excluding ``state_keys``.

    ``state_keys`` (storage keys of parameters and buffers) is read live, so storages
    added to it while the meter is active are skipped from then on.
    """

    def __init__(self, state_keys: set[int], precision: str = "fp32") -> None:
        self.state_keys = state_keys
        self.precision = precision
        self._seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.state_keys and key not in self._seen:
            # keep the storage alive so its key cannot be reused while we count
            self._seen[key] = (t.untyped_storage(), storage_bytes(t, self.precision))
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total_bytes(self) -> int:
        """Bytes of the distinct storages saved so far."""
        return sum(b for _, b in self._seen.values())


def _float_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean keep-mask as SDPA's additive bias (0 keep, -inf drop)."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(mask.logical_not(), -math.inf)


def fused_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` as a GPU's fused kernel would run it (see module doc).

    Falls back to the stock function off the meta device or for unusual shapes.

    Example:
        >>> q = torch.empty(2, 4, 16, 8, device="meta")
        >>> fused_sdpa(q, q, q, is_causal=True).shape
        torch.Size([2, 4, 16, 8])
    """
    fallback = (query.device.type != "meta" or query.dim() != 4 or key.dim() != 4
                or query.size(-1) != value.size(-1))
    if fallback:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    heads = query.size(1)
    if key.size(1) != heads:  # grouped-query attention: expand k, v to the query heads
        key = key.repeat_interleave(heads // key.size(1), dim=1)
        value = value.repeat_interleave(heads // value.size(1), dim=1)
    if attn_mask is None:
        out = aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)
        return out[0]
    bias = _float_bias(attn_mask, query.dtype)
    bias = bias.expand(query.size(0), heads, query.size(2), key.size(2))
    out = aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p, is_causal, scale=scale)
    return out[0]
