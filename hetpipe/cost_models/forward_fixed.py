"""What a training forward costs on a CPU beyond its ops' work (issue 17 item 4): a fixed cost per op, measured
on tiny built-in transformers, and the held activations' cost per byte (`measure_held_bytes_s`).

A calibrated CPU priced each forward op's fixed cost (dispatch, autograd node, allocation, the Python
between ops) from tight loops of one repeated op: `calibrate.measure_op_overhead_s` (``y * 1.0``,
~3.5 us a kernel) and `op_calibration.measure_view_op_s` (a transpose, ~1.3 us a view).  A model's
forward runs a varied sequence instead (every op a different kernel, shape and call path; caches and
branch predictors cold for it): the forwards of `REFERENCE_MODELS` at `TINY_BATCH` x `TINY_SEQ` tokens,
where the kernels have almost nothing to do, cost ~3.7 us per op where those loops priced ~2.3 on
average, ~1.6x (one pinned process, thread CPU time, load ~9 on 2 cores, 2026-12-04).

`measure_forward_op_s` times the forward of each of `REFERENCE_MODELS` at that tiny size, takes away
what its ops' work costs at the rates measured just before (`hetpipe.cost_models.timing.pass_time_s`
with no fixed costs: a few percent of it; their 4-row matmuls run below the 1024-row rates, so up to
~2% of the figure is work, not fixed cost), and divides the rest by the ops it dispatched (kernels and views,
counted by `hetpipe.cost_models.flops.CostCounter` on meta): seconds per forward op, which
`calibrate.calibrate_device` records as the rate ``op_rates[FORWARD_OP_KEY]`` (ops per second) and
`timing.pass_time_s` charges every forward op instead of the loops' figures.

Example:
    >>> rates = (("matmul:4096", 5e10),)
    >>> op_s = measure_forward_op_s(rates, fp32_flops_s=5e10, bandwidth_bytes_s=1e10, repeats=1)
    >>> op_s is None or op_s > 0  # seconds per op (None: not measurable beside the work, e.g. under load)
    True
"""

from __future__ import annotations

import logging
import statistics
from typing import Sequence

import torch

from hetpipe.cost_models import rates as rates_mod
from hetpipe.cost_models.devices import DeviceProfile
from hetpipe.cost_models.flops import CostCounter
from hetpipe.cost_models.rates import median_rate
from hetpipe.cost_models.timing import pass_time_s
from hetpipe.cost_models.work import PassWork

LOG = logging.getLogger(__name__)

#: Built-in transformers whose tiny forward is timed: the two layouts of the CPU truth benchmark (a GPT with
#: GELU and layer norms, a Llama with SiLU, RMS norms and rotary tables), 4 layers each, no download.
REFERENCE_MODELS: tuple[str, ...] = ("gpt-tiny", "llama-tiny")
#: Blocks of `measure_held_bytes_s`, each 1 MiB of fp32: 64 MiB held, beyond the 32 MiB last-level cache of the
#: reference VM, as a micro-batch's activations are (67-91 MiB for the CPU truth benchmark's models at 8 x 128).
HELD_BLOCKS, HELD_BLOCK_NUMEL = 64, 2**18
#: One sequence of 4 tokens: the matmuls are 4 x 64 x 64 (~33 kFLOP), so the time is the fixed cost per op.
TINY_BATCH, TINY_SEQ = 1, 4


def reference_forward_work(name: str) -> PassWork:
    """What the tiny forward of built-in model `name` dispatches (counted on meta).

    Example:
        >>> work = reference_forward_work("gpt-tiny")
        >>> work.kernels > 0 and work.view_ops > 0
        True
    """
    from hetpipe.models import build

    model, inputs = build(name, device="meta", batch=TINY_BATCH, seq=TINY_SEQ)
    with CostCounter() as counter:
        model(*inputs)
    return counter.work()


