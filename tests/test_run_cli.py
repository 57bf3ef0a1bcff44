"""`hetpipe run` end to end under torchrun on CPU: an emulated 3-stage run, an emulated OOM, a killed rank,
and plans refused before anything is launched.

Each launch starts 3 ranks (gpt-tiny, micro-batch 2 x 16 tokens, 4 micro-batches) and has hard timeouts:
the ranks' own waits (``--timeout``) and the launcher's watchdog, so a broken run fails instead of hanging.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from statistics import median

import pytest

from hetpipe.plan.schema import Plan
from hetpipe.partitioner.problem import Stage
from hetpipe.runtime.report import RunReport
from tests.forked_launch import use_forked_launch
from tests.machine_load import LoadTimer, load_per_core, scaled_limit_s
from tests.runtime_plans import plan_for
from tests.synthetic import synthetic_cluster

pytestmark = pytest.mark.slow

MODEL, BATCH, SEQ, MICROBATCHES = "gpt-tiny", 2, 16, 4
# The measured emulated iteration (median over steps after the first) vs the plan's T and the
# simulator's iteration for the same schedule.  T is the simulated schedule (issue 17), but the
# emulation does not stretch the optimizer step to the plan's S_s, so T keeps the looser bound.
TOLERANCE_VS_PLAN = 0.30
TOLERANCE_VS_SIMULATED = 0.15
#: A stage's emulated F/B (median over steps) vs the plan.  Below: the stretch itself (exact up to 2%,
#: `ComputeClock`) plus timer granularity.  Above: a sleeping rank woken late on a loaded 2-core machine,
#: which is not an emulation error (seen: backward 14% over under a concurrent full test run).
STRETCH_UNDER = 0.10
STRETCH_OVER = 0.50
# The optimizer step, the loss and message handling are not stretched: their real time, divided by
# the time scale, adds to every emulated step.  gpt-tiny's stages compute for ~1 ms, so a larger
# safety factor than the default (a larger time scale) keeps that share small on 2 busy cores;
# the median over the steps after the first smooths one-off stalls from other processes.
SAFETY_FACTOR = 6.0
#: The synthetic cluster's (node, kind, fp32 TFLOP/s, memory GB), and a factor that slows its cards.
SYNTHETIC_SPEC = (("n0", "fast", 40.0, 24.0), ("n0", "mid", 30.0, 24.0), ("n1", "slow", 10.0, 12.0))
SLOW_CARDS = 0.0005
EMULATED_STEPS = 3
#: DiLoCo's emulated outer exchange (median outer step - median inner step) vs the plan's sync_s: ~10 ms
#: against a few ms of scheduler wake-ups on a busy 2-core machine.
OUTER_TOLERANCE = 0.3
#: Wall-time bound of one launch on an idle machine (generous: 3 ranks importing torch on 2 cores), scaled by
#: the load per core (`tests.machine_load.LoadTimer`): beside a CPU burner a fixed bound failed good runs.
WALL_LIMIT_S = 240.0
#: The ranks' wait bound on an idle machine (`rank_timeout_s` scales it by the load).
RANK_TIMEOUT_S = 30.0
# Forked launches: tests whose claim is what the ranks compute or emulate (losses, the emulated sync and DiLoCo
# steps) run the same CLI and rank code on ranks forked from the test fork server (`tests.forked_launch`, ~10 s of
# CPU less per launch); the emulated pipeline and replica runs, the OOMs and the killed rank stay torchrun launches.


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture

    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(model, inputs, name=MODEL)
    n = graph.num_units
    stages = (Stage(0, 0, n // 3 - 1), Stage(1, n // 3, 2 * n // 3 - 1), Stage(2, 2 * n // 3, n - 1))
    plan = plan_for(graph, synthetic_cluster(), stages, microbatches=MICROBATCHES)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return path


def hetpipe_run(argv: list[str]) -> int:
    """`hetpipe run ...` through the CLI's error convention (``error:`` line, exit 2)."""
    from hetpipe.cli import app as cli

    if "run" in cli.COMMANDS:
        return cli.main(["run", *argv])
    # Until cli.py wires `run` (the lead's file), reproduce cli.main around the same functions.
    import argparse

    from rich.console import Console

    from hetpipe.errors import HetpipeError
    from hetpipe.cli.run_cmds import add_run_parser, cmd_run

    parser = argparse.ArgumentParser(prog="hetpipe")
    add_run_parser(parser.add_subparsers(dest="command", required=True))
    try:
        return cmd_run(parser.parse_args(["run", *argv]), Console(width=160))
    except HetpipeError as err:
        Console(stderr=True, soft_wrap=True).print(f"error: {err}", markup=False, highlight=False)
        return 2


