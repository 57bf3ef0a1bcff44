"""Bytes per parameter of training state and per element of activations.

Model state per parameter = stored weight + gradient + optimizer state, and for the
mixed-precision modes also the fp32 master copy of the weight.  The mixed-precision
layout is the one of the ZeRO paper (Rajbhandari et al., SC'20, section 3.1): 16-bit
weights (2 B) and gradients (2 B) plus K bytes of fp32 optimizer state, K = 12 for
Adam (fp32 master weights 4 + first moment 4 + second moment 4), i.e. 2 + 2 + 12 = 16
B/param (`shared/reference/cost_formulas.md` section 3.2).  SGD keeps no moments,
momentum SGD one; mixed SGD still keeps the fp32 master weights.

Activations under mixed precision: autocast runs matmuls and convolutions in the
16-bit type, so the tensors autograd keeps and the tensors crossing a stage boundary
are 16-bit.  Costs are measured on the model's own (usually fp32) dtype and every
floating-point tensor wider than 16 bits is then counted at 2 bytes per element
(`element_bytes`).  Approximation: the few tensors autocast keeps in fp32 (softmax and
norm statistics, losses) are counted as 16-bit too.

Example:
    >>> state_bytes_per_param("adam", "bf16-mixed")
    16.0
    >>> state_bytes_per_param("sgd", "fp32")
    8.0
    >>> element_bytes(torch.float32, "fp16-mixed"), element_bytes(torch.int64, "fp16-mixed")
    (2, 8)
"""

from __future__ import annotations

import torch

from hetpipe.errors import ConfigError

#: Bytes of one fp32 value (IEEE 754 binary32).
FP32_BYTES = 4
#: Bytes of one fp16/bf16 value (IEEE 754 binary16 / bfloat16).
HALF_BYTES = 2

#: Training precisions: bytes of the stored weight and of its gradient, and whether an
#: fp32 master copy of the weights is kept (ZeRO paper, section 3.1).
PRECISIONS: dict[str, tuple[int, int, bool]] = {
    "fp32": (FP32_BYTES, FP32_BYTES, False),
    "bf16-mixed": (HALF_BYTES, HALF_BYTES, True),
    "fp16-mixed": (HALF_BYTES, HALF_BYTES, True),
}

#: Optimizer state in fp32 values per parameter: SGD none, momentum SGD one buffer,
#: Adam/AdamW the first and second moments (Kingma & Ba 2015; Loshchilov & Hutter 2019).
OPTIMIZER_STATE_VALUES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


def check_precision(precision: str) -> str:
    """Return ``precision`` if known, else raise `ConfigError` listing the valid ones.

    Example:
        >>> check_precision("fp32")
        'fp32'
    """
    if precision not in PRECISIONS:
        valid = ", ".join(sorted(PRECISIONS))
        raise ConfigError(f"unknown precision {precision!r}; use one of: {valid}")
    return precision


def check_optimizer(optimizer: str) -> str:
    """Return ``optimizer`` if known, else raise `ConfigError` listing the valid ones.

    Example:
        >>> check_optimizer("adamw")
        'adamw'
    """
    if optimizer not in OPTIMIZER_STATE_VALUES:
        valid = ", ".join(sorted(OPTIMIZER_STATE_VALUES))
        raise ConfigError(f"unknown optimizer {optimizer!r}; use one of: {valid}")
    return optimizer


def state_bytes_per_param(optimizer: str, precision: str) -> float:
    """Bytes of weights + gradients + optimizer state per parameter.

    Raises `ConfigError` for an unknown optimizer or precision.

    Example:
        >>> state_bytes_per_param("adamw", "fp32"), state_bytes_per_param("momentum", "fp16-mixed")
        (16.0, 12.0)
    """
    weight_b, grad_b, master = PRECISIONS[check_precision(precision)]
    moments_b = OPTIMIZER_STATE_VALUES[check_optimizer(optimizer)] * FP32_BYTES
    master_b = FP32_BYTES if master else 0
    return float(weight_b + grad_b + master_b + moments_b)


def grad_bytes_per_param(precision: str) -> int:
    """Bytes of one parameter's gradient in ``precision`` (part of `state_bytes_per_param`).

    Example:
        >>> grad_bytes_per_param("fp32"), grad_bytes_per_param("bf16-mixed")
        (4, 2)
    """
    return PRECISIONS[check_precision(precision)][1]


def weight_bytes_per_param(precision: str) -> int:
    """Bytes of one stored (compute) weight in ``precision``.

    Example:
        >>> weight_bytes_per_param("bf16-mixed")
        2
    """
    return PRECISIONS[check_precision(precision)][0]


def element_bytes(dtype: torch.dtype, precision: str) -> int:
    """Bytes of one activation element of ``dtype`` when training in ``precision``.

    Floating types wider than 16 bits count 2 bytes under the mixed precisions (see the
    module docstring); other dtypes count their own size.

    Example:
        >>> element_bytes(torch.float32, "fp32"), element_bytes(torch.bfloat16, "fp32")
        (4, 2)
    """
    size = dtype.itemsize
    if PRECISIONS[check_precision(precision)][2] and dtype.is_floating_point:
        return min(size, HALF_BYTES)
    return size


def tensor_bytes(t: torch.Tensor, precision: str = "fp32") -> int:
    """Bytes of a tensor's logical elements (``numel``) in ``precision``.

    Example:
        >>> tensor_bytes(torch.empty(2, 3, device="meta"))
        24
    """
    return t.numel() * element_bytes(t.dtype, precision)
