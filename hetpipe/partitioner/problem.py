"""The pure solver input and the objective every solver optimises.

`Problem` is a table-only description of a pipeline-partitioning instance: per unit times on each device kind,
memory, cut bytes, the devices and the link matrix -- exactly what a plan file records, so a plan can be re-checked
from the file alone.  `evaluate` is the single implementation of the optimisation contract (issue #3).

Objective (units u = 0..L-1; p stages; stage s on device d_s holds [l_s, r_s]):

    F_s, B_s  = sum of fwd_s / bwd_s of its units on kind(d_s)          (per micro-batch)
    C_s       = latency(d_s, d_{s+1}) + boundary_bytes[r_s] / bandwidth(d_s, d_{s+1})   (s < p-1)
    S_s       = sum of step_s of its units on kind(d_s) + step_launch_s[kind(d_s)]   (once per step;
                `hetpipe.cost_models.optimizer_step`)
    T         = the 1F1B action lists the runtime executes (`schedule.builders.one_f_one_b`),
                replayed with F_s, B_s, a transfer of C_s per message (one at a time per link
                direction) and S_s after each rank's last backward: the end of the last step
                (`hetpipe.schedule.replay`, equal to `hetpipe.schedule.simulate`)
    T_est     = sum_s (F_s + B_s) + sum_{s<p-1} 2 C_s
                + (m - 1) * max( max_s (F_s + B_s), max_{s<p-1} 2 C_s )
                (the H-1F1B estimate: `Evaluation.estimate_s`, the solvers' search surrogate, and T itself
                for a problem whose `objective` is ``estimate``: plans before version 4)
    M_s       = sum state_bytes + tied_bytes(s) - G_s
                + max_t ( g_t G_s + k_t (A_s + in_s + out_s) + i_t in_s + i'_t in'_s + o_t out_s + o'_t out'_s + w_t Wg_s )
    A_s       = sum activation_bytes - boundary_held_bytes[r_s]: every storage a micro-batch keeps for backward
                counted once, in the unit that produces it, less those out_s holds (`capture.storages`)
    G_s       = sum grad_bytes: parameter gradients, freed at each step's start
    in_s = boundary_bytes[l_s - 1] (0 for s = 0);  out_s = boundary_bytes[r_s] (0 for s = p - 1)
    in'_s, out'_s     = the same cuts' boundary_grad_bytes: what gradient messages carry
    (g_t, k_t, i_t, i'_t, o_t, o'_t) over the moments t of a step of the stage's 1F1B action list
                      (`hetpipe.schedule.held.stage_held_terms`; they depend on p - s, m and s = 0 only):
                      gradients allocated or not, micro-batches in flight (at most min(p - s, m)), each
                      keeping its received input and its output until its backward, and activation /
                      gradient messages of the input / output cut -- receive buffers posted ahead, received
                      gradients, sends not yet waited for (`cost_models.stage_memory.pipeline_stage_bytes`)
    tied_bytes(s)   = state bytes of every tied parameter (GPT-2's wte = lm_head) that a unit of stage s uses
                      but whose owner unit (counted in state_bytes) is elsewhere: the runtime keeps a replica
                      + [T_s inside a backward, if > 0]   (memory model 4)
    T_s       = max transient_bwd_bytes over the stage's units: what a backward allocates beyond the ledger
                (the LM loss's 2 x logits bytes, `capture.transients`)
    M_s      >= sum state_bytes + tied_bytes(s) + U_s   (memory model 5: the optimizer step's moment)
    U_s       = a_k P_s + b_k max_tensor_s on kind k = kind(d_s) (`step_transient[k]`): P_s = sum step_param_bytes
                (+ tied replicas' step_bytes), max_tensor_s = max step_tensor_bytes (and replicas'); 0 if offloading
    constraint: M_s <= usable_bytes(d_s)

With ``Problem.schedule`` one of `SPLIT_SCHEDULES` (ZB-H1, ZB-1F1B) T replays those lists (B_s - W_s, then W_s =
`stage_weight_s`), M_s their moments: w_t micro-batches between B and W keep Wg_s = sum weight_grad_bytes (0 on s = 0).

Activation recomputation (issue 14; `hetpipe.cost_models.recompute`): a stage may recompute a set R_s of its
units (`Stage.recompute_units`); each u in R_s keeps only its input in_u = boundary_bytes[u - 1] (0 for the stage's
first unit) per in-flight micro-batch instead of activation_bytes[u], its activations live again once during its
backward, and its forward runs again in the backward:

    B_s += sum_{u in R_s} F_u
    M_s  = ... + k_t * (A_s - sum_{u in R_s} (A_u - in_u) + in_s + out_s) + ... + max_{u in R_s} A_u
    (`pipeline_stage_bytes` with recompute_saved_bytes = sum (A_u - in_u), recompute_peak_bytes)

`evaluate` prices whatever set a stage carries; `Problem.recompute` says which a solver may pick.  A stage with
`Stage.selective` is priced on `cost_models.selective.selective_variant` (its units drop their cheap outputs).

Optimizer-state offload (issue 14; `hetpipe.cost_models.offload`): a stage with `Stage.offload` keeps its
optimizer state (Adam's m, v; mixed precisions: the fp32 master weights too) on its host; P_s its
trainable parameters (tied replicas included):

    M_s   -= P_s * host_bytes_per_param                        (every moment of the step)
    O_s    = P_s * link_bytes_per_param / host_link(d_s) + P_s * step_bytes_per_param / host_memory(d_s)
    S_s    = O_s for an offloading stage: its optimizer step IS its offload tail, replayed in T
             after the rank's last backward like any step
    T_est += max_s O_s over the offloading stages              (`step_tail_s`: why the max)

(priced, or the search would see offloading as free memory); `Problem.offload`: never | auto | all.

Tensor-parallel groups (issue 15): a stage with `Stage.members` runs on 2..`group_max` cards of <= `group_nodes`
nodes, lead `device` first; F_s, B_s, M_s (every member's) and S_s per `tp_tables.group_stage`, C_s lead to lead.

Interleaved 1F1B (``schedule="interleaved:V"``, `hetpipe.schedule.interleaved`): `stages` are the V p virtual stages
in model order, stage k on rank k % p (so on stage k % p's device); F, B, C (the wrap-around link p-1 -> 0 included)
and S per virtual stage as above, T replays the interleaved lists, and every virtual stage's M is its rank's
(`hetpipe.cost_models.chunk_memory` over the rank's per-chunk moments).

T_est is the heterogeneous 1F1B estimate of HARP / AMP / Metis (cost_formulas.md §3.3); min(p - s, m)
in-flight micro-batches is 1F1B's footprint (Narayanan et al. SC'21; Megatron theoretical_memory_usage.py).

Example:
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)},
    ...                state_bytes=(10, 10), activation_bytes=(1, 1), boundary_bytes=(4, 0),
    ...                devices=(DeviceSlot("d0", "a", "n0", 100), DeviceSlot("d1", "a", "n0", 100)),
    ...                bandwidth_bytes_s=((1.0, 4.0), (4.0, 1.0)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4)
    >>> ev = evaluate(prob, (Stage(0, 0, 0), Stage(1, 1, 1)))
    >>> ev.iteration_s, ev.estimate_s   # the schedule; the estimate (3 + 3) + 2*1 + 3 * max(3, 2)
    (19.0, 17.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from hetpipe.cost_models.backward_split import stage_bwd_weight_s
from hetpipe.cost_models.chunk_memory import ChunkTerms, pipeline_rank_bytes
from hetpipe.cost_models.offload import NO_OFFLOAD, OFFLOAD_MODES, OffloadCost, OffloadRates, offload_cost
from hetpipe.cost_models.recompute import RECOMPUTE_MODES, RecomputeCost, recompute_cost
from hetpipe.cost_models.selective import SelectiveTables, selective_variant
from hetpipe.cost_models.stage_memory import pipeline_stage_bytes
from hetpipe.cost_models.step_transient import StepTransient
from hetpipe.errors import InfeasibleError
from hetpipe.partitioner.problem_types import (  # re-exported: the contract's names
    DeviceSlot, Evaluation, Stage, StageCost, TiedCopy)
from hetpipe.partitioner.tp_tables import GroupStage, StagePosition, UnitSplit, group_stage
from hetpipe.schedule.builders import SCHEDULES, SPLIT_SCHEDULES, is_split
from hetpipe.schedule.held import position_held_terms, stage_held_terms
from hetpipe.schedule.held_virtual import rank_held_terms
from hetpipe.schedule.interleaved import chunks_of, parse_interleaved
from hetpipe.schedule.replay import replay_iteration_s

#: What `evaluate`'s T is: ``schedule`` (plan version 4 on): the action lists the runtime runs,
#: replayed with optimizer steps; ``estimate``: the H-1F1B formula (plans before version 4).
OBJECTIVES = ("schedule", "estimate")


@dataclass(frozen=True)
class Problem:
    """A partitioning instance.  Sequences are indexed by unit; matrices by device index.

    `bandwidth_bytes_s[i][j]` and `latency_s[i][j]` describe the link i -> j.  `recompute` is the recomputation
    lever (`RECOMPUTE_MODES`): ``none`` (default), ``auto`` (`partitioner.recompute`), ``all``, ``selective`` (issue 14).
    """

    fwd_s: Mapping[str, tuple[float, ...]]
    bwd_s: Mapping[str, tuple[float, ...]]
    state_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    boundary_bytes: tuple[int, ...]
    devices: tuple[DeviceSlot, ...]
    bandwidth_bytes_s: tuple[tuple[float, ...], ...]
    latency_s: tuple[tuple[float, ...], ...]
    microbatches: int
    tied: tuple[TiedCopy, ...] = ()
    recompute: str = "none"
    # Per unit: the part of boundary_bytes[u] also in activation_bytes (held for backward); () = none.
    boundary_held_bytes: tuple[int, ...] = ()
    # Per unit: gradient bytes within state_bytes (from a step's first backward); () = always (a bound).
    grad_bytes: tuple[int, ...] = ()
    # Per unit: the part of boundary_bytes[u] that requires grad (the message back); () = the whole cut.
    boundary_grad_bytes: tuple[int, ...] = ()
    # Per unit: what a recompute of it allocates again (`RecomputedUnit.saved_bytes`); () = activation_bytes;
    # what a split backward keeps from B to W (`Unit.weight_grad_bytes`); () = none (plans before it).
    recompute_bytes: tuple[int, ...] = ()
    weight_grad_bytes: tuple[int, ...] = ()
    # Per unit: the most its backward allocates at once beyond the ledger (`Unit.transient_bwd_bytes`,
    # memory model 4); () = none (plans before it).
    transient_bwd_bytes: tuple[int, ...] = ()
    # Per unit: the bytes of its stepped parameters, all and the largest (`Unit.step_param_bytes`), and per
    # device kind the step's multiples of them (memory model 5, `cost_models.step_transient`); ()/{} = none.
    step_param_bytes: tuple[int, ...] = ()
    step_tensor_bytes: tuple[int, ...] = ()
    step_transient: Mapping[str, StepTransient] = field(default_factory=dict)
    # Optimizer-state offload (`hetpipe.cost_models.offload`): the lever's setting, the per-parameter
    # bytes (None = offload impossible: no optimizer/precision known), and -- for the solvers'
    # outer walk only (`solvers/offload_walk.py`) -- the most tail seconds a stage may pay for it.
    offload: str = "never"
    offload_rates: OffloadRates | None = None
    offload_cap_s: float = math.inf
    # Per kind, per unit: the bandwidth share of the optimizer step S (`optimizer_step.unit_step_s`); {} = free.
    step_s: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    # Per device kind: the launch share of S, paid once per stage (`optimizer_step.step_launch_s`).
    step_launch_s: Mapping[str, float] = field(default_factory=dict)
    # What T means (`OBJECTIVES`): the simulated schedule (default) or the H-1F1B estimate.
    objective: str = "schedule"
    # The action lists T replays and M_s holds (`schedule.builders.SCHEDULES`; split: B and W apart).
    schedule: str = "1f1b"
    # Tensor-parallel groups (issue 15): per unit what a group splits (`tp_tables.UnitSplit`; () = no groups), the
    # most cards a group may hold (1 = pipeline only) and the most nodes they may come from (`solvers/group_dp.py`).
    tensor_parallel: tuple[UnitSplit, ...] = ()
    group_max: int = 1
    group_nodes: int = 1
    selective: SelectiveTables | None = None  # the selective recompute level (issue 14); None = not offered

    @property
    def unit_recompute_bytes(self) -> tuple[int, ...]:
        """Per unit, what recomputing it frees per micro-batch before its input is kept, and allocates again."""
        return self.recompute_bytes or self.activation_bytes

    def __post_init__(self) -> None:
        for name, modes in (("recompute", RECOMPUTE_MODES), ("offload", OFFLOAD_MODES), ("objective", OBJECTIVES)):
            if getattr(self, name) not in modes:
                raise ValueError(f"Problem.{name} is {getattr(self, name)!r}; use one of {', '.join(modes)}")
        if self.schedule.partition("@")[0] not in SCHEDULES and parse_interleaved(self.schedule) is None:
            raise ValueError(f"Problem.schedule is {self.schedule!r}; use one of {', '.join(SCHEDULES)}")

    @property
    def num_units(self) -> int:
        return len(self.state_bytes)

    def comm_s(self, src: int, dst: int, cut_after: int) -> float:
        """C: one-way time of the cut after unit `cut_after` over link src -> dst.

        A cut of 0 bytes still pays the latency (a message is sent): C = latency + bytes / bandwidth, every cut.
        """
        return self.latency_s[src][dst] + self.boundary_bytes[cut_after] / self.bandwidth_bytes_s[src][dst]


def stage_memory_bytes(problem: Problem, stages: Sequence[Stage], s: int) -> int:
    """M_s of the contract for stage index `s` of `stages` (interleaved: its rank's, every chunk's sum)."""
    if stages[s].selective and problem.selective is not None:  # its variant's M_s and the level's peak once
        return problem.selective.peak_bytes + stage_memory_bytes(selective_variant(problem), stages, s)
    p, chunks = len(stages), chunks_of(problem.schedule)
    if chunks > 1:
        ranks = p // chunks
        terms = [stage_memory_terms(problem, stages, k) for k in range(s % ranks, p, ranks)]
        return pipeline_rank_bytes(terms, rank_held_terms(ranks, s % ranks, chunks, problem.microbatches))
    held = (position_held_terms(p - 1 - s, first=s == 0, microbatches=problem.microbatches)
            if problem.schedule == "1f1b" else stage_held_terms(p, s, problem.microbatches, schedule=problem.schedule))
    return pipeline_stage_bytes(**vars(stage_memory_terms(problem, stages, s)), held=held)


def stage_memory_terms(problem: Problem, stages: Sequence[Stage], s: int) -> ChunkTerms:
    """Stage (or chunk) s's terms of M_s: state, gradients, A_s, its cuts, its recompute's."""
    st, p, rc = stages[s], len(stages), stage_recompute_cost(problem, stages[s])
    units = range(st.first_unit, st.last_unit + 1)
    state = sum(problem.state_bytes[u] for u in units) + tied_bytes(problem, st) - stage_offload(problem, st).saved_bytes
    return ChunkTerms(
        state_bytes=state, grad_bytes=sum(problem.grad_bytes[u] for u in units) if problem.grad_bytes else 0,
        activation_bytes=stage_activation_bytes(problem, st),
        in_bytes=problem.boundary_bytes[st.first_unit - 1] if s > 0 else 0,
        out_bytes=problem.boundary_bytes[st.last_unit] if s < p - 1 else 0,
        in_grad_bytes=grad_cut_bytes(problem, st.first_unit - 1) if s > 0 else 0,
        out_grad_bytes=grad_cut_bytes(problem, st.last_unit) if s < p - 1 else 0,
        recompute_saved_bytes=rc.saved_bytes, recompute_peak_bytes=rc.peak_bytes,
        weight_grad_bytes=sum(problem.weight_grad_bytes[u] for u in units if s and is_split(problem.schedule)
                              and problem.weight_grad_bytes),
        transient_bwd_bytes=stage_transient_bytes(problem, st), **stage_step_transient(problem, st))


def stage_step_bytes(problem: Problem, stage: Stage) -> tuple[int, int]:
    """(P_s, the largest stepped tensor's bytes) of `stage`: its units' and its tied replicas' (memory model 5)."""
    units, copies = range(stage.first_unit, stage.last_unit + 1), [t.step_bytes for t in held_replicas(problem, stage)]
    params, largest = problem.step_param_bytes, problem.step_tensor_bytes
    return (sum(params[u] for u in units) + sum(copies) if params else sum(copies),
            max([largest[u] for u in units] + copies if largest else copies, default=0))


def stage_step_transient(problem: Problem, stage: Stage) -> dict[str, int]:
    """U_s's two parts on `stage`'s kind (`ChunkTerms.step_list_bytes`, ``step_tensor_bytes``); 0 where the stage
    offloads (its optimizer steps host copies, `runtime/stage/offload.py`) or the kind has no rule."""
    rule = problem.step_transient.get(problem.devices[stage.device].kind)
    if rule is None or stage.offload:
        return {"step_list_bytes": 0, "step_tensor_bytes": 0}
    params, largest = stage_step_bytes(problem, stage)
    return {"step_list_bytes": rule.list_multiple * params, "step_tensor_bytes": rule.tensor_multiple * largest}


def stage_transient_bytes(problem: Problem, stage: Stage) -> int:
    """T_s: the largest backward transient of `stage`'s units (memory model 4; 0 without the table)."""
    table = problem.transient_bwd_bytes
    return max((table[u] for u in range(stage.first_unit, stage.last_unit + 1)), default=0) if table else 0


def grad_cut_bytes(problem: Problem, unit: int) -> int:
    """Bytes of the gradient message over the cut after `unit` (the whole cut if not recorded)."""
    return (problem.boundary_grad_bytes or problem.boundary_bytes)[unit]


def stage_activation_bytes(problem: Problem, stage: Stage) -> int:
    """A_s: what one micro-batch keeps for backward on `stage` beyond its input and output frames: its
    units' held storages (each in the unit that produces it) less the held share of its output cut."""
    act = sum(problem.activation_bytes[u] for u in range(stage.first_unit, stage.last_unit + 1))
    has_out = problem.boundary_held_bytes and stage.last_unit < problem.num_units - 1  # the last stage sends nothing
    return act - (problem.boundary_held_bytes[stage.last_unit] if has_out else 0)


def stage_recompute_cost(problem: Problem, stage: Stage) -> RecomputeCost:
    """Bytes saved, peak and seconds added by the units `stage` recomputes, on its device's kind."""
    return recompute_cost(stage.recompute_units, activation_bytes=problem.unit_recompute_bytes,
                          boundary_bytes=problem.boundary_bytes,
                          fwd_s=problem.fwd_s[problem.devices[stage.device].kind], first_unit=stage.first_unit)


def tied_bytes(problem: Problem, stage: Stage) -> int:
    """State bytes of the tied-parameter replicas `stage` holds (see the module docstring)."""
    return sum(t.state_bytes for t in held_replicas(problem, stage))


def held_replicas(problem: Problem, stage: Stage) -> list[TiedCopy]:
    """The tied parameters `stage` keeps a replica of: it uses one but does not hold its owner unit."""
    held = range(stage.first_unit, stage.last_unit + 1)
    return [t for t in problem.tied
            if t.owner_unit not in held and any(u in held for u in t.user_units if u != t.owner_unit)]


def validate_stages(problem: Problem, stages: Sequence[Stage]) -> None:
    """Raise ValueError unless `stages` cover every unit once, in order, on distinct devices."""
    if not stages:
        raise ValueError("a plan needs at least one stage")
    expected = 0
    for s, st in enumerate(stages):
        if st.first_unit != expected or st.last_unit < st.first_unit:
            raise ValueError(f"stage {s} covers units [{st.first_unit}, {st.last_unit}], expected to start at {expected}")
        if not 0 <= st.device < len(problem.devices):
            raise ValueError(f"stage {s} uses device index {st.device}, out of range")
        rc = st.recompute_units
        if any(not st.first_unit <= u <= st.last_unit for u in rc) or len(set(rc)) != len(rc):
            raise ValueError(f"stage {s} recomputes units {list(rc)}, not distinct units of its own "
                             f"[{st.first_unit}, {st.last_unit}]")
        if st.selective and (problem.selective is None or st.members or chunks_of(problem.schedule) > 1):
            raise ValueError(f"stage {s} runs the selective level: not priced here (no tables, a group, or chunks)")
        if st.offload and not can_offload(problem, st):
            raise ValueError(f"stage {s} offloads, but its device {problem.devices[st.device].id} has no host link "
                             "or host memory figure, the problem no offload rates, or the stage no trainable state")
        _validate_group(problem, st, s)
        expected = st.last_unit + 1
    if expected != problem.num_units:
        raise ValueError(f"stages end at unit {expected - 1}, the model has {problem.num_units} units")
    ranks, chunks = divmod(len(stages), chunks_of(problem.schedule))
    if chunks or any(st.device != stages[k % ranks].device or st.members for k, st in enumerate(stages[ranks:])):
        raise ValueError(f"{problem.schedule}: {len(stages)} stages are not chunks of ranks 0..p-1 on their devices")
    used = [d for st in stages[:ranks] for d in (st.members or (st.device,))]
    if len(set(used)) != len(used):
        raise ValueError(f"a device is used by two stages: {used}")


def stage_step_s(problem: Problem, stage: Stage) -> float:
    """S_s: the optimizer step of `stage` on its device's kind (0 when the problem prices none)."""
    kind = problem.devices[stage.device].kind
    table = problem.step_s.get(kind)
    return 0.0 if table is None else (sum(table[u] for u in range(stage.first_unit, stage.last_unit + 1))
                                      + problem.step_launch_s.get(kind, 0.0))


def evaluate(problem: Problem, stages: Sequence[Stage], *, objective: str | None = None) -> Evaluation:
    """Objective T and every M_s of a placement (see the module docstring).

    T is the simulated 1F1B iteration, optimizer steps included (``objective="schedule"``,
    `hetpipe.schedule.replay`), or the H-1F1B estimate (``"estimate"``); None takes
    `Problem.objective`.  `Evaluation.estimate_s` always holds the estimate.
    """
    validate_stages(problem, stages)
    objective = problem.objective if objective is None else objective
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
    costs: list[StageCost] = []
    for s, st in enumerate(stages):
        if st.members:
            costs.append(group_stage_cost(problem, stages, s))
            continue
        kind, pst = problem.devices[st.device].kind, selective_variant(problem) if st.selective else problem
        units = range(st.first_unit, st.last_unit + 1)
        fwd = sum(problem.fwd_s[kind][u] for u in units)
        bwd = sum(pst.bwd_s[kind][u] for u in units) + stage_recompute_cost(pst, st).extra_s
        send = problem.comm_s(st.device, stages[s + 1].device, st.last_unit) if s + 1 < len(stages) else 0.0
        off = stage_offload(problem, st)
        costs.append(StageCost(fwd_s=fwd, bwd_s=bwd, bwd_weight_s=stage_weight_s(problem, st), send_s=send,
                               memory_bytes=stage_memory_bytes(problem, stages, s),
                               usable_bytes=problem.devices[st.device].usable_bytes, offload_bytes=off.saved_bytes,
                               offload_s=off.tail_s, step_s=stage_step_or_tail_s(problem, st)))
    compute = [c.fwd_s + c.bwd_s for c in costs]
    comm2 = [2.0 * c.send_s for c in costs[:-1]]
    bottleneck = max(compute + comm2)
    tail = step_tail_s(problem, stages)
    estimate = sum(compute) + sum(comm2) + (problem.microbatches - 1) * bottleneck + tail
    total = estimate if objective == "estimate" else schedule_s(costs, problem.microbatches, problem.schedule)
    return Evaluation(iteration_s=total, bottleneck_s=bottleneck, stages=tuple(costs), tail_s=tail,
                      estimate_s=estimate, objective=objective)


def schedule_s(costs: Sequence[StageCost], microbatches: int, schedule: str = "1f1b") -> float:
    """The action lists of `schedule` (1F1B by default) replayed over these stage costs (`hetpipe.schedule.replay`)."""
    return replay_iteration_s(schedule, len(costs) // chunks_of(schedule), microbatches, fwd_s=[c.fwd_s for c in costs],
                              bwd_s=[c.bwd_s for c in costs], send_s=[c.send_s for c in costs[:-1]],
                              step_s=[c.step_s for c in costs], bwd_weight_s=[c.bwd_weight_s for c in costs])


def stage_weight_s(problem: Problem, stage: Stage) -> float:
    """W_s: the weight-gradient seconds within B_s (`hetpipe.cost_models.backward_split`); a unit is
    trainable if it has gradient bytes (state bytes where gradients are not recorded)."""
    units = range(stage.first_unit, stage.last_unit + 1)
    trainable = problem.grad_bytes or problem.state_bytes
    table = problem.bwd_s[problem.devices[stage.device].kind]
    return stage_bwd_weight_s(bwd_s=[table[u] for u in units], trainable=[trainable[u] > 0 for u in units])


def stage_step_or_tail_s(problem: Problem, stage: Stage) -> float:
    """The step the schedule replays for `stage`: O_s if it offloads, its on-card S_s otherwise."""
    off = stage_offload(problem, stage)
    return off.tail_s if off.saved_bytes > 0 else stage_step_s(problem, stage)


def stage_params(problem: Problem, stage: Stage) -> int:
    """Trainable parameters `stage` steps: its units' (grad_bytes / gradient bytes per parameter) and its tied
    replicas' (state bytes / state bytes per parameter).  0 without offload rates."""
    rates = problem.offload_rates
    if rates is None or not problem.grad_bytes:
        return 0
    units = range(stage.first_unit, stage.last_unit + 1)
    own = sum(problem.grad_bytes[u] for u in units) // rates.grad_bytes_per_param
    return own + tied_bytes(problem, stage) // rates.state_bytes_per_param


def can_offload(problem: Problem, stage: Stage) -> bool:
    """Whether `stage` could keep optimizer state on its host: rates and host figures known, and offloading moves
    some bytes (SGD in fp32 has no optimizer state to move)."""
    dev, rates = problem.devices[stage.device], problem.offload_rates
    return (rates is not None and rates.host_bytes_per_param > 0 and dev.host_link_bytes_s > 0
            and dev.host_memory_bytes_s > 0 and stage_params(problem, stage) > 0)


def offload_if(problem: Problem, stage: Stage) -> OffloadCost:
    """What offloading would save and cost `stage` (whether or not it does); `NO_OFFLOAD` if it cannot."""
    if not can_offload(problem, stage):
        return NO_OFFLOAD
    dev = problem.devices[stage.device]
    assert problem.offload_rates is not None
    return offload_cost(stage_params(problem, stage), problem.offload_rates,
                        host_link_bytes_s=dev.host_link_bytes_s, host_memory_bytes_s=dev.host_memory_bytes_s)


def stage_offload(problem: Problem, stage: Stage) -> OffloadCost:
    """Bytes off the card and O_s of `stage` as placed (`NO_OFFLOAD` when it does not offload)."""
    return offload_if(problem, stage) if stage.offload else NO_OFFLOAD


def step_tail_s(problem: Problem, stages: Sequence[Stage]) -> float:
    """The seconds the offload's tail adds to T_est: max_s O_s over the offloading stages (0 if none; the schedule
    T replays each O_s as that stage's step).  The max and no more: each tail starts after its stage's last backward,
    by the H-1F1B span, and the cards' tails run in parallel (exact when stage 0 has the largest; no overlap with
    the drain credited).  T_est counts no on-card S_s; it counts O_s so that the search does not see offloading as free."""
    return max((stage_offload(problem, st).tail_s for st in stages), default=0.0)


def _validate_group(problem: Problem, st: Stage, s: int) -> None:
    """A group: 2..group_max distinct cards of <= group_nodes nodes, `device` first, no recompute or offload."""
    m = st.members
    if m and (m[0] != st.device or len(set(m)) != len(m) or not 2 <= len(m) <= problem.group_max
              or not all(0 <= d < len(problem.devices) for d in m)
              or len({problem.devices[d].node for d in m}) > problem.group_nodes or not problem.tensor_parallel):
        raise ValueError(f"stage {s}: group {list(m)} must be 2..{problem.group_max} distinct cards of <= "
                         f"{problem.group_nodes} node(s), device {st.device} first, with tensor-parallel tables")
    if m and (st.recompute_units or st.offload):
        raise ValueError(f"stage {s}: a tensor-parallel group neither recomputes nor offloads (not priced)")


def stage_position(problem: Problem, stages: Sequence[Stage], s: int) -> StagePosition:
    """Stage s's position and cut terms as `stage_memory_bytes` prices them (for `tp_tables`)."""
    st, p = stages[s], len(stages)
    return StagePosition(
        stages_after=p - 1 - s, first=s == 0, microbatches=problem.microbatches,
        in_bytes=problem.boundary_bytes[st.first_unit - 1] if s > 0 else 0,
        out_bytes=problem.boundary_bytes[st.last_unit] if s < p - 1 else 0,
        in_grad_bytes=grad_cut_bytes(problem, st.first_unit - 1) if s > 0 else 0,
        out_grad_bytes=grad_cut_bytes(problem, st.last_unit) if s < p - 1 else 0,
        activation_bytes=stage_activation_bytes(problem, st), tied_bytes=tied_bytes(problem, st),
        transient_bwd_bytes=stage_transient_bytes(problem, st), step_bytes=stage_step_bytes(problem, st))


def group_stage_cost(problem: Problem, stages: Sequence[Stage], s: int) -> StageCost:
    """`StageCost` of group stage s (`tp_tables.group_stage`); a group whose split fits no shares
    is priced as not fitting (memory = every byte of the stage on its lead)."""
    st = stages[s]
    send = problem.comm_s(st.device, stages[s + 1].device, st.last_unit) if s + 1 < len(stages) else 0.0
    try:
        g: GroupStage = group_stage(problem, first=st.first_unit, last=st.last_unit, members=st.members,
                                    position=stage_position(problem, stages, s))
    except InfeasibleError:  # the members hold less than the whole split: priced as the lead alone, not fitting
        kind, units, usable = problem.devices[st.device].kind, range(st.first_unit, st.last_unit + 1), \
            problem.devices[st.device].usable_bytes
        lone = [*stages[:s], replace(st, members=()), *stages[s + 1:]]
        return StageCost(fwd_s=sum(problem.fwd_s[kind][u] for u in units), bwd_s=sum(problem.bwd_s[kind][u] for u in units),
                         send_s=send, memory_bytes=max(stage_memory_bytes(problem, lone, s), usable + 1),
                         usable_bytes=usable, step_s=stage_step_s(problem, st))
    worst = max(range(len(g.shares)), key=lambda i: g.memory_bytes[i] - g.usable_bytes[i])
    return StageCost(fwd_s=g.fwd_s, bwd_s=g.bwd_s, send_s=send, memory_bytes=g.memory_bytes[worst],
                     usable_bytes=g.usable_bytes[worst], step_s=g.step_s, shares=g.shares)
