"""`partition()`: model + cluster -> Plan.  The glue between capture, costs and solvers.

Example (the tiny test MLP on the home lab; `partition` captures it on meta, no weights):
    >>> import hetpipe
    >>> from hetpipe.models import build
    >>> model, inputs = build("mlp-tiny", device="meta", batch=2)
    >>> plan = hetpipe.partition(model, "examples/clusters/homelab.yaml",
    ...                          example_inputs=inputs, global_batch=8)
    >>> plan.solver.name, plan.solver.status, plan.training.microbatches
    ('dp', 'FEASIBLE', 4)
    >>> [(s.device, s.first_unit, s.last_unit) for s in plan.stages]   # the 4090 first, then the 3090
    [('desk:1', 0, 3), ('desk:0', 4, 7)]
    >>> hetpipe.check_plan(plan).ok
    True
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from hetpipe.cost_models.cluster_checks import as_cluster
from hetpipe.cost_models.devices import Cluster, DeviceProfile
from hetpipe.cost_models.offload import check_offload_option, offload_rates
from hetpipe.cost_models.recompute import check_recompute_option
from hetpipe.cost_models.validate import check_solver_options
from hetpipe.cost_models.memory import state_bytes_per_param
from hetpipe.cost_models.optimizer_step import loop_unit_step_s, step_launch_s, tensor_step_s, unit_step_s
from hetpipe.cost_models.stage_memory import MEMORY_MODEL
from hetpipe.cost_models.step_transient import STEP_VALUE_BYTES
from hetpipe.cost_models.timing import efficiencies, peak_flops_s
from hetpipe.errors import ConfigError
from hetpipe.partitioner.capture.graph import UnitGraph
from hetpipe.plan.offload_note import offload_note
from hetpipe.plan.unit_times import profile_unit_times, unit_times  # noqa: F401 (re-exported)
from hetpipe.plan.solved import solve_for_plan
from hetpipe.plan.selective_plan import (check_selective_mode, level_used, offer_for_options,  # noqa: F401
                                        offers_selective)
from hetpipe.plan.selective_schema import PlanSelective
from hetpipe.plan.step_schema import step_fields, step_paths, step_transient_records
from hetpipe.plan.tp_plan import (
    check_tensor_parallel_option, plan_group_fields, plan_unit_fields, tensor_parallel_fields, tensor_parallel_note)
from hetpipe.plan.schema import (
    RECOMPUTE_NOTE,
    BaselineReport,
    KindSeconds,
    LeftOut,
    Plan,
    PlanDevice,
    PlanLink,
    PlanModel,
    PlanStage,
    PlanTied,
    PlanTraining,
    PlanUnit,
    Predicted,
    SolverReport,
    UnitTimes,
)
from hetpipe.partitioner.placement import simulate_placement
from hetpipe.plan.chunk_schema import plan_chunks
from hetpipe.schedule.interleaved import chunks_of
from hetpipe.partitioner.problem import DeviceSlot, Evaluation, Problem, Stage, TiedCopy, evaluate, is_split

log = logging.getLogger(__name__)


def build_problem(graph: UnitGraph, cluster: Cluster, *, microbatches: int, recompute: str = "none",
                  offload: str = "never", tensor_parallel: str = "off") -> Problem:
    """The solver input for `graph` on `cluster` with `microbatches` per iteration, the
    activation-recomputation lever `recompute` (auto | none | all, `Problem.recompute`) and the
    optimizer-offload lever `offload` (never | auto | all, `Problem.offload`)."""
    if not cluster.devices:
        raise ConfigError(f"cluster {cluster.name!r} has no devices; add at least one device to the cluster file")
    times = unit_times(graph, cluster)
    ids = [d.id for d in cluster.devices]
    bandwidth = tuple(
        tuple(float("inf") if a == b else cluster.link(a, b).bandwidth_bytes_s for b in ids) for a in ids
    )
    latency = tuple(tuple(0.0 if a == b else cluster.link(a, b).latency_s for b in ids) for a in ids)
    steps = step_tables(graph, cluster)
    return Problem(
        step_s={k: v for k, (v, _) in steps.items()},
        step_launch_s={k: launch for k, (_, launch) in steps.items()},
        fwd_s={k: tuple(t.fwd for t in v) for k, v in times.items()},
        bwd_s={k: tuple(t.bwd for t in v) for k, v in times.items()},
        state_bytes=tuple(u.state_bytes for u in graph.units),
        activation_bytes=tuple(u.activation_bytes for u in graph.units),
        boundary_bytes=tuple(u.boundary_bytes for u in graph.units),
        boundary_held_bytes=tuple(u.boundary_held_bytes for u in graph.units),
        grad_bytes=tuple(u.grad_bytes for u in graph.units),
        boundary_grad_bytes=tuple(u.boundary_grad_bytes for u in graph.units),
        recompute_bytes=tuple(u.recompute_bytes for u in graph.units),
        weight_grad_bytes=tuple(u.weight_grad_bytes for u in graph.units),
        transient_bwd_bytes=tuple(u.transient_bwd_bytes for u in graph.units), **step_fields(graph, cluster),
        devices=tuple(DeviceSlot(d.id, d.kind, d.node, d.usable_bytes, d.host_link_bytes_s, d.host_memory_bytes_s)
                      for d in cluster.devices),
        bandwidth_bytes_s=bandwidth,
        latency_s=latency,
        microbatches=microbatches,
        tied=tied_copies(graph),
        recompute=recompute,
        offload=offload,
        offload_rates=offload_rates(graph.optimizer, graph.precision),
        **tensor_parallel_fields(graph, tensor_parallel),
    )


def step_tables(graph: UnitGraph, cluster: Cluster) -> dict[str, tuple[tuple[float, ...], float]]:
    """Per device kind: `profile_step_table` of its profile."""
    return {kind: profile_step_table(graph, cluster.profile(kind)) for kind in cluster.kinds}


def profile_step_table(graph: UnitGraph, prof: DeviceProfile) -> tuple[tuple[float, ...], float]:
    """Each unit's bandwidth share of the optimizer step on profile `prof` and its launch share
    (`hetpipe.cost_models.optimizer_step`, at the bandwidth and kernel overhead `timing.py` uses); where
    the device runs the per-tensor loop (a measured ``step_op_s``), each unit's tensors pay its ops instead, and
    with a measured ``step_bytes_s`` its bytes are the loop's, at the loop's rate
    (`optimizer_step.loop_unit_step_s`)."""
    eff = efficiencies(prof)
    if prof.step_op_s is not None and prof.step_bytes_s is not None:
        return tuple(loop_unit_step_s(params=u.param_count, tensors=u.param_tensors, optimizer=graph.optimizer,
                                      precision=graph.precision, step_bytes_s=prof.step_bytes_s,
                                      step_op_s=prof.step_op_s) for u in graph.units), 0.0
    shares = tuple(unit_step_s(params=u.param_count, optimizer=graph.optimizer, precision=graph.precision,
                               memory_bandwidth_bytes_s=prof.memory_bandwidth_bytes_s,
                               bandwidth_efficiency=eff.bandwidth) for u in graph.units)
    if prof.step_op_s is None:
        return shares, step_launch_s(graph.optimizer, eff.kernel_overhead_s)
    return tuple(s + tensor_step_s(tensors=u.param_tensors, optimizer=graph.optimizer, step_op_s=prof.step_op_s)
                 for s, u in zip(shares, graph.units)), 0.0


def tied_copies(graph: UnitGraph) -> tuple[TiedCopy, ...]:
    """Tied parameters as the memory model sees them: owner unit, user units, bytes of one replica."""
    per_param = state_bytes_per_param(graph.optimizer, graph.precision)
    return tuple(TiedCopy(t.unit_indices[0], tuple(t.unit_indices), int(round(t.numel * per_param)),
                          t.numel * STEP_VALUE_BYTES) for t in graph.tied if len(t.unit_indices) > 1)



def cost_model_notes(cluster: Cluster, precision: str) -> dict[str, str]:
    """Human-readable assumptions per device kind, recorded in the plan."""
    notes = {}
    for kind in cluster.kinds:
        p = cluster.profile(kind)
        eff = efficiencies(p)
        notes[kind] = (
            f"{peak_flops_s(p, precision) / 1e12:.1f} TFLOP/s peak ({precision}) x efficiency {eff.matmul:.2f}"
            f"{'' if eff.calibrated else ' (default)'}; "
            f"{p.memory_bandwidth_bytes_s / 1e9:.0f} GB/s x {eff.bandwidth:.2f}; "
            f"{eff.kernel_overhead_s * 1e6:.1f} us/op; source: {p.source}"
        )
    return notes


def predicted_figures(problem: Problem, stages: tuple[Stage, ...], ev: Evaluation, global_batch: int) -> Predicted:
    """The plan's `Predicted` block of an evaluated placement (T, bubble, samples/s, utilisation, simulated T)."""
    m = problem.microbatches
    util = {d.id: 0.0 for d in problem.devices}
    busy = 0.0
    for st, cost in zip(stages, ev.stages):
        work = m * (cost.fwd_s + cost.bwd_s)
        util[problem.devices[st.device].id] += work / ev.iteration_s  # interleaved: a card's chunks add up
        busy += work
    bubble = 1.0 - busy / (len({st.device for st in stages}) * ev.iteration_s)
    return Predicted(
        iteration_s=ev.iteration_s,
        bubble_fraction=bubble,
        samples_per_s=global_batch / ev.iteration_s,
        utilisation=util,
        simulated_iteration_s=simulated_iteration_s(problem, stages),
        t_1f1b_estimate_s=ev.estimate_s,
    )


