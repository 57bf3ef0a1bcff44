"""What the homogeneous frameworks would do on the same cards, under the same cost model.

Each baseline keeps the devices in the order the cluster file lists them, uses all of
them (as many as there are units), and cuts the model their way:

* ``uniform``: equal units per stage (Megatron-LM, torchtitan; the remainder goes to
  the first stages, as ``numpy.array_split`` does);
* ``parameters``: contiguous stages with balanced parameter counts, minimising the
  largest (DeepSpeed ``PipelineModule(partition_method="parameters")``, its default);
* ``time-homogeneous``: time-balanced as if every device were the first one
  (torchgpipe ``balance_by_time``, which profiles on one device).

Their T and memory come from `problem.evaluate`, the planner's own objective, so the
comparison is like for like; ``fits`` says whether every stage fits its card.  They get the
planner's activation-recomputation lever too (`Problem.recompute`: ``all`` is Megatron-LM's
full recomputation; ``auto`` recomputes per stage only what it must to fit).

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0, 1.0)}, bwd_s={"a": (2.0, 2.0, 2.0)}, state_bytes=(1, 1, 8),
    ...                activation_bytes=(1, 1, 1), boundary_bytes=(0, 0, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
    ...                bandwidth_bytes_s=((inf, 1.0), (1.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=2)
    >>> [(s.first_unit, s.last_unit) for s in baseline(prob, "uniform").stages]
    [(0, 1), (2, 2)]
    >>> [(s.first_unit, s.last_unit) for s in baseline(prob, "parameters").stages]
    [(0, 1), (2, 2)]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from hetpipe.cost_models.quantities import human_bytes
from hetpipe.errors import ConfigError
from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.capture.units import split_bounds

#: Name -> the framework whose default it reproduces.
BASELINES: dict[str, str] = {
    "uniform": "equal units per stage (Megatron-LM, torchtitan)",
    "parameters": "balanced parameter counts (DeepSpeed default)",
    "time-homogeneous": "time-balanced as if all devices were identical (torchgpipe)",
}
#: Integer resolution for time weights: nanoseconds.
_NS_PER_S = 1e9


@dataclass(frozen=True)
class BaselineResult:
    """A baseline placement and its cost under the contract."""

    name: str
    stages: tuple[Stage, ...]
    iteration_s: float
    fits: bool
    note: str = ""


def _equal_bounds(num_units: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(num_units, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def rule_bounds(problem: Problem, name: str, stages: int, *, profile_kind: str | None = None) -> list[tuple[int, int]]:
    """[start, end) unit ranges of baseline `name`'s cut rule for `stages` stages.

    ``time-homogeneous`` balances the times of `profile_kind` (default: the first listed
    device's kind, where torchgpipe profiles); the other rules ignore it.
    """
    if name == "uniform":
        return _equal_bounds(problem.num_units, stages)
    if name == "parameters":
        return split_bounds(list(problem.state_bytes), stages)
    if name == "time-homogeneous":
        kind = profile_kind if profile_kind is not None else problem.devices[0].kind
        weights = [int(round((f + b) * _NS_PER_S)) for f, b in zip(problem.fwd_s[kind], problem.bwd_s[kind])]
        return split_bounds(weights, stages)
    raise ConfigError(f"unknown baseline {name!r}; use one of: {', '.join(BASELINES)}")


def baseline_stages(problem: Problem, name: str) -> tuple[Stage, ...]:
    """The baseline's placement: cluster order, all devices (at most one per unit), each stage
    recomputing what the problem's lever chooses (`recompute.with_recompute`; none for ``none``).
    Baselines never offload optimizer state (`without_offload`): their best-cards search prices no tail."""
    p = min(len(problem.devices), problem.num_units)
    bounds = rule_bounds(problem, name, p)
    return with_recompute(without_offload(problem), tuple(Stage(i, lo, hi - 1) for i, (lo, hi) in enumerate(bounds)))


def without_offload(problem: Problem) -> Problem:
    """`problem` with the offload lever off: what the baselines (Megatron, DeepSpeed, torchgpipe rules) use."""
    return problem if problem.offload == "never" else replace(problem, offload="never")


def _overflow_note(problem: Problem, stages: Sequence[Stage], memory: Sequence[tuple[int, int]]) -> str:
    worst = max(range(len(stages)), key=lambda s: memory[s][0] - memory[s][1])
    used, usable = memory[worst]
    dev = problem.devices[stages[worst].device]
    return (f"stage {worst} on {dev.id} ({dev.kind}) needs {human_bytes(used)} of "
            f"{human_bytes(usable)} usable: out of memory")


def baseline(problem: Problem, name: str) -> BaselineResult:
    """Place `problem` the way baseline `name` would and evaluate it."""
    stages = baseline_stages(problem, name)
    ev = evaluate(problem, stages)
    note = "" if ev.fits else _overflow_note(problem, stages, [(c.memory_bytes, c.usable_bytes) for c in ev.stages])
    return BaselineResult(name, stages, ev.iteration_s, ev.fits, note)