def _error(err: str) -> str:
    """The ``error:`` message with any console line wrapping undone."""
    text = " ".join(err.split())
    assert text.startswith("error: "), err
    return text


def _assert_stretched_to_plan(rep: RunReport, plan: Plan) -> None:
    """Every stage was stretched to its prediction (unless it overran, which the report counts) and fit."""
    for st, planned in zip(rep.stages, plan.stages):
        assert st.device == planned.device and st.calibration_fwd_s > 0
        for got, want, overruns in ((st.fwd_emulated_s, planned.fwd_s, st.overruns_fwd),
                                    (st.bwd_emulated_s, planned.bwd_s, st.overruns_bwd)):
            if overruns == 0:  # a median over the steps: never short of the plan, late only by wake-ups
                assert want * (1 - STRETCH_UNDER) <= got <= want * (1 + STRETCH_OVER), (st.stage, got, want)
        assert 0 < st.peak_bytes <= st.usable_bytes


def rank_timeout_s() -> float:
    """The ranks' wait bound (``--timeout``, ``timeout_s``): `RANK_TIMEOUT_S` scaled by the load per core now.

    It also bounds the process-group join, where one rank on a loaded machine arrives long after the others
    (importing torch: 2.6 s of CPU, 11 s of wall time at load 11); a hang guard, not what the tests measure."""
    return scaled_limit_s(RANK_TIMEOUT_S, load_per_core=load_per_core())


def _common(plan: Path, run_dir: Path) -> list[str]:
    return [str(plan), "--model", MODEL, "--seq", str(SEQ), "--timeout", f"{rank_timeout_s():.0f}",
            "--run-dir", str(run_dir)]


def _assert_iteration_matches(rep: RunReport) -> None:
    """The emulated iteration vs the simulated schedule and the plan's T.

    Both bounds hold when the run was clean.  A compute overrun or a message that arrived late is the
    loaded machine (a sleeping rank woken late), counted in the report, not an emulation error: then only
    the lower bound is checked (the emulation never beats the schedule).  Seen: +22% with 1 late message
    under load 9-11 with a CPU burner; benchmarks/runtime_emulated.py carries the timing claim.  Wake-ups
    under the late threshold are no late message, but the report sums them (real seconds per step, all
    ranks): the upper bounds allow that sum, in emulated seconds (seen: +15.5% with none counted, load ~14).
    """
    why = (f"time scale {rep.time_scale:.4g}, overruns {rep.overruns}, late messages {rep.late_messages}, "
           f"waits past arrivals {rep.late_wait_per_step_s * 1e3:.2f} ms per step, "
           f"real step {rep.measured_iteration_s:.4f} s")
    measured, simulated = rep.measured_emulated_iteration_s, rep.simulated_iteration_s
    waited = rep.late_wait_per_step_s / rep.time_scale  # emulated seconds (time_scale: real s per emulated s)
    assert measured >= simulated * (1 - TOLERANCE_VS_SIMULATED), why
    assert rep.prediction_error >= -TOLERANCE_VS_PLAN, rep.prediction_error
    if rep.overruns == 0 and rep.late_messages == 0:
        assert simulated * (1 - TOLERANCE_VS_SIMULATED) <= measured <= simulated * (1 + TOLERANCE_VS_SIMULATED) \
            + waited, why
        assert rep.prediction_error <= TOLERANCE_VS_PLAN + waited / rep.predicted_iteration_s, rep.prediction_error


