"""Bounds and checks shared by every entrance: cluster files and dicts, `Cluster` objects, plans, CLI flags.

One place says what a sane figure is, so the cluster loader, the plan loader, the CLI and
the Python API refuse the same things with the same words.  Every check raises a
`HetpipeError` subclass whose one-line message names the field, the value and the fix.
Values are shown through `show`, which cuts long reprs (a YAML alias bomb must not turn
into a 700 MB error line).

The bounds are generous sanity limits, not hardware facts: they exist so that a typo
(``memory: 1e300TB``, ``count: 100000``) is refused before any work starts instead of
overflowing an integer or building a billion links.

Example:
    >>> finite_number(2.5, "stages[0].fwd_s", minimum=0.0)
    2.5
    >>> try:
    ...     finite_number(float("nan"), "links[3].bandwidth_bytes_s", minimum=0.0, strict=True)
    ... except ConfigError as err:
    ...     print(err)
    links[3].bandwidth_bytes_s: must be a finite number > 0, got nan; fix the value or re-create the file
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

from hetpipe.errors import ConfigError, HetpipeError

#: Most devices one cluster may have.  The planner is measured up to 1,024 cards
#: (benchmarks/RESULTS.md); links are stored for every ordered pair, so n devices cost n^2
#: link records (4,096 cards: 16.7 M, several GB of Python objects).  Bounded before any
#: link is built.
MAX_DEVICES = 4096
#: Largest memory of one device: 1 PiB.  Today's largest accelerator has 288 GB; a CPU host
#: a few TB.  Beyond this a figure is a typo (and 1e300TB overflows every integer type).
MAX_DEVICE_MEMORY_BYTES = 2**50
#: Largest compute figure of one device: 1e18 FLOP/s (an exaFLOP/s; a B200 is ~2.25e15 dense bf16).
MAX_DEVICE_FLOPS_S = 1e18
#: Largest bandwidth of any link or memory: 1e15 B/s (1 PB/s; HBM3e is ~8e12 B/s).
MAX_BANDWIDTH_BYTES_S = 1e15
#: Largest latency of one link or per-op overhead: one hour (a satellite hop is ~0.6 s).
MAX_LATENCY_S = 3600.0
#: Largest cluster file read: 4 MiB (a 4,096-card file written one device per line is ~300 KB).
MAX_CLUSTER_FILE_BYTES = 4 * 2**20
#: Largest plan file read: 256 MiB (llama-7b on 1,024 cards is a few MB; unit tables grow with units x kinds).
MAX_PLAN_FILE_BYTES = 256 * 2**20
#: YAML aliases (``*name``) one cluster file may use.  Each alias can double the expanded
#: document ("billion laughs"), so a 500-byte file can expand to gigabytes; real cluster files
#: use a handful to share a node's network figures.
MAX_YAML_ALIASES = 64
#: Longest value repr shown in an error message.
MAX_SHOWN_CHARS = 60

_REPR = reprlib.Repr()
_REPR.maxstring = MAX_SHOWN_CHARS
_REPR.maxother = MAX_SHOWN_CHARS
_REPR.maxlist = 4
_REPR.maxdict = 4
_REPR.maxlevel = 2


def show(value: object) -> str:
    """A short repr of `value` for an error message (long strings, deep lists are cut).

    Example:
        >>> show("x" * 100)[:12], len(show("x" * 100)) <= MAX_SHOWN_CHARS + 2
        ("'xxxxxxxxxxx", True)
        >>> show([[1, 2], [3, [4, [5]]]])
        '[[1, 2], [3, [...]]]'
    """
    return _REPR.repr(value)


def finite_number(value: object, field: str, *, minimum: float = 0.0, maximum: float = math.inf,
                  strict: bool = False, fix: str = "fix the value or re-create the file",
                  error: type[HetpipeError] = ConfigError) -> float:
    """`value` as a float that is finite and in [minimum, maximum] (> minimum when `strict`).

    Example:
        >>> finite_number(3, "training.microbatches", minimum=1)
        3.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{field}: must be a number, got {show(value)}; {fix}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    low_ok = number > minimum if strict else number >= minimum
    if not math.isfinite(number) or not low_ok or number > maximum:
        bound = f"{'>' if strict else '>='} {minimum:g}"
        if math.isfinite(maximum):
            bound += f" and <= {maximum:g}"
        raise error(f"{field}: must be a finite number {bound}, got {show(value)}; {fix}")
    return number


def whole_number(value: object, field: str, *, minimum: int = 0, maximum: int | None = None,
                 fix: str = "fix the value or re-create the file", error: type[HetpipeError] = ConfigError) -> int:
    """`value` as an int in [minimum, maximum] (bools and floats are refused).

    Example:
        >>> whole_number(4, "count", minimum=1, maximum=MAX_DEVICES)
        4
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise error(f"{field}: must be a whole number {bound}, got {show(value)}; {fix}")
    return value


def check_device_count(count: int, field: str) -> None:
    """Refuse clusters larger than `MAX_DEVICES` before any link is built."""
    if count > MAX_DEVICES:
        raise ConfigError(f"{field}: {count} devices is more than hetpipe plans ({MAX_DEVICES}); "
                          "lower count, or plan one group of nodes at a time")


#: Longest solver time limit accepted: one day (the planner answers in seconds to minutes).
MAX_TIME_LIMIT_S = 86400.0


def check_solver_options(solver: object, time_limit_s: object, seed: object) -> None:
    """The solver's options: a name, a time limit in (0, one day] seconds or ``"auto"`` (the default:
    `partitioner.solvers.time_budget`), a seed in [0, 2^31).

    A zero or negative limit is refused rather than answered by another solver (a CP-SAT run
    with no time is no CP-SAT run).

    Example:
        >>> check_solver_options("auto", 10.0, 0)
        >>> check_solver_options("auto", "auto", 0)
    """
    if not isinstance(solver, str):
        raise ConfigError(f"solver: must be a name (auto, dp, cpsat), got {show(solver)}")
    if time_limit_s != "auto":
        finite_number(time_limit_s, "time limit (--time-limit, time_limit_s)", strict=True,
                      maximum=MAX_TIME_LIMIT_S, fix="give the solver's wall-clock budget in seconds, e.g. --time-limit "
                      "10, or auto")
    whole_number(seed, "seed (--seed)", minimum=0, maximum=2**31 - 1, fix="use e.g. --seed 0")
