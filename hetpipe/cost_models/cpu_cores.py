"""CPU core groups as devices: split this host's cores, pin a process to a group, read and write a group.

On a machine without GPUs a "device" can be a group of CPU cores: one process pinned to
the group (``os.sched_setaffinity``) with as many intra-op threads as the group has cores.
`hetpipe profile --calibrate --cpu-devices N` measures each group as a device
(`hetpipe.cost_models.group_calibration`), the cluster file records each device's
``cores``, and a non-emulated `hetpipe run` pins the rank of each stage to its device's
group (`hetpipe.runtime.pinning`), so the plan's devices are the processes that really run.

Example:
    >>> split_cores(2, available=(0, 1, 2, 3))
    ((0, 1), (2, 3))
    >>> parse_cores("0-2,5"), format_cores((0, 1, 2, 5))
    ((0, 1, 2, 5), '0-2,5')
"""

from __future__ import annotations

import os
from typing import Sequence

from hetpipe.errors import ConfigError

#: Largest core index a cluster file may name (Linux's default CONFIG_NR_CPUS on x86-64 is 8192).
MAX_CORE_INDEX = 8191


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on, sorted (all of ``os.cpu_count()`` where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def split_cores(groups: int, *, available: Sequence[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """`groups` equal, disjoint groups of consecutive available cores (a remainder is left unused).

    Example:
        >>> split_cores(2, available=(0, 1, 2))
        ((0,), (1,))
    """
    cores = tuple(sorted(available if available is not None else available_cores()))
    if groups < 1 or groups > len(cores):
        raise ConfigError(f"--cpu-devices {groups}: this process may use {len(cores)} core(s) "
                          f"({format_cores(cores)}); pass a number from 1 to {len(cores)}")
    size = len(cores) // groups
    return tuple(cores[i * size:(i + 1) * size] for i in range(groups))


def parse_cores(value: object) -> tuple[int, ...]:
    """A core list: ``3``, ``"0-3"``, ``"0,2,4-5"`` or ``[0, 1]``; sorted, without repeats.

    Example:
        >>> parse_cores([1, 0]), parse_cores(3)
        ((0, 1), (3,))
    """
    if isinstance(value, bool):
        raise ValueError("a core list, not a boolean")
    if isinstance(value, int):
        items: list[int] = [value]
    elif isinstance(value, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError("a list of whole core numbers")
        items = list(value)
    elif isinstance(value, str):
        items = []
        for part in value.replace(" ", "").split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"{part!r} is not a core number or range")
            items.extend(range(int(low), int(high or low) + 1))
    else:
        raise ValueError("a core number, a range string like '0-3' or a list of core numbers")
    if not items or min(items) < 0 or max(items) > MAX_CORE_INDEX:
        raise ValueError(f"core numbers must be 0 to {MAX_CORE_INDEX}, at least one")
    return tuple(sorted(set(items)))


def format_cores(cores: Sequence[int]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"`` (what `parse_cores` reads back)."""
    runs: list[str] = []
    ordered = sorted(cores)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


def pin_cores(cores: Sequence[int]) -> None:
    """Run this process on `cores` only, with one intra-op thread per core.

    Example:
        >>> pin_cores(available_cores()[:1])  # doctest: +SKIP
    """
    import torch

    if not cores:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("this platform cannot pin a process to cores (no os.sched_setaffinity); "
                          "remove cores: from the cluster file")
    try:
        os.sched_setaffinity(0, set(cores))
    except OSError as err:
        raise ConfigError(f"cannot pin to cores {format_cores(cores)}: {err.strerror}; the cluster file names cores "
                          f"this machine does not offer (available: {format_cores(available_cores())}); "
                          "re-run `hetpipe profile --calibrate --cpu-devices N` here") from None
    torch.set_num_threads(len(cores))
