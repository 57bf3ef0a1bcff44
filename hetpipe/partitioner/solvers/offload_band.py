"""The optimizer-offload lever inside the DP's stage tables: per entry, the cheaper of offloading or not.

`dp.StageTables` describes a stage on units [lo, lo + w + 1) in band form.  A stage that
offloads (`hetpipe.cost_models.offload`) holds ``saved = P * host_bytes_per_param`` fewer
bytes at every moment of its step (P: its trainable parameters, tied replicas included) and
pays the tail ``O = P * (link_bytes_per_param / host_link + step_bytes_per_param / host_memory)``
of its device class.  Under `Problem.offload_cap_s` = Theta (the outer walk,
`offload_walk.tail_walk`), the entry's cost is:

* ``never``: the recompute lever's cost alone (`dp.StageTables.band`);
* ``auto``: min(cost without offload, cost with offload) where the entry can offload and
  O <= Theta, the cost with offload being F+B plus the smallest fitting recompute prefix's
  seconds with ``saved`` taken off every moment (inf where nothing fits);
* ``all``: the cost with offload wherever the entry can offload (O <= Theta), the cost without
  it where it cannot (no trainable state, no host figures).

This is exactly `recompute.choose_levers` in band form (its docstring says why it is exact
for a fixed Theta).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetpipe.partitioner.problem import Problem


class OffloadBand:
    """Bytes saved and tail seconds of every entry, per device class (module docstring)."""

    def __init__(self, problem: Problem, tables: Any) -> None:
        rates = problem.offload_rates
        assert rates is not None and problem.grad_bytes
        L = problem.num_units
        lo = np.arange(L + 1)[:, None]
        g = np.concatenate(([0.0], np.cumsum(np.asarray(problem.grad_bytes, dtype=np.float64))))
        params = (g[tables.hi] - g[lo]) // rates.grad_bytes_per_param + tables.tied // rates.state_bytes_per_param
        self.mode, self.cap_s = problem.offload, problem.offload_cap_s
        self.saved = params * rates.host_bytes_per_param
        self.able: list[np.ndarray] = []
        self.tail: list[np.ndarray] = []
        for cls in tables.classes:
            dev = problem.devices[cls.members[0]]
            ok = dev.host_link_bytes_s > 0 and dev.host_memory_bytes_s > 0 and rates.host_bytes_per_param > 0
            tail = (params * rates.link_bytes_per_param / dev.host_link_bytes_s
                    + params * rates.step_bytes_per_param / dev.host_memory_bytes_s) if ok else np.full(params.shape, np.inf)
            self.able.append(tables.valid & ok & (params > 0))
            self.tail.append(tail)

    def cost(self, tables: Any, c: int, after_stages: int, cap: float, width: int, base: np.ndarray,
             without: np.ndarray) -> np.ndarray:
        """(L+1, width) cost of class c's entries with the lever; `base` = F+B, `without` = the cost
        without offload (inf where it does not fit)."""
        sl = np.s_[:, :width]
        cls = tables.classes[c]
        saved = self.saved

        def moments(after: int) -> list[tuple[int, int, np.ndarray]]:
            return [(k, b, held - saved) for k, b, held in tables.moments(after)]

        if tables.levers is None:
            fits = np.max([held for _, backward, held in moments(after_stages) if not backward], axis=0)[sl]
            with_off = np.where(fits <= cls.usable_bytes, base, np.inf)
        else:
            with_off = base + tables.levers.extra_s(cls.kind, cls.usable_bytes, after_stages, moments, base <= cap,
                                                    tag="offload")
        able = self.able[c][sl]
        allowed = able & (self.tail[c][sl] <= self.cap_s)
        with_off = np.where(allowed, with_off, np.inf)
        if self.mode == "all":
            return np.where(able, with_off, without)
        return np.minimum(without, with_off)


def offload_band(problem: Problem, tables: Any) -> OffloadBand | None:
    """The lever's band for `tables`, or None when `problem` cannot offload at all."""
    if problem.offload == "never" or problem.offload_rates is None or not problem.grad_bytes:
        return None
    return OffloadBand(problem, tables)
