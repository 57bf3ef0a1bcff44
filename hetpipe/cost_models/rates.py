"""Timing primitive of every calibration: the median rate of a repeated operation.

Example:
    >>> median_rate(lambda: sum(range(100)), device="cpu", work=100.0, repeats=1) > 0
    True
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

from hetpipe.errors import ConfigError

#: Each timed repeat runs enough back-to-back kernels to last at least this long, so
#: sub-millisecond GPU kernels are not dominated by timer/launch resolution.
MIN_TIMED_S = 0.02
#: Cap on back-to-back kernels per repeat (keeps a slow first call from exploding).
MAX_INNER_ITERATIONS = 1000
#: The clock `median_rate` times with: wall time, what a plan predicts.  A benchmark on a shared
#: machine may set ``time.thread_time`` (CPU time of the calling thread: other processes taking the
#: core do not count), as ``benchmarks/cpu_truth.py --cpu-time`` does for its load-robust check.
CLOCK = time.perf_counter


def sync(device: str) -> None:
    """Wait for `device`'s queued kernels (a CUDA device; a CPU runs synchronously).

    Example:
        >>> sync("cpu")
    """
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def median_rate(op: Callable[[], object], *, device: str, work: float, repeats: int) -> float:
    """Median of ``work / seconds`` over `repeats` timings of `op` (after a warm-up)."""
    if repeats < 1:
        raise ConfigError(f"repeats must be at least 1, got {repeats}; pass repeats=5")
    op()  # warm-up: allocations, page faults, kernel selection, lazy CUDA init
    sync(device)
    start = CLOCK()
    op()  # a warm call sizes the inner loop
    sync(device)
    warm_s = max(CLOCK() - start, 1e-9)
    inner = max(1, min(MAX_INNER_ITERATIONS, math.ceil(MIN_TIMED_S / warm_s)))
    rates = []
    for _ in range(repeats):
        sync(device)
        start = CLOCK()
        for _ in range(inner):
            op()
        sync(device)
        rates.append(work * inner / max(CLOCK() - start, 1e-12))
    return statistics.median(rates)
