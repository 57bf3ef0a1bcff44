"""Issue 16, items 3-4: a slowed card re-planned away (``--adapt``) and ranks killed mid-run survived (``--max-restarts``).

(a) Straggler: ``gpt-demo`` (micro-batch 1, 4 micro-batches) planned on the emulated mini home lab
(``examples/clusters/homelab-mini.yaml``), 40 emulated steps (the issue's figure) and 80, checkpoints every 5; from step 5 the
busiest stage's card computes 3x slower (``--inject slow:...``, hetpipe.runtime.faults).  Three runs:
``--adapt`` (the ranks' straggler detection names the card -- a 3x card after its first slow step --,
the job holds at the next step boundary for the supervisor's verdict, and the supervisor re-plans and
switches the job in place there if the predicted gain beats the switch), *stay* (the same fault, no ``--adapt``)
and the *oracle* (the plan made knowing the slowdown, run from step 0 with the card at its slowed
speed: its tables).  Reported: steps to detection, re-plan time, the emulated step time of each,
throughput after the re-plan vs staying (goal >= 1.5x) and vs the oracle (goal within 10%), and the
rest of the run (steps 5..40) end to end in real seconds, restart included.

(b) Kills: ``gpt-tiny`` (3 hand-cut stages on a 6-card synthetic cluster, not emulated), 40 steps,
checkpoints every 4, ``--max-restarts N``; N times a rank of the running job, chosen at random, is
killed with SIGKILL at a set step (the process vanishes, as on a lost node).  Reported per fault: the
step, the dead card, steps redone (goal: <= the checkpoint interval), the re-plan and recovery
seconds; the final loss and parameters against a fault-free run of the same data; the median
recovery time.

(c) N faults of every kind over one emulated run (kills, slowdowns, link cuts; `benchmarks/fault_storm.py`).

Usage:
    python benchmarks/faults.py [--kills N] [--mixed N] [--skip-straggler] [--straggler-steps 40 80]

Writes ``benchmarks/results/faults.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
from typing import Any
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, write_result  # noqa: E402

A_MODEL, A_BATCH, A_SEQ, A_GLOBAL, A_STEPS, A_EVERY, A_SLOW_AT, A_FACTOR = "gpt-demo", 1, 128, 4, 40, 5, 5, 3.0
B_MODEL, B_STEPS, B_EVERY, B_DELAY_S = "gpt-tiny", 40, 4, "0.15"
SIX_CARDS = (("n0", "fast", 40.0, 24.0), ("n0", "fast", 40.0, 24.0), ("n0", "mid", 30.0, 24.0),
             ("n1", "mid", 30.0, 24.0), ("n1", "slow", 10.0, 12.0), ("n1", "slow", 10.0, 12.0))


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------- (a) straggler


def _median_emu(report, first: int) -> float:
    """Median emulated step time of the report's step records from index ``first`` on."""
    return statistics.median(r.emulated_step_s for r in report.step_records[first:])


def straggler(tmp: Path, steps: int = A_STEPS) -> list[str]:
    """Part (a); needs ``--inject`` (hetpipe.runtime.faults)."""
    if importlib.util.find_spec("hetpipe.runtime.faults") is None:
        return ["(a) not run: it needs `--inject slow:...` and the ranks' straggler detection "
                "(hetpipe.runtime.faults, issue 16 item 5), which this checkout does not have."]
    import hetpipe
    from hetpipe.models import build
    from hetpipe.plan.replan import replan

    meta, inputs = build(A_MODEL, device="meta", batch=A_BATCH, seq=A_SEQ)
    plan = hetpipe.partition(meta, ROOT / "examples" / "clusters" / "homelab-mini.yaml", example_inputs=inputs,
                             global_batch=A_GLOBAL, name=A_MODEL)
    slow = max(plan.stages, key=lambda s: s.fwd_s + s.bwd_s)
    oracle = replan(plan, slowdown={slow.device: A_FACTOR})
    common = dict(model=A_MODEL, steps=steps, emulate=True, seq=A_SEQ, checkpoint_every=A_EVERY)
    inject = [f"slow:rank={slow.index},factor={A_FACTOR:g},step={A_SLOW_AT}"]
    t0 = time.time()
    adapt = hetpipe.run(plan, inject=inject, adapt=True, checkpoint_dir=tmp / "a-ck", run_dir=tmp / "a-run", **common)
    stay = hetpipe.run(plan, inject=inject, checkpoint_dir=tmp / "s-ck", run_dir=tmp / "s-run", **common)
    orc = hetpipe.run(oracle.plan, checkpoint_dir=tmp / "o-ck", run_dir=tmp / "o-run", **common)
    wall = time.time() - t0
    return _straggler_lines(plan, slow, oracle, adapt, stay, orc, tmp, wall, steps)


