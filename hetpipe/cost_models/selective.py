"""The selective recompute level: a stage drops the cheap outputs inside each of its units (issue 14).

Korthikanti et al., MLSys'23 ("Reducing Activation Recomputation in Large Transformer Models"),
selective recomputation: recompute what is cheap to redo and heavy to keep.  Per unit u the capture
derives (`partitioner.capture.selective`) which memory-bound nodes (norms, activations) the unit may
drop and re-run in its backward while the compute-bound nodes reading them (matmuls, attention) are
never re-run (the policy of PyTorch's selective checkpoint: those ops ``MUST_SAVE``, the dropped ones
``PREFER_RECOMPUTE``; run by `runtime/stage/selective.py`), and from that:

* ``freed_bytes[u]``: bytes per in-flight micro-batch the level frees (the dropped nodes' outputs,
  which the readers held for their backward);
* ``extra_s[kind][u]``: the dropped nodes' forward seconds, re-run in u's backward;
* ``peak_bytes``: the largest unit's dropped outputs, which live again during that unit's backward.

A stage with `Stage.selective` runs the level on its units; it is priced exactly as the same stage of
`selective_variant` (activation and recompute bytes less ``freed_bytes``, backward plus
``extra_s``) with ``peak_bytes`` added to M_s once.  Conservative on purpose: ``peak_bytes`` is the
model's largest, at every moment, not only inside a backward; a unit the stage recomputes whole still
pays its ``extra_s`` (its whole forward re-runs anyway) and its re-allocated activations beyond the
variant's recompute bytes (``freed_bytes[u]`` <= ``peak_bytes``) are within that added peak.

Example:
    >>> from types import SimpleNamespace
    >>> tab = SelectiveTables(freed_bytes=(0, 3), peak_bytes=4, extra_s={"a": (0.0, 0.5)})
    >>> prob = SimpleNamespace(activation_bytes=(5, 10), unit_recompute_bytes=(5, 10), bwd_s={"a": (2.0, 2.0)},
    ...                        selective=tab)
    >>> v = tab.variant_fields(prob)
    >>> v["activation_bytes"], v["recompute_bytes"], v["bwd_s"], v["selective"]
    ((5, 7), (5, 7), {'a': (2.0, 2.5)}, None)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping


@dataclass(frozen=True)
class SelectiveTables:
    """Per unit, what the selective level frees and costs (module docstring); empty = no level."""

    freed_bytes: tuple[int, ...]  # per unit, bytes per in-flight micro-batch
    peak_bytes: int  # the largest unit's dropped outputs, live again once (bytes)
    extra_s: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # kind -> per unit seconds

    def variant_fields(self, problem: Any) -> dict[str, Any]:
        """The fields of `problem` that differ on its selective variant (`selective_variant`)."""
        freed = self.freed_bytes
        return {"activation_bytes": tuple(max(0, int(a) - f) for a, f in zip(problem.activation_bytes, freed)),
                "recompute_bytes": tuple(max(0, int(a) - f) for a, f in zip(problem.unit_recompute_bytes, freed)),
                "bwd_s": {k: tuple(b + e for b, e in zip(problem.bwd_s[k], self.extra_s[k])) for k in problem.bwd_s},
                "selective": None}

    def stage_extra_s(self, kind: str, first_unit: int, last_unit: int) -> float:
        """Seconds the level adds to the backward of a stage on units [first_unit, last_unit] of `kind`.

        Example:
            >>> SelectiveTables((1, 1), 1, {"a": (0.25, 0.5)}).stage_extra_s("a", 0, 1)
            0.75
        """
        return sum(self.extra_s[kind][u] for u in range(first_unit, last_unit + 1))

    def any_freed(self, first_unit: int, last_unit: int) -> bool:
        """Whether the level frees anything on units [first_unit, last_unit] (else it is never worth running)."""
        return any(self.freed_bytes[u] > 0 for u in range(first_unit, last_unit + 1))


_VARIANT: list[Any] = []  # the last problem and its variant: the solvers' caches key on the object's identity


def selective_variant(problem: Any) -> Any:
    """The problem (`partitioner.problem.Problem`) a `Stage.selective` stage is priced on: `problem` with
    `SelectiveTables.variant_fields`; `problem` itself when it offers no level.  The same object for the
    same `problem` object, so that tables cached per problem (the DP's recompute band) are shared."""
    tab = problem.selective
    if tab is None:
        return problem
    if not _VARIANT or _VARIANT[0] is not problem:
        _VARIANT[:] = [problem, replace(problem, **tab.variant_fields(problem))]
    return _VARIANT[1]
