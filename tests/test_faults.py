"""Fault injection and straggler detection without torchrun: specs, checks, the emulator's factors, the detector."""

from __future__ import annotations

import json
import math
import random
import time
from types import SimpleNamespace

import pytest

from hetpipe.errors import ConfigError, RuntimeFailure
from hetpipe.runtime.emulate.pipeline import ComputeStretch, EmulationHooks, LinkClock, StageTiming
from hetpipe.runtime.faults.inject import (
    KILL_EXIT_CODE, FaultSchedule, KillRank, SlowCompute, SlowLink, check_faults, parse_fault, parse_faults,
)
from hetpipe.runtime.faults.options import fault_args
from hetpipe.runtime.faults.straggler import (
    StragglerDetector, StragglerRecord, read_stragglers, steps_to_name, straggler_path, write_straggler,
)
from hetpipe.runtime.faults.watch import StepWatch
from hetpipe.runtime.launch import LaunchSpec, RankError, first_error, worker_args, write_error
from tests.runtime_plans import synthetic_plan


def test_specs_parse_to_records_and_back():
    assert parse_fault("slow:rank=1,factor=3,step=2") == SlowCompute(1, 3.0, 2)
    assert parse_fault(" link:src=2, dst=1, factor=2.5, step=0") == SlowLink(2, 1, 2.5, 0)
    cut = parse_fault("link:src=0,dst=1,factor=cut,step=4")
    assert cut.cut and cut == parse_fault("link:src=0,dst=1,factor=inf,step=4") == parse_fault(cut.spec())
    assert parse_fault("kill:rank=2,step=5") == KillRank(2, 5)
    for f in parse_faults(["slow:rank=1,factor=3,step=2", "kill:rank=0,step=1", cut]):
        assert parse_fault(f.spec()) == f


@pytest.mark.parametrize("spec, fragment", [
    ("slow:rank=1,factor=3", "lacks step; write e.g. slow:rank=1,factor=3,step=2"),
    ("slow:rank=1,factor=0.5,step=2", "factor 0.5 must be a number >= 1"),
    ("slow:rank=1,factor=cut,step=2", "factor cut must be a number >= 1"),
    ("slow:rank=-1,factor=2,step=2", "rank '-1' must be a whole number >= 0"),
    ("slow:rank=1,speed=2,step=2", "'speed=2' is not a field of a slow fault"),
    ("crash:rank=1,step=2", "unknown fault 'crash'; use one of slow, link, kill"),
    ("kill:rank=1,step=x", "step 'x' must be a whole number >= 0"),
])
def test_bad_specs_are_one_line_errors_naming_field_value_and_fix(spec, fragment):
    with pytest.raises(ConfigError) as err:
        parse_fault(spec)
    msg = str(err.value)
    assert msg.startswith(f"--inject {spec!r}: ") and fragment in msg and "\n" not in msg


def test_faults_are_checked_against_the_run():
    slow = parse_faults(["slow:rank=1,factor=3,step=2"])
    with pytest.raises(ConfigError, match="needs --emulate .real devices are not slowed by hetpipe"):
        check_faults(slow, num_ranks=3, emulate=False, replicas=False)
    check_faults(parse_faults(["kill:rank=1,step=2"]), num_ranks=3, emulate=False, replicas=False)  # any run
    with pytest.raises(ConfigError, match="rank 3 does not exist: the run has ranks 0-2"):
        check_faults(parse_faults(["kill:rank=3,step=1"]), num_ranks=3, emulate=True, replicas=False)
    with pytest.raises(ConfigError, match="no pipeline message goes from rank 0 to rank 2"):
        check_faults(parse_faults(["link:src=0,dst=2,factor=2,step=1"]), num_ranks=3, emulate=True, replicas=False)
    with pytest.raises(ConfigError, match="single-pipeline plans only"):
        check_faults(slow, num_ranks=3, emulate=True, replicas=True)
    with pytest.raises(ConfigError, match="step 2 is not before --steps 2"):
        check_faults(slow, num_ranks=3, emulate=True, replicas=False, steps=2)
    plan = SimpleNamespace(stages=(0, 1, 2), replicas=())
    with pytest.raises(ConfigError, match="--straggler-steps must be a whole number of steps from 1"):
        fault_args(plan, None, emulate=True, steps=3, margin=None, window_steps=0)


