"""Selective activation recomputation of a stage's units: which units first, and what it costs.

A stage that recomputes unit u keeps only u's input for the backward and re-runs u's
forward inside the backward (``torch.utils.checkpoint(..., use_reentrant=False)``: the
region saves its inputs, and the backward replays the region's forward before its own
gradients; Chen et al. 2016, "Training deep nets with sublinear memory cost").  Per unit:

* memory kept per in-flight micro-batch: ``in_u`` instead of ``A_u`` (``A_u`` = what
  autograd saves in u, ``in_u`` = ``boundary_bytes[u - 1]``, and 0 for the stage's first
  unit, whose input is the stage's received input ``in_s``, counted already), so
  ``saved_u = A_u - in_u`` bytes per micro-batch;
* while u's backward runs, its activations exist again for that one micro-batch: the
  stage's peak adds ``max_{u in R} A_u`` once, not per in-flight micro-batch;
* time: the forward again, ``F_u`` on the stage's device kind, added to the backward
  (Korthikanti et al., MLSys'23, "Reducing Activation Recomputation in Large Transformer
  Models": recompute what is cheap to recompute and heavy to keep first).

`recompute_order` ranks a stage's units by saved bytes per recompute second,
``saved_u / F_u`` descending (ties by unit index); units that save nothing
(``A_u <= in_u``) are never worth recomputing and are left out.  A stage recomputes a
prefix of that order (``r`` units, r = 0 .. len(order)); `recompute_cost` prices a set.

Example (units 0-2 of a stage starting at unit 0; unit 1 keeps 6 of its 10 bytes' input):
    >>> order = recompute_order(activation_bytes=(4, 10, 3), boundary_bytes=(6, 2, 0),
    ...                         fwd_s=(1.0, 1.0, 0.5), first_unit=0, last_unit=2)
    >>> order          # keys: 4/1 (first unit: its input is the stage's), (10-6)/1, (3-2)/0.5
    (0, 1, 2)
    >>> recompute_cost(order[:2], activation_bytes=(4, 10, 3), boundary_bytes=(6, 2, 0),
    ...                fwd_s=(1.0, 1.0, 0.5), first_unit=0)
    RecomputeCost(units=(0, 1), saved_bytes=8, peak_bytes=10, extra_s=2.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from hetpipe.errors import ConfigError

#: The lever's settings: ``auto`` = the planner picks, per stage, the shortest prefix of the
#: order that fits; ``none`` = never recompute; ``all`` = every unit of the order on every
#: stage (Megatron-LM ``--recompute-granularity full``, what fits or not); ``selective`` = no whole unit,
#: the selective level (`cost_models.selective`) on every stage (Megatron-LM ``--recompute-granularity
#: selective``; `partitioner.selective_mode`).
RECOMPUTE_MODES = ("auto", "none", "all", "selective")


def check_recompute_option(mode: object) -> None:
    """Refuse anything but one of `RECOMPUTE_MODES` (``--recompute``, ``recompute=``).

    Example:
        >>> check_recompute_option("auto")
        >>> check_recompute_option("some")
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: recompute (--recompute): 'some' is not a setting; use one of auto, none, all, selective
    """
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute (--recompute): {mode!r} is not a setting; use one of {', '.join(RECOMPUTE_MODES)}")


@dataclass(frozen=True)
class RecomputeCost:
    """What recomputing `units` (global indices) changes on one stage, per micro-batch."""

    units: tuple[int, ...]
    saved_bytes: int  # sum (A_u - in_u): less held per in-flight micro-batch
    peak_bytes: int  # max A_u: one recomputed unit's activations, live once during its backward
    extra_s: float  # sum F_u: forward time added to the stage's backward


def unit_input_bytes(boundary_bytes: Sequence[int], first_unit: int, u: int) -> int:
    """in_u: what a recomputed unit keeps, its input (0 for the stage's first unit).

    Example:
        >>> unit_input_bytes((6, 2, 0), 0, 0), unit_input_bytes((6, 2, 0), 0, 2)
        (0, 2)
    """
    return 0 if u == first_unit else int(boundary_bytes[u - 1])


def _key(saved: int, fwd_s: float) -> float:
    """Saved bytes per recompute second; a free forward (0 s) ranks first."""
    return saved / fwd_s if fwd_s > 0 else math.inf


def recompute_order(*, activation_bytes: Sequence[int], boundary_bytes: Sequence[int], fwd_s: Sequence[float],
                    first_unit: int, last_unit: int) -> tuple[int, ...]:
    """The stage's units worth recomputing, best first (see the module docstring).

    Example:
        >>> recompute_order(activation_bytes=(5, 5), boundary_bytes=(5, 0), fwd_s=(1.0, 1.0),
        ...                 first_unit=0, last_unit=1)   # unit 1 saves 5 - 5 = 0 bytes
        (0,)
    """
    ranked = []
    for u in range(first_unit, last_unit + 1):
        saved = int(activation_bytes[u]) - unit_input_bytes(boundary_bytes, first_unit, u)
        if saved > 0:
            ranked.append((-_key(saved, float(fwd_s[u])), u))
    return tuple(u for _, u in sorted(ranked))


def recompute_cost(units: Iterable[int], *, activation_bytes: Sequence[int], boundary_bytes: Sequence[int],
                   fwd_s: Sequence[float], first_unit: int) -> RecomputeCost:
    """Bytes saved per micro-batch, the one-off peak and the added seconds of recomputing `units`.

    The seconds are summed in the given order (the order's prefix order), as the DP adds them.

    Example:
        >>> recompute_cost((), activation_bytes=(1,), boundary_bytes=(0,), fwd_s=(1.0,), first_unit=0)
        RecomputeCost(units=(), saved_bytes=0, peak_bytes=0, extra_s=0.0)
    """
    units = tuple(units)
    saved = sum(int(activation_bytes[u]) - unit_input_bytes(boundary_bytes, first_unit, u) for u in units)
    peak = max((int(activation_bytes[u]) for u in units), default=0)
    extra = 0.0
    for u in units:
        extra += float(fwd_s[u])
    return RecomputeCost(units, saved, peak, extra)
