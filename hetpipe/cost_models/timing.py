"""Unit time on a device kind: the documented roofline-style time model.

For one unit and one micro-batch on a device profile P (issue #2, "Costs"):

    fwd_s = fwd_flops / (peak_flops(P, precision) * matmul_efficiency)
          + memory_traffic_bytes / (P.memory_bandwidth_bytes_s * bandwidth_efficiency)
          + op_count * kernel_overhead_s
    bwd_s = bwd_flops / (peak_flops * matmul_efficiency)
          + BACKWARD_TRAFFIC_FACTOR * memory_traffic_bytes / (bandwidth * bandwidth_efficiency)
          + BACKWARD_TRAFFIC_FACTOR * op_count * kernel_overhead_s

A profile with measured per-op rates (``DeviceProfile.op_rates``: a calibrated CPU, issue 17
item 4) prices each pass from its own counts (`hetpipe.cost_models.work.PassWork`; the backward's
are measured on meta too, not twice the forward's) and every op kind it has a rate for at that rate:

    pass_s = (flops - attention_flops - matmul_flops) / (peak * matmul_efficiency)
           + sum_attention attention_flops / rate[attention or attention_backward]
           + sum_shape matmul_flops[s] / matmul_rate(s)
           + sum_op bytes_op / min(rate[op], bandwidth * bandwidth_efficiency)
           + (traffic - sum_op bytes_op) / (bandwidth * bandwidth_efficiency)
           + kernels * (backward_op_s in a backward pass, else kernel_overhead_s)
           + view_ops * view_op_s

except that a forward pass on a profile with a measured ``forward_op`` rate (ops per second,
`hetpipe.cost_models.forward_fixed`: the fixed cost per op of tiny transformers' forwards, whose varied
ops cost ~1.6x a loop repeating one) pays ``(kernels + view_ops) / rate[forward_op]`` for its fixed costs,
and a unit's forward with a measured ``held_bytes`` rate pays ``activation_bytes / rate[held_bytes]`` for
the activations it holds for backward (`unit_time_s`: fresh memory no cache holds).

The fixed costs per op are measured by calibration (`hetpipe.cost_models.op_calibration`): a forward op
(dispatch, autograd node, allocation), a backward op (the autograd engine's node plus its kernel) and an
op without a kernel (a view, detach or allocation: the HF models run hundreds per forward); a profile
without the last two prices backward kernels at ``kernel_overhead_s`` and views as free, as before.

``matmul_rate(s)`` interpolates the calibrated ``matmul:<s>`` rates (`hetpipe.cost_models.work.matmul_key`:
s is the product of a matmul's two smaller dimensions) linearly in log2(s), clamped at the ends
(`matmul_rate`); without them a matmul runs at the peak x efficiency rate, as before.
The ``min`` is the roofline (Williams, Waterman, Patterson, CACM 2009): a memory-bound op runs
no faster than its in-cache arithmetic (measured, e.g. GELU's tanh) nor than memory streams
(the copy bandwidth) -- a step's activations outgrow the caches.

The compute term is the standard "FLOPs over achieved FLOP/s" stage-time model
(cost_formulas.md §3.1, t_k = sum F / (TFLOPs_k * eta_k)); the memory term
charges memory-bound ops (elementwise, norms, softmax) at achieved DRAM
bandwidth; the overhead term is the per-kernel launch cost.  Efficiencies are
measured by `hetpipe profile --calibrate` where the device is present; the
defaults below apply otherwise and are stated as such in every plan.

Example:
    >>> from hetpipe.cost_models.devices import DeviceProfile
    >>> p = DeviceProfile(kind="x", memory_bytes=1, tensor_flops_s=100e12, fp32_flops_s=10e12,
    ...                   memory_bandwidth_bytes_s=1e12, matmul_efficiency=0.5,
    ...                   bandwidth_efficiency=1.0, kernel_overhead_s=0.0)
    >>> unit_time_s(fwd_flops=5e12, bwd_flops=10e12, memory_traffic_bytes=0, op_count=0,
    ...             profile=p, precision="bf16-mixed")
    UnitTime(fwd_s=0.1, bwd_s=0.2)
    >>> from dataclasses import replace
    >>> cpu = replace(p, op_rates=(("attention", 25e12), ("gelu", 1e11)))
    >>> work = PassWork(flops=10e12, traffic_bytes=3e11, kernels=0, by_op=(("attention", 5e12), ("gelu", 2e11)))
    >>> round(pass_time_s(work, profile=cpu, precision="bf16-mixed"), 6)  # 5e12/5e13 + 5e12/25e12 + 2 + 0.1
    2.4
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetpipe.cost_models.devices import DeviceProfile
from hetpipe.cost_models.memory import check_precision
from hetpipe.cost_models.work import FLOP_KEYS, FORWARD_OP_KEY, HELD_KEY, PassWork, is_matmul_key, matmul_size

# Achieved / peak dense matmul FLOP/s when no calibration is available.
# cost_formulas.md §3.1: "eta_k is the achieved fraction (30-60% typical)";
# we take the midpoint of that cited range.  Calibration replaces it.
DEFAULT_MATMUL_EFFICIENCY = 0.45

# Achieved / peak DRAM bandwidth for streaming (elementwise) kernels.  STREAM
# triad on current GPUs reaches roughly 80-90% of the datasheet bandwidth
# (McCalpin's STREAM benchmark methodology; typical reported GPU figures);
# we take the low end.  [typical; calibrate]
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8

# Fixed cost per launched kernel.  CUDA kernel launch latency is a few
# microseconds (NVIDIA CUDA C++ Best Practices Guide, "kernel launch overhead";
# commonly measured at ~5 us).  [typical; calibrate]
DEFAULT_KERNEL_OVERHEAD_S = 5e-6

# A memory-bound op's backward reads the incoming gradient and the saved input
# and writes the input gradient: about twice its forward traffic (forward:
# read input, write output).  Same factor for launches (one or two kernels).
BACKWARD_TRAFFIC_FACTOR = 2.0

@dataclass(frozen=True)
class Efficiencies:
    """The efficiency figures a profile runs at: calibrated where present, else the defaults above."""

    matmul: float
    bandwidth: float
    kernel_overhead_s: float
    calibrated: bool


def efficiencies(profile: DeviceProfile) -> Efficiencies:
    """`profile`'s efficiencies with each missing one replaced by its documented default."""
    return Efficiencies(
        matmul=DEFAULT_MATMUL_EFFICIENCY if profile.matmul_efficiency is None else profile.matmul_efficiency,
        bandwidth=(DEFAULT_BANDWIDTH_EFFICIENCY if profile.bandwidth_efficiency is None
                   else profile.bandwidth_efficiency),
        kernel_overhead_s=DEFAULT_KERNEL_OVERHEAD_S if profile.kernel_overhead_s is None else profile.kernel_overhead_s,
        calibrated=profile.matmul_efficiency is not None,
    )


