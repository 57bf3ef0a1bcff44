"""Issue 16's second benchmark: N injected faults (kills, slowdowns, link cuts) over one emulated run.

``gpt-tiny`` from 3 hand-cut stages on the 6-card synthetic cluster of `benchmarks/faults.py` part (b),
emulated, ``4 (N + 1)`` steps, checkpoints every `EVERY`, supervised with ``--max-restarts N --adapt
--wait-for-return WAIT_S`` and all N faults given up front as ``--inject`` specs of that one run.  Fault
i (of N) happens at step ``round((i + 1) * steps / (N + 1))`` (+ i mod 3, off the checkpoint steps) on a
random rank (`random.Random(SEED)`), its kind by `KINDS`:

* ``kill`` -- the rank exits hard (``--inject kill``); most come back after `DOWN_S` (``down=``), so the
  supervisor resumes on the same plan; the ones marked ``gone`` never do: after `WAIT_S` it re-plans
  without that card;
* ``cut`` -- the rank's outgoing emulated link is cut (``--inject link:...,factor=cut``): the sends
  block for the run's `TIMEOUT_S`, the ranks fail naming the link; it heals after `DOWN_S` (the
  supervisor resumes on the same plan) except the one marked ``gone`` (its far end is re-planned away);
* ``slow`` -- the card computes `SLOW_FACTOR` x slower from then on, for the rest of the run: the ranks
  name it, ``--adapt`` weighs a re-plan against a restart.

The supervised run carries the faults across its relaunches (`hetpipe.runtime.faults.carry`): each fires
once, in whichever attempt reaches its step, on that attempt's plan (a rank beyond a smaller plan's
stages hits its last stage; a link fault on a one-stage plan cannot fire and is listed as such), and a
slowdown stays with the card it hit on every later plan that uses it, by what that plan does not price.
Compared with a fault-free run of the same data and weights: the final loss and parameters (fp32,
within 1e-5), steps redone per restart (at most the checkpoint interval), and the recovery time of each
restart.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

EVERY, TIMEOUT_S, WAIT_S, DOWN_S, SLOW_FACTOR, SEED = 4, 20.0, 8.0, 2.0, 2.0, 7
KINDS = ("kill", "slow", "cut", "kill", "cut", "slow", "kill gone", "cut", "kill", "slow",
         "cut gone", "kill", "slow", "cut", "kill", "slow", "kill gone", "cut", "kill", "slow")


def storm_specs(n: int, steps: int, ranks: int, rng: random.Random) -> list[str]:
    """The ``--inject`` specs of ``n`` faults over ``steps`` steps of a ``ranks``-stage plan (module docstring)."""
    out = []
    for i in range(n):
        step, kind = min(steps - 1, round((i + 1) * steps / (n + 1)) + i % 3), KINDS[i % len(KINDS)]
        down = "" if kind.endswith("gone") else f",down={DOWN_S:g}"
        if kind.startswith("cut"):
            src = rng.randrange(ranks - 1)
            out.append(f"link:src={src},dst={src + 1},factor=cut,step={step}{down}")
        elif kind.startswith("slow"):
            out.append(f"slow:rank={rng.randrange(ranks)},factor={SLOW_FACTOR:g},step={step}")
        else:
            out.append(f"kill:rank={rng.randrange(ranks)},step={step}{down}")
    return out


def mixed(tmp: Path, n: int) -> list[str]:
    """``n`` faults over one emulated, supervised run; the report's lines."""
    from hetpipe.runtime.run import run
    from tests.test_checkpoint import read_checkpoint
    from benchmarks.faults import B_MODEL, six_card_setup
    from tests.supervise_data import SEQ

    graph, plan, model = six_card_setup(tmp)
    steps = EVERY * (n + 1)
    common = dict(model=B_MODEL, steps=steps, seq=SEQ, data="tests.supervise_data:slow_batches",
                  loss="hetpipe.models:lm_loss", weights=tmp / "init.pt", checkpoint_every=EVERY)
    clean = run(plan, checkpoint_dir=tmp / "clean-ck", timeout_s=60.0, **common)
    specs = storm_specs(n, steps, len(plan.stages), random.Random(SEED))
    t0 = time.time()
    faulty = run(plan, run_dir=tmp / "m-run", emulate=True, timeout_s=TIMEOUT_S, checkpoint_dir=tmp / "m-ck",
                 inject=specs, max_restarts=n, adapt=True, wait_for_return=WAIT_S, **common)
    wall = time.time() - t0
    a, b = (read_checkpoint(d / f"step-{steps:06d}") for d in (tmp / "clean-ck", tmp / "m-ck"))
    diff = max(float((a[k] - b[k]).abs().max()) for k in a if k.startswith("model/"))
    stragglers = sorted(p.name for p in (tmp / "m-run").glob("attempt-*/straggler-rank*.json"))
    return _lines(specs, faulty, clean, steps, wall, diff, len(stragglers))


def _fault_rows(specs: list[str], notes) -> tuple[list[list[object]], dict[str, int]]:
    """Per fault, what the run's ``injection ...`` notes say became of it; and how many of each kind fired."""
    said = [n[len("injection "):] for n in notes if n.startswith("injection ")]
    rows, kinds = [], {"kill": 0, "link": 0, "slow": 0}
    for i, (spec, line) in enumerate(zip(specs, said)):
        state = line.partition(": ")[2]  # "<spec as run>: fired as <spec> on <card or link> in <attempt>"
        fired = state.startswith("fired as ")
        as_spec, _, rest = state[len("fired as "):].partition(" on ") if fired else ("", "", "")
        target, _, attempt = rest.rpartition(" in ")
        rows.append([i + 1, spec, as_spec if fired else state, target, attempt])
        kinds[spec.split(":")[0]] += fired
    return rows, kinds


def _lines(specs: list[str], faulty, clean, steps: int, wall: float, diff: float, named: int) -> list[str]:
    from benchmarks.common import markdown_table

    rows, kinds = _fault_rows(specs, faulty.notes)
    restarts = [[i + 1, r.kind, r.device, r.failed_step, r.resumed_step, r.steps_redone,
                 "yes" if r.steps_redone <= EVERY else "NO", f"{r.waited_s:.1f}", f"{r.restart_s:.1f}", r.new_stages]
                for i, r in enumerate(faulty.restarts)]
    recov = [r.restart_s for r in faulty.restarts if r.kind in ("lost", "returned")]
    final_ok = abs(faulty.losses[-1] - clean.losses[-1]) <= 1e-5 * max(1.0, abs(clean.losses[-1]))
    decisions = [n for n in faulty.notes if n.startswith("straggler:")]
    return [f"(c) `gpt-tiny` emulated on the 6 synthetic cards, {steps} steps, checkpoints every {EVERY}, "
            f"`--max-restarts {len(specs)} --adapt --wait-for-return {WAIT_S:g}`, --timeout {TIMEOUT_S:g} s, the "
            f"{len(specs)} faults given as --inject of the one supervised run (carried across its relaunches); "
            f"{sum(kinds.values())} fired: {kinds['kill']} kills, {kinds['link']} "
            f"link cuts, {kinds['slow']} slowdowns x{SLOW_FACTOR:g} (a kill or cut comes back after {DOWN_S:g} s "
            f"unless marked gone); {wall:.0f} s wall.", "",
            markdown_table(["fault", "--inject (run)", "fired as", "hit", "attempt"], rows), "",
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