def _detected_step(run_dir: Path) -> int | None:
    for path in sorted((run_dir / "attempt-0").glob("straggler-rank*.json")):
        return int(json.loads(path.read_text()).get("detected_step", -1))
    return None


def _straggler_lines(plan, slow, oracle, adapt, stay, orc, tmp: Path, wall: float, steps: int) -> list[str]:
    from hetpipe.runtime.supervise import stage_text

    detected = _detected_step(tmp / "a-run")
    decisions = [n for n in adapt.notes if n.startswith("straggler:")]
    stay_emu, orc_emu = _median_emu(stay, A_SLOW_AT + 1), _median_emu(orc, 1)
    r = adapt.restarts[0] if adapt.restarts else None
    in_place = r is not None and r.kind == "in-place"  # one report of every step; a relaunch's has its own steps
    adapt_emu = (_median_emu(adapt, r.resumed_step) if in_place else _median_emu(adapt, 1) if r
                 else _median_emu(adapt, A_SLOW_AT + 1))
    # The rest of the run in emulated (device) seconds; before its stop a relaunched --adapt ran the same old plan under
    # the same fault as the stay run, whose steps stand in for them.  The switch or relaunch itself is real seconds here.
    rest_stay = sum(s.emulated_step_s for s in stay.step_records[A_SLOW_AT:])
    rest_adapt = (sum(s.emulated_step_s for s in stay.step_records[A_SLOW_AT:r.resumed_step])
                  + sum(s.emulated_step_s for s in adapt.step_records) if r and not in_place
                  else sum(s.emulated_step_s for s in adapt.step_records[A_SLOW_AT:]))
    act = "switch in place" if in_place else "relaunch"
    with_act = rest_adapt + (r.restart_s / adapt.time_scale if r else 0.0)  # the act's real s on the run's clock
    rows = [["stay on the old plan", stage_text(plan), f"{oracle.old_iteration_s:.4g}", f"{stay_emu:.4g}", "1.00"],
            ["--adapt" + (f" (after the {act})" if r else " (stayed)"), r.new_stages if r else stage_text(plan),
             f"{(r.new_predicted_s if r else oracle.old_iteration_s):.4g}", f"{adapt_emu:.4g}",
             f"{stay_emu / adapt_emu:.2f}"],
            ["oracle = the re-plan (knows the slowdown)", stage_text(oracle.plan), f"{oracle.new_iteration_s:.4g}",
             f"{orc_emu:.4g}", f"{stay_emu / orc_emu:.2f}"]]
    what = (f"switched in place after step {r.resumed_step} in {r.restart_s:.2f} s ({_switch_parts(tmp)}), nothing "
            "redone, no relaunch" if in_place else
            f"relaunched from the checkpoint of step {r.resumed_step} ({r.steps_redone} steps redone), next step done "
            f"{r.restart_s:.1f} s after the stop" if r else "stayed on the old plan")
    return [f"(a) `{A_MODEL}` on homelab-mini: {stage_text(plan)}, predicted T {plan.predicted.iteration_s:.4g} emu s; "
            f"stage {slow.index} ({slow.device}) {A_FACTOR:g}x slower from step {A_SLOW_AT} of {steps} "
            f"(`--inject slow:...`); checkpoints every {A_EVERY}; three emulated runs, {wall:.0f} s wall.", "",
            markdown_table(["run", "stages", "predicted T (emu s)", "measured step (emu s, median)",
                            "throughput vs stay"], rows), "",
            f"- detection: the fault starts at step {A_SLOW_AT}; the ranks named the straggler after step {detected} "
            f"({(detected or 0) - A_SLOW_AT} steps later). Re-plan: {oracle.replan_s:.3f} s (from the plan's tables).",
            f"- the supervisor's decision: {'; '.join(decisions) or 'none logged'}; it {what}.",
            f"- re-planned plan vs staying: {stay_emu / orc_emu:.2f}x measured ({oracle.old_iteration_s / oracle.new_iteration_s:.2f}x "
            f"predicted; goal >= 1.5x: {'met' if stay_emu / orc_emu >= 1.5 else 'NOT met'}); --adapt's own steps after the "
            f"fault: {stay_emu / adapt_emu:.2f}x staying, {adapt_emu / orc_emu:.3f} of the oracle's step time (goal within "
            f"10%: {'met' if adapt_emu <= 1.1 * orc_emu else 'NOT met'}).",
            f"- steps {A_SLOW_AT}..{steps} end to end, emulated seconds: stay {rest_stay:.1f}, --adapt {rest_adapt:.1f} "
            f"({rest_stay / rest_adapt:.2f}x)" + (f", plus the {act}: {r.restart_s:.2f} real s on this box, "
            f"{r.restart_s / adapt.time_scale:.2f} emu s at --adapt's time scale: {with_act:.1f} ({rest_stay / with_act:.2f}x; "
            f"goal >= 1.5x: {'met' if rest_stay / with_act >= 1.5 else 'NOT met'})" if r else "") + f". Time scales (real s per emu s, "
            f"each launch calibrates its own): stay {stay.time_scale:.3g}, --adapt's last job {adapt.time_scale:.3g}, "
            f"oracle {orc.time_scale:.3g}."]


