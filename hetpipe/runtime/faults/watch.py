"""The worker's per-step hook for faults: inject what the schedule says, watch for stragglers.

`StepWatch.before_step` applies the injected faults in force at the step (a kill exits the
process at once; a slowdown sets the emulator's `ComputeStretch.factor` / `LinkClock.factor`),
`StepWatch.after_step` turns the step's recorded actions into measured / predicted ratios and
feeds the `StragglerDetector`; a detection is logged (one WARNING line), written to
``RUN_DIR/straggler-rank{R}.json`` at once (a supervisor polls for it) and kept for the run
report.  Ratios are in the plan's seconds: real durations divided by the emulation's time scale
(1 without emulation, where the plan's device is the real one).

Under ``--emulate`` an action's measured duration is what the emulated device took: its real
compute stretched to its target (the plan's time x the injected factor), or the compute alone
when it overran the target (the CPU could not keep up: that is measured, and counts).  The
host's wake-up latency after the stretch sleep is the host's, not the device's, and is left out:
on the 2-core reference machine at load 11 it added up to +65% to 6 ms actions (a rank named at
1.65x with no fault and no overrun), far above any margin worth using.

Example:
    >>> round(ratio_of([0.3, 0.31, 0.29], time_scale=0.1, predicted_s=1.0), 6)  # median of the step's actions
    3.0
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from statistics import median
from typing import Any, Sequence

from hetpipe.runtime.faults.inject import KILL_EXIT_CODE, FaultSchedule, rank_devices
from hetpipe.runtime.faults.returns import write_down
from hetpipe.runtime.faults.straggler import (
    DEFAULT_MARGIN, DEFAULT_STEPS, StepRatios, StragglerDetector, StragglerRecord, write_straggler,
)

log = logging.getLogger("hetpipe.faults")


def ratio_of(samples: Sequence[float], *, time_scale: float, predicted_s: float) -> float:
    """Median of real ``samples`` in plan seconds over ``predicted_s``; NaN without samples or prediction."""
    if not samples or not predicted_s > 0:
        return math.nan
    return median(samples) / time_scale / predicted_s


class StepWatch:
    """One rank's fault injection and straggler watch (see the module docstring).

    Args:
        plan, stage: the plan and this rank's stage index in it (a single-pipeline plan detects;
            a replica plan only gets kills).
        rank, stage_ranks: this rank and every stage's rank (links are named by rank in ``--inject``).
        hooks: the executor hooks recording F/B durations (`RecordingHooks` or `EmulationHooks`).
        faults, run_dir, margin, window_steps, first_step, timeout_s: as named.
    """

    def __init__(self, *, plan: Any, stage: int, rank: int, stage_ranks: Sequence[int], hooks: Any,
                 faults: FaultSchedule, run_dir: Path, margin: float = DEFAULT_MARGIN,
                 window_steps: int = DEFAULT_STEPS, first_step: int = 0, timeout_s: float = 60.0,
                 detect: bool = True) -> None:
        self.plan, self.stage, self.rank, self.hooks, self.faults = plan, stage, rank, hooks, faults
        self.stage_ranks, self.run_dir = list(stage_ranks), Path(run_dir)
        self.detector = StragglerDetector(margin=margin, steps=window_steps, first_step=first_step)
        self.records: list[StragglerRecord] = []
        self.step_ratios: list[StepRatios] = []
        # an interleaved rank is judged where its durations are in chunk 0's seconds (`EmulationHooks.stretch`)
        self.detect = (detect and not plan.replicas
                       and hasattr(hooks, "chunk_predicted" if plan.stages[0].chunks else "fwd_s"))
        self.step = first_step
        dev = plan.devices[plan.device_index()[plan.stages[stage].device]] if not plan.replicas else None
        self.device, self.kind = (dev.id, dev.kind) if dev is not None else ("", "")
        self._peers = self._cut_peers()
        if hasattr(hooks, "clocks"):
            hooks.cut_timeout_s = timeout_s
            hooks.link_names = {cut: self._link_name(peer) for cut, peer in self._peers.items()}
        self._marks: tuple[int, int, dict[int, int]] = (0, 0, {})

    def _cut_peers(self) -> dict[int, int]:
        """Cut -> the stage this rank sends to over it (activations forward, gradients back); an
        interleaved rank's cuts are every chunk's (virtual stage s = c n + stage; its peer: s +- 1 mod n)."""
        if self.plan.replicas:
            return {}
        n, virtual = len(self.plan.stages), range(self.stage, len(self.plan.stages) * max(
            1, len(self.plan.stages[self.stage].chunks)), len(self.plan.stages))
        return {cut: peer % n for s in virtual for cut, peer in ((s, s + 1), (s - 1, s - 1))
                if 0 <= peer < n * len(virtual)}

    def _link_name(self, peer: int) -> str:
        return f"{self.plan.stages[self.stage].device} -> {self.plan.stages[peer].device}"

    def card(self) -> str:
        """The card this rank runs on: a tensor-parallel member's own (`inject.rank_devices`: the order the
        supervisor names a dead rank's card in), else its stage's."""
        group = () if self.plan.replicas else tuple(self.plan.stages[self.stage].group_devices or ())
        devices = rank_devices(self.plan) if group else ()
        return devices[self.rank] if self.rank < len(devices) and devices[self.rank] in group else self.device

    def before_step(self, step: int) -> None:
        """Apply the faults in force at ``step``: exit hard, or set the emulator's factors."""
        self.step = step
        kill = self.faults.kill_at(rank=self.rank, step=step)
        if kill is not None:
            if kill.down_s:  # when the device is back: the injector knows, a supervisor may wait for it
                write_down(self.run_dir, self.card(), down_s=kill.down_s)
            log.error("rank %d: injected kill at the start of step %d (exit %d, no cleanup)", self.rank, step,
                      KILL_EXIT_CODE)
            sys.stderr.flush()
            os._exit(KILL_EXIT_CODE)  # like a lost node: no error file, no teardown
        for cut in self.faults.cuts_starting(src=self.rank, step=step):
            peer = next((p for p in self._peers.values() if self.stage_ranks[p] == cut.dst), None)
            if cut.down_s and peer is not None:
                write_down(self.run_dir, self._link_name(peer), down_s=cut.down_s)
        compute = getattr(self.hooks, "compute", None)
        if compute is not None:
            compute.factor = self.faults.compute_factor(rank=self.rank, step=step)
        for cut, clock in getattr(self.hooks, "clocks", {}).items():
            peer = self._peers.get(cut)
            if peer is not None:
                clock.factor = self.faults.link_factor(src=self.rank, dst=self.stage_ranks[peer], step=step)
        if self.detect:
            clocks = getattr(self.hooks, "clocks", {})
            self._marks = (len(self._durations("fwd")), len(self._durations("bwd")),
                           {cut: len(c.transfers) for cut, c in clocks.items()})

    def _durations(self, op: str) -> list[float]:
        """Real seconds of every ``fwd`` / ``bwd`` action: the emulated device's when emulated (see above)."""
        device = getattr(self.hooks, f"{op}_device_s", None)
        return device if device is not None else getattr(self.hooks, f"{op}_s")

    def ratios(self) -> dict[str, float]:
        """This step's measured / predicted per measure: ``fwd``, ``bwd``, ``send->S`` (S: the peer stage)."""
        f0, b0, sends = self._marks
        st, scale = self.plan.stages[self.stage], float(getattr(self.hooks, "time_scale", 1.0))
        out = {"fwd": ratio_of(self._durations("fwd")[f0:], time_scale=scale, predicted_s=st.fwd_s),
               "bwd": ratio_of(self._durations("bwd")[b0:], time_scale=scale, predicted_s=st.bwd_s)}
        for cut, clock in getattr(self.hooks, "clocks", {}).items():
            bandwidth, latency = self.hooks.links[cut]
            ratios = [wire / scale / (latency + n / bandwidth) for n, wire in clock.transfers[sends.get(cut, 0):]
                      if n > 0]
            if ratios:
                out[f"send->{self._peers[cut]}"] = median(ratios)
        return out

    def after_step(self, step: int) -> None:
        """Feed the step's ratios to the detector; name (log, file, record) what it detects."""
        if not self.detect:
            return
        ratios = {m: r for m, r in self.ratios().items() if r == r}  # NaN: no such action this step
        if step > self.detector.first_step:  # the warm-up step is neither judged nor reported
            self.step_ratios.append(StepRatios(step, ratios))
        for group, (factors, since) in self.detector.observe(step, ratios).items():
            link = ""
            if group.startswith("link"):
                link = self._link_name(int(group.rsplit(">", 1)[1]))
            record = StragglerRecord(rank=self.rank, stage=self.stage, device=self.device, kind=self.kind,
                                     what="link" if link else "compute", factors=factors, since_step=since,
                                     detected_step=step, link=link, margin=self.detector.margin,
                                     window_steps=self.detector.steps)
            log.warning("%s", record.line())
            write_straggler(self.run_dir, record)
            self.records.append(record)

    def explain(self, message: str) -> str:
        """A failure's message, plus which link was cut when a cut was in force (every rank knows the faults)."""
        cut = self.faults.cut_at(self.step)
        if cut is None or "is cut" in message:
            return message
        return f"{message} (the emulated link from rank {cut.src} to rank {cut.dst} was cut by --inject {cut.spec()})"

    def result_fields(self) -> dict[str, Any]:
        """The `RankResult` fields this watch fills."""
        return {"stragglers": tuple(self.records), "step_ratios": tuple(self.step_ratios)}


def step_watch(args: Any, *, plan: Any, stage: int, rank: int, stage_ranks: Sequence[int], hooks: Any,
               first_step: int) -> StepWatch:
    """The worker's `StepWatch` from its arguments (``--inject``, ``--straggler-margin/-steps``).

    Stragglers are judged where the plan's figures describe the device the rank runs on: under
    ``--emulate``, or on CUDA devices (the plan's own cards).  A CPU run without emulation measures
    this machine, not the plan's devices, so nothing is judged there.
    """
    import torch

    margin = getattr(args, "straggler_margin", None)
    window = getattr(args, "straggler_steps", None)
    return StepWatch(plan=plan, stage=stage, rank=rank, stage_ranks=stage_ranks, hooks=hooks,
                     faults=FaultSchedule.from_specs(getattr(args, "inject", None)), run_dir=args.run_dir,
                     margin=DEFAULT_MARGIN if margin is None else margin,
                     window_steps=DEFAULT_STEPS if window is None else window, first_step=first_step,
                     timeout_s=args.timeout, detect=bool(args.emulate) or torch.cuda.is_available())
