"""M_s in the DP's band form: the memory model's tables per stage entry and the moments of its action list.

`dp.StageTables` describes a stage on units [lo, lo + w + 1) for every lo and w at once.
`memory_tables` adds memory model 2's per-entry terms (`hetpipe.partitioner.problem`):
the parameter gradients G_s, the held share of the output cut (subtracted from A_s) and
the gradient messages of the cuts before and after; `band_moments` evaluates
`hetpipe.cost_models.stage_memory.pipeline_stage_bytes` at every moment of the stage's
action list (`hetpipe.schedule.held.position_held_terms`), so M_s is their largest.  Memory model
4's T_s (`transient_band`) is in every backward moment, and each such moment comes again, flagged
as outside a backward, on the entries whose T_s > 0: a consumer that counts a backward's moments
only with a recomputation's peak (`recompute_band.memory_with`) still counts T_s alone.  Memory model
5's step moment depends on the class's kind: `step_band` holds its tables, `dp.StageTables.step_fits` checks it.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (1.0, 1.0)}, state_bytes=(10, 10),
    ...                activation_bytes=(5, 5), boundary_bytes=(4, 0), devices=(DeviceSlot("d", "a", "n", 99),),
    ...                bandwidth_bytes_s=((1.0,),), latency_s=((0.0,),), microbatches=2, grad_bytes=(2, 2))
    >>> lo = np.arange(3)[:, None]
    >>> hi = np.minimum(lo + np.arange(2)[None, :] + 1, 2)
    >>> grads, held_out, before, after = memory_tables(prob, lo, hi, (3, 2))
    >>> grads[0].tolist(), after[0].tolist()      # [0, 1) and [0, 2): G, the gradient message after
    ([2.0, 4.0], [4.0, 0.0])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetpipe.partitioner.problem import Problem, TiedCopy
from hetpipe.schedule.held import position_held_terms


def memory_tables(problem: Problem, lo: np.ndarray, hi: np.ndarray,
                  shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(G_s, held share of the output cut, gradient message before, after) of every entry [lo, hi)."""
    L = problem.num_units
    gr = np.concatenate(([0.0], np.cumsum(np.asarray(problem.grad_bytes or (0,) * L, dtype=np.float64))))
    held = np.asarray(problem.boundary_held_bytes or (0,) * L, dtype=np.float64)
    gd = np.asarray(problem.boundary_grad_bytes or problem.boundary_bytes, dtype=np.float64)
    before = np.broadcast_to(np.where(lo > 0, gd[np.maximum(lo - 1, 0)], 0.0), shape)
    held_out = np.where(hi < L, held[np.clip(hi - 1, 0, L - 1)], 0.0)  # the last stage sends nothing
    return gr[hi] - gr[lo], held_out, before, gd[np.clip(hi - 1, 0, L - 1)]


def band_moments(tables: Any, after_stages: int, microbatches: int, sl: tuple) -> list[tuple[int, int, np.ndarray]]:
    """Per moment t of a stage's action list with `after_stages` stages after it: (k_t, inside a backward,
    its bytes without recomputation) over the band slice `sl` of `tables` (a `dp.StageTables`); a first
    stage's moments are -inf on the other rows and the other way round."""
    t = tables
    follows = after_stages > 0
    cut_in, grad_in = t.before[sl], t.before_grad[sl]
    cut_out, grad_out = (t.after[sl], t.after_grad[sl]) if follows else (0.0, 0.0)
    base, per_mb, first = t.state[sl] - t.grads[sl], t.act[sl] + cut_in + cut_out, t.first[sl]
    out, transient = [], t.transient[sl]
    for is_first, rows in ((True, first), (False, ~first)):
        for c in position_held_terms(after_stages, first=is_first, microbatches=microbatches):
            held = (base + c.grads * t.grads[sl] + c.microbatches * per_mb + c.in_frames * cut_in
                    + c.in_grad_frames * grad_in + c.out_frames * cut_out + c.out_grad_frames * grad_out)
            if c.backward:  # T_s inside a backward; where T_s > 0 that moment counts with or without a recompute
                held = held + transient
                out.append((c.microbatches, 0, np.where(rows & (transient > 0), held, -np.inf)))
            out.append((c.microbatches, c.backward, np.where(rows, held, -np.inf)))
    return out


def transient_band(problem: Problem, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """T_s of every entry [lo, hi) (`problem.stage_transient_bytes`): the running max of the units' transients
    along the band's width (hi grows by one unit a column; columns past the model repeat its last unit)."""
    L = problem.num_units
    table = np.asarray(problem.transient_bwd_bytes or (0,) * L, dtype=np.float64)
    return np.maximum.accumulate(table[np.clip(hi - 1, 0, L - 1)], axis=1)


def tied_band(problem: Problem, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Bytes of tied-parameter replicas a stage [lo, hi) holds (`problem.tied_bytes`), as a band."""
    extra = np.zeros(np.broadcast_shapes(lo.shape, hi.shape))
    for t, held in replica_bands(problem, lo, hi):
        extra = extra + np.where(held, float(t.state_bytes), 0.0)
    return extra


def replica_bands(problem: Problem, lo: np.ndarray, hi: np.ndarray) -> list[tuple[TiedCopy, np.ndarray]]:
    """Per tied parameter, where a stage [lo, hi) keeps a replica (`problem.held_replicas`): it holds a user, not
    the owner."""
    out = []
    for t in problem.tied:
        users = np.zeros(problem.num_units + 1)
        for u in t.user_units:
            if u != t.owner_unit:
                users[u + 1] = 1.0
        users = np.cumsum(users)
        has_owner = (lo <= t.owner_unit) & (t.owner_unit < hi)
        out.append((t, ((users[hi] - users[lo]) > 0) & ~has_owner))
    return out


def step_band(problem: Problem, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(P_s, the largest stepped tensor) of every entry [lo, hi), tied replicas included (`problem.stage_step_bytes`;
    the largest as a running max along the band's width, like `transient_band`)."""
    L = problem.num_units
    cum = np.concatenate(([0.0], np.cumsum(np.asarray(problem.step_param_bytes or (0,) * L, dtype=np.float64))))
    table = np.asarray(problem.step_tensor_bytes or (0,) * L, dtype=np.float64)
    params = cum[hi] - cum[lo]
    largest = np.maximum.accumulate(table[np.clip(hi - 1, 0, L - 1)], axis=1)
    for t, held in replica_bands(problem, lo, hi):
        params = params + np.where(held, float(t.step_bytes), 0.0)
        largest = np.maximum(largest, np.where(held, float(t.step_bytes), 0.0))
    return params, largest
