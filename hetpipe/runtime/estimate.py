"""How long ``hetpipe run --emulate`` will take, before anything is launched, and the limit on it.

An emulated rank stretches every forward/backward to ``time_scale x`` its plan time, and
the worker picks ``time_scale`` from one measured forward/backward per stage
(`hetpipe.runtime.emulate.pipeline.choose_time_scale`).  Here the measurement is
replaced by a lower estimate -- the stage's FLOPs (the plan's unit tables) at this
CPU's achieved single-thread matmul rate -- and passed through the very same
`choose_time_scale`, so::

    wall  ~  start-up + calibration + steps x time_scale x T

with T the plan's predicted iteration (replica sync included), start-up
`STARTUP_PER_RANK_S` per rank, and calibration `CALIBRATION_PASSES` serial passes of one
micro-batch.  Real models run below the matmul rate (attention, norms, per-op
overhead), so the compute part is a **lower** bound: a run refused for exceeding the
limit would take at least that long.

Example:
    >>> est = WallEstimate(startup_s=10.0, calibration_s=2.0, step_s=30.0, steps=4, time_scale=0.5,
    ...                    cpu_flops_s=5e10, iteration_s=60.0)
    >>> est.total_s, default_timeout_s(est)
    (132.0, 90.0)
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

from hetpipe.errors import ConfigError
from hetpipe.plan.group_run import rank_slots
from hetpipe.plan.schema import Plan

log = logging.getLogger(__name__)

#: Start-up of one rank under torchrun (import torch, capture on meta, build the stage):
#: 2 ranks took 7-8 s, 4 ranks 13-15 s on 2 cores (environment_facts.md "Processes").
STARTUP_PER_RANK_S = 3.5
#: The worker's calibration: one micro-batch through the serial pipeline this many times
#: (`hetpipe.runtime.worker.CALIBRATION_PASSES`, repeated here to keep this module light).
CALIBRATION_PASSES = 4
#: The size of the matmul that measures this CPU (512^3 multiply-adds: ~10 ms per call on one core).
CPU_MATMUL_SIZE = 512
#: Default ``--timeout`` under emulation: no wait of a rank lasts longer than one real
#: iteration (a receive waits at most for the pipeline's warm-up, the step barrier for the
#: slowest rank's step); 3 iterations cover the estimate being low (see above).
TIMEOUT_ITERATIONS = 3.0
#: ``--timeout`` when nothing longer is needed (the run parser's historic default).
BASE_TIMEOUT_S = 60.0
#: ``hetpipe run --emulate --max-minutes`` default.
DEFAULT_MAX_MINUTES = 10.0


@dataclass(frozen=True)
class WallEstimate:
    """The parts of an emulated run's wall time, in real seconds.

    Attributes:
        startup_s: torchrun start-up of every rank.
        calibration_s: the worker's calibration passes.
        step_s: one emulated step (``time_scale x iteration_s``).
        steps: steps the run makes.
        time_scale: estimated real seconds per emulated second.
        cpu_flops_s: the single-thread matmul rate of this CPU used for the estimate.
        iteration_s: the plan's predicted iteration (emulated seconds).
    """

    startup_s: float
    calibration_s: float
    step_s: float
    steps: int
    time_scale: float
    cpu_flops_s: float
    iteration_s: float

    @property
    def total_s(self) -> float:
        return self.startup_s + self.calibration_s + self.steps * self.step_s

    def parts(self) -> str:
        """Where the time goes, in words."""
        return (f"start-up {self.startup_s:.0f} s, calibration {self.calibration_s:.3g} s, {self.steps} steps x "
                f"{self.step_s:.3g} s: the plan's {self.iteration_s:.4g} s iteration x time scale "
                f"{self.time_scale:.3g} on this CPU's {self.cpu_flops_s / 1e9:.1f} GFLOP/s per core")

    def line(self) -> str:
        """One line for the CLI."""
        return f"estimated wall time: at least {_minutes(self.total_s)} ({self.parts()})"


def _minutes(seconds: float) -> str:
    """``0.556 s``, ``45.3 s``, ``15.2 min``: three figures under 2 minutes (a 0.556 s step is not "1 s")."""
    return f"{seconds:.3g} s" if seconds < 120 else f"{seconds / 60:.1f} min"


@functools.lru_cache(maxsize=1)
def cpu_flops_s() -> float:
    """Single-thread fp32 matmul FLOP/s of this CPU (what each emulating rank gets)."""
    import torch

    from hetpipe.cost_models.calibrate import measure_matmul_flops_s

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_matmul_flops_s("cpu", size=CPU_MATMUL_SIZE, repeats=3)
    finally:
        torch.set_num_threads(threads)


def _num_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def estimate_wall(plan: Plan, *, steps: int, safety_factor: float | None = None, flops_s: float | None = None,
                  num_cores: int | None = None) -> WallEstimate:
    """`WallEstimate` of ``hetpipe run --emulate`` with ``plan`` for ``steps`` steps on this machine.

    Example:
        >>> # est = estimate_wall(Plan.load("plan.json"), steps=3); print(est.line())
    """
    from hetpipe.runtime.emulate.pipeline import DEFAULT_SAFETY_FACTOR, StageTiming, choose_time_scale

    rate = flops_s if flops_s is not None else cpu_flops_s()
    real, predicted = [], []
    for st in plan.stages:
        units = plan.units[st.first_unit:st.last_unit + 1]
        real.append(StageTiming(sum(u.fwd_flops for u in units) / rate, sum(u.bwd_flops for u in units) / rate))
        predicted.append(StageTiming(st.fwd_s, st.bwd_s))
    nproc = len(rank_slots(plan))  # one rank per card: a tensor-parallel group's members too
    scale = choose_time_scale(real, predicted, num_ranks=nproc, num_cores=num_cores or _num_cores(),
                              safety_factor=safety_factor or DEFAULT_SAFETY_FACTOR).real_s_per_emulated_s
    iteration_s = plan.predicted.iteration_s
    return WallEstimate(startup_s=STARTUP_PER_RANK_S * nproc,
                        calibration_s=CALIBRATION_PASSES * sum(r.fwd_s + r.bwd_s for r in real),
                        step_s=scale * iteration_s, steps=steps, time_scale=scale, cpu_flops_s=rate,
                        iteration_s=iteration_s)


def default_timeout_s(est: WallEstimate) -> float:
    """``--timeout`` for an emulated run: `TIMEOUT_ITERATIONS` real iterations (or one calibration), at least 60 s."""
    longest_wait_s = max(est.step_s, est.calibration_s / CALIBRATION_PASSES)
    return max(BASE_TIMEOUT_S, TIMEOUT_ITERATIONS * longest_wait_s)


def refuse_if_too_long(est: WallEstimate, plan: Plan, *, max_minutes: float) -> None:
    """Raise `ConfigError` when ``est`` exceeds ``max_minutes``, naming the ways to shrink the run.

    Example:
        >>> est = WallEstimate(10.0, 2.0, 300.0, 3, 0.5, 5e10, 600.0)
        >>> refuse_if_too_long(est, None, max_minutes=10)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: --max-minutes 10: the emulated run needs at least 15.2 min ...
    """
    if not (max_minutes > 0 and math.isfinite(max_minutes)):
        raise ConfigError(f"--max-minutes must be a positive number of minutes, got {max_minutes!r}; e.g. 10")
    limit_s = 60.0 * max_minutes
    if est.total_s <= limit_s:
        return
    fit_steps = math.floor((limit_s - est.startup_s - est.calibration_s) / est.step_s) if est.step_s > 0 else 0
    ways = [f"--steps {fit_steps} (each step takes about {_minutes(est.step_s)})" if fit_steps >= 1
            else f"not --steps: one step alone takes {_minutes(est.step_s)}"]
    if plan is not None and plan.training.microbatches > 1:
        mb = plan.training.micro_batch_size
        ways.append(f"fewer micro-batches: re-plan with a smaller --global-batch (now {plan.training.global_batch} = "
                    f"{plan.training.microbatches} x {mb}) or a smaller --batch/--seq")
    ways.append("a smaller model or a scaled-down cluster (e.g. gpt-demo on examples/clusters/homelab-mini.yaml)")
    ways.append(f"--max-minutes {math.ceil(est.total_s / 60)} to allow it")
    raise ConfigError(f"--max-minutes {max_minutes:g}: the emulated run needs at least {_minutes(est.total_s)} on "
                      f"this machine ({est.parts()}); shrink it: {'; '.join(ways)}")
