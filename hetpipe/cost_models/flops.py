"""FLOPs, memory traffic and kernel counts of the aten ops a forward/backward runs.

`CostCounter` stacks two dispatch modes over the ops that execute (on the meta
device, so nothing is computed):

* `torch.utils.flop_counter.FlopCounterMode` counts matmuls, convolutions and fused
  attention exactly (2 FLOPs per multiply-add, its convention).  It knows only those
  kernels (23 ops in torch 2.13; ``shared/reference/environment_facts.md``).
* `_FormulaMode` adds what FlopCounterMode counts as 0, with the formulas below, and
  the bytes read and written by every memory-bound op.

Formulas for the ops FlopCounterMode does not know (N = elements of the op's input
unless stated).  Each constant counts the arithmetic operations of the op's defining
formula per element; the per-row statistics (one rsqrt or log per row) are ignored:

* pointwise ops (``torch.Tag.pointwise``): 1 FLOP per output element, including
  transcendentals (exp, tanh, erf count 1).  A composite activation written as several
  ops (HF's tanh-GELU) is counted op by op, a fused one (``aten.gelu``) as 1 per element.
* reductions (``torch.Tag.reduction``): 1 FLOP per input element.
* layer/group/batch norm forward: mean 1 + centre 1 + square-and-sum 2 + scale by rstd 1
  = 5 per element, plus 1 per affine tensor (weight, bias); batch norm in eval: 2 + affine.
* norm backward: dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·w: 10 per element,
  plus 2 for the weight gradient (Σ dy·x̂) and 1 for the bias gradient (Σ dy).
* RMS norm (fused op): square 1 + sum 1 + scale 1 = 3, plus 1 for the weight.
* softmax / log-softmax: max 1 + subtract 1 + exp 1 + sum 1 + divide (or log-subtract) 1 = 5;
  their backward dy·y, sum, subtract, multiply = 4.
* dropout: draw-and-compare 1 + scale 1 = 2 per element.
* embedding backward (scatter-add): 1 per gradient element.
* data movement (embedding, gather, index, cat, copies, fills, creation): 0 FLOPs.
Any other op counts 0 FLOPs and is listed in ``CostCounter.uncounted``.

Memory traffic (memory-bound ops only; matmul/conv/attention are compute-bound and
excluded): bytes of the tensor inputs read plus the tensor outputs written.  An input is
read at most once per stored element (an expanded, stride-0 view counts its storage).
Gathers (embedding, index, index_select, gather) read only the indices and the rows
they return, not the whole table.

Example:
    >>> x = torch.empty(4, 8, device="meta")
    >>> w = torch.empty(8, 16, device="meta")
    >>> with CostCounter() as cc:
    ...     y = torch.relu(x @ w)
    >>> tally = cc.snapshot()
    >>> tally.flops == 2 * 4 * 8 * 16 + 4 * 16, tally.traffic_bytes, tally.kernels
    (True, 512, 2)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from hetpipe.cost_models.memory import element_bytes
from hetpipe.cost_models.work import ATTENTION_BWD_KEY, ATTENTION_KEY, PassWork, matmul_key

logger = logging.getLogger(__name__)

aten = torch.ops.aten

#: FLOPs per element of a pointwise op (see module docstring).
POINTWISE_FLOPS_PER_ELEMENT = 1
#: FLOPs per input element of a reduction.
REDUCTION_FLOPS_PER_ELEMENT = 1
#: Norm forward: mean 1 + centre 1 + square-and-sum 2 + scale by rstd 1.
NORM_FWD_FLOPS_PER_ELEMENT = 5
#: Batch norm in eval mode: centre 1 + scale 1.
NORM_EVAL_FLOPS_PER_ELEMENT = 2
#: Affine weight or bias of a norm: 1 multiply or add per element each.
NORM_AFFINE_FLOPS_PER_ELEMENT = 1
#: Norm backward input gradient (formula in the module docstring).
NORM_BWD_FLOPS_PER_ELEMENT = 10
#: Norm backward weight gradient Σ dy·x̂: multiply 1 + add 1.
NORM_BWD_WEIGHT_FLOPS_PER_ELEMENT = 2
#: Norm backward bias gradient Σ dy: add 1.
NORM_BWD_BIAS_FLOPS_PER_ELEMENT = 1
#: RMS norm forward: square 1 + sum 1 + scale 1.
RMS_NORM_FLOPS_PER_ELEMENT = 3
#: Softmax / log-softmax forward: max, subtract, exp, sum, divide.
SOFTMAX_FWD_FLOPS_PER_ELEMENT = 5
#: Softmax / log-softmax backward: multiply, sum, subtract, multiply.
SOFTMAX_BWD_FLOPS_PER_ELEMENT = 4
#: Dropout: draw-and-compare 1 + scale 1.
DROPOUT_FLOPS_PER_ELEMENT = 2
#: Embedding backward scatter-add: 1 add per gradient element.
EMBEDDING_BWD_FLOPS_PER_ELEMENT = 1


def _packets(*names: str) -> frozenset[Any]:
    """aten overload packets by name, skipping any this torch build lacks."""
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


#: Ops that only allocate or reinterpret memory: no kernel, no FLOPs, no traffic.
NO_KERNEL_OPS = _packets(
    "detach", "alias", "_unsafe_view", "lift_fresh", "_assert_tensor_metadata", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "_local_scalar_dense", "_assert_async",
)
NORM_FWD_OPS = _packets("native_layer_norm", "native_group_norm", "native_batch_norm",
                        "_native_batch_norm_legit", "_native_batch_norm_legit_functional")
NORM_EVAL_OPS = _packets("_native_batch_norm_legit_no_training")
NORM_BWD_OPS = _packets("native_layer_norm_backward", "native_group_norm_backward",
                        "native_batch_norm_backward")
RMS_NORM_OPS = _packets("_fused_rms_norm")
SOFTMAX_FWD_OPS = _packets("_softmax", "_log_softmax")
SOFTMAX_BWD_OPS = _packets("_softmax_backward_data", "_log_softmax_backward_data")
DROPOUT_OPS = _packets("native_dropout")
EMBEDDING_BWD_OPS = _packets("embedding_dense_backward")
GATHER_OPS = _packets("embedding", "index", "index_select", "gather")
#: Data movement: 0 FLOPs by definition (traffic still counted).
DATA_MOVEMENT_OPS = GATHER_OPS | _packets(
    "cat", "stack", "copy_", "clone", "_to_copy", "fill_", "zero_", "zeros", "ones", "full",
    "zeros_like", "ones_like", "full_like", "arange", "scalar_tensor", "new_zeros", "new_ones",
    "new_full", "constant_pad_nd", "repeat", "index_put", "index_put_", "scatter", "slice_scatter",
    "select_scatter", "as_strided_scatter", "masked_fill", "where", "tril", "triu", "flip", "roll",
    "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "bernoulli", "rand_like",
    "split_with_sizes_copy", "unbind_copy", "unfold_copy", "lift_fresh_copy", "resize_",
)


def _cpu_flash_fwd_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    """The CPU flash-attention kernel has no formula in torch: use torch's SDPA one."""
    return sdpa_flop_count(query, key, value)


