"""How fast each CPU core group is *now*: a fixed reference workload, timed pinned (issue 17 item 4).

A calibration measures a core group once; a run on the same group minutes later meets the
host as it is then.  On a shared virtual machine the host's speed drifts (session 15: the same
stage's forward 30.6 then 53.5 ms ten minutes apart; the same single-process work 64.6 then
79.3 ms of thread CPU time), so a run's measured / predicted ratio mixes the cost model's
error with the host's drift.  This module times one fixed piece of work -- shaped like the
benchmark models' compute (`REFERENCE_PARTS`) -- in one pinned process per core group, all
groups at once as the stages run, so that a benchmark can take it right before and after a
calibration and a run and divide the host's drift out of the ratios *as measured*
(`host_drift`), beside the raw ratios.

The parts, each timed separately in wall time (`time.perf_counter`, what a run measures) and in
the thread's CPU time (`time.thread_time`: time other processes hold the core does not count):

* ``matmul``: `REFERENCE_MATMULS` linear layers of 1024 tokens, width 128 to 512 (the benchmark
  models' h=128 and FFN 344-512): 4 x 2 x 1024 x 128 x 512 = 537 MFLOP, ~7 ms on one core of the
  reference VM (~80 GFLOP/s at this shape, load ~6, 2026-12-04);
* ``gelu``: the tanh GELU over one layer's output (512 Ki elements, 2 MiB): the transcendental
  elementwise kind the models' forwards spend ~13% on, ~1.4 ms;
* ``stream``: a copy of 32 MiB (as large as the reference VM's last-level cache, so source and
  destination together do not fit): a stage's held activations stream like this, 3-7 ms (the two
  groups share the cache and the memory bus: the same copy took either at load ~6).

A sample's total is the sum of the parts' medians; `HostDrift` also keeps each part's ratio, so a
table can say whether the drift was in the arithmetic or in the memory.

Example:
    >>> before = (ReferenceTiming((0,), 0.010, 0.009, (("matmul", 0.005),), 0.0),)
    >>> after = (ReferenceTiming((0,), 0.012, 0.0099, (("matmul", 0.006),), 60.0),)
    >>> d = host_drift(before, after)[0]
    >>> round(d.wall_ratio, 2), round(d.cpu_ratio, 2), d.cores, d.parts_wall_ratio
    (1.2, 1.1, (0,), (('matmul', 1.2),))
"""

from __future__ import annotations

import logging
import multiprocessing
import statistics
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Callable, Sequence

import torch

from hetpipe.cost_models.cpu_cores import pin_cores
from hetpipe.errors import ConfigError, RuntimeFailure

logger = logging.getLogger(__name__)

#: Tokens, width in and width out of the reference linear layer (module docstring).
REFERENCE_TOKENS, REFERENCE_WIDTH_IN, REFERENCE_WIDTH_OUT = 1024, 128, 512
#: Linear layers per pass: the matmul part about half of a pass, as matmuls are of the models' forwards.
REFERENCE_MATMULS = 4
#: Bytes of the reference copy: the reference VM's last-level cache (32 MiB, lscpu), so that the
#: copy's source and destination together exceed it.
REFERENCE_STREAM_BYTES = 32 * 2**20
#: Timed passes per sample (after one warm-up pass); the median of each part is kept (robust to one
#: preempted pass). 40 passes of ~12-16 ms: ~0.5 s of work per sample beside 3-15 s of process start-up
#: (importing torch in a spawned process, quiet to load ~6).
REFERENCE_REPEATS = 40
#: Bound on one sample of every group, and on the probes' start-up (importing torch under spawn).
REFERENCE_TIMEOUT_S = 120.0
#: How long a probe may take to exit when told to (it finishes the sample it is in first).
PROBE_EXIT_S = 10.0
#: The parts, in the order they run.
REFERENCE_PARTS = ("matmul", "gelu", "stream")


@dataclass(frozen=True)
class ReferenceTiming:
    """One sample of the reference workload on one core group: median seconds per pass."""

    cores: tuple[int, ...]
    wall_s: float  # the parts' median wall seconds, summed
    cpu_s: float  # the parts' median thread CPU seconds, summed
    parts_wall_s: tuple[tuple[str, float], ...]  # (part, median wall seconds) per `REFERENCE_PARTS`
    taken_at_s: float  # time.time() when the sample ended (seconds since the epoch)
    parts_cpu_s: tuple[tuple[str, float], ...] = ()  # (part, median thread CPU seconds)