def test_emulated_run_writes_a_report_that_matches_the_plan(plan_path, tmp_path, capsys):
    report_path = tmp_path / "run.json"
    timer = LoadTimer(WALL_LIMIT_S)
    rc = hetpipe_run([*_common(plan_path, tmp_path / "run"), "--steps", str(EMULATED_STEPS), "--emulate",
                      "--report", str(report_path), "--safety-factor", str(SAFETY_FACTOR)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert timer.within_limit(), timer.why()
    rep = RunReport.load(report_path)
    plan = Plan.load(plan_path)
    assert rep.steps == EMULATED_STEPS and len(rep.losses) == EMULATED_STEPS and all(math.isfinite(x) for x in rep.losses)
    assert rep.emulate and rep.schedule == "1f1b" and rep.world_size == 3 and rep.time_scale > 0
    assert rep.predicted_iteration_s == plan.predicted.iteration_s
    _assert_stretched_to_plan(rep, plan)
    for st in rep.stages:
        assert st.peak_breakdown["params"] > 0 and st.peak_breakdown["activations"] > 0
    _assert_iteration_matches(rep)
    assert "time scale" in out.out and "median" in out.out
    # The last step's actions per rank (for the measured Gantt): exactly the schedule's actions, in order,
    # non-overlapping, and each F/B lasting its stretched (emulated) time, not just the CPU's compute.
    from hetpipe.schedule.builders import one_f_one_b

    schedule = one_f_one_b(3, MICROBATCHES)
    assert sorted(t.stage for t in rep.timelines) == [0, 1, 2]
    for t in rep.timelines:
        assert [a.action for a in t.actions] == [str(a) for a in schedule[t.stage]]
        ends = [a.start_s + a.duration_s for a in t.actions]
        assert all(b.start_s >= e - 1e-6 for e, b in zip(ends, t.actions[1:]))
        fwd = [a.duration_s / rep.time_scale for a in t.actions if "F" in a.action and "_" not in a.action]
        want, overran = plan.stages[t.stage].fwd_s, rep.stages[t.stage].overruns_fwd > 0
        # the least of the step's forwards: never short of the plan, late only by wake-ups (the stretch's bounds)
        assert want * (1 - STRETCH_UNDER) <= min(fwd) and (overran or min(fwd) <= want * (1 + STRETCH_OVER)), \
            (t.stage, fwd, want)


def test_emulated_oom_names_rank_stage_action_and_exits_2(plan_path, tmp_path, capsys):
    plan = Plan.load(plan_path)
    last = plan.stages[-1]
    # Shrink the last stage's card to half of what the plan says the stage needs.
    devices = tuple(dataclasses.replace(d, usable_bytes=last.memory_bytes // 2) if d.id == last.device else d
                    for d in plan.devices)
    stages = tuple(dataclasses.replace(s, usable_bytes=last.memory_bytes // 2) if s.device == last.device else s
                   for s in plan.stages)  # a stage records its card's usable bytes (plan/validate.py)
    small = tmp_path / "small.json"
    dataclasses.replace(plan, devices=devices, stages=stages).save(small)
    timer = LoadTimer(WALL_LIMIT_S)
    rc = hetpipe_run([*_common(small, tmp_path / "run"), "--steps", "2", "--emulate"])
    err = capsys.readouterr().err
    assert rc == 2
    assert timer.within_limit(), timer.why()
    line = _error(err)
    assert line.startswith(f"error: emulated OOM on rank 2 (stage 2, {last.device} (slow)) at 2")
    assert "held >" in line and "usable (params" in line and "activations" in line
    errors = json.loads((tmp_path / "run" / "error-rank2.json").read_text())
    assert errors["rank"] == 2 and errors["action"].startswith("2")


def test_killed_rank_fails_the_run_within_the_timeout(plan_path, tmp_path, capsys):
    timer = LoadTimer(WALL_LIMIT_S)
    rc = hetpipe_run([*_common(plan_path, tmp_path / "run"), "--steps", "3", "--loss",
                      "tests.run_helpers:lm_loss_then_die"])
    err = capsys.readouterr().err
    assert rc == 2
    assert timer.within_limit(), timer.why()
    line = _error(err)
    # Usually the dead rank first (it could not report itself), then what the first survivor saw.  When
    # torchrun tears the job down before it records the signal, the survivor's error alone names the dead
    # peer and the action it waited on -- what issue #4 requires; both forms are accepted, nothing else.
    killed_first = line.startswith("error: rank 2 (stage 2) was killed by signal 9 (SIGKILL) without reporting "
                                   "an error; then rank ")
    survivor_only = line.startswith("error: rank ") and "from rank 2" in line and "is rank 2 alive?" in line
    assert killed_first or survivor_only, line
    assert "failed waiting on" in line or "timed out" in line, line
    for path in (tmp_path / "run").glob("error-rank*.json"):  # the survivors stopped by name, not by a hang
        survivor = json.loads(path.read_text())
        assert survivor["rank"] in (0, 1) and survivor["kind"] == "RuntimeFailure", survivor


def test_plan_for_another_model_is_refused_before_launch(plan_path, tmp_path, capsys):
    rc = hetpipe_run([str(plan_path), "--model", "llama-tiny", "--seq", str(SEQ), "--steps", "1",
                      "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"this plan was made for model '{MODEL}'" in _error(err) and "re-plan" in _error(err)
    assert not (tmp_path / "run").exists()  # nothing was launched


def test_invalid_schedule_is_refused_before_launch(plan_path, tmp_path, capsys):
    rc = hetpipe_run([*_common(plan_path, tmp_path / "run"), "--steps", "1", "--schedule", "zero-bubble"])
    assert rc == 2
    assert "unknown schedule 'zero-bubble'" in _error(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_python_api_trains_on_user_data_like_a_single_process_reference(plan_path, tmp_path, monkeypatch):
    """`run(data=...)`: the first and last stages read the user's batches; step 0's loss equals the
    unsplit model's loss on the same global batch with the same (seeded) weights (its ranks forked:
    `tests.forked_launch`)."""
    use_forked_launch(monkeypatch)
    import torch

    from hetpipe.models import build, lm_loss
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.runtime.stage.build import build_stage, split_stages
    from hetpipe.runtime.run import run

    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 256, (BATCH * MICROBATCHES, SEQ), generator=gen)
        batches.append((ids, torch.roll(ids, -1, 1)))
    rep = run(plan_path, model=MODEL, steps=2, data=batches, loss=lm_loss, seq=SEQ, timeout_s=rank_timeout_s())
    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(model, inputs, name=MODEL)
    whole = build_stage(split_stages(graph.module, {}, example_inputs=inputs, num_stages=1), 0, state_dict=None,
                        device="cpu", seed=0)
    ids, targets = batches[0]
    with torch.no_grad():
        losses = [lm_loss(whole(x), y).item() for x, y in zip(ids.chunk(MICROBATCHES), targets.chunk(MICROBATCHES))]
    assert rep.losses[0] == pytest.approx(sum(losses) / MICROBATCHES, rel=1e-5)
    assert not rep.emulate and rep.time_scale == 1.0 and math.isfinite(rep.losses[1])
    assert rep.losses[1] != rep.losses[0]  # the second batch, after one Adam step


def test_replica_plan_runs_end_to_end_like_the_concatenated_batch(tmp_path, monkeypatch):
    """`hetpipe.run` on a version-2 plan (issue #6): replica A = 2 stages with 3 micro-batches, replica B = 1
    stage with 1 micro-batch, synchronous sync.  Step 0's loss is the unsplit model's mean loss over the
    whole global batch (each replica weighted by its samples); step 1 ran after a synced update (ranks forked:
    `tests.forked_launch`)."""
    use_forked_launch(monkeypatch)
    import torch

    from hetpipe.models import build, lm_loss
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.runtime.stage.build import build_stage, split_stages
    from hetpipe.runtime.run import run
    from tests.runtime_plans import replica_plan_for

    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(model, inputs, name=MODEL)
    n = graph.num_units
    plan = replica_plan_for(graph, synthetic_cluster(), [((Stage(0, 0, n // 2 - 1), Stage(1, n // 2, n - 1)), 3),
                                                         ((Stage(2, 0, n - 1),), 1)])
    path = tmp_path / "replicas.json"
    plan.save(path)
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 256, (BATCH * 4, SEQ), generator=gen)
        batches.append((ids, torch.roll(ids, -1, 1)))
    rep = run(path, model=MODEL, steps=2, data=batches, loss=lm_loss, seq=SEQ, timeout_s=rank_timeout_s())
    whole = build_stage(split_stages(graph.module, {}, example_inputs=inputs, num_stages=1), 0, state_dict=None,
                        device="cpu", seed=0)
    ids, targets = batches[0]
    with torch.no_grad():
        expected = lm_loss(whole(ids), targets).item()  # mean over the 4 equal micro-batches of both replicas
    assert rep.world_size == 3 and rep.losses[0] == pytest.approx(expected, rel=1e-5)
    assert math.isfinite(rep.losses[1]) and rep.losses[1] != rep.losses[0]


@pytest.fixture(scope="module")
def replica_plan_path(tmp_path_factory) -> Path:
    """Replica A = n0:0 + n0:1 (2 stages, 3 micro-batches), replica B = n1:2 (1 stage, 1 micro-batch), synchronous
    sync over a 1 GB/s inter-node link, so compute (~1.4 ms) and sync (~1.5 ms) weigh about the same in T."""
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture
    from tests.runtime_plans import replica_plan_for

    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(model, inputs, name=MODEL)
    n = graph.num_units
    plan = replica_plan_for(graph, synthetic_cluster(inter_bytes_s=1e9),
                            [((Stage(0, 0, n // 2 - 1), Stage(1, n // 2, n - 1)), 3), ((Stage(2, 0, n - 1),), 1)])
    path = tmp_path_factory.mktemp("replicas") / "replicas.json"
    plan.save(path)
    return path


def test_emulated_replica_run_matches_the_simulated_iteration(replica_plan_path, tmp_path, capsys):
    """`hetpipe run replicas.json --emulate` (issue #6 + #4): one time scale for every rank, every stage
    stretched to its own replica's prediction, and the step (slowest replica + the emulated gradient sync)
    within TOLERANCE_VS_SIMULATED of the simulator's max_r T_r + T_sync."""
    plan = Plan.load(replica_plan_path)
    assert plan.sync.policy == "synchronous" and 0.3 < plan.sync.sync_s / plan.sync.compute_s < 3.0
    report_path = tmp_path / "run.json"
    rc = hetpipe_run([*_common(replica_plan_path, tmp_path / "run"), "--steps", str(EMULATED_STEPS), "--emulate",
                      "--report", str(report_path), "--safety-factor", str(SAFETY_FACTOR)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rep = RunReport.load(report_path)
    assert rep.emulate and rep.world_size == 3 and rep.time_scale > 0 and len(rep.losses) == EMULATED_STEPS
    assert rep.predicted_iteration_s == plan.predicted.iteration_s
    _assert_stretched_to_plan(rep, plan)
    # The emulated sync is what separates this from the slowest replica alone: without it the step would be
    # compute_s, far outside the tolerance (sync_s / compute_s > 0.3 above).
    _assert_iteration_matches(rep)


@pytest.fixture(scope="module")
def ddp_plan_path(tmp_path_factory) -> Path:
    """Two single-card replicas (n0:0 and n0:1, one micro-batch each) over a 1 GB/s link, sync parts of about one
    transformer block (200 kB): the sync (~0.9 ms) outlasts the compute (~0.7 ms) and overlapping it with the
    backward hides about a fifth of the step (simulated 1.3 ms overlapped vs 1.6 ms after backward)."""
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture
    from tests.runtime_plans import replica_plan_for

    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(model, inputs, name=MODEL)
    n = graph.num_units
    plan = replica_plan_for(graph, synthetic_cluster(intra_bytes_s=1e9), [((Stage(0, 0, n - 1),), 1),
                                                                          ((Stage(1, 0, n - 1),), 1)],
                            bucket_cap_bytes=200_000)
    path = tmp_path_factory.mktemp("ddp") / "ddp.json"
    plan.save(path)
    return path


def test_emulated_sync_overlapped_with_backward_beats_sync_after_it(ddp_plan_path, tmp_path, capsys, monkeypatch):
    """Issue #6: the emulated step with the sync overlapped (the default) and with ``--no-sync-overlap`` each
    match their own simulation, and overlapping is measurably faster (its ranks forked: `tests.forked_launch`)."""
    use_forked_launch(monkeypatch)
    from hetpipe.plan.run_sim import simulated_iteration_s

    # Each rank steps Adam over the whole model (~3 ms of real CPU), which the emulation does not stretch and T
    # does not count, and wakes from its sleeps late on a loaded machine: real seconds that, divided by the time
    # scale, add to the ~1.3 ms emulated step.  At 3x the other tests' scale (~100) a clean run beside a CPU burner
    # came out 15.4% over its simulation (load ~4); at 6x (~200-300) that share is halved.
    safety_factor = 6 * SAFETY_FACTOR
    plan = Plan.load(ddp_plan_path)
    overlap_sim, serial_sim = (simulated_iteration_s(plan, "1f1b", overlap_sync=o) for o in (True, False))
    assert serial_sim == pytest.approx(plan.predicted.iteration_s) and overlap_sim < 0.85 * serial_sim
    measured = {}
    for flags in ([], ["--no-sync-overlap"]):
        report_path = tmp_path / f"run{len(flags)}.json"
        rc = hetpipe_run([*_common(ddp_plan_path, tmp_path / f"run{len(flags)}"), "--steps", str(EMULATED_STEPS + 1),
                          "--emulate", "--report", str(report_path), "--safety-factor", str(safety_factor), *flags])
        assert rc == 0, capsys.readouterr().err
        rep = RunReport.load(report_path)
        assert rep.simulated_iteration_s == pytest.approx(overlap_sim if not flags else serial_sim)
        assert rep.measured_emulated_iteration_s == pytest.approx(rep.simulated_iteration_s,
                                                                  rel=TOLERANCE_VS_SIMULATED), (flags, rep.overruns)
        measured[bool(flags)] = rep.measured_emulated_iteration_s
    # No direct comparison of the two runs' wall times (they ran at different moments of a shared machine's
    # load): each matched its own simulation within TOLERANCE_VS_SIMULATED above, and the simulations differ
    # by more than that (overlap_sim < 0.85 serial_sim), so a run that did not overlap would have failed there.
    print(f"overlap: measured {measured[False]:.4g} s vs simulated {overlap_sim:.4g} s; after backward: measured "
          f"{measured[True]:.4g} s vs simulated {serial_sim:.4g} s")


def test_emulated_diloco_charges_the_outer_step_every_h_steps(tmp_path, capsys, monkeypatch):
    """Issue #6: under --emulate a DiLoCo plan (H = 2) runs its inner steps without sync and every second step
    adds the outer exchange, lasting the plan's sync_s after the slowest replica (its ranks forked:
    `tests.forked_launch`)."""
    use_forked_launch(monkeypatch)
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture
    from tests.runtime_plans import replica_plan_for

    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(model, inputs, name=MODEL)
    n = graph.num_units
    # Cards and link slowed so that a step lasts ~20 ms and the outer exchange ~10 ms: at the default figures
    # they were 1.5 and 1.7 ms, where one scheduler wake-up (~0.2 ms on a loaded 2-core box) is 15%.
    slow = tuple((node, kind, tflops * SLOW_CARDS, mem) for node, kind, tflops, mem in SYNTHETIC_SPEC)
    plan = replica_plan_for(graph, synthetic_cluster(slow, inter_bytes_s=1e8),
                            [((Stage(0, 0, n // 2 - 1), Stage(1, n // 2, n - 1)), 3), ((Stage(2, 0, n - 1),), 1)],
                            policy="diloco", outer_steps=2)
    assert plan.sync.policy == "diloco" and plan.sync.outer_steps == 2
    assert plan.sync.compute_s > 0.01 and plan.sync.sync_s > 0.005  # both well above scheduling noise
    path = tmp_path / "diloco.json"
    plan.save(path)
    report_path = tmp_path / "run.json"
    rc = hetpipe_run([*_common(path, tmp_path / "run"), "--steps", "9", "--emulate", "--report", str(report_path),
                      "--safety-factor", str(SAFETY_FACTOR)])
    assert rc == 0, capsys.readouterr().err
    rep = RunReport.load(report_path)
    steps = [r.emulated_step_s for r in rep.step_records]
    # odd steps end with an outer step (every 2nd inner step); step 0 is the warm-up.  Medians of four
    # samples each, not single steps: one late wake-up on a loaded 2-core machine moved a single step by 30%.
    inner = median(steps[2::2])
    outer = median(steps[1::2])
    compute = plan.sync.compute_s
    if rep.overruns == 0 and rep.late_messages == 0:  # the emulation kept up: steps last what the plan says
        assert inner == pytest.approx(compute, rel=TOLERANCE_VS_SIMULATED), (steps, compute)
        assert outer - inner == pytest.approx(plan.sync.sync_s, rel=OUTER_TOLERANCE), (steps, plan.sync.sync_s)
    else:  # an overloaded machine (the report counts it) only ever makes steps longer, never shorter: a late
        # inner step shrinks outer - inner, so the exchange is checked on the outer steps themselves
        why = (steps, compute, plan.sync.sync_s, rep.overruns, rep.late_messages)
        assert inner >= compute * (1 - TOLERANCE_VS_SIMULATED), why
        assert outer >= compute * (1 - TOLERANCE_VS_SIMULATED) + plan.sync.sync_s * (1 - OUTER_TOLERANCE), why
    print(f"diloco H=2: emulated steps {[round(x * 1e3, 3) for x in steps]} ms; compute {compute * 1e3:.3f} ms, "
          f"outer exchange {plan.sync.sync_s * 1e3:.3f} ms")


def test_emulated_replica_oom_names_rank_replica_and_stage(replica_plan_path, tmp_path, capsys):
    plan = Plan.load(replica_plan_path)
    single = plan.stages[plan.replicas[1].first_stage]  # replica 1's only stage, rank 2
    devices = tuple(dataclasses.replace(d, usable_bytes=single.memory_bytes // 2) if d.id == single.device else d
                    for d in plan.devices)
    stages = tuple(dataclasses.replace(s, usable_bytes=single.memory_bytes // 2) if s.device == single.device else s
                   for s in plan.stages)  # a stage records its card's usable bytes (plan/validate.py)
    small = tmp_path / "small.json"
    dataclasses.replace(plan, devices=devices, stages=stages).save(small)
    rc = hetpipe_run([*_common(small, tmp_path / "run"), "--steps", "2", "--emulate"])
    err = capsys.readouterr().err
    assert rc == 2
    line = _error(err)
    assert line.startswith(f"error: emulated OOM on rank 2 (stage 0, replica 1 on {single.device} (slow)) at 0"), line
    assert "held >" in line and "usable (params" in line
    errors = json.loads((tmp_path / "run" / "error-rank2.json").read_text())
    assert errors["rank"] == 2 and errors["action"].startswith("0")
