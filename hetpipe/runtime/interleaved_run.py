"""What `hetpipe run` does with an interleaved plan (plan version 6 chunks; issue 17 item 2).

Each rank builds one stage module per chunk (`hetpipe.runtime.stage.build.build_chunks`: chunk c of
plan stage r is virtual stage ``c p + r``) and its executor runs the rank's interleaved 1F1B list
over them (`hetpipe.runtime.execute.chunks`).  Not run yet, each refused before launch with its
fix: emulation (`--emulate` stretches compute per stage, not per chunk), weights files and
checkpoints (they name one stage per rank), fault injection and supervision, replicas and
tensor-parallel groups.

Example:
    >>> refuse_unrunnable_interleaved(1, {"emulate": True})      # a plain plan: nothing refused
    >>> refuse_unrunnable_interleaved(2, {"emulate": False, "weights": None})
    >>> refuse_unrunnable_interleaved(2, {"emulate": True})
    Traceback (most recent call last):
    ...
    hetpipe.errors.ConfigError: --emulate: an interleaved plan (2 chunks per card) runs without it so far; drop --emulate, or re-plan with --schedule 1f1b
"""

from __future__ import annotations

from typing import Any, Mapping

from hetpipe.errors import ConfigError
from hetpipe.plan.schema import Plan
from hetpipe.schedule.interleaved import chunks_of

#: run() options an interleaved plan does not take yet -> the flag users know them by
UNSUPPORTED = {"emulate": "--emulate", "weights": "--weights", "save_weights": "--save-weights",
               "checkpoint_dir": "--checkpoint-dir", "resume": "--resume", "inject": "--inject",
               "max_restarts": "--max-restarts", "adapt": "--adapt", "wait_for_return": "--wait-for-return"}


def plan_chunks(plan: Plan) -> int:
    """Chunks per card of ``plan``: its stages' recorded chunks, 1 for a plain plan."""
    return max(1, len(plan.stages[0].chunks)) if plan.stages else 1


def refuse_unrunnable_interleaved(chunks: int, options: Mapping[str, Any]) -> None:
    """Raise `ConfigError` for the first of ``options`` (run()'s keyword arguments) an interleaved run
    does not take yet (module docstring); nothing for a plain plan (``chunks`` 1)."""
    if chunks < 2:
        return
    for name, flag in UNSUPPORTED.items():
        if options.get(name):
            raise ConfigError(f"{flag}: an interleaved plan ({chunks} chunks per card) runs without it so far; "
                              f"drop {flag}, or re-plan with --schedule 1f1b")


def check_schedule(plan: Plan, schedule: str) -> None:
    """Refuse running ``plan`` under a schedule of another chunk count (its chunks are its cut)."""
    have, want = plan_chunks(plan), chunks_of(schedule)
    if have != want:
        raise ConfigError(f"--schedule {schedule} runs {want} chunk{'s' if want > 1 else ''} per card, the plan was "
                          f"cut into {have}; drop --schedule (the plan's is {plan.training.schedule}) or re-plan with "
                          f"--schedule {schedule}")
    if have > 1 and (plan.replicas or any(st.group_devices for st in plan.stages)):
        raise ConfigError("an interleaved plan with replicas or tensor-parallel groups does not run yet; re-plan "
                          "with --schedule 1f1b")
