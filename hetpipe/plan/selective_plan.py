"""Offer the selective recompute level to the planner, record it in the plan, re-derive it (issue 14).

`selective_offer` derives the level of every unit of a capture from a node-granularity capture of the
same model (`partitioner.selective`): the `SelectiveTables` the planner prices (`Problem.selective`) and
the `PlanSelective` record of the same numbers plus each unit's dropped fx nodes (`Plan.selective`,
version 7).  `selective_mismatch` is `check --model`'s re-derivation: the recorded nodes, freed bytes and
peak must be a fresh capture's (and, given the cluster, the seconds within `TIME_RTOL`).

Example:
    >>> from hetpipe.cost_models.cluster import load_cluster
    >>> from hetpipe.plan.build import capture_builtin
    >>> graph, nodes = capture_builtin("gpt-tiny"), capture_builtin("gpt-tiny", granularity="node")
    >>> tables, record = selective_offer(graph, nodes, load_cluster("examples/clusters/homelab.yaml"))
    >>> record.units[0].nodes, tables.freed_bytes[1] == record.units[0].freed_bytes
    (('transformer_h_0_ln_1', 'transformer_h_0_ln_2', 'gelu'), True)
    >>> selective_mismatch(record, graph, nodes) is None
    True
"""

from __future__ import annotations

import logging
import math
from typing import Any

from hetpipe.cost_models.selective import SelectiveTables
from hetpipe.errors import ConfigError, HetpipeError, PlanError
from hetpipe.partitioner.baselines import BASELINES, baseline, without_offload
from hetpipe.partitioner.problem import Stage, is_split
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.selective import selective_tables, unit_level
from hetpipe.plan.selective_schema import PlanSelective, PlanSelectiveUnit
from hetpipe.plan.unit_times import unit_times
from hetpipe.schedule.interleaved import chunks_of

log = logging.getLogger(__name__)

#: Relative tolerance on re-derived seconds (the same float formula evaluated twice; `plan.tables.TIME_RTOL`).
TIME_RTOL = 1e-9


def selective_offer(graph: Any, node_graph: Any, cluster: Any) -> tuple[SelectiveTables, PlanSelective]:
    """The level of `graph`'s units (a `UnitGraph`) from `node_graph` (the same model captured at node
    granularity), its seconds the dropped nodes' forward times on each of `cluster`'s kinds."""
    node_fwd_s = {k: tuple(t.fwd for t in v) for k, v in unit_times(node_graph, cluster).items()}
    tables = selective_tables(graph.units, node_graph, node_fwd_s)
    units = tuple(
        PlanSelectiveUnit(index=u.index, nodes=lv.nodes, freed_bytes=lv.freed_bytes,
                          time_s={k: tables.extra_s[k][u.index] for k in sorted(tables.extra_s)})
        for u, lv in ((u, unit_level(u, node_graph)) for u in graph.units) if lv.freed_bytes > 0)
    return tables, PlanSelective(peak_bytes=tables.peak_bytes, units=units)


def offer_for_capture(graph: Any, capture_nodes: Any, cluster: Any) -> tuple[SelectiveTables, PlanSelective] | None:
    """`selective_offer` with the node graph from ``capture_nodes()``; None (logged) when the model does
    not capture at node granularity or the level frees nothing (then the planner is not offered it)."""
    try:
        node_graph = capture_nodes()
    except HetpipeError as err:
        log.info("selective recompute level not offered: the node-granularity capture failed (%s)", err)
        return None
    if [n for u in graph.units for n in u.node_names] and node_graph.fingerprint != graph.fingerprint:
        log.info("selective recompute level not offered: the node capture is of another graph")
        return None
    tables, record = selective_offer(graph, node_graph, cluster)
    return (tables, record) if record.units else None


def offers_selective(recompute: str, schedule: str, tensor_parallel: str) -> bool:
    """Whether a plan with these options is offered the selective level: under ``--recompute auto`` (or
    forced on every stage, ``selective``), one card per stage and 1F1B (`evaluate` prices the level for
    neither groups nor chunks; the runtime runs whole-unit recomputation under no split schedule either,
    `runtime.run.refuse_split_recompute`).

    Example:
        >>> offers_selective("auto", "1f1b", "off"), offers_selective("auto", "zb-h1", "off")
        (True, False)
    """
    return (recompute in ("auto", "selective") and tensor_parallel == "off" and schedule not in ("auto", "gpipe")
            and chunks_of(schedule) == 1 and not is_split(schedule))


