"""``hetpipe run``'s checkpoint options, checked before anything is launched.

`checkpoint_args` refuses a bad ``--checkpoint-every``, an unwritable ``--checkpoint-dir``, one that
already holds checkpoints of an earlier run when the run does not resume, ``--weights`` with
``--resume``, DiLoCo replica plans (`hetpipe.runtime.checkpoint.replicas`), and a ``--resume``
checkpoint that is incomplete, of another model, lacks a name of the new plan's stages, holds another
optimizer's state, was saved with another ``--seed`` or global batch, or is already past ``--steps``; it resolves ``--resume DIR`` to the newest complete
checkpoint and says which.

Example:
    >>> from types import SimpleNamespace
    >>> checkpoint_args(SimpleNamespace(replicas=()), None, 5, None, model="m", seq=None, steps=3)
    Traceback (most recent call last):
    ...
    hetpipe.errors.ConfigError: --checkpoint-every 5 needs --checkpoint-dir DIR (where to write the checkpoints)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from hetpipe.cost_models.outputs import writable_folder
from hetpipe.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointArgs:
    """The checked options: absolute paths for the workers, and where a resumed run starts."""

    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: str | None = None  # a complete step-NNNNNN folder
    resume_step: int = 0

    def launch_fields(self) -> dict[str, Any]:
        """The `LaunchSpec` fields."""
        return {"checkpoint_dir": self.checkpoint_dir, "checkpoint_every": self.checkpoint_every,
                "resume": self.resume}

    def annotate(self, report: Any) -> Any:
        """The run report with a note saying where a resumed run started (its step records count from 0).

        Example:
            >>> @dataclass(frozen=True)
            ... class Report:  # a RunReport's notes
            ...     notes: tuple = ()
            >>> CheckpointArgs(resume="ck/step-000004", resume_step=4).annotate(Report()).notes
            ... # doctest: +NORMALIZE_WHITESPACE
            ("resumed from ck/step-000004: step records 0.. are the run's steps 4.. (counted from 0; the checkpoint
            holds the first 4)",)
        """
        if self.resume is None:
            return report
        # counted from 0 as the run's steps and `--inject`'s are (a 1-based figure here contradicted them)
        note = (f"resumed from {self.resume}: step records 0.. are the run's steps {self.resume_step}.. "
                f"(counted from 0; the checkpoint holds the first {self.resume_step})")
        return dataclasses.replace(report, notes=(*report.notes, note))


def check_options(plan: Any, checkpoint_dir: str | os.PathLike[str] | None, every: int | None,
                  resume: str | os.PathLike[str] | None, *, steps: int, seed: int = 0,
                  weights: str | os.PathLike[str] | None = None) -> Any:
    """The checks that need neither a capture nor a tensor read, so the CLI makes them before it prints
    anything: the options themselves, a reused ``--checkpoint-dir`` without ``--resume``, ``--weights``
    with ``--resume``, and the ``--resume`` marker (steps, seed, global batch, optimizer).  Returns the
    resumed (folder, marker), or None.

    Example:
        >>> from types import SimpleNamespace
        >>> check_options(SimpleNamespace(replicas=()), None, None, "ck", steps=3, weights="w.pt")
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: --weights w.pt with --resume ck: the checkpoint holds the weights (and the optimizer state) to continue from; drop --weights, or drop --resume to start from w.pt
    """
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigError(f"--checkpoint-every must be a positive number of steps, got {every!r}")
    if every is not None and checkpoint_dir is None:
        raise ConfigError(f"--checkpoint-every {every} needs --checkpoint-dir DIR (where to write the checkpoints)")
    refuse_weights_with_resume(weights, resume)
    if checkpoint_dir is not None or resume is not None:
        from hetpipe.runtime.checkpoint.replicas import refuse_diloco

        refuse_diloco(plan, "--checkpoint-dir" if resume is None else "--resume")
    if resume is None:
        if checkpoint_dir is not None:
            from hetpipe.runtime.checkpoint.files import refuse_reused_dir

            refuse_reused_dir(checkpoint_dir)
        return None
    from hetpipe.runtime.checkpoint.state import resume_marker

    return resume_marker(plan, resume, steps=steps, seed=seed)


def refuse_weights_with_resume(weights: Any, resume: Any) -> None:
    """Initial weights and a checkpoint to continue from exclude each other (the checkpoint's weights win
    silently otherwise)."""
    if weights is not None and resume is not None:
        raise ConfigError(f"--weights {weights} with --resume {resume}: the checkpoint holds the weights (and the "
                          f"optimizer state) to continue from; drop --weights, or drop --resume to start from {weights}")


def checkpoint_args(plan: Any, checkpoint_dir: str | os.PathLike[str] | None, every: int | None,
                    resume: str | os.PathLike[str] | None, *, model: str, seq: int | None,
                    steps: int, seed: int = 0) -> CheckpointArgs:
    """Check the checkpoint options of a run of ``plan`` (see the module docstring)."""
    check_options(plan, checkpoint_dir, every, resume, steps=steps, seed=seed)
    out_dir = writable_folder(checkpoint_dir, "--checkpoint-dir") if checkpoint_dir is not None else None
    if resume is None:
        return CheckpointArgs(out_dir, every)
    from hetpipe.runtime.checkpoint.state import preflight_resume
    from hetpipe.runtime.rank import capture_for_plan

    graph, example = capture_for_plan(plan, model=model, seq=seq)
    folder, info = preflight_resume(plan, graph, example, resume, model=model, steps=steps, seed=seed)
    log.info("resuming from %s (step %d of %d, saved by a %d-stage plan)", folder, info.step, steps,
             info.num_stages)
    return CheckpointArgs(out_dir, every, str(folder.absolute()), info.step)