def _cpu_flash_bwd_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any,
                         **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


#: Formulas added to FlopCounterMode (shapes in, FLOPs out).
EXTRA_FLOP_FORMULAS: dict[Any, Any] = {
    p: f
    for name, f in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_fwd_flops),
                    ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_bwd_flops))
    if hasattr(aten, name)
    for p in (getattr(aten, name),)
}
#: Compute-bound ops: counted by FlopCounterMode, excluded from memory traffic.
COMPUTE_BOUND_OPS = frozenset(flop_registry) | frozenset(EXTRA_FLOP_FORMULAS)
#: Fused attention kernels (forward, backward): their FLOPs also go to the work table
#: (`hetpipe.cost_models.work`), which a calibrated CPU prices at its measured attention rate.
ATTENTION_FWD_OPS = _packets(
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward")
ATTENTION_BWD_OPS = _packets(
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_flash_attention_backward", "_efficient_attention_backward")


#: Dense matmuls: their FLOPs also go to the work table under `work.matmul_key` (priced per shape
#: class on a calibrated CPU).  Operand positions: (a, b) for mm/bmm, (bias, a, b) for addmm/baddbmm.
MATMUL_OPS = {aten.mm: 0, aten.bmm: 0, aten.addmm: 1, aten.baddbmm: 1}


def _matmul_work(packet: Any, args: tuple[Any, ...]) -> tuple[str, int]:
    """(work key, FLOPs) of one matmul: 2 M K N, torch's ``mm_flop`` / ``bmm_flop`` formula."""
    first = MATMUL_OPS[packet]
    a, b = args[first], args[first + 1]
    m = math.prod(a.shape[:-1])  # bmm: batch x rows
    k, n = a.shape[-1], b.shape[-1]
    return matmul_key(m, k, n), 2 * m * k * n


def _attention_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one fused attention kernel by the formula FlopCounterMode uses for it."""
    packet = func.overloadpacket
    formula = EXTRA_FLOP_FORMULAS.get(packet)
    formula = shape_wrapper(formula) if formula is not None else flop_registry[packet]
    return int(formula(*args, **kwargs, out_val=out))


@dataclass(frozen=True)
class OpTally:
    """Cumulative counts since a `CostCounter` was entered."""

    flops: int
    traffic_bytes: int
    kernels: int


def _numel(t: Any) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _first_numel(tensors: list[torch.Tensor]) -> int:
    return tensors[0].numel() if tensors else 0


def _norm_flops(packet: Any, args: tuple[Any, ...], outs: list[torch.Tensor]) -> int:
    """Formula FLOPs of norm, softmax and dropout ops (see the module docstring)."""
    ins = [a for a in args if isinstance(a, torch.Tensor)]
    n = _first_numel(ins)
    if packet in NORM_FWD_OPS or packet in NORM_EVAL_OPS:
        base = NORM_FWD_FLOPS_PER_ELEMENT if packet in NORM_FWD_OPS else NORM_EVAL_FLOPS_PER_ELEMENT
        affine = sum(1 for a in args[1:3] if isinstance(a, torch.Tensor))
        return n * (base + affine * NORM_AFFINE_FLOPS_PER_ELEMENT)
    if packet in NORM_BWD_OPS:
        # the last argument is output_mask = [grad_input, grad_weight, grad_bias] wanted
        mask = [bool(m) for m in args[-1]] if isinstance(args[-1], (list, tuple)) else [True] * 3
        per = (NORM_BWD_FLOPS_PER_ELEMENT * mask[0] + NORM_BWD_WEIGHT_FLOPS_PER_ELEMENT * mask[1]
               + NORM_BWD_BIAS_FLOPS_PER_ELEMENT * mask[2])
        return n * per
    if packet in RMS_NORM_OPS:
        has_w = len(args) > 2 and isinstance(args[2], torch.Tensor)
        return n * (RMS_NORM_FLOPS_PER_ELEMENT + (NORM_AFFINE_FLOPS_PER_ELEMENT if has_w else 0))
    if packet in SOFTMAX_FWD_OPS:
        return n * SOFTMAX_FWD_FLOPS_PER_ELEMENT
    if packet in SOFTMAX_BWD_OPS:
        return n * SOFTMAX_BWD_FLOPS_PER_ELEMENT
    if packet in DROPOUT_OPS:
        return n * DROPOUT_FLOPS_PER_ELEMENT
    if packet in EMBEDDING_BWD_OPS:
        return n * EMBEDDING_BWD_FLOPS_PER_ELEMENT
    return -1


def formula_flops(func: Any, args: tuple[Any, ...], out: Any) -> int:
    """FLOPs of one op FlopCounterMode does not count; -1 when no formula applies.

    Example:
        >>> x = torch.empty(2, 3, device="meta")
        >>> formula_flops(aten._softmax.default, (x, -1, False), x)
        30
    """
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    flops = _norm_flops(func.overloadpacket, args, outs)
    if flops >= 0:
        return flops
    if torch.Tag.pointwise in func.tags:
        return max((t.numel() for t in outs), default=0) * POINTWISE_FLOPS_PER_ELEMENT
    if torch.Tag.reduction in func.tags:
        return _numel(args[0]) * REDUCTION_FLOPS_PER_ELEMENT if args else 0
    if func.overloadpacket in DATA_MOVEMENT_OPS:
        return 0
    return -1


def _read_bytes(t: torch.Tensor, precision: str) -> int:
    """Bytes an op reads from one input: each stored element at most once."""
    if t.numel() == 0:
        return 0
    stored = t.untyped_storage().nbytes() // max(t.element_size(), 1)
    return min(t.numel(), stored) * element_bytes(t.dtype, precision)


def traffic_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                  precision: str = "fp32") -> int:
    """Bytes read + written by one memory-bound op (see the module docstring).

    Example:
        >>> x = torch.empty(4, 4, device="meta")
        >>> traffic_bytes(aten.add.Tensor, (x, x), {}, x)
        192
    """
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    written = sum(t.numel() * element_bytes(t.dtype, precision) for t in outs)
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if func.overloadpacket in GATHER_OPS:
        indices = [t for t in ins if not t.dtype.is_floating_point]
        return written + sum(_read_bytes(t, precision) for t in indices) + written
    return written + sum(_read_bytes(t, precision) for t in ins)


class _FormulaMode(TorchDispatchMode):
    """Adds formula FLOPs, memory traffic and kernel counts for every op it sees."""

    def __init__(self, precision: str) -> None:
        super().__init__()
        self.precision = precision
        self.flops = 0
        self.traffic = 0
        self.kernels = 0
        self.view_ops = 0  # ops without a kernel (`work.PassWork.view_ops`)
        self.by_op: dict[str, int] = {}  # the work table (`hetpipe.cost_models.work`)
        self.uncounted: set[str] = set()

    def _record(self, key: str, amount: int) -> None:
        self.by_op[key] = self.by_op.get(key, 0) + amount

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in NO_KERNEL_OPS or func.is_view:
            self.view_ops += 1
            return out
        self.kernels += 1
        if packet in ATTENTION_FWD_OPS or packet in ATTENTION_BWD_OPS:
            key = ATTENTION_KEY if packet in ATTENTION_FWD_OPS else ATTENTION_BWD_KEY
            self._record(key, _attention_flops(func, args, kwargs, out))
        if packet in MATMUL_OPS:
            self._record(*_matmul_work(packet, args))
        if packet in COMPUTE_BOUND_OPS:
            return out  # compute-bound: FLOPs from FlopCounterMode, no traffic counted
        flops = formula_flops(func, args, out)
        if flops < 0:
            self.uncounted.add(str(func))
            flops = 0
        self.flops += flops
        moved = traffic_bytes(func, args, kwargs, out, self.precision)
        self.traffic += moved
        self._record(packet.__name__, moved)
        return out


class CostCounter:
    """Context manager counting FLOPs, memory traffic and kernels of the ops run inside.

    Example:
        >>> with CostCounter() as cc:
        ...     _ = torch.empty(8, device="meta").exp()
        >>> cc.snapshot().flops
        8
    """

    def __init__(self, precision: str = "fp32") -> None:
        self._flop_counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
        self._formulas = _FormulaMode(precision)

    def __enter__(self) -> CostCounter:
        self._flop_counter.__enter__()
        self._formulas.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._formulas.__exit__(*exc)
        self._flop_counter.__exit__(*exc)
        if self._formulas.uncounted:
            logger.debug("ops counted as 0 FLOPs: %s", sorted(self._formulas.uncounted))

    @property
    def uncounted(self) -> frozenset[str]:
        """Ops that ran without a FLOP formula (counted as 0)."""
        return frozenset(self._formulas.uncounted)

    def work(self) -> PassWork:
        """Counts accumulated so far with the per-op work table (`hetpipe.cost_models.work`).

        Example:
            >>> with CostCounter() as cc:
            ...     _ = torch.nn.functional.gelu(torch.empty(4, device="meta"))
            >>> cc.work()
            PassWork(flops=4, traffic_bytes=32, kernels=1, by_op=(('gelu', 32),), view_ops=1)
        """
        tally = self.snapshot()
        return PassWork.of(flops=tally.flops, traffic_bytes=tally.traffic_bytes, kernels=tally.kernels,
                           by_op=self._formulas.by_op, view_ops=self._formulas.view_ops)

    def snapshot(self) -> OpTally:
        """Counts accumulated so far."""
        return OpTally(
            flops=int(self._flop_counter.get_total_flops()) + self._formulas.flops,
            traffic_bytes=self._formulas.traffic,
            kernels=self._formulas.kernels,
        )
