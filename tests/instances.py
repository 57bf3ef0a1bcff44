"""Random small partitioning instances and a brute-force reference for solver tests.

`brute_force` enumerates every ordered device subset, every set of cuts and, under
`Problem.recompute`, every recompute choice of every stage (``auto``: each prefix of each
stage's order; ``all``: the whole order; ``none``: nothing), under `Problem.offload` every
offload choice of every stage (``auto``: off or on where it can; ``all``: on where it can),
and calls `problem.evaluate`
on each: independent of every solver's internals, so exact by construction (and only
usable on tiny instances).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

from dataclasses import replace

from hetpipe.cost_models.recompute import recompute_order
from hetpipe.cost_models.offload import OffloadRates
from hetpipe.cost_models.selective import SelectiveTables, selective_variant
from hetpipe.cost_models.step_transient import NO_STEP_TRANSIENT, StepTransient
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, TiedCopy, can_offload, evaluate

KINDS = ("fast", "mid", "slow")
SPEED = {"fast": 1.0, "mid": 1.6, "slow": 3.0}  # time multiplier per kind


def random_problem(rng: random.Random, *, units: int, devices: int, microbatches: int | None = None,
                   tight_memory: bool = False, recompute: str = "none", activation_max: int = 6,
                   objective: str = "estimate") -> Problem:
    """Units with random work and bytes; devices of 1-3 kinds on 1-2 nodes with slower links between nodes.

    ``objective="estimate"`` (default) prices placements with the H-1F1B estimate, the surrogate the
    DP / CP-SAT / relaxation solve exactly; ``"schedule"`` (the planner's objective) also draws an
    optimizer step per unit and kind (`with_random_steps`).
    """
    base = [rng.uniform(0.5, 2.0) for _ in range(units)]
    kinds = rng.sample(KINDS, rng.randint(1, 3))
    devs = []
    for i in range(devices):
        kind = rng.choice(kinds)
        node = rng.choice(("n0", "n1"))
        usable = rng.randint(40, 120) if tight_memory else 10**6
        devs.append(DeviceSlot(f"d{i}", kind, node, usable))
    fwd = {k: tuple(b * SPEED[k] for b in base) for k in kinds}
    bwd = {k: tuple(2 * b * SPEED[k] for b in base) for k in kinds}
    bw = tuple(tuple(math.inf if a is b else (10.0 if a.node == b.node else rng.choice((1.0, 2.0)))
                     for b in devs) for a in devs)
    lat = tuple(tuple(0.0 if a is b else (0.01 if a.node == b.node else 0.1) for b in devs) for a in devs)
    # half the instances tie the first and last unit (GPT-2's wte = lm_head)
    tied = (TiedCopy(0, (0, units - 1), rng.randint(1, 8)),) if units >= 2 and rng.random() < 0.5 else ()
    prob = Problem(
        tied=tied,
        fwd_s=fwd,
        bwd_s=bwd,
        state_bytes=tuple(rng.randint(1, 10) for _ in range(units)),
        activation_bytes=tuple(rng.randint(1, activation_max) for _ in range(units)),
        boundary_bytes=tuple(rng.randint(1, 8) for _ in range(units - 1)) + (0,),
        devices=tuple(devs),
        bandwidth_bytes_s=bw,
        latency_s=lat,
        microbatches=microbatches or rng.randint(1, 8),
        recompute=recompute,
    )
    # memory model 2's tables, drawn last (the draws above keep their seeds' instances): gradients
    # within the state, the held share and the gradient message of each cut
    prob = dataclasses.replace(prob, grad_bytes=tuple(rng.randint(0, s) for s in prob.state_bytes),
                               boundary_held_bytes=tuple(rng.randint(0, b) for b in prob.boundary_bytes),
                               boundary_grad_bytes=tuple(rng.randint(0, b) for b in prob.boundary_bytes),
                               objective=objective)
    prob = with_random_steps(rng, prob) if objective == "schedule" else prob
    return with_random_step_transients(rng, with_random_transients(rng, prob))


def with_random_step_transients(rng: random.Random, prob: Problem) -> Problem:
    """`prob` with memory model 5's optimizer step transient, from a generator seeded by `rng`'s state without
    drawing from it (as `with_random_transients`, salted apart): often none, else stepped bytes within each
    unit's gradients (the largest tensor within them), a tied replica's, and per kind foreach (1 x all),
    per-tensor (3 x the largest) or SGD's (none)."""
    own = random.Random("step" + repr(rng.getstate()))
    if own.random() < 0.4:
        return prob
    stepped = tuple(own.randint(0, g) for g in (prob.grad_bytes or prob.state_bytes))
    rules = {k: own.choice((StepTransient(1, 0), StepTransient(0, 3), NO_STEP_TRANSIENT)) for k in prob.fwd_s}
    return dataclasses.replace(prob, step_param_bytes=stepped, step_tensor_bytes=tuple(own.randint(0, b) for b in stepped),
                               step_transient=rules,
                               tied=tuple(replace(t, step_bytes=own.randint(0, 4)) for t in prob.tied))


def with_random_transients(rng: random.Random, prob: Problem) -> Problem:
    """`prob` with memory model 4's backward transients, from a generator seeded by `rng`'s state without
    drawing from it (the seeds' instances and whatever their callers draw next stay as they were): often
    none, else up to a loss's share on the last unit and small ones elsewhere."""
    own = random.Random(repr(rng.getstate()))  # a str seed: the same in every process
    if own.random() < 0.4:
        return prob
    last = prob.num_units - 1
    return dataclasses.replace(prob, transient_bwd_bytes=tuple(own.randint(0, 40) if u == last else own.choice((0, 0, 2))
                                                               for u in range(prob.num_units)))


def with_random_steps(rng: random.Random, prob: Problem) -> Problem:
    """`prob` with an optimizer step per unit (proportional to its state, up to 2 s on the slowest kind)
    and a launch share per kind."""
    scale = rng.choice((0.0, 0.05, 0.2))
    steps = {k: tuple(scale * s * SPEED[k] for s in prob.state_bytes) for k in prob.fwd_s}
    return dataclasses.replace(prob, step_s=steps, step_launch_s={k: rng.choice((0.0, 0.01)) for k in prob.fwd_s})


def two_node_schedule_problem(rng: random.Random, devs: tuple[DeviceSlot, ...], fwd: dict[str, tuple[float, ...]],
                              *, max_microbatches: int) -> Problem:
    """A schedule-objective problem on `devs` (nodes n0/n1: bandwidth 8 inside a node, 1 or 2 between, latency
    0.01 / 0.1), B = 2F per kind and unit, 0-4 bytes per cut, 2..`max_microbatches` micro-batches and an optimizer
    step of 0 or 0.3 per kind and unit: the pace-bound tests' instances (test_pace_relaxation, test_pace_prices)."""
    units = len(next(iter(fwd.values())))
    bw = tuple(tuple(math.inf if a is b else (8.0 if a.node == b.node else rng.choice((1.0, 2.0))) for b in devs)
               for a in devs)
    lat = tuple(tuple(0.0 if a is b else (0.01 if a.node == b.node else 0.1) for b in devs) for a in devs)
    return Problem(fwd_s=fwd, bwd_s={k: tuple(2.0 * f for f in v) for k, v in fwd.items()},
                   state_bytes=(1,) * units, activation_bytes=(1,) * units,
                   boundary_bytes=tuple(rng.randint(0, 4) for _ in range(units - 1)) + (0,),
                   devices=devs, bandwidth_bytes_s=bw, latency_s=lat, microbatches=rng.randint(2, max_microbatches),
                   objective="schedule", step_s={k: tuple(rng.choice((0.0, 0.3)) for _ in range(units)) for k in fwd})


def recompute_choices(problem: Problem, placement: tuple[Stage, ...]):
    """Every recompute choice of `placement` the lever allows, as stage tuples."""
    per_stage = []
    for st in placement:
        able = problem.offload != "never" and can_offload(problem, st)
        offs = {"never": [False], "all": [able], "auto": [False, True] if able else [False]}[problem.offload]
        # the selective level (`Problem.selective`, under auto): on or off, with the variant's order when on
        # (``selective``: forced on every stage, no whole unit, `partitioner.selective_mode`)
        sels = [False, True] if problem.selective is not None and problem.recompute == "auto" else [False]
        sels = [True] if problem.recompute == "selective" else sels
        choices = []
        for sel in sels:
            prob = selective_variant(problem) if sel else problem
            order = recompute_order(activation_bytes=prob.unit_recompute_bytes, boundary_bytes=prob.boundary_bytes,
                                    fwd_s=prob.fwd_s[prob.devices[st.device].kind],
                                    first_unit=st.first_unit, last_unit=st.last_unit)
            rs = {"none": [0], "all": [len(order)], "auto": range(len(order) + 1), "selective": [0]}[problem.recompute]
            choices += [replace(st, recompute_units=tuple(sorted(order[:r])), offload=off, selective=sel)
                        for r in rs for off in offs]
        per_stage.append(choices)
    yield from itertools.product(*per_stage)


def with_selective(rng: random.Random, problem: Problem) -> Problem:
    """`problem` offering the selective level: per unit up to half its activation bytes freed, a peak at least
    the largest freed, and per kind up to a fifth of the unit's forward seconds re-run."""
    freed = tuple(rng.randint(0, a // 2) if rng.random() < 0.8 else 0 for a in problem.activation_bytes)
    extra = {k: tuple(rng.uniform(0.0, 0.2) * f for f in problem.fwd_s[k]) for k in problem.fwd_s}
    tab = SelectiveTables(freed_bytes=freed, peak_bytes=max(freed) + rng.randint(0, 2), extra_s=extra)
    return replace(problem, selective=tab)


def selective_instance(rng: random.Random, i: int, *, recompute: str = "auto") -> Problem:
    """The i-th random instance of a selective-level sweep: 2-5 units on 1-3 tight cards offering the level
    (`with_selective`) under `recompute`, every third (i % 3 == 0) with the offload lever ``auto`` too."""
    prob = random_problem(rng, units=rng.randint(2, 5), devices=rng.randint(1, 3), tight_memory=True,
                          recompute=recompute, activation_max=20)
    prob = with_selective(rng, prob)
    return with_offload(rng, prob, "auto") if i % 3 == 0 else prob


#: Small per-parameter figures for offload instances (1 gradient byte per parameter; 2 of 4 state
#: bytes leave the card; 2 link bytes and 7 host-step bytes per step).
TEST_RATES = OffloadRates(state_bytes_per_param=4, grad_bytes_per_param=1, host_bytes_per_param=2,
                          link_bytes_per_param=2, step_bytes_per_param=7)


def with_offload(rng: random.Random, problem: Problem, mode: str) -> Problem:
    """`problem` with the offload lever `mode`: consistent gradient bytes (a third of the state at
    most; the state 6x the drawn one), host figures per node (one node's cards may have none: they cannot offload)."""
    host = {n: (rng.choice((1.0, 4.0, 20.0)), rng.choice((2.0, 8.0, 50.0))) for n in ("n0", "n1")}
    if rng.random() < 0.3:
        host["n1"] = (0.0, 0.0)
    devs = tuple(replace(d, host_link_bytes_s=host[d.node][0], host_memory_bytes_s=host[d.node][1])
                 for d in problem.devices)
    tied = tuple(replace(t, state_bytes=4 * t.state_bytes) for t in problem.tied)
    state = tuple(6 * s for s in problem.state_bytes)  # state large enough that offloading it matters
    return replace(problem, devices=devs, tied=tied, offload=mode, offload_rates=TEST_RATES, state_bytes=state,
                   grad_bytes=tuple(rng.randint(0, s // 3) for s in state))


def all_placements(problem: Problem, *, stages: int | None = None):
    """Every (ordered device subset, cuts) placement, as stage tuples."""
    L, n = problem.num_units, len(problem.devices)
    sizes = [stages] if stages else range(1, min(n, L) + 1)
    for p in sizes:
        for cuts in itertools.combinations(range(1, L), p - 1):
            bounds = (0, *cuts, L)
            for devs in itertools.permutations(range(n), p):
                yield tuple(Stage(devs[s], bounds[s], bounds[s + 1] - 1) for s in range(p))


def brute_force(problem: Problem, *, stages: int | None = None) -> float:
    """Least T over every placement that fits (inf if none fits)."""
    best = math.inf
    for placement in all_placements(problem, stages=stages):
        for choice in recompute_choices(problem, placement):
            ev = evaluate(problem, choice)
            if ev.fits:
                best = min(best, ev.iteration_s)
    return best


def close(a: float, b: float, rel: float) -> bool:
    """a and b equal within `rel` of the larger (or both infinite)."""
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


def assert_solvers_match_brute_force(prob: Problem, exact, i: int) -> bool:
    """`exact` (a DP answer or None) and CP-SAT both equal brute-force enumeration of the contract, and
    each reports what its stages cost under `evaluate`.  False when no placement fits (both said so)."""
    from hetpipe.partitioner.solvers.cpsat import solve_cpsat

    ref = brute_force(prob)
    assert close(exact.iteration_s if exact else math.inf, ref, 1e-9), (i, ref, exact)
    got = solve_cpsat(prob, time_limit_s=20.0, seed=0)
    if exact is None:
        assert got.status == "INFEASIBLE", (i, got)
        return False
    assert got.status == "OPTIMAL" and close(got.iteration_s, ref, 1e-5), (i, got, ref)
    for res in (exact, got):  # what a solver reports is what its stages cost
        assert close(evaluate(prob, res.stages).iteration_s, res.iteration_s, 1e-9)
    return True


def best_shard_subset_s(rp, pipes, candidates) -> float:
    """The least T over every subset of ``candidates`` sharded on ``pipes`` that fits (inf if none):
    brute force over the sharding lever, the reference the replica tests compare solvers with."""
    from hetpipe.partitioner.replica_shard import evaluate_sharding

    best = math.inf
    for n in range(len(candidates) + 1):
        for subset in itertools.combinations(candidates, n):
            ev = evaluate_sharding(rp, pipes, subset)
            if ev.fits:
                best = min(best, ev.iteration_s)
    return best
