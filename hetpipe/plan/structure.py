"""A plan's structure: which units each stage runs, under which schedule and optimizer (checked at load).

`validate_structure` runs inside `plan.validate.validate_plan`, so every command that loads a
plan (``check``, ``show``, ``simulate``, ``compare``, ``run``) and `check_plan` on a `Plan` object
refuse a hand-edited plan the same way: one `PlanError` naming the field, its value and the fix,
before a table is printed or a rank launched.  Without it an overlapping or gapped split surfaced
as a traceback from the simulator, a ``KeyError`` inside a rank, or a run that trained another
split than the one its report describes.

* ``training.schedule`` is one hetpipe runs (`schedule.builders.SCHEDULES`, extra warm-ups
  ``base@k,...`` with one count per stage, or ``interleaved:V``);
* ``training.optimizer`` and ``training.precision`` are ones the cost model and the runtime know;
* each pipeline's stages (every replica's, `Plan.replicas`; under ``interleaved:V`` the chunks in
  virtual-stage order) run units ``0..L-1`` once each, in order: the first starts at unit 0, each next
  one right after the previous one ends, and the last ends at unit L-1.

Whether the recorded times and bytes are the tables' is `check_plan`'s job (exit 1 in ``hetpipe check``).

Example (a two-stage split of four units; stage 1 edited to start one unit early):
    >>> from types import SimpleNamespace as NS
    >>> stage = lambda i, a, b: NS(index=i, first_unit=a, last_unit=b, chunks=())
    >>> plan = NS(training=NS(schedule="1f1b", optimizer="adam", precision="fp32"), units=[0, 1, 2, 3],
    ...           stages=[stage(0, 0, 1), stage(1, 2, 3)], replicas=())
    >>> validate_structure(plan)
    >>> plan.stages[1] = stage(1, 1, 3)
    >>> try:
    ...     validate_structure(plan)
    ... except PlanError as err:
    ...     print(str(err)[:88])
    plan.stages[0].last_unit is 1 but plan.stages[1].first_unit is 1: unit 1 would run on tw
"""

from __future__ import annotations

from typing import Any, Sequence

from hetpipe.cost_models.memory import OPTIMIZER_STATE_VALUES, PRECISIONS
from hetpipe.errors import PlanError, ScheduleError
from hetpipe.schedule.builders import SCHEDULES, split_name
from hetpipe.schedule.interleaved import parse_interleaved

_FIX = "re-create it with `hetpipe plan` (`hetpipe check` re-checks a plan you edit)"
#: One piece of a pipeline as its units are tiled: (field path, first unit, last unit).
Piece = tuple[str, int, int]


def validate_structure(plan: Any) -> None:
    """Raise `PlanError` unless `plan`'s schedule, optimizer and stage split are well formed (module docstring)."""
    _names(plan)
    for first, stages in _pipelines(plan):
        _tiling(_pieces(plan, first, stages), len(plan.units))


def _names(plan: Any) -> None:
    t = plan.training
    if t.optimizer not in OPTIMIZER_STATE_VALUES:
        raise PlanError(f"plan.training.optimizer is {t.optimizer!r}, not an optimizer hetpipe knows; use one of "
                        f"{', '.join(sorted(OPTIMIZER_STATE_VALUES))} (`hetpipe plan --optimizer`), or {_FIX}")
    if t.precision not in PRECISIONS:
        raise PlanError(f"plan.training.precision is {t.precision!r}, not a precision hetpipe knows; use one of "
                        f"{', '.join(sorted(PRECISIONS))} (`hetpipe plan --precision`), or {_FIX}")
    _schedule(plan)


def _schedule(plan: Any) -> None:
    """The schedule name is one the simulator and the ranks run, as the plan spells it (exact case)."""
    name = plan.training.schedule
    base, at, _ = name.partition("@")
    try:
        if parse_interleaved(name) is not None:
            return
        if base in SCHEDULES:
            for _, stages in _pipelines(plan) if at else ():
                split_name(name, len(stages))  # one extra warm-up count per stage of each pipeline
            return
    except ScheduleError as err:
        raise PlanError(f"plan.training.schedule: {err}; or {_FIX}") from None
    raise PlanError(f"plan.training.schedule is {name!r}, not a schedule hetpipe runs; use one of "
                    f"{', '.join(SCHEDULES)} or interleaved:V (`hetpipe plan --schedule`), or {_FIX}")