def test_schedule_says_what_holds_at_each_step():
    sched = FaultSchedule(parse_faults(["slow:rank=1,factor=3,step=2", "slow:rank=1,factor=2,step=4",
                                        "link:src=1,dst=2,factor=cut,step=3", "kill:rank=0,step=5"]))
    assert [sched.compute_factor(rank=1, step=s) for s in range(6)] == [1, 1, 3, 3, 6, 6]
    assert sched.compute_factor(rank=0, step=5) == 1.0
    assert sched.link_factor(src=1, dst=2, step=2) == 1.0 and math.isinf(sched.link_factor(src=1, dst=2, step=3))
    assert sched.link_factor(src=2, dst=1, step=3) == 1.0  # one direction only
    assert [sched.kills(rank=0, step=s) for s in (4, 5, 6)] == [False, True, False]
    assert sched.cut_at(2) is None and sched.cut_at(3).spec() == "link:src=1,dst=2,factor=inf,step=3"


def test_emulator_stretches_compute_and_links_by_the_injected_factor():
    c = ComputeStretch()
    assert c.remaining_s("F", elapsed_s=0.2, target_s=1.0) == pytest.approx(0.8)
    c.factor = 3.0
    assert c.remaining_s("F", elapsed_s=0.2, target_s=1.0) == pytest.approx(2.8) and c.overruns["F"] == 0
    clock = LinkClock(time_scale=2.0)
    assert clock.arrival_s(send_at_s=0.0, num_bytes=100, bandwidth_bytes_s=100.0, latency_s=0.5) == 3.0
    clock.factor = 4.0
    assert clock.arrival_s(send_at_s=10.0, num_bytes=100, bandwidth_bytes_s=100.0, latency_s=0.5) == 22.0
    assert clock.transfers == [(100, 3.0), (100, 12.0)]


def test_a_send_over_a_cut_link_blocks_for_the_timeout_then_names_the_link():
    hooks = EmulationHooks(rank=1, stage=1, device_label="n0:1 (mid)", usable_bytes=10**9,
                           predicted=StageTiming(1.0, 2.0), links={1: (1e9, 0.0), 0: (1e9, 0.0)}, time_scale=1.0)
    watch = StepWatch(plan=synthetic_plan(), stage=1, rank=1, stage_ranks=[0, 1, 2], hooks=hooks,
                      faults=FaultSchedule(parse_faults(["link:src=1,dst=2,factor=cut,step=3"])), run_dir=".",
                      timeout_s=0.05)
    watch.before_step(2)
    assert hooks.send_delay_s(1, 1000) >= 0  # not cut yet
    watch.before_step(3)
    hooks.current = "1SEND_F0"
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"could not send 1SEND_F0: the emulated link n0:1 -> n1:2 is cut"):
        hooks.send_delay_s(1, 1000)
    assert time.monotonic() - t0 >= 0.05
    assert hooks.send_delay_s(0, 1000) >= 0  # the other direction still works
    assert "was cut by --inject link:src=1,dst=2" in watch.explain("rank 2 (stage 2) timed out after 1.0 s")


def test_detector_names_an_injected_slowdown_within_k_steps_and_never_noise():
    rng = random.Random(0)
    # Noise as the emulation shows it on a loaded 2-core machine: actions late by up to +20% (the worst
    # per-stage median seen is +14%, tests/test_run_cli.py STRETCH_OVER), never early.
    for _ in range(200):
        d = StragglerDetector(margin=0.25, steps=3)
        assert all(not d.observe(s, {"fwd": 1 + 0.2 * rng.random(), "bwd": 1 + 0.2 * rng.random()})
                   for s in range(40))
    for factor, steps_needed in ((3.0, 1), (1.5, 2), (1.3, 3)):  # the larger the slowdown, the sooner
        d = StragglerDetector(margin=0.25, steps=3)
        named = {}
        for s in range(10):
            ratio = factor * (1 + 0.02 * rng.random()) if s >= 2 else 1.0
            found = d.observe(s, {"fwd": ratio, "bwd": ratio, "send->2": 1.0})
            if found:
                named[s] = found
        at = 2 + steps_needed - 1  # slow from step 2: named after that many slow steps, once
        assert list(named) == [at] and list(named[at]) == ["compute"], (factor, named)
        assert steps_to_name(factor, margin=0.25, steps=3) == steps_needed
        factors, since = named[at]["compute"]
        assert since == 2 and factor <= factors["fwd"] <= 1.02 * factor and set(factors) == {"fwd", "bwd"}


def test_detector_skips_warm_up_and_needs_consecutive_steps():
    d = StragglerDetector(margin=0.25, steps=2, first_step=5)  # named once the run's excess reaches 2 x 0.25
    assert d.observe(5, {"fwd": 9.0}) == {}  # the first step the rank runs is warm-up
    assert d.observe(6, {"fwd": 1.3}) == {} and d.observe(7, {"fwd": 1.0}) == {} and d.observe(8, {"fwd": 1.3}) == {}
    assert d.observe(9, {"fwd": 1.3, "send->1": 5.0}) == {"compute": ({"fwd": 1.3}, 8),  # 0.3 + 0.3 >= 0.5
                                                          "link->1": ({"send->1": 5.0}, 9)}  # 4.0 >= 0.5 at once
    assert d.observe(10, {"fwd": 1.3, "send->1": 5.0}) == {}  # each named once
    assert steps_to_name(1.2, margin=0.25, steps=2) == 0  # within the margin: never


