"""The watchdog reads per-action progress: a rank inside one long step is not killed while actions finish."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hetpipe.runtime.execute import heartbeat
from hetpipe.runtime.launch import PROGRESS_GRACE_S, LaunchSpec, watchdog_reason

TIMEOUT_S = 5.0


def _spec(run_dir: Path, nproc: int = 2) -> LaunchSpec:
    return LaunchSpec(plan_path=run_dir / "plan.json", model="gpt-tiny", steps=1, nproc=nproc, run_dir=run_dir,
                      timeout_s=TIMEOUT_S)


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


@pytest.fixture(autouse=True)
def _no_heartbeat_left():
    yield
    heartbeat.uninstall()


def test_beat_after_an_action_keeps_a_long_step_alive(tmp_path):
    spec = _spec(tmp_path)
    stale = TIMEOUT_S + PROGRESS_GRACE_S + 10  # older than the watchdog allows
    for rank in range(2):
        heartbeat.install(tmp_path / f"progress-rank{rank}")
        _age(tmp_path / f"progress-rank{rank}", stale)
    started = time.time() - 2 * stale  # start-up long over
    assert "no rank reported progress" in watchdog_reason(spec, started, None)
    # rank 1 is mid-step: one action finished (its beat is due: the last write is old)
    heartbeat.install(tmp_path / "progress-rank1")
    _age(tmp_path / "progress-rank1", stale)
    time.sleep(heartbeat.MIN_INTERVAL_S)
    heartbeat.beat()
    assert watchdog_reason(spec, started, None) == ""


def test_beats_are_throttled(tmp_path):
    path = tmp_path / "progress-rank0"
    heartbeat.install(path)
    _age(path, 100)
    heartbeat.beat()  # within MIN_INTERVAL_S of install: no write
    assert time.time() - path.stat().st_mtime > 50
    time.sleep(heartbeat.MIN_INTERVAL_S)
    heartbeat.beat()
    assert time.time() - path.stat().st_mtime < 5


def test_beat_without_install_writes_nothing(tmp_path):
    heartbeat.uninstall()
    heartbeat.beat()
    assert list(tmp_path.iterdir()) == []


def test_start_up_limit_applies_until_every_rank_beat(tmp_path):
    spec = _spec(tmp_path, nproc=3)
    heartbeat.install(tmp_path / "progress-rank0")
    assert watchdog_reason(spec, time.time(), None) == ""
    assert "only 1 of 3 ranks started" in watchdog_reason(spec, time.time() - 10_000, None)