@dataclass(frozen=True)
class HostDrift:
    """The host's speed on one core group at a run against at its calibration: seconds of the same
    reference work then / now.  Above 1 the group was slower at the run; ``ratio / drift`` takes it out."""

    cores: tuple[int, ...]
    wall_ratio: float
    cpu_ratio: float
    parts_wall_ratio: tuple[tuple[str, float], ...] = ()  # (part, its wall ratio) where both sides have it
    parts_cpu_ratio: tuple[tuple[str, float], ...] = ()  # (part, its CPU-time ratio) where both sides have it


def _operands() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(REFERENCE_TOKENS, REFERENCE_WIDTH_IN, generator=gen),
            "w": torch.randn(REFERENCE_WIDTH_IN, REFERENCE_WIDTH_OUT, generator=gen),
            "src": torch.ones(REFERENCE_STREAM_BYTES // 4), "dst": torch.empty(REFERENCE_STREAM_BYTES // 4)}


def _parts(t: dict[str, torch.Tensor]) -> tuple[tuple[str, Callable[[], object]], ...]:
    y = t["x"] @ t["w"]
    return (("matmul", lambda: [torch.mm(t["x"], t["w"]) for _ in range(REFERENCE_MATMULS)]),
            ("gelu", lambda: torch.nn.functional.gelu(y, approximate="tanh")),
            ("stream", lambda: t["dst"].copy_(t["src"])))


def time_reference(repeats: int = REFERENCE_REPEATS, *, cores: Sequence[int] = ()) -> ReferenceTiming:
    """The reference workload in this process (pinned or not: `cores` only labels the sample).

    Example:
        >>> t = time_reference(1)
        >>> t.wall_s > 0 and t.cpu_s > 0 and [p for p, _ in t.parts_wall_s] == list(REFERENCE_PARTS)
        True
    """
    if repeats < 1:
        raise ConfigError(f"reference repeats: {repeats}; pass 1 or more")
    parts = _parts(_operands())
    for _, op in parts:  # warm-up: first-touch pages and kernel selection stay out of the medians
        op()
    wall: dict[str, list[float]] = {name: [] for name, _ in parts}
    cpu: dict[str, list[float]] = {name: [] for name, _ in parts}
    for _ in range(repeats):
        for name, op in parts:
            w0, c0 = time.perf_counter(), time.thread_time()
            op()
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    med_wall = tuple((name, statistics.median(wall[name])) for name, _ in parts)
    med_cpu = tuple((name, statistics.median(cpu[name])) for name, _ in parts)
    return ReferenceTiming(tuple(cores), sum(s for _, s in med_wall), sum(s for _, s in med_cpu), med_wall,
                           time.time(), med_cpu)


def _probe_loop(cores: tuple[int, ...], repeats: int, conn: Connection) -> None:
    """A spawned probe: pin as a rank pins (`cpu_cores.pin_cores`), then one sample per request until None."""
    pin_cores(cores)
    conn.send("ready")
    while conn.recv() is not None:
        conn.send(asdict(time_reference(repeats, cores=cores)))


def _timing(doc: dict) -> ReferenceTiming:
    return ReferenceTiming(tuple(doc["cores"]), doc["wall_s"], doc["cpu_s"],
                           tuple((str(k), float(v)) for k, v in doc["parts_wall_s"]), doc["taken_at_s"],
                           tuple((str(k), float(v)) for k, v in doc.get("parts_cpu_s", ())))


class ReferenceProbes:
    """One pinned probe process per core group, kept alive between samples (a spawned process pays ~2-15 s
    importing torch; a sample ~0.5 s of work): `sample` times every group at once, as the stages run.

    Example:
        >>> with ReferenceProbes(((0,), (1,))) as probes:  # doctest: +SKIP
        ...     probes.sample()[1].cores
        (1,)
    """

    def __init__(self, groups: Sequence[Sequence[int]], *, repeats: int = REFERENCE_REPEATS,
                 timeout_s: float = REFERENCE_TIMEOUT_S) -> None:
        if not groups or any(not g for g in groups):
            raise ConfigError("reference probes need at least one non-empty core group; see cpu_cores.split_cores")
        if repeats < 1:
            raise ConfigError(f"reference repeats: {repeats}; pass 1 or more")
        self.groups = tuple(tuple(sorted(int(c) for c in g)) for g in groups)
        self.repeats, self.timeout_s = repeats, timeout_s
        self._procs: list[tuple[BaseProcess, Connection]] = []

    def __enter__(self) -> "ReferenceProbes":
        ctx = multiprocessing.get_context("spawn")
        for cores in self.groups:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_probe_loop, args=(cores, self.repeats, theirs), daemon=True)
            proc.start()
            self._procs.append((proc, mine))
        try:
            for _ in self._replies():
                pass
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _replies(self) -> list[object]:
        """One reply per probe, each within the timeout (a dead or stuck probe raises `RuntimeFailure`)."""
        out = []
        deadline = time.monotonic() + self.timeout_s
        for (proc, conn), cores in zip(self._procs, self.groups):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeFailure(f"reference probe on cores {cores} did not answer within {self.timeout_s:.0f} s "
                                     f"(alive: {proc.is_alive()}); check the load, or raise timeout_s")
            out.append(conn.recv())
        return out

    def sample(self) -> tuple[ReferenceTiming, ...]:
        """One `ReferenceTiming` per group, all groups timed at once."""
        for _, conn in self._procs:
            conn.send("sample")
        got = tuple(_timing(doc) for doc in self._replies())
        for t in got:
            logger.info("reference on cores %s: %.3f ms wall, %.3f ms CPU", t.cores, t.wall_s * 1e3, t.cpu_s * 1e3)
        return got

    def __exit__(self, *exc: object) -> None:
        for proc, conn in self._procs:
            try:
                conn.send(None)
            except OSError:  # the probe is gone already
                pass
        for proc, conn in self._procs:
            proc.join(timeout=PROBE_EXIT_S)
            if proc.is_alive():
                proc.terminate()
            conn.close()
        self._procs = []


