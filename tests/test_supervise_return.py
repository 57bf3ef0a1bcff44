"""``--wait-for-return SECONDS`` (issue 16, item 4): after a lost rank the supervisor waits for its
device to be back and resumes on the same plan, bitwise the uninterrupted run; when it does not come
back in time, it re-plans on the survivors as before.  The report says which it chose.

gpt-tiny on the 3-device synthetic cluster (the plan and data of tests/test_supervise.py); the kill is
injected (``--inject kill:rank=2,step=3,down=2``: rank 2 exits at the start of step 3 and its device is
back 2 s later, as the rank records before it exits).
"""

from __future__ import annotations

import pytest
import torch

from hetpipe.errors import ConfigError
from hetpipe.runtime.faults.inject import KillRank, parse_fault
from hetpipe.runtime.faults.options import check_wait_for_return
from hetpipe.runtime.faults.returns import back_marker, wait_for_return, write_down
from hetpipe.runtime.report import RunReport
from hetpipe.runtime.restarts import Restart
from tests.forked_launch import forked_launches
from tests.supervise_data import DELAY_ENV
from tests.test_checkpoint import read_checkpoint
from tests.test_run_cli import _error, hetpipe_run
from tests.test_supervise import _argv, setup  # noqa: F401 - `setup` is a fixture

#: --wait-for-return of the returning-device run: far above the 2 s the device is down.
WAIT_LIMIT_S = 120


def test_a_device_is_back_by_its_marker_or_its_kills_record(tmp_path):
    assert parse_fault("kill:rank=2,step=3,down=2.5") == KillRank(2, 3, 2.5)
    with pytest.raises(ConfigError, match="down '-1' must be a number of seconds >= 0"):
        parse_fault("kill:rank=2,step=3,down=-1")
    attempt = tmp_path / "attempt-0"
    attempt.mkdir()
    assert wait_for_return(["n1:2"], attempt_dir=attempt, run_dir=tmp_path, timeout_s=0.05, poll_s=0.01) is None
    back_marker(tmp_path, "n1:2").write_text("")
    assert wait_for_return(["n1:2"], attempt_dir=attempt, run_dir=tmp_path, timeout_s=0.05) is not None
    write_down(attempt, "n0:1", down_s=3600.0)  # back in an hour: not within the wait
    assert wait_for_return(["n0:1"], attempt_dir=attempt, run_dir=tmp_path, timeout_s=0.05, poll_s=0.01) is None
    write_down(attempt, "n0:1", down_s=0.0)
    assert wait_for_return(["n0:1", "n1:2"], attempt_dir=attempt, run_dir=tmp_path, timeout_s=1.0) is not None


def test_the_wait_option_is_checked_and_the_report_says_which_was_chosen(setup, tmp_path, capsys):  # noqa: F811
    assert check_wait_for_return(2, 1) == 2.0
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ConfigError, match="--wait-for-return must be a finite number"):
            check_wait_for_return(bad, 1)
    folder, _ = setup
    assert hetpipe_run(_argv(folder, tmp_path, 4, "--wait-for-return", "30")) == 2
    assert "--wait-for-return 30 needs --max-restarts N" in _error(capsys.readouterr().err)
    common = dict(kind="returned", cause="rank 2 exited with code 137", rank=2, device="n1:2", failed_step=3,
                  resumed_step=2, steps_redone=1, replan_s=0.0, restart_s=9.5, old_predicted_s=2.8e-3,
                  new_predicted_s=2.8e-3, old_stages="a[0-1] b[2-5]", new_stages="a[0-1] b[2-5]", waited_s=2.1)
    line = Restart(**common).line()
    assert "back after 2.1 s: the same plan a[0-1] b[2-5]" in line and "re-planned" not in line
    line = Restart(**{**common, "kind": "lost", "new_stages": "a[0-5]"}).line()
    assert "not back within 2.1 s; re-planned in 0 s: a[0-5]" in line