def check_selective_mode(recompute: str, schedule: str, tensor_parallel: str) -> None:
    """Refuse ``recompute="selective"`` where the level is not priced (`offers_selective`): one line, the fix.

    Example:
        >>> check_selective_mode("selective", "interleaved:2", "off")
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: recompute (--recompute): 'selective' with --schedule interleaved:2: the selective level is priced and run under 1F1B only; use --schedule 1f1b or --recompute auto
    """
    if recompute != "selective" or offers_selective(recompute, schedule, tensor_parallel):
        return
    if tensor_parallel != "off":
        raise ConfigError(f"recompute (--recompute): 'selective' with --tensor-parallel {tensor_parallel}: the "
                          "selective level is priced for one card per stage only; use --tensor-parallel off or "
                          "--recompute auto")
    raise ConfigError(f"recompute (--recompute): 'selective' with --schedule {schedule}: the selective level is "
                      "priced and run under 1F1B only; use --schedule 1f1b or --recompute auto")


def offer_for_options(graph: Any, cluster: Any, capture_nodes: Any, *, recompute: str, schedule: str,
                      tensor_parallel: str) -> tuple[SelectiveTables, PlanSelective] | None:
    """The selective level a plan with these options is offered (`offer_for_capture`; None where
    `offers_selective` says no): the one code path of `hetpipe plan` and `hetpipe.partition`.
    ``capture_nodes()`` captures the same model at node granularity (only called when offered)."""
    check_selective_mode(recompute, schedule, tensor_parallel)
    if not offers_selective(recompute, schedule, tensor_parallel):
        return None
    return offer_for_capture(graph, capture_nodes, cluster)


def selective_mismatch(record: PlanSelective, graph: Any, node_graph: Any, cluster: Any = None) -> str | None:
    """What in `record` (a plan's `Plan.selective`) a fresh derivation from `graph` and `node_graph`
    contradicts (one line), or None; with `cluster`, the seconds are compared too."""
    if cluster is None:
        fresh_units = tuple((u.index, lv.nodes, lv.freed_bytes) for u, lv in
                            ((u, unit_level(u, node_graph)) for u in graph.units) if lv.freed_bytes > 0)
        peak = max((unit_level(u, node_graph).peak_bytes for u in graph.units), default=0)
        fresh = PlanSelective(peak, tuple(PlanSelectiveUnit(i, n, f, {}) for i, n, f in fresh_units))
    else:
        fresh = selective_offer(graph, node_graph, cluster)[1]
    if record.peak_bytes != fresh.peak_bytes:
        return f"selective.peak_bytes is {record.peak_bytes}, the model's is {fresh.peak_bytes}"
    got, want = {u.index: u for u in record.units}, {u.index: u for u in fresh.units}
    if sorted(got) != sorted(want):
        return f"selective.units lists units {sorted(got)}, the model's level frees on units {sorted(want)}"
    for i, rec in got.items():
        new = want[i]
        if tuple(rec.nodes) != tuple(new.nodes) or rec.freed_bytes != new.freed_bytes:
            return (f"selective unit {i}: drops {list(rec.nodes)} freeing {rec.freed_bytes} bytes, the model's level "
                    f"drops {list(new.nodes)} freeing {new.freed_bytes}")
        bad = [k for k in new.time_s if not math.isclose(rec.time_s.get(k, math.nan), new.time_s[k],
                                                        rel_tol=TIME_RTOL)]
        if bad:
            return (f"selective unit {i}: time_s[{bad[0]!r}] is {rec.time_s.get(bad[0])!r}, the cluster's is "
                    f"{new.time_s[bad[0]]!r}")
    return None


def verify_selective(record: PlanSelective, graph: Any, node_graph: Any, cluster: Any = None) -> None:
    """Raise `PlanError` when `selective_mismatch` finds something (`check --model`)."""
    problem = selective_mismatch(record, graph, node_graph, cluster)
    if problem:
        raise PlanError(f"{problem}; the plan's selective level is not this model's (edited, or planned with other "
                        "options); re-create it with `hetpipe plan`")


def level_used(problem: Any, stages: Any, baselines: Any) -> bool:
    """Whether the plan must record the selective level's tables: a stage runs it, or a recorded baseline's
    forced or best placement does as `with_recompute` re-derives it (`plan.baseline_check` prices them again
    from the plan's tables: without the level they would choose other levers).

    Example:
        >>> level_used(None, [], {})
        False
    """
    if any(st.selective for st in stages):
        return True
    if problem is None or problem.selective is None:
        return False
    ids = {d.id: i for i, d in enumerate(problem.devices)}
    for name, rec in baselines.items():
        if name in BASELINES and any(st.selective for st in baseline(problem, name).stages):
            return True
        best = rec.best.stages if rec.best is not None else ()
        if best and any(st.selective for st in with_recompute(without_offload(problem), tuple(
                Stage(ids[s.device], s.first_unit, s.last_unit) for s in best))):
            return True
    return False
