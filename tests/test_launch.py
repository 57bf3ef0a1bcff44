"""Launch plumbing without torchrun: commands, error files, first-error choice, report merge, worker helpers."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch

from hetpipe.errors import ConfigError, PlanError
from hetpipe.runtime.launch import (
    LaunchSpec,
    RankError,
    exit_codes,
    first_error,
    multinode_command,
    read_errors,
    summary_from_log,
    torchrun_command,
    worker_args,
    write_error,
)
from hetpipe.runtime.report import RankResult, RunReport, build_report
from hetpipe.runtime.data import split_microbatches, synthetic_batch
from hetpipe.runtime.rank import make_optimizer, stage_for, stage_links, stage_ranks
from tests.runtime_plans import synthetic_plan


def _spec(tmp_path: Path, **kw) -> LaunchSpec:
    args = dict(plan_path=tmp_path / "plan.json", model="gpt-tiny", steps=2, nproc=3, run_dir=tmp_path)
    args.update(kw)
    return LaunchSpec(**args)


def test_torchrun_command_is_standalone_one_process_per_stage(tmp_path):
    cmd = torchrun_command(_spec(tmp_path, emulate=True, schedule="gpipe", seq=16), python="/py")
    assert cmd[:3] == ["/py", "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc-per-node=3" in cmd and "--max-restarts=0" in cmd
    tail = cmd[cmd.index("hetpipe.runtime.worker") + 1:]
    assert tail == worker_args(_spec(tmp_path, emulate=True, schedule="gpipe", seq=16))
    assert tail[0] == str(tmp_path / "plan.json") and "--emulate" in tail
    assert tail[tail.index("--schedule") + 1] == "gpipe" and tail[tail.index("--seq") + 1] == "16"


def test_multinode_command_uses_c10d_rendezvous(tmp_path):
    line = multinode_command(_spec(tmp_path, nproc=3), node="shelf", nnodes=2, nproc_per_node=1,
                             endpoint="desk:29500")
    assert line.startswith("torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=desk:29500")
    assert "--standalone" not in line and "-m hetpipe.runtime.worker" in line and line.endswith("--plan-node shelf")


@pytest.mark.parametrize("emulate", [False, True])
def test_torchrun_hands_every_worker_argument_through(tmp_path, emulate):
    """torchrun's own parser must not take a worker flag for one of its options (``--node`` would be
    read as an abbreviation of ``--node-rank``), and the worker must parse what arrives."""
    import shlex

    from torch.distributed.run import get_args_parser

    from hetpipe.runtime.worker import parse_args

    spec = _spec(tmp_path, nproc=3, emulate=emulate, schedule="gpipe", seq=16)
    for argv in (torchrun_command(spec, python="/py")[3:],
                 shlex.split(multinode_command(spec, node="shelf", nnodes=2, nproc_per_node=1,
                                               endpoint="desk:29500"))[1:]):
        ns = get_args_parser().parse_args(argv)
        assert ns.module and ns.training_script == "hetpipe.runtime.worker"
        worker = parse_args(ns.training_script_args)
        assert worker.plan == tmp_path / "plan.json" and worker.emulate is emulate and worker.seq == 16
    assert worker.node == "shelf"


def test_ranks_map_to_their_nodes_stages():
    plan = synthetic_plan()  # stages 0, 1 on node n0, stage 2 on n1
    assert [stage_for(plan, node=None, rank=r, local_rank=0) for r in range(3)] == [0, 1, 2]
    assert stage_for(plan, node="n0", rank=2, local_rank=1) == 1
    assert stage_for(plan, node="n1", rank=0, local_rank=0) == 2  # the rendezvous put n1 first
    with pytest.raises(ConfigError, match="node 'n1' has 1 stages .* use --nproc-per-node=1"):
        stage_for(plan, node="n1", rank=1, local_rank=1)
    with pytest.raises(ConfigError, match="runs no stage of this plan"):
        stage_for(plan, node="attic", rank=0, local_rank=0)
    assert stage_ranks([2, 0, 1], 3) == [1, 2, 0]
    with pytest.raises(ConfigError, match="exactly one rank"):
        stage_ranks([0, 0, 1], 3)


def test_first_error_is_the_earliest_rank_error(tmp_path):
    t = time.time()
    write_error(tmp_path, RankError(0, 0, "0RECV_B1", "rank 0 (stage 0) failed waiting on 0RECV_B1 from rank 1 "
                                    "(Connection closed by peer)", "RuntimeFailure", t + 0.5))
    write_error(tmp_path, RankError(2, 2, "2F3", "emulated OOM on rank 2 (stage 2, n1:0 (x)) at 2F3: ...",
                                    "RuntimeFailure", t))
    (tmp_path / "error-rank1.json").write_text("{truncated")  # a rank killed mid-write is skipped
    errors = read_errors(tmp_path)
    assert [e.rank for e in errors] == [2, 0]
    assert first_error(tmp_path, "").startswith("emulated OOM on rank 2 (stage 2")


def test_error_line_adds_rank_stage_action_when_missing():
    err = RankError(1, 1, "1F0", "ValueError: boom\nmore", "ValueError", 0.0)
    assert err.line() == "rank 1 (stage 1, at 1F0): ValueError: boom"


def test_summary_from_torchrun_log_names_the_killed_rank():
    log = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
           "Failures:\n  <NO_OTHER_FAILURES>\nRoot Cause (first observed failure):\n[0]:\n"
           "  time      : 2025-01-01_00:00:00\n  host      : box\n  rank      : 2 (local_rank: 2)\n"
           "  exitcode  : -9 (pid: 123)\n")
    assert summary_from_log(log) == ("rank 2 (stage 2) was killed by signal 9 (SIGKILL) without reporting an "
                                     "error; see the log for its output")
    assert summary_from_log("x\nsomething broke\n") == "torchrun failed: something broke"


def test_exit_codes_pair_each_summary_entry_with_its_own_rank():
    """Recorded from a CI failure: the agent's "failed (exitcode: 1) local_rank: 0" line before the
    summary must not be paired with the next entry's code (it lost the killed rank 1)."""
    log = ("E1203 09:23:48.132000 9275 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 9402) of binary: py\n"
           "Failures:\n[1]:\n  time      : 2026-12-03_09:23:48\n  host      : localhost\n"
           "  rank      : 1 (local_rank: 1)\n  exitcode  : 137 (pid: 9403) \n  error_file: <N/A>\n"
           "[2]:\n  time      : t\n  host      : h\n  rank      : 2 (local_rank: 2)\n  exitcode  : 1 (pid: 9404) \n"
           "Root Cause (first observed failure):\n[0]:\n  time      : t\n  host      : h\n"
           "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 9402) \n")
    assert exit_codes(log) == {1: 137, 2: 1, 0: 1}


