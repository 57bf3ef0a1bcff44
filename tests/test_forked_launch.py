"""`tests.forked_launch`: ``hetpipe run`` with its ranks forked from the test fork server.

A forked launch trains like a torchrun launch of the same plan (the same losses, bit for bit: the same rank
code on the same argv), sees the environment the test set after the fork server started, and a failed rank
ends the job at once, naming it, instead of leaving the others to wait out their timeout.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hetpipe.errors import RuntimeFailure
from hetpipe.plan.schema import Plan
from hetpipe.runtime.report import RunReport
from tests.dist_helpers import run_world
from tests.forked_launch import use_forked_launch
from tests.machine_load import guard_s
from tests.test_run_cli import MODEL, SEQ, hetpipe_run, plan_path  # noqa: F401 - `plan_path` is a fixture

pytestmark = pytest.mark.slow
#: What the ranks read from the environment in `test_a_forked_run_sees_the_tests_environment`.
MARK_ENV = "HETPIPE_FORKED_TEST_MARK"


def _argv(plan: Path, run_dir: Path, *extra: str) -> list[str]:
    run_dir.mkdir(parents=True)  # --report's folder must exist
    return [str(plan), "--model", MODEL, "--seq", str(SEQ), "--steps", "2", "--timeout", f"{guard_s(30.0):.0f}",
            "--run-dir", str(run_dir), "--report", str(run_dir / "run.json"), *extra]


def test_a_forked_run_equals_the_torchrun_run_of_the_same_plan(plan_path, tmp_path, monkeypatch):  # noqa: F811
    assert hetpipe_run(_argv(plan_path, tmp_path / "torchrun")) == 0
    use_forked_launch(monkeypatch)
    assert hetpipe_run(_argv(plan_path, tmp_path / "forked")) == 0
    launched, forked = (RunReport.load(tmp_path / name / "run.json") for name in ("torchrun", "forked"))
    assert forked.world_size == launched.world_size == len(Plan.load(plan_path).stages)
    assert list(forked.losses) == list(launched.losses)  # exactly: the same rank code on the same argv
    assert not (tmp_path / "forked" / "torchrun.log").exists()


def _fail_or_wait(rank: int, world: int) -> None:
    """Rank 0 fails at once; the others wait for it in a collective it never joins."""
    import torch.distributed as dist

    if rank == 0:
        raise ValueError("rank 0 failed on purpose")
    dist.barrier()


def test_fail_fast_ends_the_world_at_the_first_failed_rank(tmp_path):
    started = time.monotonic()
    timeout_s = guard_s(120.0)
    outcomes = run_world(_fail_or_wait, world_size=3, timeout_s=timeout_s, out_dir=tmp_path, fail_fast=True)
    assert outcomes[0].error_type == "ValueError"
    assert time.monotonic() - started < timeout_s  # returned at the failure, not at the deadline
    assert all(o.value is None for o in outcomes[1:])  # the waiting ranks were ended, not let finish


def test_a_forked_run_sees_the_tests_environment(plan_path, tmp_path, monkeypatch):  # noqa: F811
    """A variable set after the fork server started reaches the ranks (torchrun's inherit the launcher's)."""
    monkeypatch.setenv(MARK_ENV, "set-by-the-test")
    use_forked_launch(monkeypatch)
    rc = hetpipe_run(_argv(plan_path, tmp_path / "run", "--loss", "tests.test_forked_launch:loss_needing_the_mark"))
    assert rc == 0


def loss_needing_the_mark(logits, targets):  # noqa: ANN001, ANN201 - a loss_fn(output, targets)
    """The LM loss, in a rank that must see `MARK_ENV` (a forked rank without the test's environment fails)."""
    from hetpipe.models import lm_loss

    if os.environ.get(MARK_ENV) != "set-by-the-test":
        raise RuntimeFailure(f"{MARK_ENV} is not in the rank's environment")
    return lm_loss(logits, targets)
