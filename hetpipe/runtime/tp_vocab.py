"""A token embedding and an LM head split by vocabulary over a tensor-parallel group (issue 15).

Member m holds rows ``[first, first + n_m)`` of the (V, h) weight (only those rows are allocated;
``n_m`` from the shares by largest remainder, like heads and columns).  The math follows
Megatron-LM (``core/tensor_parallel/layers.py``: ``VocabParallelEmbedding``;
``cross_entropy.py``: ``_VocabParallelCrossEntropy``; Shoeybi et al. 2019, §3):

* `VocabParallelEmbedding`: ids outside the member's rows look up row 0 and are zeroed; the
  partial outputs are summed over the group (`reduce_from_group`: all-reduce forward, identity
  backward).  Each id is in exactly one member's rows, so the sum is the full lookup.
* `VocabParallelHead`: ``copy_to_group(x) @ W_m^T`` -- the member's logits slice (b, s, n_m); the
  input gradient is summed over the group backward.
* `vocab_parallel_cross_entropy`: with z the member's logits (N, n_m) and t the targets,
  ``m = allreduce_max(max_j z_j)``, ``e = exp(z - m)``, ``S = allreduce_sum(sum_j e_j)``,
  ``z_t = allreduce_sum(z_t - m if t in the member's rows else 0)``; loss per token
  ``log S - z_t`` (= ``logsumexp(z) - z_t``), mean over tokens whose target is not
  ``ignore_index`` (as ``F.cross_entropy``).  Backward, no collective: ``dL/dz = (e / S - onehot(t)) · g / count``
  on the member's columns.

Example (a group of one is plain cross-entropy):
    >>> import torch, torch.nn.functional as F
    >>> z, t = torch.randn(6, 5, requires_grad=True), torch.tensor([0, 4, 2, 2, 1, 3])
    >>> loss = vocab_parallel_cross_entropy(z, t, first=0, group=None)
    >>> bool(torch.allclose(loss, F.cross_entropy(z, t)))
    True
    >>> loss.backward(); g = z.grad.clone(); z.grad = None; F.cross_entropy(z, t).backward()
    >>> bool(torch.allclose(g, z.grad))
    True
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.models import hf as hf_models
from hetpipe.models import losses
from hetpipe.partitioner.capture.tensor_blocks import TensorParallelBlock
from hetpipe.runtime.tp_comm import all_reduce_in_place, copy_to_group, reduce_from_group

#: ``F.cross_entropy``'s default: targets equal to it count for nothing.
IGNORE_INDEX = -100
#: The losses a vocabulary-split head runs as `vocab_parallel_cross_entropy` (cross-entropy of the
#: flattened logits: the built-in language-model losses).
LM_LOSSES = (losses.lm_loss, hf_models.lm_loss)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary (module docstring)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, first: int, group: Any) -> torch.Tensor:
        rows = logits.shape[-1]
        peak = logits.detach().amax(dim=-1)
        all_reduce_in_place(peak, group, dist.ReduceOp.MAX)
        shifted = logits.detach() - peak.unsqueeze(-1)  # (N, n_m), <= 0: exp cannot overflow
        valid = target != IGNORE_INDEX
        mine = valid & (target >= first) & (target < first + rows)
        local = (target - first).masked_fill(~mine, 0)
        picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        all_reduce_in_place(picked, group, dist.ReduceOp.SUM)
        exp = shifted.exp_()
        total = exp.sum(dim=-1)
        all_reduce_in_place(total, group, dist.ReduceOp.SUM)
        count = valid.sum()
        loss = (total.log() - picked).masked_fill(~valid, 0.0).sum() / count
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, mine, valid, count)  # softmax slice
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local, mine, valid, count = ctx.saved_tensors
        out = softmax.clone()
        hit = mine.nonzero().squeeze(1)
        out[hit, local[hit]] -= 1.0
        out.mul_((valid.unsqueeze(-1) * (grad / count)).to(out.dtype))
        return out, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, first: int, group: Any
                                 ) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (N, n_m: this member's vocabulary rows from ``first``) against
    ``target`` (N,), equal to ``F.cross_entropy`` of the whole logits (module docstring)."""
    return _VocabParallelCrossEntropy.apply(logits, target, first, group)


class VocabShard(nn.Module):
    """A member's rows ``[first, first + weight.shape[0])`` of a (``vocab``, h) weight."""

    def __init__(self, weight: nn.Parameter, *, first: int, vocab: int, group: Any) -> None:
        super().__init__()
        self.weight = weight
        self.first, self.vocab, self.group = first, vocab, group


