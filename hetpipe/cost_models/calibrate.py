"""Calibration: measure what this machine really does, instead of trusting datasheets.

Three measurements, each fast on a CPU (a few seconds in all):

* `measure_matmul_flops_s` - a square matmul, median of repeats after a warm-up
  (synchronising CUDA around each timing);
* `measure_memory_bandwidth_bytes_s` - a large tensor copy (read + write);
* `measure_link` - ping-pong between local ranks over torch.distributed gloo on
  127.0.0.1, fitted to the alpha-beta model ``t = latency + bytes / bandwidth``
  (cost_formulas.md §3.4).

`calibrate_device` bundles the first two into a frozen `Calibration`, and
`apply_calibration` turns it into a `DeviceProfile` whose ``matmul_efficiency`` is
measured / peak.

Example:
    >>> flops = measure_matmul_flops_s("cpu", size=64, repeats=2)
    >>> flops > 0
    True
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from torch.multiprocessing.spawn import ProcessContext, ProcessException

from hetpipe.cost_models.cpu_cores import format_cores
from hetpipe.cost_models.forward_fixed import measure_forward_op_s, measure_held_bytes_s
from hetpipe.cost_models.op_calibration import (
    measure_backward_op_s, measure_op_rates, measure_step_bytes_s, measure_step_op_s, measure_view_op_s,
)
from hetpipe.cost_models.rates import MAX_INNER_ITERATIONS, MIN_TIMED_S, median_rate  # noqa: F401 (re-exported)
from hetpipe.cost_models.devices import DeviceProfile
from hetpipe.cost_models.work import FORWARD_OP_KEY, HELD_KEY
from hetpipe.errors import ConfigError, RuntimeFailure

logger = logging.getLogger(__name__)

#: Matmul edge used by default: 1024^3 is 2.1 GFLOP, ~0.1 s on the 2-core reference
#: VM (environment_facts.md machine) and large enough to leave launch overhead
#: behind on a GPU when repeated (see MIN_TIMED_S).
DEFAULT_MATMUL_SIZE = 1024
#: Timed repeats per measurement; the median is reported (robust to one slow run).
DEFAULT_REPEATS = 5
#: FLOPs of an n x n by n x n matmul: n^3 multiply-adds, 2 FLOPs each.
FLOPS_PER_MULTIPLY_ADD = 2
#: Copy size for memory bandwidth: 64 MiB, far above the last-level cache of the
#: reference VM and of any GPU's L2 (the largest in gpu_specs.md is H100's 50 MB).
DEFAULT_COPY_BYTES = 64 * 2**20
#: A copy reads and writes every byte once.
COPY_TRAFFIC_FACTOR = 2
#: Message sizes for the link fit: 4 KiB pins the latency, 4-64 MiB the bandwidth
#: (cost_formulas.md §3.4: fit beta at MB sizes, small messages never reach peak).
DEFAULT_LINK_SIZES_BYTES: tuple[int, ...] = (4 * 2**10, 256 * 2**10, 4 * 2**20, 16 * 2**20, 64 * 2**20)
#: Bound on the whole multi-process link measurement, start-up included
#: (environment_facts.md: 2-4 ranks under mp.spawn start in 6-8 s).
LINK_TIMEOUT_S = 60.0
#: torch.distributed timeout for any single collective/p2p call inside the workers.
LINK_OP_TIMEOUT_S = 30.0
#: Kind of the catalog's CPU row, whose "peak" is itself a measurement.
CPU_KIND = "cpu"
#: Ops per timed chain of `measure_op_overhead_s`, on tensors of `OVERHEAD_NUMEL` elements: the
#: arithmetic is nothing, so the time is the framework's fixed cost per op (dispatch, autograd
#: node, allocation), the ``op_count * kernel_overhead_s`` term of `hetpipe.cost_models.timing`.
OVERHEAD_CHAIN_OPS = 200
OVERHEAD_NUMEL = 8


@dataclass(frozen=True)
class LinkMeasurement:
    """An alpha-beta fit of point-to-point transfers between local ranks.

    Attributes:
        latency_s: fitted alpha (one-way, half a ping-pong round trip).
        bandwidth_bytes_s: fitted beta.
        sizes_bytes: message sizes measured.
        median_times_s: median one-way time per size.
        world_size: ranks that took part (rank 0 ping-pongs with each peer in turn).
        backend: torch.distributed backend used.
        method: how it was measured: a ping-pong (`measure_link`) or framed one-way messages
            (`hetpipe.cost_models.link_calibration.measure_message_link`).
    """

    latency_s: float
    bandwidth_bytes_s: float
    sizes_bytes: tuple[int, ...]
    median_times_s: tuple[float, ...]
    world_size: int
    backend: str = "gloo"
    method: str = "ping-pong"


@dataclass(frozen=True)
class Calibration:
    """What one device measured on this host.

    Attributes:
        device: torch device string (``cpu``, ``cuda:0``).
        tensor_matmul_flops_s: matmul FLOP/s in the training dtype (bf16 on CUDA;
            fp32 on a CPU, which has no tensor cores).
        fp32_matmul_flops_s: fp32 matmul FLOP/s.
        memory_bandwidth_bytes_s: copy bandwidth (bytes read + written per second).
        matmul_size: matmul edge used.
        host: host name.
        torch_version: torch that ran the kernels.
        measured_at: UTC date of the measurement (ISO 8601).
        link: a loopback link fit, when one was measured.
        kernel_overhead_s: fixed seconds per recorded op (`measure_op_overhead_s`), when measured.
        cores: the CPU core group it ran pinned to (`hetpipe.cost_models.core_groups`); () = unpinned.
        op_rates: per-op-kind rates (`hetpipe.cost_models.op_calibration.measure_op_rates`), on a CPU, and
            ``forward_op``: forward ops per second (`hetpipe.cost_models.forward_fixed.measure_forward_op_s`).
        step_op_s: seconds per op of the per-tensor optimizer loop (`measure_step_op_s`), on a CPU.
        step_bytes_s: bytes per second that loop streams (`measure_step_bytes_s`), on a CPU.
        backward_op_s: fixed seconds per backward op (`measure_backward_op_s`), on a CPU.
        view_op_s: fixed seconds per op without a kernel (`measure_view_op_s`), on a CPU.
    """

    device: str
    tensor_matmul_flops_s: float
    fp32_matmul_flops_s: float
    memory_bandwidth_bytes_s: float
    matmul_size: int
    host: str
    torch_version: str
    measured_at: str
    link: LinkMeasurement | None = None
    kernel_overhead_s: float | None = None
    cores: tuple[int, ...] = ()
    op_rates: tuple[tuple[str, float], ...] = ()
    step_op_s: float | None = None
    step_bytes_s: float | None = None
    backward_op_s: float | None = None
    view_op_s: float | None = None


def measure_matmul_flops_s(
    device: str = "cpu", *, dtype: torch.dtype = torch.float32, size: int = DEFAULT_MATMUL_SIZE,
    repeats: int = DEFAULT_REPEATS,
) -> float:
    """Achieved FLOP/s of a ``size x size`` matmul on `device`, median of `repeats`.

    Example:
        >>> measure_matmul_flops_s("cpu", size=32, repeats=1) > 0
        True
    """
    if size < 1:
        raise ConfigError(f"matmul size must be positive, got {size}; pass size=1024")
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    work = float(FLOPS_PER_MULTIPLY_ADD * size**3)
    return median_rate(lambda: torch.mm(a, b), device=device, work=work, repeats=repeats)


def measure_memory_bandwidth_bytes_s(
    device: str = "cpu", *, size_bytes: int = DEFAULT_COPY_BYTES, repeats: int = DEFAULT_REPEATS,
) -> float:
    """Achieved copy bandwidth on `device` (bytes read + written per second).

    Example:
        >>> measure_memory_bandwidth_bytes_s("cpu", size_bytes=2**20, repeats=1) > 0
        True
    """
    numel = max(1, size_bytes // 4)
    src = torch.ones(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    work = float(COPY_TRAFFIC_FACTOR * numel * 4)
    return median_rate(lambda: dst.copy_(src), device=device, work=work, repeats=repeats)


def measure_op_overhead_s(device: str = "cpu", *, repeats: int = DEFAULT_REPEATS) -> float:
    """Seconds per op of a chain of tiny elementwise ops recorded by autograd (median of `repeats`).

    Example:
        >>> 0 < measure_op_overhead_s("cpu", repeats=1) < 0.01
        True
    """
    x = torch.ones(OVERHEAD_NUMEL, device=device, requires_grad=True)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(OVERHEAD_CHAIN_OPS):
            y = y * 1.0
        return y

    ops_s = median_rate(chain, device=device, work=float(OVERHEAD_CHAIN_OPS), repeats=repeats)
    return 1.0 / ops_s


def fit_alpha_beta(sizes_bytes: Sequence[int], times_s: Sequence[float]) -> tuple[float, float]:
    """Fit ``t = latency + bytes / bandwidth``; returns ``(latency_s, bandwidth_bytes_s)``.

    Least squares on *relative* error (weights 1/t^2), so the small messages fix the
    latency and the large ones the bandwidth instead of the largest size dominating.
    A negative intercept (noise) is refitted through the origin (latency 0).

    Example:
        >>> lat, bw = fit_alpha_beta([1000, 2000, 4000], [2e-6, 3e-6, 5e-6])
        >>> round(lat * 1e6, 6), round(bw / 1e9, 6)
        (1.0, 1.0)
    """
    if len(sizes_bytes) != len(times_s) or len(sizes_bytes) < 2:
        raise ConfigError("the alpha-beta fit needs at least two (size, time) pairs; measure more sizes")
    w = [1.0 / (t * t) for t in times_s]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes_bytes))
    sy = sum(wi * y for wi, y in zip(w, times_s))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes_bytes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes_bytes, times_s))
    denom = sw * sxx - sx * sx
    if denom <= 0:
        raise ConfigError("the alpha-beta fit needs at least two distinct message sizes")
    slope = (sw * sxy - sx * sy) / denom
    intercept = (sy - slope * sx) / sw
    if intercept < 0:
        slope, intercept = sxy / sxx, 0.0
    if slope <= 0:
        raise RuntimeFailure("link measurement: time did not grow with message size; use larger sizes_bytes")
    return intercept, 1.0 / slope


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ping_pong(rank: int, peer: int, sizes: Sequence[int], repeats: int) -> list[list[float]]:
    """One-way times (half round trips) per size between rank 0 and `peer`."""
    import torch.distributed as dist

    times: list[list[float]] = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
        per_size = []
        for i in range(repeats + 1):  # the first exchange is a warm-up
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i > 0:
                per_size.append((time.perf_counter() - start) / 2)
        times.append(per_size)
    return times


def _link_worker(rank: int, world_size: int, port: int, sizes: list[int], repeats: int, out: str,
                 core_groups: list[list[int]] | None = None) -> None:
    """Spawned per rank: rank 0 ping-pongs with every peer in turn and writes the times."""
    import torch.distributed as dist

    from hetpipe.cost_models.cpu_cores import pin_cores

    torch.set_num_threads(1)  # environment_facts.md: mp.spawn oversubscribes otherwise
    if core_groups:
        pin_cores(core_groups[rank])  # each end runs where its device (core group) runs
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=LINK_OP_TIMEOUT_S),
    )
    try:
        samples: list[list[float]] = [[] for _ in sizes]
        for peer in range(1, world_size):
            if rank in (0, peer):
                for acc, got in zip(samples, _ping_pong(rank, peer, sizes, repeats)):
                    acc.extend(got)
            dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps(samples))
    finally:
        dist.destroy_process_group()


def join_or_kill(context: ProcessContext, timeout_s: float, *, what: str = "link measurement") -> None:
    """Wait for spawned measurement processes; terminate them past `timeout_s`; failures name `what`."""
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for proc in context.processes:
                    proc.terminate()
                raise RuntimeFailure(
                    f"{what} did not finish within {timeout_s:.0f} s; "
                    "check that 127.0.0.1 is usable and the machine is not overloaded"
                )
    except ProcessException as err:
        last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise RuntimeFailure(f"{what}: a process failed: {last}; rerun, or check gloo on 127.0.0.1") from err


def measure_link(
    world_size: int = 2, *, sizes_bytes: Sequence[int] = DEFAULT_LINK_SIZES_BYTES,
    repeats: int = DEFAULT_REPEATS, timeout_s: float = LINK_TIMEOUT_S,
    core_groups: Sequence[Sequence[int]] | None = None,
) -> LinkMeasurement:
    """Measure point-to-point transfers between `world_size` local gloo ranks.

    With `core_groups` (one per rank), rank r runs pinned to ``core_groups[r]``.

    Example:
        >>> m = measure_link(2, sizes_bytes=(4096, 2**20), repeats=2)  # doctest: +SKIP
        >>> m.bandwidth_bytes_s > 0  # doctest: +SKIP
        True
    """
    if not 2 <= world_size <= 4:
        raise ConfigError(f"world_size must be 2 to 4 local ranks, got {world_size}")
    sizes = sorted({int(s) for s in sizes_bytes})
    if len(sizes) < 2 or sizes[0] < 4:
        raise ConfigError("sizes_bytes needs at least two distinct sizes of 4 bytes or more")
    groups = [list(g) for g in core_groups] if core_groups else None
    if groups is not None and len(groups) != world_size:
        raise ConfigError(f"core_groups has {len(groups)} groups for {world_size} ranks; give one per rank")
    with tempfile.TemporaryDirectory(prefix="hetpipe-link-") as tmp:
        out = os.path.join(tmp, "times.json")
        context = torch.multiprocessing.spawn(
            _link_worker, args=(world_size, free_port(), sizes, repeats, out, groups), nprocs=world_size, join=False,
        )
        join_or_kill(context, timeout_s)
        samples = json.loads(Path(out).read_text())
    medians = [statistics.median(s) for s in samples]
    latency_s, bandwidth = fit_alpha_beta(sizes, medians)
    logger.info("loopback link: latency %.3g s, bandwidth %.3g B/s", latency_s, bandwidth)
    return LinkMeasurement(latency_s, bandwidth, tuple(sizes), tuple(medians), world_size)


def calibrate_device(
    device: str = "cpu", *, size: int = DEFAULT_MATMUL_SIZE, repeats: int = DEFAULT_REPEATS,
    copy_bytes: int = DEFAULT_COPY_BYTES, link: LinkMeasurement | None = None, cores: tuple[int, ...] = (),
) -> Calibration:
    """Measure matmul FLOP/s (training dtype and fp32), copy bandwidth and, on a CPU, the cost per op.

    `cores` only records where the caller pinned this process (`hetpipe.cost_models.group_calibration`).

    Example:
        >>> cal = calibrate_device("cpu", size=64, repeats=1, copy_bytes=2**20)
        >>> cal.tensor_matmul_flops_s == cal.fp32_matmul_flops_s  # a CPU has no tensor cores
        True
    """
    fp32 = measure_matmul_flops_s(device, dtype=torch.float32, size=size, repeats=repeats)
    # bf16 is what autocast trains with on a GPU; CPU training runs in fp32 here.
    tensor = fp32 if device == "cpu" else measure_matmul_flops_s(
        device, dtype=torch.bfloat16, size=size, repeats=repeats)
    bandwidth = measure_memory_bandwidth_bytes_s(device, size_bytes=copy_bytes, repeats=repeats)
    # A CPU runs each op synchronously, so its fixed cost per op adds up; a GPU's launches overlap
    # the previous kernel on the stream, so the catalog's launch figure stays (timing.py).
    overhead = measure_op_overhead_s(device, repeats=repeats) if device == "cpu" else None
    # A CPU's attention, transcendental ops and per-tensor optimizer loop have their own rates (issue 17
    # item 4, `op_calibration`); a GPU's are left to the roofline and its foreach step.
    op_rates = measure_op_rates(device, repeats=repeats) if device == "cpu" else ()
    if op_rates:  # the fixed cost per forward op, net of the tiny forwards' work at the rates just measured
        forward_op_s = measure_forward_op_s(op_rates, fp32_flops_s=fp32, bandwidth_bytes_s=bandwidth, repeats=repeats)
        held = measure_held_bytes_s(repeats=repeats)  # None: no measurable cost, not priced
        op_rates = tuple(sorted(op_rates + (((FORWARD_OP_KEY, 1.0 / forward_op_s),) if forward_op_s else ())
                                + (((HELD_KEY, held),) if held is not None else ())))
    step_op_s = measure_step_op_s(repeats=repeats) if device == "cpu" else None
    step_bytes_s = measure_step_bytes_s(step_op_s=step_op_s, repeats=repeats) if step_op_s is not None else None
    return Calibration(
        device=device, tensor_matmul_flops_s=tensor, fp32_matmul_flops_s=fp32,
        memory_bandwidth_bytes_s=bandwidth, matmul_size=size, host=socket.gethostname(),
        torch_version=torch.__version__, measured_at=datetime.date.today().isoformat(), link=link,
        kernel_overhead_s=overhead, cores=cores, op_rates=op_rates, step_op_s=step_op_s,
        step_bytes_s=step_bytes_s,
        backward_op_s=measure_backward_op_s(repeats=repeats) if device == "cpu" else None,
        view_op_s=measure_view_op_s(repeats=repeats) if device == "cpu" else None,
    )


def apply_calibration(profile: DeviceProfile, calibration: Calibration) -> DeviceProfile:
    """`profile` with measured efficiencies: ``matmul_efficiency = measured / peak``.

    The CPU row's "peak" is itself a placeholder measurement, so for ``cpu`` (and
    for any card that measures above its catalog peak, which means the row is
    wrong) the measured figures become the peaks and the efficiencies 1.0.

    Example:
        >>> p = DeviceProfile("x", 10**9, 100e12, 50e12, 1e12)
        >>> cal = Calibration("cuda:0", 40e12, 20e12, 0.8e12, 1024, "h", "2.13", "2025-01-01")
        >>> q = apply_calibration(p, cal)
        >>> q.matmul_efficiency, q.bandwidth_efficiency
        (0.4, 0.8)
    """
    tensor, fp32, bandwidth = profile.tensor_flops_s, profile.fp32_flops_s, profile.memory_bandwidth_bytes_s
    measured_peak = profile.kind == CPU_KIND
    if calibration.tensor_matmul_flops_s > tensor or calibration.memory_bandwidth_bytes_s > bandwidth:
        if not measured_peak:
            logger.warning("%s measured above its catalog peak; using the measured figures as peaks "
                           "(check the catalog row)", profile.kind)
        measured_peak = True
    if measured_peak:
        tensor, fp32 = calibration.tensor_matmul_flops_s, calibration.fp32_matmul_flops_s
        bandwidth = calibration.memory_bandwidth_bytes_s
    eff = calibration.tensor_matmul_flops_s / tensor
    bw_eff = calibration.memory_bandwidth_bytes_s / bandwidth
    source = (f"calibrated {calibration.measured_at} on {calibration.host} ({calibration.device}, "
              f"{calibration.matmul_size}^3 matmul {calibration.tensor_matmul_flops_s:.4g} FLOP/s, "
              f"copy {calibration.memory_bandwidth_bytes_s:.4g} B/s, torch {calibration.torch_version}); "
              f"peaks: {'measured' if measured_peak else profile.source}")
    overhead = profile.kernel_overhead_s if calibration.kernel_overhead_s is None else calibration.kernel_overhead_s
    if calibration.kernel_overhead_s is not None:
        source += f"; {calibration.kernel_overhead_s * 1e6:.3g} us per op"
    if calibration.cores:
        source += f"; pinned to cores {format_cores(calibration.cores)}, {len(calibration.cores)} thread(s)"
    if calibration.op_rates:
        source += f"; rates of {len(calibration.op_rates)} op kinds"
    if calibration.step_op_s is not None:
        source += f"; per-tensor optimizer loop {calibration.step_op_s * 1e6:.3g} us per op"
    if calibration.step_bytes_s is not None:
        source += f", streams {calibration.step_bytes_s:.4g} B/s"
    if calibration.backward_op_s is not None and calibration.view_op_s is not None:
        source += (f"; {calibration.backward_op_s * 1e6:.3g} us per backward op, "
                   f"{calibration.view_op_s * 1e6:.3g} us per view")
    return replace(profile, tensor_flops_s=tensor, fp32_flops_s=fp32, memory_bandwidth_bytes_s=bandwidth,
                   matmul_efficiency=eff, bandwidth_efficiency=bw_eff, kernel_overhead_s=overhead, source=source,
                   op_rates=calibration.op_rates or profile.op_rates,
                   step_op_s=profile.step_op_s if calibration.step_op_s is None else calibration.step_op_s,
                   step_bytes_s=profile.step_bytes_s if calibration.step_bytes_s is None else calibration.step_bytes_s,
                   backward_op_s=(profile.backward_op_s if calibration.backward_op_s is None
                                  else calibration.backward_op_s),
                   view_op_s=profile.view_op_s if calibration.view_op_s is None else calibration.view_op_s)