def measure_reference(groups: Sequence[Sequence[int]], *, repeats: int = REFERENCE_REPEATS,
                      timeout_s: float = REFERENCE_TIMEOUT_S) -> tuple[ReferenceTiming, ...]:
    """One `ReferenceTiming` per core group, timed at once in fresh pinned processes (`ReferenceProbes`, once).

    Example:
        >>> measure_reference(((0,), (1,)))[1].cores  # doctest: +SKIP
        (1,)
    """
    with ReferenceProbes(groups, repeats=repeats, timeout_s=timeout_s) as probes:
        return probes.sample()


def _mean_by_group(samples: Sequence[ReferenceTiming]) -> dict[tuple[int, ...], dict[str, float]]:
    """Per core group: the mean seconds of its samples, under ``wall``, ``cpu`` and each part's name."""
    by: dict[tuple[int, ...], list[ReferenceTiming]] = {}
    for s in samples:
        by.setdefault(tuple(s.cores), []).append(s)
    out = {}
    for cores, got in by.items():
        means = {"wall": statistics.fmean(s.wall_s for s in got), "cpu": statistics.fmean(s.cpu_s for s in got)}
        for part in {p for s in got for p, _ in s.parts_wall_s}:
            means[part] = statistics.fmean(v for s in got for p, v in s.parts_wall_s if p == part)
        for part in {p for s in got for p, _ in s.parts_cpu_s}:
            means["cpu:" + part] = statistics.fmean(v for s in got for p, v in s.parts_cpu_s if p == part)
        out[cores] = means
    return out


def host_drift(at_calibration: Sequence[ReferenceTiming], at_run: Sequence[ReferenceTiming]) -> tuple[HostDrift, ...]:
    """Per core group present on both sides: the mean reference seconds at the run / at the calibration.

    Each side may hold several samples per group (e.g. right before and right after the calibration);
    their mean stands for that side (a linear drift over the side's span averages to its middle).

    Example:
        >>> cal = [ReferenceTiming((1,), 0.010, 0.010, (), 0.0), ReferenceTiming((1,), 0.012, 0.010, (), 30.0)]
        >>> run = [ReferenceTiming((1,), 0.0165, 0.0121, (), 90.0)]
        >>> d = host_drift(cal, run)[0]
        >>> round(d.wall_ratio, 3), round(d.cpu_ratio, 3)
        (1.5, 1.21)
    """
    cal, run = _mean_by_group(at_calibration), _mean_by_group(at_run)
    out = []
    for cores in sorted(set(cal) & set(run)):
        c, r = cal[cores], run[cores]
        if min(c.values()) <= 0:
            raise ConfigError(f"reference timing on cores {cores}: {c['wall']} s wall, {c['cpu']} s CPU at the "
                              "calibration; every sample must be positive")
        parts = tuple((p, r[p] / c[p]) for p in REFERENCE_PARTS if p in c and p in r)
        cpu_parts = tuple((p, r[f"cpu:{p}"] / c[f"cpu:{p}"]) for p in REFERENCE_PARTS
                          if f"cpu:{p}" in c and f"cpu:{p}" in r)
        out.append(HostDrift(cores, r["wall"] / c["wall"], r["cpu"] / c["cpu"], parts, cpu_parts))
    return tuple(out)