def test_straggler_files_round_trip_for_a_polling_supervisor(tmp_path):
    rec = StragglerRecord(rank=1, stage=1, device="n0:1", kind="mid", what="compute",
                          factors={"fwd": 3.02, "bwd": 2.98}, since_step=2, detected_step=4)
    path = write_straggler(tmp_path, rec)
    assert path == straggler_path(tmp_path, 1) and json.loads(path.read_text())["format"] == "hetpipe.straggler"
    (tmp_path / "straggler-rank2.json").write_text("{half")
    assert read_stragglers(tmp_path) == (rec,)
    assert rec.factor == 3.02 and rec.line().startswith("straggler: rank 1 (stage 1, n0:1 (mid)): compute")


def test_watch_measures_ratios_in_plan_seconds_and_writes_the_file(tmp_path):
    plan = synthetic_plan()
    st = plan.stages[1]
    hooks = SimpleNamespace(fwd_s=[], bwd_s=[], time_scale=10.0)
    watch = StepWatch(plan=plan, stage=1, rank=1, stage_ranks=[0, 1, 2], hooks=hooks, faults=FaultSchedule(),
                      run_dir=tmp_path, window_steps=2)
    for step, factor in enumerate([1.0, 1.0, 1.3, 1.3]):  # 1.3x with K = 2: two slow steps (0.6 >= 2 x 0.25)
        watch.before_step(step)
        hooks.fwd_s += [10.0 * st.fwd_s * factor] * 4
        hooks.bwd_s += [10.0 * st.bwd_s * factor] * 4
        watch.after_step(step)
    assert [round(r.ratios["fwd"], 6) for r in watch.step_ratios] == [1.0, 1.3, 1.3]  # step 0 is warm-up
    (rec,) = watch.records
    assert (rec.rank, rec.stage, rec.device, rec.since_step, rec.detected_step) == (1, 1, st.device, 2, 3)
    assert read_stragglers(tmp_path) == (rec,)


def test_workers_get_every_fault_and_a_hard_exit_is_the_root_cause(tmp_path):
    spec = LaunchSpec(plan_path=tmp_path / "p.json", model="m", steps=3, nproc=3, run_dir=tmp_path,
                      inject=("kill:rank=1,step=2", "slow:rank=0,factor=2,step=1"), straggler_margin=0.5)
    args = worker_args(spec)
    assert args[args.index("--inject") + 1] == "kill:rank=1,step=2" and args.count("--inject") == 2
    assert args[args.index("--straggler-margin") + 1] == "0.5"
    write_error(tmp_path, RankError(0, 0, "0STEP", "rank 0 (stage 0) timed out", "RuntimeFailure", time.time()))
    log = f"rank      : 1 (local_rank: 1)\n  exitcode  : {KILL_EXIT_CODE} (pid: 7)\n"
    assert first_error(tmp_path, log).startswith("rank 1 (stage 1) exited with code 137 without reporting an error; "
                                                 "then rank 0 (stage 0) timed out")


def test_cli_refuses_slowing_real_devices_before_anything_starts(tmp_path, capsys):
    from hetpipe.cli import app

    synthetic_plan().save(tmp_path / "plan.json")
    rc = app.main(["run", str(tmp_path / "plan.json"), "--model", "gpt-tiny", "--steps", "3", "--run-dir",
                   str(tmp_path / "run"), "--inject", "slow:rank=1,factor=3,step=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "needs --emulate" in err and not (tmp_path / "run").exists()


def test_netns_falls_back_to_the_emulation_and_says_so(tmp_path, monkeypatch):
    from rich.console import Console

    from hetpipe.cli.netns_run import netns_or_emulate
    from hetpipe.runtime.faults import netns

    synthetic_plan().save(tmp_path / "plan.json")
    args = SimpleNamespace(plan=tmp_path / "plan.json", emulate=False, data=None, loss=None, weights=None,
                           save_weights=None, checkpoint_dir=None, resume=None, inject=None, schedule=None)
    console = Console(record=True, width=200)
    monkeypatch.setattr(netns, "netns_support", lambda: "creating network namespaces needs root")
    assert netns_or_emulate(args, console) is False and args.emulate is True
    assert "not on network namespaces (creating network namespaces needs root): running with --emulate" in \
        console.export_text()
    with pytest.raises(ConfigError, match="drop --emulate"):
        netns_or_emulate(args, console)
    args.emulate, args.inject = False, ["kill:rank=0,step=1"]
    with pytest.raises(ConfigError, match="drop --inject"):
        netns_or_emulate(args, console)