def _work_s(work: PassWork, profile: DeviceProfile) -> float:
    """Seconds `work`'s FLOPs and bytes take at `profile`'s rates, no fixed cost per op."""
    return pass_time_s(PassWork(work.flops, work.traffic_bytes, 0, work.by_op), profile=profile, precision="fp32")


def measure_forward_op_s(op_rates: Sequence[tuple[str, float]], *, fp32_flops_s: float, bandwidth_bytes_s: float,
                         repeats: int = 3) -> float | None:
    """Seconds of fixed cost per op (kernel or view) of a model's forward on this CPU (module docstring).

    `op_rates`, `fp32_flops_s` and `bandwidth_bytes_s`: the rates measured on this CPU, to take away the
    tiny forwards' work.  None when the forwards took no more than that work: the rates were measured
    while another process held the core (a loaded machine), so no fixed cost is measurable and the
    calibration leaves it out (the loops' per-op figures price the ops, as before session 14).
    """
    from hetpipe.models import build

    profile = DeviceProfile(kind="cpu", memory_bytes=1, tensor_flops_s=fp32_flops_s, fp32_flops_s=fp32_flops_s,
                            memory_bandwidth_bytes_s=bandwidth_bytes_s, matmul_efficiency=1.0,
                            bandwidth_efficiency=1.0, kernel_overhead_s=0.0, op_rates=tuple(op_rates))
    fixed_s, ops = 0.0, 0
    for name in REFERENCE_MODELS:
        work = reference_forward_work(name)
        model, inputs = build(name, device="cpu", batch=TINY_BATCH, seq=TINY_SEQ)
        forward_s = 1.0 / median_rate(lambda: model(*inputs), device="cpu", work=1.0, repeats=repeats)
        fixed_s += forward_s - _work_s(work, profile)
        ops += work.kernels + work.view_ops
    if fixed_s <= 0 or ops == 0:
        LOG.warning("the tiny forwards of %s took no more than their ops' work at the measured rates (%.3g s "
                    "net): no fixed cost per forward op recorded; calibrate on a quieter machine to price it",
                    ", ".join(REFERENCE_MODELS), fixed_s)
        return None
    return fixed_s / ops


def measure_held_bytes_s(*, repeats: int = 3) -> float | None:
    """Bytes per second a forward in training mode pays for the activations it holds (None: not measurable).

    A training forward keeps its activations for backward, so every op writes its output to memory
    that no cache holds (the block last held an activation an iteration ago); timed without autograd, or
    in a calibration loop, each output reuses the block the last one freed, hot in the caches.  Here
    one elementwise op (``x * 1``) writes `HELD_BLOCKS` outputs of `HELD_BLOCK_NUMEL` fp32 into
    distinct blocks allocated (and faulted in) beforehand, then as often into one block; the
    difference of the medians over the bytes written is the rate.  Page faults are left out: a
    steady training loop reuses its heap (session 13: ~30 faults per iteration with glibc's
    thresholds raised, F unchanged).  (Session 14, one pinned process, load ~4: a forward took
    ~60-70 us per MiB of held activations more than under ``torch.no_grad``, for gpt-tiny, gpt-demo
    and the CPU truth benchmark's HF Llama.)

    Example:
        >>> rate = measure_held_bytes_s(repeats=1)
        >>> rate is None or rate > 0
        True
    """
    src = torch.ones(HELD_BLOCK_NUMEL)
    blocks = [torch.ones(HELD_BLOCK_NUMEL) for _ in range(HELD_BLOCKS)]

    def run(fresh: bool) -> float:
        start = rates_mod.CLOCK()
        for i in range(HELD_BLOCKS):
            torch.mul(src, 1.0, out=blocks[i] if fresh else blocks[0])
        return rates_mod.CLOCK() - start

    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats + 1):  # the first of each is a warm-up
        for fresh in (True, False):
            times[fresh].append(run(fresh))
    extra_s = statistics.median(times[True][1:]) - statistics.median(times[False][1:])
    return HELD_BLOCKS * HELD_BLOCK_NUMEL * 4 / extra_s if extra_s > 0 else None
