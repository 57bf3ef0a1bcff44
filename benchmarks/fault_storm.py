"""Issue 16's second benchmark: N injected faults (kills, slowdowns, link cuts) over one emulated run.

``gpt-tiny`` from 3 hand-cut stages on the 6-card synthetic cluster of `benchmarks/faults.py` part (b),
emulated, ``4 (N + 1)`` steps, checkpoints every `EVERY`, supervised with ``--max-restarts N --adapt
--wait-for-return WAIT_S``.  Fault i (of N) happens at step ``round((i + 1) * steps / (N + 1))`` on a
random stage of whichever plan is running then (`random.Random(SEED)`), its kind by `KINDS`:

* ``kill`` -- the rank exits hard (``--inject kill``); most come back after `DOWN_S` (``down=``), so the
  supervisor resumes on the same plan; the ones marked ``gone`` never do: after `WAIT_S` it re-plans
  without that card;
* ``cut`` -- the stage's outgoing emulated link is cut (``--inject link:...,factor=cut``): the sends
  block for the run's `TIMEOUT_S`, the ranks fail naming the link; it heals after `DOWN_S` (the
  supervisor resumes on the same plan) except the one marked ``gone`` (its far end is re-planned away);
  on a one-stage plan there is no link to cut and the fault is a kill instead (said in the table);
* ``slow`` -- the card computes `SLOW_FACTOR` x slower from then on, for the rest of the run (a
  relaunched job on a plan that does not price it gets it injected again): the ranks name it,
  ``--adapt`` weighs a re-plan against a restart.

Injected faults live in one launch (``--inject`` is per attempt), so this script passes each attempt
the faults still to come and the slowdowns already in force; it drives `hetpipe.runtime.supervise`
itself with that per-attempt fault list.  Compared with a fault-free run of the same data and weights:
the final loss and parameters (fp32, within 1e-5), steps redone per restart (at most the checkpoint
interval), and the recovery time of each restart.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

EVERY, TIMEOUT_S, WAIT_S, DOWN_S, SLOW_FACTOR, SEED = 4, 20.0, 8.0, 2.0, 2.0, 7
KINDS = ("kill", "slow", "cut", "kill", "cut", "slow", "kill gone", "cut", "kill", "slow",
         "cut gone", "kill", "slow", "cut", "kill", "slow", "kill gone", "cut", "kill", "slow")


@dataclass
class Fault:
    """One scheduled fault and what became of it."""

    step: int
    kind: str  # kill | cut | slow, with " gone" when it never comes back
    spec: str = ""  # the --inject spec of the attempt it fired in
    device: str = ""  # the card (kill, slow) or link (cut) it hit
    attempt: str = ""


@dataclass
class Storm:
    """The fault schedule, and the per-attempt state the attempt function keeps."""

    faults: list[Fault]
    rng: random.Random
    slowed: dict[str, float] = field(default_factory=dict)  # device -> total slowdown in force
    applied: set[int] = field(default_factory=set)  # the slowdowns counted in `slowed`

    def inject_for(self, plan, folder: Path, start: int) -> list[str]:
        """The --inject specs of the attempt in ``folder`` on ``plan``, resuming after step ``start``."""
        high = _high_water(folder.parent, start)
        for i, f in enumerate(self.faults):  # a fault the previous attempts reached has fired: it is history now
            if f.spec.startswith("slow") and f.step <= high and i not in self.applied:
                self.applied.add(i)
                self.slowed[f.device] = self.slowed.get(f.device, 1.0) * SLOW_FACTOR
        specs = _persisting_slowdowns(plan, self.slowed, start)
        for f in (f for f in self.faults if f.step > high):
            f.spec, f.device, f.attempt = self._spec(plan, f), "", folder.name
            f.device = _target(plan, f.spec)
            specs.append(f.spec)
        return specs

    def _spec(self, plan, f: Fault) -> str:
        n = len(plan.stages)
        down = "" if f.kind.endswith("gone") else f",down={DOWN_S:g}"
        if f.kind.startswith("cut") and n > 1:
            s = self.rng.randrange(n - 1)
            return f"link:src={s},dst={s + 1},factor=cut,step={f.step}{down}"
        if f.kind.startswith("slow"):
            return f"slow:rank={self.rng.randrange(n)},factor={SLOW_FACTOR:g},step={f.step}"
        return f"kill:rank={self.rng.randrange(n)},step={f.step}{down}"


def _high_water(base: Path, start: int) -> int:
    """The furthest step any earlier attempt under ``base`` finished (at least ``start``)."""
    from hetpipe.runtime.steps_done import read_steps

    done = [r.steps_done for d in base.glob("attempt-*") for r in read_steps(d).values()]
    return max([start, *done])


def _persisting_slowdowns(plan, slowed: dict[str, float], start: int) -> list[str]:
    """``slow:`` specs for the cards of ``plan`` slower than the plan prices them (``kind@x<f>``)."""
    kinds = {d.id: d.kind for d in plan.devices}
    out = []
    for rank, st in enumerate(plan.stages):
        priced = float(kinds[st.device].partition("@x")[2] or 1.0)
        left = slowed.get(st.device, 1.0) / priced
        if left > 1.0 + 1e-6:
            out.append(f"slow:rank={rank},factor={left:.6g},step={start}")
    return out


def _target(plan, spec: str) -> str:
    fields = dict(part.split("=") for part in spec.split(":", 1)[1].split(","))
    if spec.startswith("link"):
        return f"{plan.stages[int(fields['src'])].device} -> {plan.stages[int(fields['dst'])].device}"
    return plan.stages[int(fields["rank"])].device


def mixed(tmp: Path, n: int) -> list[str]:
    """``n`` faults over one emulated, supervised run; the report's lines."""
    import torch

    from hetpipe.runtime.checkpoint.files import find_checkpoint
    from hetpipe.runtime.run import run
    from hetpipe.runtime.supervise import SuperviseOptions, supervise
    from tests.test_checkpoint import read_checkpoint
    from benchmarks.faults import B_MODEL, six_card_setup
    from tests.supervise_data import SEQ

    graph, plan, model = six_card_setup(tmp)
    steps = EVERY * (n + 1)
    common = dict(model=B_MODEL, steps=steps, seq=SEQ, data="tests.supervise_data:slow_batches",
                  loss="hetpipe.models:lm_loss", weights=tmp / "init.pt", checkpoint_every=EVERY)
    clean = run(plan, checkpoint_dir=tmp / "clean-ck", timeout_s=60.0, **common)
    # Spread over the run, off the checkpoint steps by 0-2 (a kill right after a checkpoint redoes nothing).
    storm = Storm([Fault(min(steps - 1, round((i + 1) * steps / (n + 1)) + i % 3), KINDS[i % len(KINDS)])
                   for i in range(n)], random.Random(SEED))

    def attempt(p, folder: Path, resume_from: str | None):
        start = find_checkpoint(resume_from)[1].step if resume_from else 0
        folder.mkdir(parents=True, exist_ok=True)
        return run(p, run_dir=folder, resume=resume_from, emulate=True, timeout_s=TIMEOUT_S,
                   checkpoint_dir=tmp / "m-ck", inject=storm.inject_for(p, folder, start), **common)

    opts = SuperviseOptions(checkpoint_dir=tmp / "m-ck", steps=steps, max_restarts=n, adapt=True,
                            checkpoint_every=EVERY, wait_for_return_s=WAIT_S)
    t0 = time.time()
    faulty = supervise(plan, attempt, opts, run_dir=tmp / "m-run")
    wall = time.time() - t0
    a, b = (read_checkpoint(d / f"step-{steps:06d}") for d in (tmp / "clean-ck", tmp / "m-ck"))
    diff = max(float((a[k] - b[k]).abs().max()) for k in a if k.startswith("model/"))
    stragglers = sorted(p.name for p in (tmp / "m-run").glob("attempt-*/straggler-rank*.json"))
    return _lines(storm, faulty, clean, steps, wall, diff, len(stragglers))