# torchrun's summary after rank 2 SIGKILLed itself (recorded from `hetpipe run`): its "Root Cause" is
# rank 0, the first exit torchrun observed, not the first failure.
_KILLED_LOG = """hetpipe.runtime.worker FAILED
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 26752)
[2]:
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 26753)  (SIGKILL)
  traceback : Signal 9 (SIGKILL) received by PID 26753
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 26751)
"""


def test_a_killed_rank_is_named_before_the_survivors_it_broke(tmp_path):
    t = time.time()
    # rank 1 saw the dead rank 2; rank 0 only saw rank 1 go away (the teardown race makes either first).
    write_error(tmp_path, RankError(0, 0, "0RECV_B1", "rank 0 (stage 0) failed waiting on 0RECV_B1 from rank 1 "
                                    "(Connection closed by peer)", "RuntimeFailure", t))
    write_error(tmp_path, RankError(1, 1, "1RECV_B1", "rank 1 (stage 1) failed waiting on 1RECV_B1 from rank 2 "
                                    "(Connection reset by peer)", "RuntimeFailure", t + 0.1))
    line = first_error(tmp_path, _KILLED_LOG)
    assert line == ("rank 2 (stage 2) was killed by signal 9 (SIGKILL) without reporting an error; then rank 0 "
                    "(stage 0) failed waiting on 0RECV_B1 from rank 1 (Connection closed by peer)")
    # torchrun's SIGTERM teardown of a survivor is not a root cause; an error file wins.
    teardown = _KILLED_LOG.replace("-9 (pid: 26753)  (SIGKILL)", "-15 (pid: 26753)")
    assert first_error(tmp_path, teardown).startswith("rank 0 (stage 0) failed waiting on 0RECV_B1")
    assert summary_from_log(teardown).startswith("rank 0 (stage 0) exited with code 1")  # no signal: lowest rank