def simulated_iteration_s(problem: Problem, stages: tuple[Stage, ...]) -> float:
    """The discrete-event simulation of a placement under its schedule (the analytic T's check; README)."""
    return simulate_placement(problem, stages, schedule=problem.schedule).iteration_s


def _plan_units(graph: UnitGraph, problem: Problem) -> tuple[PlanUnit, ...]:
    """Plan units whose ``time_s`` are the very tables the solver optimised (taken from `problem`)."""
    return tuple(
        PlanUnit(
            index=u.index,
            name=u.name,
            node_names=u.node_names,
            fwd_flops=u.fwd_flops,
            bwd_flops=u.bwd_flops,
            param_bytes=u.param_bytes,
            state_bytes=u.state_bytes,
            activation_bytes=u.activation_bytes,
            boundary_bytes=u.boundary_bytes,
            boundary_held_bytes=u.boundary_held_bytes,
            grad_bytes=problem.grad_bytes[u.index] if problem.grad_bytes else 0,
            boundary_grad_bytes=problem.boundary_grad_bytes[u.index] if problem.boundary_grad_bytes else 0,
            recompute_bytes=problem.recompute_bytes[u.index] if problem.recompute_bytes else 0,
            # only split plans (version 5) hold gradients from B to W
            weight_grad_bytes=u.weight_grad_bytes if is_split(problem.schedule) else 0,
            transient_bwd_bytes=problem.transient_bwd_bytes[u.index] if problem.transient_bwd_bytes else 0,
            step_param_bytes=u.step_param_bytes, step_tensor_bytes=u.step_tensor_bytes,
            time_s={k: UnitTimes(fwd=problem.fwd_s[k][u.index], bwd=problem.bwd_s[k][u.index],
                                 step=problem.step_s[k][u.index] if k in problem.step_s else 0.0)
                    for k in problem.fwd_s},
            **plan_unit_fields(problem, u.index),
        )
        for u in graph.units
    )