def _lines(storm: Storm, faulty, clean, steps: int, wall: float, diff: float, named: int) -> list[str]:
    from benchmarks.common import markdown_table

    fired = [f for f in storm.faults if f.spec]
    injected_as = {"kill": "kill", "cut": "link", "slow": "slow"}
    rows = [[i + 1, f.step, f.kind + ("" if f.spec.startswith(injected_as[f.kind.split()[0]]) else " (1 stage: kill)"),
             f.spec, f.device, f.attempt] for i, f in enumerate(fired)]
    restarts = [[i + 1, r.kind, r.device, r.failed_step, r.resumed_step, r.steps_redone,
                 "yes" if r.steps_redone <= EVERY else "NO", f"{r.waited_s:.1f}", f"{r.restart_s:.1f}", r.new_stages]
                for i, r in enumerate(faulty.restarts)]
    recov = [r.restart_s for r in faulty.restarts if r.kind in ("lost", "returned")]
    final_ok = abs(faulty.losses[-1] - clean.losses[-1]) <= 1e-5 * max(1.0, abs(clean.losses[-1]))
    kinds = {k: sum(f.spec.startswith(k) for f in fired) for k in ("kill", "link", "slow")}
    decisions = [n for n in faulty.notes if n.startswith("straggler:")]
    return [f"(c) `gpt-tiny` emulated on the 6 synthetic cards, {steps} steps, checkpoints every {EVERY}, "
            f"`--max-restarts {len(storm.faults)} --adapt --wait-for-return {WAIT_S:g}`, --timeout {TIMEOUT_S:g} s; "
            f"{len(storm.faults)} faults scheduled, {len(fired)} injected: {kinds['kill']} kills, {kinds['link']} "
            f"link cuts, {kinds['slow']} slowdowns x{SLOW_FACTOR:g} (a kill or cut comes back after {DOWN_S:g} s "
            f"unless marked gone); {wall:.0f} s wall.", "",
            markdown_table(["fault", "step", "kind", "--inject", "hit", "attempt"], rows), "",
            markdown_table(["restart", "kind", "device / link", "failed at", "resumed from", "redone",
                            f"<= {EVERY}", "waited s", "recovery s", "stages after"], restarts), "",
            f"- survived: the run reached step {steps} after {len(faulty.restarts)} restarts; steps redone "
            f"{sum(r.steps_redone for r in faulty.restarts)} in all, at most "
            f"{max((r.steps_redone for r in faulty.restarts), default=0)} per restart (checkpoint interval {EVERY}).",
            f"- final loss {faulty.losses[-1]:.6f} vs fault-free {clean.losses[-1]:.6f} "
            f"({'equal within 1e-5' if final_ok else 'DIFFERENT'}); final parameters max abs diff {diff:.2e}.",
            f"- recovery of kills and cuts (the failed job's end -> the new job's first step, the wait included): "
            f"median {statistics.median(recov) if recov else float('nan'):.1f} s over {len(recov)}; a cut is "
            f"noticed only after the sends' timeout ({TIMEOUT_S:g} s), before that.",
            f"- slowdowns: {named} straggler reports; --adapt's decisions: {len(decisions)} weighed, "
            f"{sum(r.kind == 'adapt' for r in faulty.restarts)} relaunched" + "".join(f"\n  - {d}" for d in decisions)]


if __name__ == "__main__":  # python benchmarks/fault_storm.py [N]: prints the lines (benchmarks/faults.py writes them)
    import sys
    import tempfile

    keep = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp(prefix="hetpipe-storm-"))
    keep.mkdir(parents=True, exist_ok=True)
    print("\n".join(mixed(keep, int(sys.argv[1]) if len(sys.argv) > 1 else 20)))
