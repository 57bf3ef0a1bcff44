"""Injected faults across the relaunches of a supervised run (``--inject`` with ``--max-restarts`` / ``--adapt``).

A supervised run is several launches (attempts), each resuming from a checkpoint on the plan of
the moment.  `InjectionCarrier` hands each attempt its ``--inject`` specs so that the faults
belong to the RUN, not to one launch:

* each fault fires once, at its global step, in whichever attempt reaches that step first; a
  fault an earlier attempt reached (some rank of it finished ``step`` steps: it began the step)
  is history and is not injected again, even though the relaunch redoes steps before it;
* ``rank`` means that launched rank of the plan running when the step is reached, as torchrun numbers
  them (stages in order, every tensor-parallel group member its own rank: `inject.rank_devices`); a plan
  re-made on fewer cards than the rank asks for gets the fault on its last rank.  ``src``/``dst`` of a
  link name the ranks of neighbouring stages' leads (who send the cuts); a plan re-made on fewer stages
  gets it on its last link, and a link fault on a one-stage plan has no link to hit: it is recorded as
  not fired;
* a compute slowdown stays with the CARD it hit: every later attempt whose plan uses that card
  gets ``slow:`` on its rank from the later of its global step and the attempt's first step, by
  the factor the plan does not already price (a plan re-made by ``--adapt`` gives the card the
  kind ``<kind>@x<F>``, `hetpipe.plan.replan`, and emulation runs it F times slower already);
  slowdowns have no end step in the ``--inject`` language, so they last to the end of the run;
* kills and link faults (cuts, slow links) act in the attempt that reaches them only: a kill's or a
  cut's ``down=`` is read by that attempt's supervisor (`hetpipe.runtime.faults.returns`).

`records` says, per fault, the spec each attempt got, the card or link it hit and the attempt.

Example:
    >>> from types import SimpleNamespace as NS
    >>> plan = NS(stages=(NS(device="a"), NS(device="b")), devices=(NS(id="a", kind="k"), NS(id="b", kind="k")))
    >>> c = InjectionCarrier(["kill:rank=3,step=4", "slow:rank=0,factor=2,step=1"])
    >>> c.specs_for(plan, high_water=0, start=0)
    ('kill:rank=1,step=4', 'slow:rank=0,factor=2,step=1')
    >>> c.specs_for(plan, high_water=4, start=2)   # both fired in the first attempt; the slowdown stays on "a"
    ('slow:rank=0,factor=2,step=2',)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from hetpipe.plan.replan import SLOW_MARK
from hetpipe.runtime.faults.inject import Fault, KillRank, SlowCompute, SlowLink, parse_faults, rank_devices

log = logging.getLogger(__name__)



@dataclass
class CarriedFault:
    """One fault of the run and what became of it."""

    fault: Fault
    spec: str = ""  # the spec its attempt got ("" until an attempt was due to reach it)
    target: str = ""  # the card (slow, kill) or link "A -> B" it hit
    attempt: str = ""  # the attempt folder it was handed to
    reached: bool = False  # an attempt reached its step: it fired (``spec``) or could not (``note``)
    note: str = ""  # why it did not fire (a link fault on a one-stage plan)

    @property
    def fired(self) -> bool:
        return self.reached and bool(self.spec)


def priced_factor(plan: Any, device: str) -> float:
    """How many times slower than its kind ``plan`` prices ``device`` (1.0: as its kind)."""
    kind = next((d.kind for d in plan.devices if d.id == device), "")
    return float(kind.partition(SLOW_MARK)[2] or 1.0)


def high_water(run_dir: Path, start: int) -> int:
    """The furthest step any attempt under ``run_dir`` finished (at least ``start``)."""
    from hetpipe.runtime.steps_done import read_steps

    done = [r.steps_done for d in run_dir.glob("attempt-*") for r in read_steps(d).values()]
    return max([start, *done])


class InjectionCarrier:
    """The run's faults, handed to each attempt (module docstring)."""

    def __init__(self, specs: Sequence[str | Fault] | None) -> None:
        self.records = [CarriedFault(f) for f in parse_faults(list(specs or ()))]

    def for_attempt(self, plan: Any, folder: Path, start: int) -> tuple[str, ...]:
        """The ``--inject`` specs of the attempt in ``folder`` (under the run's folder) on ``plan``,
        resuming after ``start`` steps."""
        specs = self.specs_for(plan, high_water=high_water(folder.parent, start), start=start, attempt=folder.name)
        if specs:
            log.info("%s: injecting %s", folder.name, "; ".join(specs))
        return specs

    def specs_for(self, plan: Any, *, high_water: int, start: int, attempt: str = "") -> tuple[str, ...]:
        """`for_attempt` with the furthest step earlier attempts finished given (pure but for `records`)."""
        self.settle(high_water)
        out = list(self._persisting(plan, start))
        for r in self.records:
            if r.reached:
                continue
            r.attempt, r.note = attempt, ""
            resolved = _resolve(r.fault, plan)
            if resolved is None:
                r.spec, r.target = "", ""
                r.note = f"not fired: a link fault on a {len(plan.stages)}-stage plan (no link)"
                continue
            r.spec, r.target = resolved[0].spec(), resolved[1]
            out.append(r.spec)
        return tuple(out)

    def settle(self, high_water: int) -> None:
        """Mark what the attempts were handed and reached (``high_water``: the furthest step they
        finished; after a finished run, its ``--steps``) as history: fired, or noted as not fired."""
        for r in self.records:
            if (r.spec or r.note) and r.fault.step <= high_water:
                r.reached = True

    def _persisting(self, plan: Any, start: int) -> list[str]:
        """``slow:`` specs for the cards of ``plan`` that fired slowdowns hit, beyond what the plan prices."""
        ranks = {device: i for i, device in enumerate(rank_devices(plan))}
        slowed: dict[str, tuple[float, int]] = {}
        for r in self.records:
            if r.fired and isinstance(r.fault, SlowCompute) and r.target in ranks:
                factor, step = slowed.get(r.target, (1.0, r.fault.step))
                slowed[r.target] = (factor * r.fault.factor, min(step, r.fault.step))
        out = []
        for device, (factor, step) in slowed.items():
            left = factor / priced_factor(plan, device)
            if left > 1.0 + 1e-6:
                out.append(SlowCompute(ranks[device], float(f"{left:.6g}"), max(step, start)).spec())
        return out

    def lines(self) -> list[str]:
        """One line per fault: its spec as given, what it became and where."""
        out = []
        for r in self.records:
            if r.fired:
                out.append(f"{r.fault.spec()}: fired as {r.spec} on {r.target} in {r.attempt}")
            else:
                out.append(f"{r.fault.spec()}: {r.note if r.reached else 'not reached'}")
        return out


def _resolve(fault: Fault, plan: Any) -> tuple[Fault, str] | None:
    """The fault on ``plan``'s stages (ranks clamped to its last stage) and the card or link it hits."""
    devices = rank_devices(plan)
    leads = [i for i, d in enumerate(devices) if d in {st.device for st in plan.stages}]  # each stage's lead rank
    if isinstance(fault, SlowLink):
        n = len(leads)
        if n < 2:
            return None
        stage_of = {r: s for s, r in enumerate(leads)}  # a given rank that is no lead: clamped like a stage index
        a, b = (stage_of.get(r, min(r, n - 1)) for r in (fault.src, fault.dst))
        low = min(min(a, b), n - 2)
        src, dst = (low, low + 1) if fault.src < fault.dst else (low + 1, low)
        return replace(fault, src=leads[src], dst=leads[dst]), f"{devices[leads[src]]} -> {devices[leads[dst]]}"
    assert isinstance(fault, (SlowCompute, KillRank))
    rank = min(fault.rank, len(devices) - 1)
    return replace(fault, rank=rank), devices[rank]