def test_worker_helpers():
    ex = (torch.empty(2, 8, dtype=torch.int64, device="meta"),)
    (a,), t = synthetic_batch("gpt-tiny", ex, global_batch=4, vocab=256, seed=3, step=0)
    (b,), _ = synthetic_batch("gpt-tiny", ex, global_batch=4, vocab=256, seed=3, step=1)
    assert a.shape == (4, 8) and 0 <= int(a.min()) and int(a.max()) < 256 and not torch.equal(a, b)
    assert torch.equal(t, torch.roll(a, -1, 1))
    mbs = split_microbatches((a, a + 1), 2, what="inputs")
    assert len(mbs) == 2 and torch.equal(mbs[1][1], a[2:] + 1)
    with pytest.raises(ConfigError, match="not divisible into 3"):
        split_microbatches(a, 3, what="inputs")
    for name, cls in (("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)):
        assert isinstance(make_optimizer(name, [torch.nn.Parameter(torch.zeros(1))], lr=None), cls)
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'"):
        make_optimizer("lion", [torch.nn.Parameter(torch.zeros(1))], lr=None)


def test_stage_links_follow_the_plan():
    plan = synthetic_plan()
    links = {(l.src, l.dst): l for l in plan.links}
    middle = stage_links(plan, 1)
    fwd = links[(plan.stages[1].device, plan.stages[2].device)]
    back = links[(plan.stages[1].device, plan.stages[0].device)]
    assert middle == {1: (fwd.bandwidth_bytes_s, fwd.latency_s), 0: (back.bandwidth_bytes_s, back.latency_s)}
    assert set(stage_links(plan, 0)) == {0} and set(stage_links(plan, 2)) == {1}
    broken = dataclasses.replace(plan, links=())
    with pytest.raises(PlanError, match="has no link"):
        stage_links(broken, 0)


def _result(stage: int, *, scale: float = 2.0, losses=()) -> RankResult:
    # 4 micro-batches per step, 3 steps: step 0's actions are warm-up and skipped by the medians.
    return RankResult(rank=stage, stage=stage, device=f"d{stage}", kind="k", step_s=(9.0, 1.0, 3.0 + stage),
                      losses=tuple(losses), fwd_s=(5.0,) * 4 + (0.25,) * 4 + (0.5,) * 4,
                      bwd_s=(9.0,) * 4 + (0.5,) * 4 + (1.0,) * 4, fwd_compute_s=(0.1,) * 12,
                      bwd_compute_s=(0.2,) * 12, time_scale=scale, peak_bytes=100 + stage,
                      peak_breakdown={"params": 100}, overruns_fwd=stage)


def test_build_report_merges_ranks(tmp_path):
    plan = synthetic_plan()
    results = [_result(s, losses=(2.0, 1.5, 1.25) if s == 2 else ()) for s in (2, 0, 1)]
    rep = build_report(plan, results, schedule="1f1b", emulate=True)
    assert rep.losses == (2.0, 1.5, 1.25)
    # Step time is the slowest rank; the median skips the warm-up step 0.
    assert [r.step_s for r in rep.step_records] == [9.0, 1.0, 5.0]
    assert rep.measured_iteration_s == 3.0 and rep.measured_emulated_iteration_s == 1.5
    assert rep.predicted_real_iteration_s == pytest.approx(2.0 * plan.predicted.iteration_s)
    assert math.isfinite(rep.simulated_iteration_s) and rep.simulated_iteration_s > 0
    s1 = rep.stages[1]
    assert (s1.fwd_emulated_s, s1.bwd_emulated_s) == (0.1875, 0.375)  # median of steps 1-2 / time scale 2
    assert s1.predicted_fwd_s == plan.stages[1].fwd_s and s1.predicted_memory_bytes == plan.stages[1].memory_bytes
    assert rep.overruns == 3 and any("CPU contention" in n for n in rep.notes)
    path = tmp_path / "run.json"
    rep.save(path)
    assert RunReport.load(path) == rep
    assert json.loads(path.read_text())["format"] == "hetpipe.run"
    with pytest.raises(ConfigError, match="a rank did not finish"):
        build_report(plan, results[:2], schedule="1f1b", emulate=True)


def test_report_load_refuses_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "hetpipe.plan"}))
    with pytest.raises(ConfigError, match="not a hetpipe run report"):
        RunReport.load(path)


