"""Straggler detection: a stage that stays slower than its plan by a margin (issue 16, item 3).

Every rank measures, per step, the median of its forward and of its backward action times
per micro-batch and, under ``--emulate``, of its sends' time on the emulated wire, each in
the plan's (emulated) seconds, and divides by what the plan predicted for them: a *ratio*
per measure (1.0 = as planned).  A step is slow for a group of measures -- ``compute``
(``fwd``, ``bwd``) or one outgoing link (``send->S``: the sends to stage S, group ``link->S``)
-- when a ratio of the group exceeds ``1 + margin``.

**How many slow steps name a stage** depends on how slow they are (`steps_to_name`): the
stage is named once the *excess* of its current run of consecutive slow steps, the sum over
those steps of (ratio - 1) (the group's largest ratio per step), reaches ``steps x margin``:
the excess that ``steps`` (K, ``--straggler-steps``) steps just over the margin add up to.  So
K is the most steps a slowdown ever needs (one just over the margin), and a large one is named
sooner: with the defaults (margin 0.25, K 3: threshold 0.75) a 3x card after 1 step (excess
2), 1.5x after 2 (0.5 + 0.5), 1.3x after 3.  One step suffices only at ratio >= 1 + K x margin
= 1.75x, 75% above the plan, far above the fault-free noise below.  The stage is named once per
group: the `StragglerRecord` holds each measure's median ratio over those steps (the factor),
the first slow step and the detection step.  The first step a rank runs is warm-up (lazy
optimizer state, allocator) and never counts.

Margin: `DEFAULT_MARGIN` 0.25.  Under ``--emulate`` an action's measured time is the emulated
device's (`hetpipe.runtime.faults.watch`): without a fault it equals the plan's up to the
stretch's own 2% (`hetpipe.runtime.emulate.pipeline.OVERRUN_TOLERANCE`) unless the CPU overran
the target -- measured 1.000 at worst over 36 stage-steps of two fault-free 3-rank runs at load
8.9 on 2 cores (tests/test_faults_run.py prints it).  On real cards step-to-step variation
(clock boost, other jobs) is a few percent; whole emulated iterations stay within 1-5% of the
plan (benchmarks/results/runtime_emulated.md).  0.25 sits well above those and below the
smallest slowdown worth re-planning for (1.5x).

Example:
    >>> d = StragglerDetector(margin=0.25, steps=3, first_step=0)
    >>> [d.observe(s, {"fwd": r, "bwd": r}) for s, r in enumerate([9.0, 1.0, 3.0])][-1]  # 3x: one step
    {'compute': ({'fwd': 3.0, 'bwd': 3.0}, 2)}
    >>> d.observe(3, {"fwd": 3.0, "bwd": 3.0})  # named once
    {}
    >>> d = StragglerDetector(margin=0.25, steps=3, first_step=0)
    >>> [d.observe(s, {"fwd": 1.3}) for s in range(4)]  # 1.3x: K = 3 steps (step 0 is warm-up)
    [{}, {}, {}, {'compute': ({'fwd': 1.3}, 1)}]
    >>> steps_to_name(3.0, margin=0.25, steps=3), steps_to_name(1.5, margin=0.25, steps=3)
    (1, 2)
    >>> group_of("send->2"), group_of("bwd")
    ('link->2', 'compute')
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Mapping

from hetpipe.errors import HetpipeError

log = logging.getLogger(__name__)

#: Slower than predicted by more than this fraction counts as slow (see the module docstring).
DEFAULT_MARGIN = 0.25
#: K: the most consecutive slow steps before a stage is named (one just over the margin needs them all;
#: larger slowdowns fewer, `steps_to_name`).  3 is the issue's example ("slower for K steps").
DEFAULT_STEPS = 3
COMPUTE_MEASURES = ("fwd", "bwd")
STRAGGLER_FORMAT = "hetpipe.straggler"
STRAGGLER_VERSION = 1


@dataclass(frozen=True)
class StragglerRecord:
    """One stage named as a straggler.

    Attributes:
        rank, stage, device, kind: who (the plan's device id and kind).
        what: ``"compute"`` (its forward/backward) or ``"link"`` (its sends on ``link``).
        factors: measure (``fwd``, ``bwd``, ``send``) -> median measured / predicted over the window.
        since_step: the first slow step of the window; detected_step: the step it was named after.
        link: ``"a:0 -> b:0"`` (device ids) for a link straggler, else ``""``.
        margin, window_steps: the settings it was detected with.
    """

    rank: int
    stage: int
    device: str
    kind: str
    what: str
    factors: Mapping[str, float]
    since_step: int
    detected_step: int
    link: str = ""
    margin: float = DEFAULT_MARGIN
    window_steps: int = DEFAULT_STEPS

    @property
    def factor(self) -> float:
        """The largest measured / predicted ratio of the record."""
        return max(self.factors.values())

    def line(self) -> str:
        """The WARNING line."""
        parts = ", ".join(f"{m} {v:.2f}x" for m, v in self.factors.items())
        on = f" link {self.link}" if self.link else ""
        return (f"straggler: rank {self.rank} (stage {self.stage}, {self.device} ({self.kind})){on}: {self.what} "
                f"measured/predicted {parts} since step {self.since_step} (detected after step {self.detected_step}; "
                f"margin {self.margin:g}, {self.window_steps} steps)")


@dataclass(frozen=True)
class StepRatios:
    """One step's measured / predicted ratio per measure (``fwd``, ``bwd``, ``send->S``), as the detector saw it."""

    step: int
    ratios: Mapping[str, float]


def group_of(measure: str) -> str:
    """``compute`` for ``fwd`` / ``bwd``; ``link->S`` for ``send->S``."""
    return "compute" if measure in COMPUTE_MEASURES else "link" + measure.removeprefix("send")


def steps_to_name(ratio: float, *, margin: float, steps: int) -> int:
    """Consecutive steps at ``ratio`` that name a stage: the fewest whose excess ``n x (ratio - 1)`` reaches
    ``steps x margin`` (0 when ``ratio`` is not slow)."""
    if not ratio > 1.0 + margin:
        return 0
    return next(n for n in range(1, steps + 1) if n * (ratio - 1.0) >= steps * margin)


@dataclass
class StragglerDetector:
    """Per group, the run of consecutive slow steps and its excess (pure; one per rank; module docstring)."""

    margin: float = DEFAULT_MARGIN
    steps: int = DEFAULT_STEPS
    first_step: int = 0  # the rank's first step: warm-up, never counted
    history: dict[str, list[tuple[int, Mapping[str, float]]]] = field(default_factory=dict)
    named: set[str] = field(default_factory=set)

    def observe(self, step: int, ratios: Mapping[str, float]) -> dict[str, tuple[dict[str, float], int]]:
        """Feed one step's ratios; returns group -> (median factors, since step) for groups named now."""
        out: dict[str, tuple[dict[str, float], int]] = {}
        if step <= self.first_step:
            return out
        groups: dict[str, list[str]] = {}
        for m, r in ratios.items():
            if r == r:  # NaN: not measured this step
                groups.setdefault(group_of(m), []).append(m)
        for group in sorted({*groups, *self.history}):
            measures = groups.get(group, [])
            got = {m: ratios[m] for m in measures}
            streak = self.history.setdefault(group, [])
            if got and max(got.values()) > 1.0 + self.margin:
                streak.append((step, got))
            else:
                streak.clear()
            excess = sum(max(r.values()) - 1.0 for _, r in streak)
            if streak and excess >= self.steps * self.margin and group not in self.named:
                window = streak[-self.steps:]
                factors = {m: median([r[m] for _, r in window if m in r]) for m in measures
                           if any(m in r for _, r in window)}
                self.named.add(group)
                out[group] = (factors, window[0][0])
        return out


def straggler_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"straggler-rank{rank}.json"


def write_straggler(run_dir: Path, record: StragglerRecord) -> Path:
    """Atomically write ``RUN_DIR/straggler-rank{R}.json`` (a later record of the rank replaces it)."""
    from hetpipe.plan.serde import to_json

    path = straggler_path(run_dir, record.rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": STRAGGLER_FORMAT, "version": STRAGGLER_VERSION, **to_json(record)}))
    os.replace(tmp, path)
    return path


def read_stragglers(run_dir: Path) -> tuple[StragglerRecord, ...]:
    """Every ``straggler-rank*.json`` in ``run_dir``, by rank (for a supervisor polling a live run).

    A file being replaced is read whole or not at all (written by rename); unreadable ones are skipped.
    """
    from hetpipe.plan.serde import from_json

    out = []
    for path in sorted(Path(run_dir).glob("straggler-rank*.json")):
        try:
            doc = json.loads(path.read_text())
            doc.pop("format", None), doc.pop("version", None)
            out.append(from_json(StragglerRecord, doc, path=str(path)))
        except (OSError, ValueError, HetpipeError) as err:  # a stray file must not stop a poller
            log.warning("ignoring unreadable %s: %s", path, err)
    return tuple(sorted(out, key=lambda r: r.rank))