def plan_stages(problem: Problem, stages: tuple[Stage, ...], ev: Evaluation) -> tuple[PlanStage, ...]:
    """The plan's stage records of an evaluated placement (indices 0..p-1, device ids, costs as evaluated;
    interleaved: one per rank, its chunks listed, `plan.chunk_schema`)."""
    ranks = len(stages) // chunks_of(problem.schedule)
    return tuple(
        PlanStage(
            index=i,
            device=problem.devices[st.device].id,
            first_unit=st.first_unit,
            last_unit=st.last_unit,
            fwd_s=c.fwd_s,
            bwd_s=c.bwd_s,
            memory_bytes=c.memory_bytes,
            usable_bytes=c.usable_bytes,
            send_s=c.send_s,
            recompute_units=tuple(sorted(st.recompute_units)),
            offload=st.offload,
            offload_bytes=c.offload_bytes,
            offload_s=c.offload_s,
            step_s=c.step_s,
            bwd_weight_s=c.bwd_weight_s if is_split(problem.schedule) else 0.0,
            **plan_group_fields(problem, st, c.shares),
            chunks=plan_chunks(stages, ev.stages, i, ranks),
            selective=st.selective,  # version 7: runs `Plan.selective` (`plan.selective_schema`)
        )
        for i, (st, c) in enumerate(zip(stages[:ranks], ev.stages))
    )


