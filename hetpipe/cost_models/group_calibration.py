"""Measure CPU core groups as devices: one pinned process per group, all at once.

Each group's process pins itself (`hetpipe.cost_models.cpu_cores.pin_cores`: affinity and
one intra-op thread per core) and runs `calibrate_device` (matmul FLOP/s, copy bandwidth,
fixed cost per op).  The groups measure *at the same time*, as the pipeline's stages
compute at the same time: memory bandwidth and the last-level cache are shared, and a
group measured alone would see more of them than it gets in a run.

``cpu_clock``: each group times its calibration in its thread's CPU time (`rates.CLOCK` set to
``time.thread_time``) instead of wall time, so that other processes sharing the cores do not
inflate the figures: what a dedicated core would do (a shared machine's calibration; a run's own CPU
seconds, the run report's ``fwd_cpu_s``, are its counterpart).  Wall time is what a plan promises.

Example:
    >>> cals = measure_core_groups(((0,),), size=64, repeats=1, copy_bytes=2**20)  # doctest: +SKIP
    >>> cals[0].cores  # doctest: +SKIP
    (0,)
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from hetpipe.cost_models.calibrate import (
    DEFAULT_COPY_BYTES, DEFAULT_MATMUL_SIZE, DEFAULT_REPEATS, Calibration, calibrate_device, join_or_kill,
)
from hetpipe.cost_models.cpu_cores import format_cores, pin_cores
from hetpipe.errors import ConfigError

logger = logging.getLogger(__name__)

#: Bound on measuring every group, process start-up included (one group takes ~3 s at the
#: profile's sizes on the 2-core reference VM; start-up 2-4 s under mp.spawn, environment_facts.md).
GROUPS_TIMEOUT_S = 120.0


def _group_worker(index: int, groups: list[list[int]], size: int, repeats: int, copy_bytes: int,
                  out_dir: str, cpu_clock: bool = False) -> None:
    """Spawned per group: pin, measure (on the thread's CPU clock with `cpu_clock`), write ``group-<index>.json``."""
    from hetpipe.cost_models import rates

    if cpu_clock:
        rates.CLOCK = time.thread_time  # this spawned process only (module docstring)
    cores = tuple(groups[index])
    pin_cores(cores)
    cal = calibrate_device("cpu", size=size, repeats=repeats, copy_bytes=copy_bytes, cores=cores)
    Path(out_dir, f"group-{index}.json").write_text(json.dumps(asdict(cal)))


def _load(path: Path) -> Calibration:
    doc = json.loads(path.read_text())
    doc["cores"] = tuple(doc["cores"])
    doc["op_rates"] = tuple((str(k), float(v)) for k, v in doc.get("op_rates", ()))
    return Calibration(**doc)


def measure_core_groups(groups: Sequence[Sequence[int]], *, size: int = DEFAULT_MATMUL_SIZE,
                        repeats: int = DEFAULT_REPEATS, copy_bytes: int = DEFAULT_COPY_BYTES,
                        timeout_s: float = GROUPS_TIMEOUT_S, cpu_clock: bool = False) -> tuple[Calibration, ...]:
    """One `Calibration` per core group, measured concurrently in pinned processes (`cpu_clock`: module docstring)."""
    if not groups or any(not g for g in groups):
        raise ConfigError("measure_core_groups needs at least one non-empty core group; see cpu_cores.split_cores")
    plain = [sorted(int(c) for c in g) for g in groups]
    with tempfile.TemporaryDirectory(prefix="hetpipe-groups-") as tmp:
        context = torch.multiprocessing.spawn(
            _group_worker, args=(plain, size, repeats, copy_bytes, tmp, cpu_clock), nprocs=len(plain), join=False)
        join_or_kill(context, timeout_s, what="core-group measurement")
        cals = tuple(_load(Path(tmp, f"group-{i}.json")) for i in range(len(plain)))
    for cal in cals:
        logger.info("cores %s: %.4g FLOP/s, %.4g B/s, %.3g s per op", cal.cores, cal.fp32_matmul_flops_s,
                    cal.memory_bandwidth_bytes_s, cal.kernel_overhead_s or 0.0)
    return cals


def group_kind(cores: Sequence[int]) -> str:
    """The device kind of a core group: ``cpu-c0``, ``cpu-c2-3`` (kinds differ: each group has its own figures).

    Example:
        >>> group_kind((0,)), group_kind((2, 3))
        ('cpu-c0', 'cpu-c2-3')
    """
    return "cpu-c" + format_cores(cores).replace(",", "_")