@pytest.mark.slow
def test_a_returning_device_resumes_the_same_plan_bitwise(setup, tmp_path, monkeypatch):  # noqa: F811
    """The run with a kill (rank 2 at the start of step 3, back 2 s later) waits for it, resumes from the
    checkpoint of step 2 on the same plan, and ends with every parameter, buffer and optimizer state
    bitwise equal to the uninterrupted run's; its losses from step 3 on are the same floats.  (The random
    generators are not compared: two fresh runs start theirs differently -- Python's and NumPy's are
    seeded by the OS -- and restoring them on the same plan is tests/test_checkpoint.py's.)"""
    folder, _ = setup
    steps = 6
    monkeypatch.setenv(DELAY_ENV, "0")
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    clean.mkdir(), faulty.mkdir()
    with forked_launches():  # the uninterrupted reference: the ranks' numbers only (tests.forked_launch)
        assert hetpipe_run(_argv(folder, clean, steps)) == 0

    assert hetpipe_run(_argv(folder, faulty, steps, "--max-restarts", "1", "--wait-for-return", str(WAIT_LIMIT_S),
                             "--inject", "kill:rank=2,step=3,down=2")) == 0
    report, full = RunReport.load(faulty / "run.json"), RunReport.load(clean / "run.json")
    (r,) = report.restarts
    # It did not wait out the limit: the record said 2 s.  The supervisor's own count of the wait, not the
    # run's wall time (two launches, which on a loaded 2-core machine can take minutes by themselves).
    assert r.kind == "returned" and r.rank == 2 and r.device == "n1:2" and 0 < r.waited_s < WAIT_LIMIT_S
    assert r.failed_step == 3 and r.resumed_step == 2 and r.steps_redone == 1 and r.new_stages == r.old_stages
    assert report.world_size == 3 and [s.device for s in report.stages] == [s.device for s in full.stages]
    assert list(report.losses) == list(full.losses[r.resumed_step:])  # exactly: same cuts, same operations
    ended, resumed = (read_checkpoint(d / "ck" / f"step-{steps:06d}") for d in (clean, faulty))
    assert sorted(ended) == sorted(resumed)
    compared = [k for k in ended if not k.startswith("rng/")]
    assert any(k.startswith("optim/") for k in compared) and any(k.startswith("model/") for k in compared)
    for key in compared:
        assert torch.equal(ended[key], resumed[key]), key


def test_a_cut_link_is_diagnosed_from_the_ranks_errors(tmp_path):
    from hetpipe.runtime.launch import RankError, write_error
    from hetpipe.runtime.supervise import diagnose, diagnose_cut
    from tests.runtime_plans import synthetic_plan

    plan = synthetic_plan()  # n0:0, n0:1, n1:2
    write_error(tmp_path, RankError(2, 2, "1F0", "rank 2 (stage 2) failed waiting on 1F0 from rank 1 (the emulated "
                                    "link from rank 1 to rank 2 was cut by --inject link:src=1,dst=2,factor=inf,step=3)",
                                    "RuntimeFailure", 1.0))
    assert diagnose(tmp_path, plan, start=0) is None  # every rank reported: no silent death
    death = diagnose_cut(tmp_path, plan, start=0)
    assert death is not None and death.link == ("n0:1", "n1:2") and death.devices == ("n1:2",)
    assert death.keys == ("n0:1 -> n1:2",) and death.ranks == (1,)
    write_error(tmp_path, RankError(1, 1, "1F0", "the emulated link n0:1 -> n1:2 is cut (--inject) and nothing arrived",
                                    "RuntimeFailure", 0.5))
    assert diagnose_cut(tmp_path, plan, start=0).link == ("n0:1", "n1:2")
    assert parse_fault("link:src=1,dst=2,factor=cut,step=3,down=2").spec() == "link:src=1,dst=2,factor=inf,step=3,down=2"
