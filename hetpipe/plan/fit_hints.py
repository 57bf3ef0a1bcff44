"""When nothing fits: which command-line settings would, and how full the fullest card would be.

`fit_options` re-captures the model once per alternative setting (``--batch 1``,
``--precision bf16-mixed``, ``--optimizer sgd``, half the ``--seq``, ``--recompute auto`` when
recomputation was off, ``--offload auto`` when offload was off, and all of them together) and solves each for memory only: the least-memory placement
(`hetpipe.partitioner.solvers.infeasible.least_memory_fit`), never the full time
objective.  `fit_hint` turns the results into one sentence for the error line: the
settings that fit with the fullest stage each reaches, else the best figure each
reaches, and the memory factor larger cards would need.

Example:
    >>> s = Settings(batch=4, seq=1024, precision="fp32", optimizer="adam")
    >>> [o.flags for o in alternatives(s, builtin=True, lm=True)]  # doctest: +NORMALIZE_WHITESPACE
    ['--batch 2', '--batch 1', '--precision bf16-mixed', '--optimizer sgd', '--seq 512', '--offload auto',
     '--batch 1 --precision bf16-mixed --optimizer sgd --seq 512']
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from hetpipe.cost_models.devices import Cluster
from hetpipe.cost_models.quantities import human_bytes
from hetpipe.errors import HetpipeError
from hetpipe.partitioner.capture.graph import UnitGraph
from hetpipe.partitioner.solvers.infeasible import MemoryFit, least_memory_fit

log = logging.getLogger(__name__)

#: The lightest settings hetpipe knows for each memory share (cost_models.memory):
#: bf16 mixed precision halves saved activations; SGD keeps no optimizer state.
LIGHT_PRECISION = "bf16-mixed"
LIGHT_OPTIMIZER = "sgd"
#: Shortest sequence worth suggesting (halving below it changes the task, not the memory question).
MIN_SUGGESTED_SEQ = 64


@dataclass(frozen=True)
class Settings:
    """The planning settings a user controls with flags (``batch``/``seq`` of built-in models)."""

    batch: int | None
    seq: int | None
    precision: str
    optimizer: str
    recompute: str = "auto"  # --recompute (its default): a capture does not depend on it, the memory solve does
    offload: str = "never"  # --offload (its default): likewise


@dataclass(frozen=True)
class FitOption:
    """One alternative: its settings, the flags that select it, and its least-memory placement."""

    settings: Settings
    flags: str
    fit: MemoryFit | None = None
    group: str = ""  # options of one group are tried in order until one fits ("--batch": 4, 2, 1)

    def figure(self) -> str:
        if self.fit is None:
            return f"{self.flags} (does not fit on any number of these cards)"
        return (f"{self.flags} (fullest stage {human_bytes(self.fit.memory_bytes)} of "
                f"{human_bytes(self.fit.usable_bytes)} on {self.fit.device})")


def alternatives(s: Settings, *, builtin: bool, lm: bool) -> list[FitOption]:
    """The settings worth trying from ``s``: each lighter flag alone, then all of them together."""
    singles: list[tuple[str, dict[str, object]]] = []
    halves: list[FitOption] = []  # the largest micro-batch that fits is the useful one: b/2, b/4, ..., 1
    if builtin and s.batch is not None and s.batch > 1:
        b = s.batch // 2
        while b > 1:
            halves.append(FitOption(dataclasses.replace(s, batch=b), f"--batch {b}", group="--batch"))
            b //= 2
        singles.append(("--batch 1", {"batch": 1}))
    if s.precision == "fp32":
        singles.append((f"--precision {LIGHT_PRECISION}", {"precision": LIGHT_PRECISION}))
    if s.optimizer != LIGHT_OPTIMIZER:
        singles.append((f"--optimizer {LIGHT_OPTIMIZER}", {"optimizer": LIGHT_OPTIMIZER}))
    if builtin and lm and s.seq is not None and s.seq // 2 >= MIN_SUGGESTED_SEQ:
        singles.append((f"--seq {s.seq // 2}", {"seq": s.seq // 2}))
    if s.recompute == "none":  # auto fits whenever some recomputation (all included) does
        singles.append(("--recompute auto", {"recompute": "auto"}))
    if s.offload == "never" and s.optimizer != LIGHT_OPTIMIZER:  # optimizer state to move to the host
        singles.append(("--offload auto", {"offload": "auto"}))
    out = [FitOption(dataclasses.replace(s, **ch), flags, group=flags.split()[0])  # type: ignore[arg-type]
           for flags, ch in singles]
    out[0:0] = halves
    combined = [x for x in singles if x[0] != "--offload auto"]  # with --optimizer sgd there is nothing to move
    if len(combined) > 1:
        every: dict[str, object] = {k: v for _, ch in combined for k, v in ch.items()}
        out.append(FitOption(dataclasses.replace(s, **every), " ".join(f for f, _ in combined)))  # type: ignore[arg-type]
    return out


def fit_options(options: list[FitOption], *, capture: Callable[[Settings], UnitGraph], cluster: Cluster,
                global_batch: int | None) -> list[FitOption]:
    """Each option with its least-memory placement (one capture and memory-only solves per option); a
    combination of several flags is skipped once a single flag fits."""
    from hetpipe.plan.build import build_problem, microbatches_for

    out: list[FitOption] = []
    for opt in options:
        done = [o for o in out if o.fit is not None and o.fit.fits]
        if (opt.flags.count("--") > 1 and done) or any(o.group == opt.group and opt.group for o in done):
            continue  # the combination only matters when no single setting fits; a group needs one answer
        try:
            graph = capture(opt.settings)
            _, m = microbatches_for(graph, global_batch, len(cluster.devices))
            fit = least_memory_fit(build_problem(graph, cluster, microbatches=m, recompute=opt.settings.recompute,
                                                 offload=opt.settings.offload))
        except HetpipeError as err:  # e.g. a global batch the new micro-batch does not divide
            log.info("fit hint %s skipped: %s", opt.flags, err)
            continue
        out.append(dataclasses.replace(opt, fit=fit))
    return out


def fit_hint(options: list[FitOption], *, current: MemoryFit | None) -> str:
    """One sentence: what fits (with figures), else the best each reaches, and what larger cards would need.

    Example:
        >>> s = Settings(1, None, "fp32", "adam")
        >>> fits = FitOption(s, "--optimizer sgd", MemoryFit(0.9, 0, "d0", 9 * 2**30, 10 * 2**30))
        >>> fit_hint([fits], current=MemoryFit(1.2, 0, "d0", 12 * 2**30, 10 * 2**30))
        'These settings fit: --optimizer sgd (fullest stage 9.00 GiB of 10.00 GiB on d0); or cards with 1.20x their usable memory.'
    """
    good = [o for o in options if o.fit is not None and o.fit.fits]
    parts = []
    if good:
        parts.append("These settings fit: " + ", ".join(o.figure() for o in good))
    elif options:
        best = {}
        for o in options:  # per group the last tried (the lightest), e.g. --batch 1
            best[o.group or o.flags] = o
        parts.append("No lighter setting fits; the best each reaches: " + ", ".join(o.figure() for o in best.values()))
    if current is not None:
        parts.append(f"cards with {current.factor:.2f}x their usable memory")
    return "; or ".join(parts) + ("." if parts else "")
