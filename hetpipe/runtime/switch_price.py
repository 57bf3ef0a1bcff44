"""What an in-place plan switch (`hetpipe.runtime.switch`) costs a supervised run, and its record.

A supervisor weighing a re-plan (``--adapt``) compares the predicted gain over the remaining steps
with the cost of acting.  When the world is unchanged the job switches in place, so the cost is
the switch's, not a relaunch's:

* after a switch of this job: that switch's measured seconds (``switches.json``);
* before one: its parts as measured in this job -- the newest checkpoint's slowest stage save
  (the hand-over writes the same tensors to the same disk, then reads them back), and the slowest
  rank's stage build at start-up (split and build, ``steps-rank<r>.json``: the switch rebuilds
  the same way).  The read-back is not priced as a second save: before a first switch the newest
  checkpoint is usually the job's first, whose save carries DCP's first-call costs in every
  process, and those (not the bytes: a few MB per stage, in the page cache) are what the
  hand-over's first read pays.  Measured on the 2-core box at load 10 (gpt-demo, homelab-mini,
  3 ranks): the first checkpoint's save 1.48-1.85 s per stage, later ones 0.45-0.78 s; the switch
  itself 2.33 s = save 0.45 + rebuild 0.86 + read and new executor 1.15; this price 1.85 + 0.55 =
  2.40 s (the old one, twice the save, 4.25 s);
* None when neither is measured yet (no checkpoint so far): the supervisor then prices a relaunch.

Example:
    >>> import tempfile
    >>> switch_cost_s(Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())) is None
    True
"""

from __future__ import annotations

from pathlib import Path

from hetpipe.errors import ConfigError
from hetpipe.runtime.checkpoint.files import find_checkpoint
from hetpipe.runtime.restarts import Restart
from hetpipe.runtime.steps_done import read_steps
from hetpipe.runtime.switch import SwitchRecord, read_switches


def newest_save_s(checkpoint_dir: Path) -> float | None:
    """The slowest stage's save seconds of the newest complete checkpoint in ``checkpoint_dir`` (None: none)."""
    try:
        _, info = find_checkpoint(checkpoint_dir)
    except ConfigError:
        return None
    return max(info.stage_save_s) if info.stage_save_s else None


def switch_cost_s(run_dir: Path, checkpoint_dir: Path) -> float | None:
    """Predicted wall seconds of an in-place switch of the job in ``run_dir`` (module docstring)."""
    done = read_switches(run_dir)
    if done:
        return done[-1].seconds
    save_s = newest_save_s(checkpoint_dir)
    builds = [r.build_s for r in read_steps(run_dir).values()]
    if save_s is None or not builds:
        return None
    return save_s + max(builds)


def in_place_restart(record: SwitchRecord, *, cause: str, rank: int, device: str, factor: float, replan_s: float,
                     old_predicted_s: float, old_measured_s: float, new_measured_s: float) -> Restart:
    """The run report's `Restart` (kind ``in-place``) of one switch: nothing redone, ``restart_s`` the switch's
    (the hold for the supervisor's verdict included: the job waited those seconds too)."""
    step = record.after_steps
    return Restart(kind="in-place", cause=cause, rank=rank, device=device, failed_step=step, resumed_step=step,
                   steps_redone=0, replan_s=replan_s, restart_s=record.seconds + record.held_s, old_predicted_s=old_predicted_s,
                   new_predicted_s=record.new_predicted_s, old_stages=record.old_stages, new_stages=record.new_stages,
                   old_measured_s=old_measured_s, new_measured_s=new_measured_s, factor=factor)