@dataclass(frozen=True)
class UnitTime:
    """Forward and backward seconds of one unit for one micro-batch."""

    fwd_s: float
    bwd_s: float


def peak_flops_s(profile: DeviceProfile, precision: str) -> float:
    """Peak dense FLOP/s the training precision runs matmuls at.

    fp32 training uses plain fp32 units (PyTorch leaves TF32 off for matmul by
    default); mixed precision uses tensor cores with FP32 accumulate.
    """
    if check_precision(precision) == "fp32":
        return profile.fp32_flops_s
    return profile.tensor_flops_s


def unit_time_s(
    *,
    fwd_flops: float,
    bwd_flops: float,
    memory_traffic_bytes: float,
    op_count: int,
    profile: DeviceProfile,
    precision: str,
    fwd_work: PassWork | None = None,
    bwd_work: PassWork | None = None,
    held_bytes: int = 0,
) -> UnitTime:
    """Time of one unit on one device kind under the model in the module docstring (the per-op
    form where `profile` has measured ``op_rates`` and both passes' work was counted).  `held_bytes`:
    the activations the unit's forward keeps for backward, priced at a measured ``held_bytes`` rate."""
    if profile.op_rates and fwd_work is not None and bwd_work is not None:
        rates = dict(profile.op_rates)
        held_s = held_bytes / rates[HELD_KEY] if HELD_KEY in rates else 0.0
        return UnitTime(fwd_s=pass_time_s(fwd_work, profile=profile, precision=precision) + held_s,
                        bwd_s=pass_time_s(bwd_work, profile=profile, precision=precision, backward=True))
    eff = efficiencies(profile)
    overhead = eff.kernel_overhead_s
    flops_s = peak_flops_s(profile, precision) * eff.matmul
    bytes_s = profile.memory_bandwidth_bytes_s * eff.bandwidth
    fwd = fwd_flops / flops_s + memory_traffic_bytes / bytes_s + op_count * overhead
    bwd = (
        bwd_flops / flops_s
        + BACKWARD_TRAFFIC_FACTOR * memory_traffic_bytes / bytes_s
        + BACKWARD_TRAFFIC_FACTOR * op_count * overhead
    )
    return UnitTime(fwd_s=fwd, bwd_s=bwd)


