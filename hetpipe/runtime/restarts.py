"""What a supervised run (`hetpipe.runtime.supervise`) records about each restart, in the run report.

Example:
    >>> r = Restart(kind="lost", cause="rank 2 was killed by signal 9 (SIGKILL)", rank=2, device="n1:2",
    ...             failed_step=5, resumed_step=4, steps_redone=1, replan_s=0.02, restart_s=9.5,
    ...             old_predicted_s=2.8e-3, new_predicted_s=1.8e-3, old_stages="n0:0[0-1] n0:1[2-3] n1:2[4-5]",
    ...             new_stages="n0:0[0-2] n0:1[3-5]")
    >>> print(r.line())
    restart 1: rank 2 (n1:2) lost at step 5 (rank 2 was killed by signal 9 (SIGKILL)); re-planned in 0.02 s: n0:0[0-2] n0:1[3-5], T 2.8 ms -> 1.8 ms; resumed from step 4, 1 step redone, running again after 9.5 s
"""

from __future__ import annotations

from dataclasses import dataclass


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


@dataclass(frozen=True)
class Restart:
    """One relaunch of a supervised run.

    ``kind``: ``lost`` (a rank died; its device is left out of the new plan), ``returned`` (a rank
    died and its device came back within ``--wait-for-return``: same plan), ``relaunched`` (a rank of
    a replica plan died: the same plan is relaunched, its card taken to be working) or ``adapt`` (a
    straggler report: the device is kept, priced at its measured slowdown; ``device`` is then
    ``"a:0 -> b:1"`` for a slow link, priced at its measured slowdown both ways) or ``in-place`` (the
    same, switched inside the running job: no relaunch, nothing redone, ``restart_s`` the switch's).  ``failed_step``:
    steps every rank had finished when the old job stopped; ``resumed_step``: the checkpoint's
    step the new job continued from; ``steps_redone`` = failed_step - resumed_step.
    ``replan_s``: wall seconds of the re-plan; ``restart_s``: wall seconds from the old job's end
    (or, for ``adapt``, the stop) to the new job's first finished step.  ``old_predicted_s``: the
    old placement's T on the changed cluster (with the slowdown; for ``lost`` its recorded T),
    ``new_predicted_s``: the new plan's T (device seconds).  ``old_measured_s`` /
    ``new_measured_s``: median iteration time measured before the restart (the last steps) and
    after it (the new job), emulated seconds under ``--emulate``, else real; 0 when unknown.
    """

    kind: str
    cause: str
    rank: int
    device: str
    failed_step: int
    resumed_step: int
    steps_redone: int
    replan_s: float
    restart_s: float
    old_predicted_s: float
    new_predicted_s: float
    old_stages: str
    new_stages: str
    old_measured_s: float = 0.0
    new_measured_s: float = 0.0
    factor: float = 0.0  # adapt: the reported slowdown of `device`
    waited_s: float = 0.0  # --wait-for-return: seconds waited for the lost device (kind ``returned``: it came back)

    def line(self, number: int = 1) -> str:
        """The one log line of this restart."""
        what = "lost" if self.kind in ("lost", "returned", "relaunched") else f"{self.factor:.3g}x slower (straggler)"
        measured = (f"; measured {_ms(self.old_measured_s)} -> {_ms(self.new_measured_s)}"
                    if self.old_measured_s and self.new_measured_s else "")
        if self.kind == "returned":
            how = f"back after {self.waited_s:.3g} s: the same plan {self.new_stages}, T {_ms(self.new_predicted_s)}"
        elif self.kind == "relaunched":
            how = f"relaunched on the same plan {self.new_stages}, T {_ms(self.new_predicted_s)}"
        elif self.kind == "in-place":
            how = (f"re-planned in {self.replan_s:.3g} s and switched in place (no relaunch): {self.new_stages}, "
                   f"T {_ms(self.old_predicted_s)} -> {_ms(self.new_predicted_s)}")
        else:
            waited = f"not back within {self.waited_s:.3g} s; " if self.waited_s else ""
            how = (f"{waited}re-planned in {self.replan_s:.3g} s: {self.new_stages}, T {_ms(self.old_predicted_s)} -> "
                   f"{_ms(self.new_predicted_s)}")
        return (f"restart {number}: rank {self.rank} ({self.device}) {what} at step {self.failed_step} ({self.cause}); "
                f"{how}{measured}; resumed from step {self.resumed_step}, {self.steps_redone} "
                f"step{'' if self.steps_redone == 1 else 's'} redone, running again after {self.restart_s:.3g} s")