def _switch_parts(tmp: Path) -> str:
    """The in-place switch's measured parts (`hetpipe.runtime.switch.SwitchRecord`), from the adapt run's folder."""
    from hetpipe.runtime.switch import read_switches

    done = [rec for d in sorted((tmp / "a-run").glob("attempt-*")) for rec in read_switches(d)]
    return (f"save {done[0].save_s:.2f} s, rebuild {done[0].build_s:.2f} s, load and new executor {done[0].load_s:.2f} s"
            if done else "no switch record")


# ----------------------------------------------------------------------------- (b) kills


def _killer(base: Path, targets: list[int], rng: random.Random, log: list[dict]) -> threading.Thread:
    """Kill a random rank of the running attempt once it finished each target step (one kill per attempt)."""
    from hetpipe.runtime.steps_done import read_steps

    def attempt_dirs() -> list[Path]:
        return sorted(base.glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))

    def run() -> None:
        done: set[Path] = set()
        for step in targets:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                dirs = [d for d in attempt_dirs() if d not in done]
                records = read_steps(dirs[-1]) if dirs else {}
                plan_file = dirs[-1] / "plan.json" if dirs else None
                if records and plan_file and plan_file.exists():
                    ranks = len(json.loads(plan_file.read_text())["stages"])
                    if len(records) == ranks and min(r.steps_done for r in records.values()) >= step:
                        victim = records[rng.randrange(ranks)]
                        os.kill(victim.pid, signal.SIGKILL)
                        log.append({"step": step, "rank": victim.rank, "attempt": dirs[-1].name})
                        done.add(dirs[-1])
                        break
                time.sleep(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def six_card_setup(tmp: Path) -> tuple[Any, Any, Any]:
    """Part (b)'s and the storm's set-up: `B_MODEL` captured, planned as three stages on cards 0, 2
    and 4 of `SIX_CARDS`, and seeded weights saved as ``tmp/init.pt``: (graph, plan, model)."""
    import torch

    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.partitioner.problem import Stage
    from tests.runtime_plans import plan_for
    from tests.supervise_data import BATCH, MICROBATCHES, SEQ
    from tests.synthetic import synthetic_cluster

    meta, inputs = build(B_MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(meta, inputs, name=B_MODEL)
    u = graph.num_units
    plan = plan_for(graph, synthetic_cluster(SIX_CARDS), (Stage(0, 0, 1), Stage(2, 2, 3), Stage(4, 4, u - 1)),
                    microbatches=MICROBATCHES)
    torch.manual_seed(3)
    model, _ = build(B_MODEL, device="cpu", batch=BATCH, seq=SEQ)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp / "init.pt")
    return graph, plan, model


def kills(tmp: Path, n: int) -> list[str]:
    """Part (b): ``n`` kills over one run, against a fault-free run of the same data."""
    import torch

    import hetpipe
    from tests.supervise_data import DELAY_ENV, SEQ
    from tests.test_checkpoint import read_checkpoint

    graph, plan, model = six_card_setup(tmp)
    os.environ[DELAY_ENV] = B_DELAY_S
    common = dict(model=B_MODEL, steps=B_STEPS, seq=SEQ, data="tests.supervise_data:slow_batches",
                  loss="hetpipe.models:lm_loss", weights=tmp / "init.pt", checkpoint_every=B_EVERY, timeout_s=30.0)
    clean = hetpipe.run(plan, checkpoint_dir=tmp / "clean-ck", **common)
    targets = [round((i + 1) * B_STEPS / (n + 1)) for i in range(n)]
    log: list[dict] = []
    killer = _killer(tmp / "k-run", targets, random.Random(7), log)
    t0 = time.time()
    faulty = hetpipe.run(plan, max_restarts=n, checkpoint_dir=tmp / "k-ck", run_dir=tmp / "k-run", **common)
    wall = time.time() - t0
    killer.join(timeout=1)
    a, b = (read_checkpoint(d / f"step-{B_STEPS:06d}") for d in (tmp / "clean-ck", tmp / "k-ck"))
    diff = max(float((a[k] - b[k]).abs().max()) for k in a if k.startswith("model/"))
    return _kill_lines(plan, faulty, clean, log, n, wall, diff)


def _kill_lines(plan, faulty, clean, log, n: int, wall: float, diff: float) -> list[str]:
    from hetpipe.runtime.supervise import stage_text

    rows = [[i + 1, r.failed_step, f"{r.rank} ({r.device})", r.resumed_step, r.steps_redone,
             "yes" if r.steps_redone <= B_EVERY else "NO", f"{r.replan_s:.3f}", f"{r.restart_s:.1f}", r.new_stages]
            for i, r in enumerate(faulty.restarts)]
    recov = [r.restart_s for r in faulty.restarts]
    final_ok = abs(faulty.losses[-1] - clean.losses[-1]) <= 1e-5 * max(1.0, abs(clean.losses[-1]))
    return [f"(b) `{B_MODEL}` from {stage_text(plan)} on 6 synthetic cards (not emulated), {B_STEPS} steps, "
            f"checkpoints every {B_EVERY}, data {B_DELAY_S} s per batch; {n} kills (SIGKILL of a random rank of the "
            f"running job, {len(log)} delivered), `--max-restarts {n}`; {wall:.0f} s wall.", "",
            markdown_table(["fault", "at step", "dead rank (card)", "resumed from", "steps redone",
                            f"<= {B_EVERY}", "re-plan s", "recovery s", "new stages"], rows), "",
            f"- survived: {len(faulty.restarts)} of {n} faults, the run reached step {B_STEPS}; steps redone "
            f"{sum(r.steps_redone for r in faulty.restarts)} in all, at most {max((r.steps_redone for r in faulty.restarts), default=0)} "
            f"per fault (checkpoint interval {B_EVERY}).",
            f"- final loss {faulty.losses[-1]:.6f} vs fault-free {clean.losses[-1]:.6f} "
            f"({'equal within 1e-5' if final_ok else 'DIFFERENT'}); final parameters max abs diff {diff:.2e}.",
            f"- recovery (a dead rank's job ending -> the new job's first step): median "
            f"{statistics.median(recov) if recov else float('nan'):.1f} s, of which re-planning "
            f"{statistics.median(r.replan_s for r in faulty.restarts) if recov else float('nan'):.3f} s; the rest "
            "is start-up (torchrun, imports, capture, building the stages) on 2 shared cores."]


def _repeat(tmp: Path, steps: int, k: int) -> list[str]:
    """One part (a) run, headed by its repetition number and the load averages around it."""
    before = _load()
    lines = straggler(tmp, steps)
    return ["", f"**(a) run {k + 1}** (load average 1/5/15 min before: {before}; after: {_load()})", "", *lines]


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5, help="faults in part (b) (the issue's figure is 20; 0 skips part (b))")
    ap.add_argument("--mixed", type=int, default=20, help="faults in part (c) (the issue's 20; 0 skips part (c))")
    ap.add_argument("--skip-straggler", action="store_true", help="skip part (a)")
    ap.add_argument("--straggler-steps", type=int, nargs="+", default=[A_STEPS, 2 * A_STEPS],
                    help=f"part (a)'s run lengths (default {A_STEPS}, the issue's, and {2 * A_STEPS}: more steps to gain)")
    ap.add_argument("--straggler-repeats", type=int, default=1,
                    help="part (a) this many times per run length, each with its load average")
    args = ap.parse_args(argv)
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="hetpipe-faults-") as tmp:
        body = [] if args.skip_straggler else [line for n in args.straggler_steps
                                               for k in range(args.straggler_repeats)
                                               for line in _repeat(Path(tmp) / f"a{n}-{k}", n, k)]
        body += ["", *kills(Path(tmp), args.kills)] if args.kills > 0 else []
        if args.mixed > 0:
            from benchmarks.fault_storm import mixed

            (Path(tmp) / "c").mkdir()
            body += ["", *mixed(Path(tmp) / "c", args.mixed)]
    body += ["", f"Load average (1/5/15 min) before: {load_before}; after: {_load()} (other engineers' jobs share "
             "the 2 cores)."]
    print("\n".join(body))
    write_result("faults", "Faults survived and stragglers re-planned (issue 16)", "\n".join(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