def assemble_plan(
    graph: UnitGraph,
    cluster: Cluster,
    *,
    problem: Problem,
    stages: tuple[Stage, ...],
    solver: SolverReport,
    global_batch: int,
    baselines: dict[str, BaselineReport] | None = None,
    left_out: tuple[LeftOut, ...] = (),
    selective: PlanSelective | None = None,
) -> Plan:
    """Build the Plan document from a solved placement (tables recorded as optimised; `selective`: the
    record of `problem.selective`, `plan.selective_plan.selective_offer`)."""
    ev = evaluate(problem, stages)
    return Plan(
        model=PlanModel(
            name=graph.model_name,
            fingerprint=graph.fingerprint,
            param_count=graph.param_count,
            num_units=graph.num_units,
            tracer=graph.tracer,
            tied=tuple(PlanTied(t.qualified_names, t.unit_indices, c.state_bytes if c else 0, c.step_bytes if c else 0)
                       for t, c in _with_copies(graph)),
        ),
        training=PlanTraining(
            global_batch=global_batch,
            micro_batch_size=graph.micro_batch_size,
            microbatches=problem.microbatches,
            optimizer=graph.optimizer,
            precision=graph.precision,
            schedule=problem.schedule,
        ),
        devices=plan_devices(problem, cluster),
        links=tuple(
            PlanLink(l.src, l.dst, l.bandwidth_bytes_s, l.latency_s, l.kind)
            for (_, _), l in sorted(cluster.links.items())
        ),
        units=_plan_units(graph, problem),
        stages=plan_stages(problem, stages, ev),
        predicted=predicted_figures(problem, stages, ev, global_batch),
        solver=solver,
        baselines=baselines or {},
        left_out=left_out,
        cost_model={**cost_model_notes(cluster, graph.precision), **recompute_note(problem), **offload_note(problem),
                    **tensor_parallel_note(problem)},
        memory_model=MEMORY_MODEL,
        **objective_fields(problem),
        # recorded where a stage runs it: a plan without it is the plan of a problem without the level (its
        # version stays the least its content needs, and check re-derives every stage's choice from the tables)
        selective=selective if problem.selective is not None and level_used(problem, stages, baselines or {}) else None,
        step_transient=step_transient_records(problem.step_transient, step_paths(cluster)) if any(
            problem.step_param_bytes) else (),  # version 9 where a unit has stepped bytes (a U_s to price)
    )  # version: the least its content needs (3: `memory_model` is a version-3 field, `PLAN_VERSION_MEMORY`)


def plan_devices(problem: Problem, cluster: Cluster) -> tuple[PlanDevice, ...]:
    """The plan's devices; their host figures only when `problem` may offload (a version-4 field)."""
    host = problem.offload != "never"
    return tuple(PlanDevice(d.id, d.kind, d.node, d.memory_bytes, d.usable_bytes,
                            d.host_link_bytes_s if host else 0.0, d.host_memory_bytes_s if host else 0.0,
                            cores=d.cores)
                 for d in cluster.devices)


def objective_fields(problem: Problem) -> dict[str, Any]:
    """The plan's record of the objective (version 4): ``schedule`` and each kind's step launch share."""
    if problem.objective != "schedule":
        return {}
    return {"objective": "schedule",
            "step_launch_s": tuple(KindSeconds(k, v) for k, v in sorted(problem.step_launch_s.items()))}