def _pipelines(plan: Any) -> list[tuple[int, Sequence[Any]]]:
    """(index of its first stage in `plan.stages`, its stages) of each pipeline: one, or one per replica."""
    if not plan.replicas:
        return [(0, plan.stages)]
    out, pos = [], 0
    for k, rep in enumerate(plan.replicas):
        if rep.first_stage != pos or rep.num_stages < 1 or pos + rep.num_stages > len(plan.stages):
            raise PlanError(f"plan.replicas[{k}]: first_stage {rep.first_stage}, num_stages {rep.num_stages} do not "
                            f"continue the replicas before it (expected first_stage {pos}, num_stages >= 1, within "
                            f"the {len(plan.stages)} stages); {_FIX}")
        out.append((pos, plan.stages[pos:pos + rep.num_stages]))
        pos += rep.num_stages
    if pos != len(plan.stages):
        raise PlanError(f"plan.replicas cover {pos} stages but plan.stages lists {len(plan.stages)}; every stage "
                        f"belongs to one replica; {_FIX}")
    return out


def _pieces(plan: Any, first: int, stages: Sequence[Any]) -> list[Piece]:
    """The pipeline's pieces in model order: its stages, or under ``interleaved:V`` chunk c of every stage, c = 0..V-1."""
    name = plan.training.schedule
    chunks = parse_interleaved(name) or 1
    for i, st in enumerate(stages, start=first):
        at = f"plan.stages[{i}]"
        if chunks == 1 and st.chunks:
            raise PlanError(f"{at}.chunks: the stage lists {len(st.chunks)} chunks but training.schedule {name!r} "
                            f"runs one piece per card; {_FIX}")
        if chunks > 1 and len(st.chunks) != chunks:
            raise PlanError(f"{at}.chunks: the stage lists {len(st.chunks)} chunks but training.schedule {name!r} "
                            f"runs {chunks} per card; {_FIX}")
        if st.chunks and (st.chunks[0].first_unit, st.chunks[0].last_unit) != (st.first_unit, st.last_unit):
            raise PlanError(f"{at}: units {st.first_unit}-{st.last_unit} are not its chunk 0's "
                            f"({st.chunks[0].first_unit}-{st.chunks[0].last_unit}); {_FIX}")
    if chunks == 1:
        return [(f"plan.stages[{i}]", st.first_unit, st.last_unit) for i, st in enumerate(stages, start=first)]
    return [(f"plan.stages[{i}].chunks[{c}]", st.chunks[c].first_unit, st.chunks[c].last_unit)
            for c in range(chunks) for i, st in enumerate(stages, start=first)]


def _tiling(pieces: list[Piece], num_units: int) -> None:
    """The pieces run units 0..num_units-1 once each, in order (`partitioner.problem.validate_stages`' rule)."""
    if not pieces:
        raise PlanError(f"plan.stages is empty: a pipeline needs at least one stage; {_FIX}")
    expected, before = 0, ""
    for at, first, last in pieces:
        if last < first:
            raise PlanError(f"{at}.last_unit is {last}, before its first_unit {first}; {_FIX}")
        if first != expected and not before:
            raise PlanError(f"{at}.first_unit is {first}, but the first stage starts at unit 0; set it to 0, or {_FIX}")
        if first != expected:
            lo, hi = min(first, expected), max(first, expected) - 1
            units = f"unit {lo}" if lo == hi else f"units {lo}-{hi}"
            what = "would run on two stages" if first < expected else "would run on no stage"
            raise PlanError(f"{before}.last_unit is {expected - 1} but {at}.first_unit is {first}: {units} {what}; "
                            f"a stage starts right after the one before it ends: set {at}.first_unit to {expected} "
                            f"(or {before}.last_unit to {first - 1}), or {_FIX}")
        expected, before = last + 1, at
    if expected != num_units:
        raise PlanError(f"{before}.last_unit is {expected - 1} but the model has {num_units} units (plan.units): the "
                        f"last stage ends at unit {num_units - 1}; set it to {num_units - 1}, or {_FIX}")
