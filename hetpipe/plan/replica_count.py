"""``hetpipe plan --replicas auto|N``: one pipeline, several pipeline replicas, or exactly N of them.

* ``1`` (the default): `partition_graph`, one pipeline (plan version 1).
* ``auto``: the replica planner (`hetpipe.plan.replicas.partition_replicas`, whose search
  includes the one-pipeline layout) against the exact single pipeline; the faster
  prediction wins (a tie keeps the single pipeline, a version-1 plan).
* ``N >= 2``: the replica search restricted to groupings of exactly N replicas
  (`solve_n_replicas`): every grouping of up to `EXHAUSTIVE_MAX_DEVICES` cards, else
  local search from N-replica seeds; each replica's pipeline and the water-filled split
  of the micro-batches are the replica planner's own.

Example:
    >>> parse_replicas("auto"), parse_replicas("2")
    ('auto', 2)
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

from hetpipe.cost_models.devices import Cluster
from hetpipe.cost_models.sync import SYNC_BUDGET_FRACTION, choose_policy
from hetpipe.errors import ConfigError, InfeasibleError
from hetpipe.partitioner.capture.graph import UnitGraph
from hetpipe.partitioner.solvers.time_budget import first_limit_s
from hetpipe.partitioner.replica_types import ReplicaProblem, ReplicaSolution, work_lower_bound
from hetpipe.partitioner.replicas import (
    GroupingSearch,
    PipelineCache,
    canon_groups,
    scorer_for,
    seed_groupings,
    set_partitions,
)
from hetpipe.plan.schema import LeftOut, Plan

log = logging.getLogger(__name__)

#: Up to this many cards every grouping into N replicas is scored (Bell(6) = 203 groupings with
#: a "left out" block); beyond it, local search from seeds under the time limit.
EXHAUSTIVE_MAX_DEVICES = 5

#: ``hetpipe plan --sync``: the replicas' gradient sync policy (`cost_models.sync.choose_policy`).
SYNC_OPTIONS = ("auto", "synchronous", "diloco")


def parse_replicas(value: str) -> str | int:
    """``"auto"`` or a positive replica count, else a `ConfigError` naming ``--replicas``."""
    if str(value).strip().lower() == "auto":
        return "auto"
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise ConfigError(f"--replicas {value!r} is not 'auto' or a positive number of pipeline replicas; "
                          "use --replicas auto, 1 (one pipeline) or e.g. 2")
    return n


def check_sharding_replicas(sharding: str, replicas: str | int) -> None:
    """Refuse a `sharding` that is no setting (`check_sharding_option`), and ``--sharding auto|all`` with one
    pipeline (``--replicas 1``, the default): it shards across replicas, so it would silently do nothing.

    Example:
        >>> check_sharding_replicas("auto", "auto"); check_sharding_replicas("never", 1)
        >>> check_sharding_replicas("auto", 1)
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: --sharding auto shards optimizer state across data-parallel replicas, but --replicas is 1 (one pipeline), so it would do nothing; add --replicas auto (or e.g. --replicas 2), or drop --sharding
    """
    from hetpipe.cost_models.sharding import check_sharding_option

    check_sharding_option(sharding)
    if sharding != "never" and replicas == 1:
        raise ConfigError(f"--sharding {sharding} shards optimizer state across data-parallel replicas, but --replicas "
                          "is 1 (one pipeline), so it would do nothing; add --replicas auto (or e.g. --replicas 2), "
                          "or drop --sharding")


class _CountedSearch(GroupingSearch):
    """`GroupingSearch` that scores only groupings of exactly ``count`` replicas."""

    def __init__(self, *args: Any, count: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.count = count

    def score(self, groups: Any) -> Any:
        return super().score(groups) if len(groups) == self.count else None

    def run(self) -> Any:
        base = self.rp.base
        seeds = [g for g in seed_groupings(base, lambda d: self.cache.best((d,), 1) is not None)
                 if len(g) == self.count]
        seeds += list(_groupings(len(base.devices), self.count))
        best = None
        for groups in dict.fromkeys(seeds):
            if time.perf_counter() >= self.deadline and best is not None:
                break
            cand = self.score(groups)
            if cand is not None and (best is None or cand.iteration_s < best.iteration_s):
                best = cand
        return self.descend(best) if best is not None else None


def _groupings(n: int, count: int) -> Iterator[Any]:
    """Groupings of ``count`` replicas: all of them (some cards left out) for small n, else contiguous chunks."""
    if n <= EXHAUSTIVE_MAX_DEVICES:
        for part in set_partitions(list(range(n + 1))):  # the block holding n is left out
            blocks = [b for b in part if n not in b]
            if len(blocks) == count:
                yield canon_groups(blocks)
    elif count <= n:
        size = n / count
        yield canon_groups([list(range(round(k * size), round((k + 1) * size))) for k in range(count)])


def check_sync_option(sync: str, replicas: str | int) -> None:
    """A `ConfigError` naming ``--sync`` for an unknown policy, or a forced one without replicas.

    Example:
        >>> check_sync_option("diloco", 2)
        >>> check_sync_option("diloco", 1)
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: --sync 'diloco' applies to replica plans only; add --replicas auto or e.g. --replicas 2
    """
    if sync not in SYNC_OPTIONS:
        raise ConfigError(f"--sync {sync!r} is not a sync policy; use one of: {', '.join(SYNC_OPTIONS)}")
    if sync != "auto" and replicas == 1:  # one pipeline has no gradient sync to choose
        raise ConfigError(f"--sync {sync!r} applies to replica plans only; add --replicas auto or e.g. --replicas 2")


def solve_n_replicas(rp: ReplicaProblem, count: int, *, policy: str = "auto", outer_steps: int | None = None,
                     time_limit_s: float = 30.0, seed: int = 0) -> ReplicaSolution:
    """The best layout of exactly ``count`` replicas found within ``time_limit_s`` (status FEASIBLE)."""
    start = time.perf_counter()
    n, m = len(rp.base.devices), rp.base.microbatches
    if count > min(n, m):
        raise ConfigError(f"--replicas {count}: the cluster has {n} cards and the global batch {m} micro-batches; "
                          f"each replica needs at least one of each, so use --replicas {min(n, m)} or fewer")
    cache = PipelineCache(rp.base, exact=False, time_limit_s=max(1.0, min(5.0, time_limit_s / 6)), seed=seed,
                          sharding=rp.sharding != "never")
    kind = "diloco" if policy == "diloco" else "synchronous"
    scorer = scorer_for(kind, outer_steps=outer_steps)
    best = _CountedSearch(rp, cache, scorer, start + time_limit_s, count=count).run()
    if best is None:
        raise InfeasibleError(f"--replicas {count}: no layout of {count} pipeline replicas fits in memory on "
                              f"these {n} cards; use fewer replicas (--replicas auto or 1)")
    pol = choose_policy(compute_s=best.compute_s, sync_s=best.sync_s, policy="synchronous" if best.shards else policy,
                        outer_steps=outer_steps, budget_fraction=SYNC_BUDGET_FRACTION)  # shards: every-step sync
    used = {st.device for r in best.replicas for st in r.stages}
    total = best.compute_s + pol.amortised_s
    return ReplicaSolution(best.replicas, best.sync, pol, best.compute_s, best.sync_s, total, "replicas-count",
                           "FEASIBLE", min(work_lower_bound(rp.base), total), time.perf_counter() - start,
                           tuple(i for i in range(n) if i not in used), best.shards)


def plan_replicas(graph: UnitGraph, cluster: Cluster, replicas: str | int, *, global_batch: int | None,
                  solver: str = "auto", time_limit_s: float | str = "auto", seed: int = 0, recompute: str = "auto",
                  offload: str = "never", schedule: str = "1f1b", tensor_parallel: str = "off",
                  sharding: str = "never", selective: Any = None, sync: str = "auto") -> Plan:
    """The plan ``hetpipe plan --replicas`` writes (see the module docstring); `selective` (the selective
    recompute level, `plan.selective_plan.selective_offer`) is offered to one pipeline only; `recompute` is the
    activation-recomputation lever of every pipeline, single or replica; `tensor_parallel` (groups,
    issue 15) is priced for one pipeline only; `sharding` the replicas' optimizer-state sharding
    (`partitioner.replica_shard`; refused with ``replicas=1``: `check_sharding_replicas`); `sync` the replicas'
    sync policy (``--sync``: auto | synchronous | diloco; `check_sync_option`).  The replicas' searches take one
    solve's limit (``auto``: `time_budget.AUTO_FIRST_S`; one pipeline may take the second, `plan.solved`)."""
    from hetpipe.plan.build import microbatches_for, partition_graph
    from hetpipe.plan.replicas import (
        assemble_replica_plan,
        build_replica_problem,
        ddp_equal,
        explain_unused,
        partition_replicas,
        single_pipeline,
    )

    check_sharding_replicas(sharding, replicas), check_sync_option(sync, replicas)
    if recompute == "selective" and replicas != 1:  # the replica planner prices no selective level
        raise ConfigError(f"recompute (--recompute): 'selective' with --replicas {replicas}: the selective level is "
                          "priced for one pipeline only; use --replicas 1 or --recompute auto")
    if replicas == 1:
        return partition_graph(graph, cluster, global_batch=global_batch, solver=solver, time_limit_s=time_limit_s,
                               seed=seed, recompute=recompute, offload=offload, schedule=schedule,
                               tensor_parallel=tensor_parallel, selective=selective)
    if schedule != "1f1b":  # replica pipelines run 1F1B (issue 17: ZB-H1 for one pipeline first)
        raise ConfigError(f"--schedule {schedule} plans one pipeline only; use --replicas 1 or --schedule 1f1b")
    if tensor_parallel != "off":  # the replica planner prices no groups (issue 15: single pipelines first)
        raise ConfigError(f"--tensor-parallel {tensor_parallel} plans one pipeline only; use --replicas 1")
    one_s = first_limit_s(time_limit_s)
    if replicas == "auto":
        try:
            single: Plan | None = partition_graph(graph, cluster, global_batch=global_batch, solver=solver,
                                                  time_limit_s=time_limit_s, seed=seed, recompute=recompute,
                                                  offload=offload, selective=selective)
        except InfeasibleError:
            single = None
        several = partition_replicas(graph, cluster, global_batch=global_batch, time_limit_s=one_s, seed=seed,
                                     recompute=recompute, sharding=sharding, offload=offload, policy=sync)
        if single is not None and (len(several.replicas) <= 1
                                   or single.predicted.iteration_s <= several.predicted.iteration_s):
            log.info("--replicas auto: one pipeline (%.4g s) vs replicas (%.4g s)", single.predicted.iteration_s,
                     several.predicted.iteration_s)
            return single
        return several
    assert isinstance(replicas, int)
    g, _ = microbatches_for(graph, global_batch, len(cluster.devices))
    rp = build_replica_problem(graph, cluster, global_batch=g, recompute=recompute, sharding=sharding,
                               offload=offload)
    sol = solve_n_replicas(rp, replicas, policy=sync, time_limit_s=one_s, seed=seed)
    base = {"ddp-equal": ddp_equal(rp),
            "single-pipeline": single_pipeline(rp, time_limit_s=max(1.0, one_s / 3), seed=seed)}
    why = explain_unused(rp, sol, time_limit_s=max(1.0, one_s / 6))
    left = tuple(LeftOut(rp.base.devices[d].id, f"{rp.base.devices[d].kind}: {text}") for d, text in why.items())
    return assemble_replica_plan(graph, cluster, rp=rp, sol=sol, global_batch=g, time_limit_s=one_s,
                                 seed=seed, baselines=base, left_out=left)