class VocabParallelEmbedding(VocabShard):
    """Lookup in this member's rows, zeros for the others' ids, summed over the group."""

    def __init__(self, weight: nn.Parameter, *, first: int, vocab: int, group: Any,
                 padding_idx: int | None = None) -> None:
        super().__init__(weight, first=first, vocab=vocab, group=group)
        rows = weight.shape[0]
        self.padding_idx = padding_idx - first if padding_idx is not None and first <= padding_idx < first + rows \
            else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.first) | (ids >= self.first + self.weight.shape[0])
        local = (ids - self.first).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, padding_idx=self.padding_idx)
        return reduce_from_group(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


class VocabParallelHead(VocabShard):
    """This member's logits slice ``x W_m^T``: (..., h) -> (..., n_m); input gradient summed over the group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_group(x, self.group), self.weight)


def shard_vocab_block(model: nn.Module, block: TensorParallelBlock, *, parts: tuple[int, int], group: Any,
                      full: torch.Tensor, device: Any, made: dict[int, nn.Parameter]) -> None:
    """Replace ``block``'s embedding or head module by this member's rows ``parts`` of ``full`` (in place).

    ``made``: sliced parameters by the id of the model's parameter they replace, so a tied embedding
    and head in one stage share one sliced parameter, as they shared the whole one.
    """
    spec = block.column[0]
    path = spec.name.rsplit(".", 1)[0]
    mod = model.get_submodule(path)
    expected = nn.Embedding if block.kind == "embedding" else nn.Linear
    if type(mod) is not expected or getattr(mod, "max_norm", None) is not None:
        raise ConfigError(f"vocabulary-split layer {path!r} is a {type(mod).__name__}; only an nn.Embedding "
                          "(without max_norm) and a bias-free nn.Linear head split by vocabulary so far: "
                          "re-plan with --tensor-parallel off")
    key = id(mod.weight)
    if key not in made:
        rows = full.detach().narrow(0, parts[0], parts[1] - parts[0]).clone()
        made[key] = nn.Parameter(rows.to(device if device is not None else _own_device(mod)))
    vocab = full.shape[0]
    new: nn.Module = (VocabParallelEmbedding(made[key], first=parts[0], vocab=vocab, group=group,
                                             padding_idx=mod.padding_idx) if block.kind == "embedding"
                      else VocabParallelHead(made[key], first=parts[0], vocab=vocab, group=group))
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _own_device(mod: nn.Module) -> Any:
    own = mod.weight.device
    if own.type == "meta":
        raise ConfigError("the model is on the meta device; pass device= (where the shard goes) and state=")
    return own


def vocab_head(module: nn.Module) -> VocabParallelHead | None:
    """The stage's vocabulary-split head, if it has one."""
    return next((m for m in module.modules() if isinstance(m, VocabParallelHead)), None)


def check_vocab_loss(loss_fn: Callable[..., Any]) -> None:
    """Refuse a loss other than the built-in language-model one for a head split by vocabulary."""
    if loss_fn not in LM_LOSSES:
        raise ConfigError(f"the plan splits the LM head by vocabulary over a tensor-parallel group, which runs only "
                          f"the built-in language-model loss (cross-entropy), not "
                          f"{getattr(loss_fn, '__qualname__', loss_fn)!r}, which would see only one card's slice "
                          "of the logits: drop --loss or re-plan with --tensor-parallel off")


def vocab_loss(loss_fn: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    """``loss_fn`` for a stage whose head may be split by vocabulary: unchanged without such a head;
    with one, the built-in language-model loss becomes `vocab_parallel_cross_entropy` of this member's
    logits; any other loss is refused (it would see only this member's slice of the vocabulary)."""
    head = vocab_head(module)
    if head is None:
        return loss_fn
    check_vocab_loss(loss_fn)

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = output if isinstance(output, torch.Tensor) else output["logits"]
        return vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            first=head.first, group=head.group)

    return loss


def tied_rows(module: nn.Module) -> dict[int, tuple[int, int]]:
    """id of each vocabulary-split parameter -> (first row, whole vocabulary): a tied one's gradient is
    summed with the other stages' whole one in a (vocabulary, h) buffer (`execute.executor`)."""
    return {id(m.weight): (m.first, m.vocab) for m in module.modules() if isinstance(m, VocabShard)}