def pass_time_s(work: PassWork, *, profile: DeviceProfile, precision: str, backward: bool = False) -> float:
    """One pass priced per op kind (module docstring, ``pass_s``); without ``op_rates`` it is the
    roofline's forward formula over `work`'s totals.  `backward`: the pass is a backward one."""
    eff = efficiencies(profile)
    flops_s = peak_flops_s(profile, precision) * eff.matmul
    bytes_s = profile.memory_bandwidth_bytes_s * eff.bandwidth
    rates = dict(profile.op_rates)
    seconds = _fixed_s(work, profile, rates, backward=backward)
    flops, traffic = float(work.flops), float(work.traffic_bytes)
    for key, amount in work.by_op:
        rate = matmul_rate(rates, matmul_size(key)) if is_matmul_key(key) else rates.get(key)
        if rate is None:
            continue
        if key in FLOP_KEYS or is_matmul_key(key):
            seconds += amount / rate
            flops -= amount
        else:
            seconds += amount / min(rate, bytes_s)
            traffic -= amount
    return seconds + flops / flops_s + traffic / bytes_s


def _fixed_s(work: PassWork, profile: DeviceProfile, rates: dict[str, float], *, backward: bool) -> float:
    """The pass's fixed costs per op (module docstring): a forward op at the measured ``forward_op`` rate where
    there is one; else a kernel at ``backward_op_s`` (backward) or the kernel overhead, a view at ``view_op_s``."""
    if not backward and FORWARD_OP_KEY in rates:
        return (work.kernels + work.view_ops) / rates[FORWARD_OP_KEY]
    per_kernel_s = profile.backward_op_s if backward and profile.backward_op_s is not None else (
        efficiencies(profile).kernel_overhead_s)
    return work.kernels * per_kernel_s + work.view_ops * (profile.view_op_s or 0.0)


def matmul_rate(rates: dict[str, float], size: int) -> float | None:
    """FLOP/s of a matmul of narrow-side size `size` from the measured ``matmul:<s>`` rates in `rates`:
    linear in log2(size) between the two nearest, the end rate outside them; None when none was measured.

    Example:
        >>> matmul_rate({"matmul:4096": 4e10, "matmul:65536": 8e10, "gelu": 1e9}, 16384)  # halfway in log2
        60000000000.0
        >>> matmul_rate({"matmul:4096": 4e10}, 10**6), matmul_rate({"gelu": 1e9}, 4096)
        (40000000000.0, None)
    """
    points = sorted((matmul_size(k), r) for k, r in rates.items() if is_matmul_key(k))
    if not points:
        return None
    if size <= points[0][0]:
        return points[0][1]
    for (s0, r0), (s1, r1) in zip(points, points[1:]):
        if size <= s1:
            t = (math.log2(size) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return r0 + t * (r1 - r0)
    return points[-1][1]