def test_watchdog_kills_on_missing_start_up_stalled_progress_and_stuck_teardown(tmp_path, monkeypatch):
    import os

    from hetpipe.runtime import launch as L

    spec = _spec(tmp_path, nproc=2, timeout_s=10.0)
    now = time.time()
    assert L.watchdog_reason(spec, now, None) == ""  # starting up
    assert "only 0 of 2 ranks started" in L.watchdog_reason(spec, now - L.startup_timeout_s(2) - 1, None)
    for r in range(2):
        (tmp_path / f"progress-rank{r}").write_text("")
    assert L.watchdog_reason(spec, now - 1000, None) == ""  # both ranks report progress
    stale = now - (10.0 + L.PROGRESS_GRACE_S + 5)
    for r in range(2):
        os.utime(tmp_path / f"progress-rank{r}", (stale, stale))
    assert "no rank reported progress" in L.watchdog_reason(spec, now - 1000, None)
    assert "did not tear the job down" in L.watchdog_reason(spec, now, now - L.TEARDOWN_GRACE_S - 1)


def test_function_spec_and_saved_data(tmp_path):
    from hetpipe.models import lm_loss
    from hetpipe.runtime.run import function_spec, save_data

    assert function_spec(lm_loss, "loss") == "hetpipe.models.losses:lm_loss"
    assert function_spec("pkg.mod:fn", "loss") == "pkg.mod:fn" and function_spec(None, "loss") is None
    with pytest.raises(ConfigError, match="define it at module level"):
        function_spec(lambda out, y: out, "loss")
    x = torch.arange(8).reshape(4, 2)
    save_data(iter([(x, x + 1)] * 5), 3, tmp_path / "d.pt")
    loaded = torch.load(tmp_path / "d.pt", weights_only=False)
    assert len(loaded) == 3 and torch.equal(loaded[2][1], x + 1)
    with pytest.raises(ConfigError, match="yielded 1 batches, the run needs 3"):
        save_data([(x, x)], 3, tmp_path / "e.pt")
    with pytest.raises(ConfigError, match="must be \\(inputs, targets\\)"):
        save_data([x], 1, tmp_path / "f.pt")


def test_collect_report_merges_per_node_run_dirs(tmp_path):
    from hetpipe.runtime.run import collect_report

    plan = synthetic_plan()
    desk, shelf = tmp_path / "desk", tmp_path / "shelf"
    desk.mkdir(), shelf.mkdir()
    # The rendezvous gave the shelf node global rank 0; it runs stage 2 (see stage_for).
    for stage, (where, rank) in enumerate(((desk, 1), (desk, 2), (shelf, 0))):
        r = dataclasses.replace(_result(stage, losses=(3.0, 2.0, 1.0) if stage == 2 else ()), rank=rank)
        r.save(where / f"result-rank{rank}.json")
    rep = collect_report(plan, [desk, shelf], emulate=True)
    assert rep.losses == (3.0, 2.0, 1.0) and [s.rank for s in rep.stages] == [1, 2, 0]
    with pytest.raises(ConfigError, match="no result-rank"):
        collect_report(plan, [tmp_path / "nowhere"])
