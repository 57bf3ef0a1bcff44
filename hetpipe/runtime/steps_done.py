"""Per-rank step counters in the run directory: ``steps-rank<r>.json``, rewritten after every step.

The launcher's ``progress-rank<r>`` only says *that* a rank is alive (its mtime); a supervisor
(`hetpipe.runtime.supervise`) also needs *how far* each rank got -- the step a dead rank died
at, how many steps a restart redoes -- and how long recent steps took, in real and (under
``--emulate``) emulated seconds.  Each rank writes its own file atomically (temporary file and
rename), so a reader sees the previous or the new record, never half of one.

Example:
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> write_steps(d, StepsDone(rank=1, stage=1, steps_done=3, pid=42, step_s=(0.5, 0.4, 0.6),
    ...                          time_scale=2.0, time_s=0.0))
    >>> read_steps(d)[1].steps_done, read_steps(d)[1].recent_emulated_s()
    (3, 0.25)
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RECENT_STEPS = 3  # steps in a "recent" median: few enough to see a slowdown, more than one to skip jitter
_KEPT_STEPS = 8  # step times kept in the file


@dataclass(frozen=True)
class StepsDone:
    """How far one rank got: global steps done (a resumed run counts from its checkpoint's step),
    its pid, its last step times (real s) and its emulation time scale (real s per emulated s; 1.0
    without ``--emulate``), written at wall time ``time_s``."""

    rank: int
    stage: int
    steps_done: int
    pid: int
    step_s: tuple[float, ...]
    time_scale: float
    time_s: float
    build_s: float = 0.0  # seconds the rank took at start-up to split the graph and build its stage

    def recent_real_s(self) -> float:
        """Median real seconds of the last `RECENT_STEPS` steps (0 before the first)."""
        return statistics.median(self.step_s[-RECENT_STEPS:]) if self.step_s else 0.0

    def since_real_s(self, step: int) -> float:
        """Median real seconds of this rank's recorded steps from global step ``step`` (0-based) on -- a
        slowdown's steps, however few -- or `recent_real_s` when none of them is recorded.

        Example:
            >>> StepsDone(0, 0, 6, 1, (1.0, 1.0, 1.0, 1.0, 3.0, 3.2), 1.0, 0.0).since_real_s(4)
            3.1
        """
        n = self.steps_done - step
        return statistics.median(self.step_s[-n:]) if 0 < n <= len(self.step_s) else self.recent_real_s()

    def recent_emulated_s(self) -> float:
        """`recent_real_s` in emulated (device) seconds."""
        return self.recent_real_s() / self.time_scale


def steps_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"steps-rank{rank}.json"


def write_steps(run_dir: Path, record: StepsDone) -> None:
    """Atomically replace the rank's record."""
    path = steps_path(run_dir, record.rank)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)


def record_step(run_dir: Path, *, rank: int, stage: int, steps_done: int, step_s: list[float], hooks: Any,
                build_s: float = 0.0) -> None:
    """The worker's call after each step (``hooks``: its emulation hooks, for the time scale)."""
    origin = getattr(hooks, "origin", None)
    scale = float(origin.real_s_per_emulated_s) if origin is not None else 1.0
    write_steps(run_dir, StepsDone(rank, stage, steps_done, os.getpid(), tuple(step_s[-_KEPT_STEPS:]), scale,
                                   time.time(), build_s))


def read_steps(run_dir: Path) -> dict[int, StepsDone]:
    """Every rank's latest record in ``run_dir`` (rank -> record); unreadable files are skipped."""
    out = {}
    for path in Path(run_dir).glob("steps-rank*.json"):
        try:
            doc = json.loads(path.read_text())
            out[int(doc["rank"])] = StepsDone(**{**doc, "step_s": tuple(doc["step_s"])})
        except (OSError, ValueError, KeyError, TypeError):
            continue  # vanished between glob and read, or not ours
    return out