def recompute_note(problem: Problem) -> dict[str, str]:
    """The plan's record of the recomputation setting (`schema.RECOMPUTE_NOTE`; nothing for ``none``)."""
    why = {"auto": "each stage recomputes the shortest prefix of its units, ranked by saved bytes per "
                   "recompute second on its card, that fits its memory (none when everything fits)",
           "all": "each stage recomputes every unit that saves memory (Megatron-LM full recomputation)",
           "selective": "every stage runs the selective level (its units' norm/GELU outputs dropped and re-run in "
                        "the backward), no whole unit (Megatron-LM selective recomputation)"}
    return {RECOMPUTE_NOTE: f"{problem.recompute}: {why[problem.recompute]}"} if problem.recompute != "none" else {}


def _with_copies(graph: UnitGraph) -> list[tuple[Any, TiedCopy | None]]:
    copies = {c.user_units: c for c in tied_copies(graph)}
    return [(t, copies.get(tuple(t.unit_indices))) for t in graph.tied]


def microbatches_for(graph: UnitGraph, global_batch: int | None, num_devices: int) -> tuple[int, int]:
    """(global_batch, microbatches): global_batch must be a multiple of the captured micro-batch size.

    Default: 2 micro-batches per device, which keeps the 1F1B bubble at most
    (p-1)/(3p-1) < 1/3 for p stages (cost_formulas.md §3.3).
    """
    mbs = graph.micro_batch_size
    if global_batch is None:
        global_batch = mbs * 2 * max(1, num_devices)
    if global_batch <= 0 or global_batch % mbs:
        raise ConfigError(
            f"global batch {global_batch} is not a positive multiple of the micro-batch size {mbs} "
            f"(the batch dimension of example_inputs); use e.g. --global-batch {mbs * max(1, global_batch // mbs)} "
            f"or change the micro-batch size"
        )
    return global_batch, global_batch // mbs


def capture_builtin(name: str, *, batch: int | None = None, seq: int | None = None, optimizer: str = "adam",
                    precision: str = "fp32", granularity: str | int = "block") -> UnitGraph:
    """Capture a built-in model (`hetpipe.models.list_models`) on meta, its training loss costed on the last unit.

    Example:
        >>> g = capture_builtin("mlp-tiny", batch=4)
        >>> g.model_name, g.micro_batch_size
        ('mlp-tiny', 4)
    """
    from hetpipe.models import build, training_loss
    from hetpipe.partitioner.capture.capture import capture

    model, inputs = build(name, device="meta", batch=batch, seq=seq)
    fn, targets = training_loss(name, inputs)
    return capture(model, inputs, name=name, granularity=granularity, optimizer=optimizer, precision=precision,
                   loss_fn=fn, targets=targets)


def partition(
    model: Any,
    cluster: Cluster | str | Path,
    *,
    example_inputs: Any,
    global_batch: int | None = None,
    optimizer: str = "adam",
    precision: str = "fp32",
    granularity: str | int = "block",
    solver: str = "auto",
    time_limit_s: float | str = "auto",
    seed: int = 0,
    name: str | None = None,
    loss_fn: Any = None,
    targets: Any = None,
    recompute: str = "auto",
    offload: str = "never",
    schedule: str = "1f1b",
    tensor_parallel: str = "off",
) -> Plan:
    """Capture `model`, cost it on `cluster`, and return the best 1F1B pipeline plan.

    `example_inputs` is ONE micro-batch (its batch dimension is the micro-batch
    size); `global_batch` must be a multiple of it.  With `loss_fn` and one micro-batch of
    `targets`, what the loss keeps for backward is counted on the last stage (an LM's
    cross-entropy keeps b*s*vocab log-probabilities).  `recompute` is the activation-recomputation
    lever: ``auto`` (each stage recomputes only what it must to fit, whole units and/or the selective
    level, as `hetpipe plan` offers it), ``none``, ``all`` or ``selective`` (the selective level alone
    on every stage); `offload` the optimizer-offload lever: ``never`` (the default), ``auto`` (a stage
    keeps its optimizer state on the host where that lowers T) or ``all``; `schedule` the pipeline
    schedule: ``1f1b`` (the default), ``zb-h1`` or ``auto`` (the faster for this plan,
    `partitioner.schedule_choice`).  Raises `InfeasibleError` when nothing fits, `ConfigError` for bad options.
    """
    from hetpipe.partitioner.capture.capture import capture

    cluster = as_cluster(cluster)  # a path, a dict or a Cluster; checked before the capture
    check_recompute_option(recompute)
    if loss_fn is None:  # not silent: the last stage's memory then lacks what the loss saves for backward
        log.warning("partition: the loss is not costed (what it saves for backward counts on the last stage); "
                    "pass loss_fn= and targets= (a built-in model's: hetpipe.models.training_loss)")
    graph = capture(model, example_inputs, name=name, granularity=granularity, optimizer=optimizer,
                    precision=precision, loss_fn=loss_fn, targets=targets)

    def capture_nodes() -> UnitGraph:  # the same model at node granularity: the selective level's source
        return graph if granularity == "node" else capture(
            model, example_inputs, name=name, granularity="node", optimizer=optimizer, precision=precision,
            loss_fn=loss_fn, targets=targets)

    offer = offer_for_options(graph, cluster, capture_nodes, recompute=recompute, schedule=schedule,
                              tensor_parallel=tensor_parallel)
    return partition_graph(graph, cluster, global_batch=global_batch, solver=solver,
                           time_limit_s=time_limit_s, seed=seed, recompute=recompute, offload=offload,
                           schedule=schedule, tensor_parallel=tensor_parallel, selective=offer)


def partition_graph(
    graph: UnitGraph,
    cluster: Cluster,
    *,
    global_batch: int | None = None,
    solver: str = "auto",
    time_limit_s: float | str = "auto",
    seed: int = 0,
    recompute: str = "auto",
    offload: str = "never",
    schedule: str = "1f1b",
    tensor_parallel: str = "off",
    selective: tuple[Any, PlanSelective] | None = None,
) -> Plan:
    """`partition` for an already captured `UnitGraph`; ``tensor_parallel="auto"`` lets stages be
    tensor-parallel groups (`partitioner/solvers/tp_solve.py`); `selective` (the level's tables and record,
    `plan.selective_plan.offer_for_options`) offers the selective recompute level per stage under ``auto``
    and is required under ``selective`` (the level forced on every stage, `partitioner.selective_mode`)."""
    from hetpipe.partitioner.schedule_choice import check_schedule_option

    cluster = as_cluster(cluster)
    check_solver_options(solver, time_limit_s, seed)
    check_recompute_option(recompute)
    check_offload_option(offload)
    check_schedule_option(schedule)
    check_tensor_parallel_option(tensor_parallel)
    check_selective_mode(recompute, schedule, tensor_parallel)
    if tensor_parallel != "off" and schedule != "1f1b":  # split schedules price one card per stage
        raise ConfigError(f"--schedule {schedule} with --tensor-parallel {tensor_parallel}: groups are priced "
                          "under 1F1B only; use --schedule 1f1b or --tensor-parallel off")
    if recompute == "selective" and selective is None:
        raise ConfigError("recompute (--recompute): 'selective', but this model offers no selective level (it does "
                          "not capture at node granularity, or no norm/GELU output can be dropped); use --recompute "
                          "auto or none")
    global_batch, m = microbatches_for(graph, global_batch, len(cluster.devices))
    problem = build_problem(graph, cluster, microbatches=m, recompute=recompute, offload=offload,
                            tensor_parallel=tensor_parallel)
    if selective is not None and offers_selective(recompute, schedule, tensor_parallel):
        problem = dataclasses.replace(problem, selective=selective[0])
    log.info("solving %d units on %d devices, %d micro-batches", graph.num_units, len(cluster.devices), m)
    got = solve_for_plan(problem, solver=solver, time_limit_s=time_limit_s, seed=seed, schedule=schedule,
                         tensor_parallel=tensor_parallel)
    sol = got.solution
    report = SolverReport(sol.solver, sol.status, sol.iteration_s, sol.bound_s, sol.wall_s, got.limit_s, seed)
    return assemble_plan(graph, cluster, problem=got.problem, stages=sol.stages, solver=report,
                         global_batch=global_batch, baselines=got.baselines, left_out=got.left_out,
                         selective=selective[1] if selective is not None else None)
