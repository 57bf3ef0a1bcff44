"""Supervised runs of replica plans (issue 16, item 4): ``--max-restarts`` relaunches the same plan.

gpt-tiny, SGD + momentum (see tests/test_checkpoint_replicas.py), a replica plan of two pipelines on
3 ranks: ranks 0-1 a 2-stage pipeline with m = 3, rank 2 a 1-stage one with m = 1.  Rank 2 is killed
at the start of step 3 of 6 (``--inject kill:rank=2,step=3``: the process exits at once, no error file;
deterministic, whatever the load), checkpoints every 2 steps.  The supervisor relaunches the same plan
from the newest checkpoint (step 2); the steps after it, and the final parameters and momentum, equal a fault-free single-device
loop over the same batches within 1e-5.  ``--adapt`` (re-planning) is refused for replica plans.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hetpipe.errors import ConfigError
from hetpipe.models import build
from hetpipe.partitioner.capture.capture import capture
from hetpipe.partitioner.problem import Stage
from hetpipe.runtime.rank import DEFAULT_LR, MOMENTUM
from hetpipe.runtime.report import RunReport
from tests.reference_loop import initial_state, reference_loop
from tests.runtime_plans import replica_plan_for
from tests.supervise_data import BATCH, SEQ, batches
from tests.synthetic import synthetic_cluster
from tests.test_checkpoint import read_checkpoint
from tests.test_run_cli import hetpipe_run
from tests.machine_load import guard_s

MODEL, OPTIMIZER, STEPS, EVERY, KILL_AT = "gpt-tiny", "momentum", 6, 2, 3
RTOL, ATOL = 1e-5, 1e-5  # fp32, the acceptance tolerances


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("supervise_replicas")
    meta, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(meta, inputs, name=MODEL, optimizer=OPTIMIZER)
    n = graph.num_units
    plan = replica_plan_for(graph, synthetic_cluster(), [((Stage(0, 0, n // 2), Stage(1, n // 2 + 1, n - 1)), 3),
                                                         ((Stage(2, 0, n - 1),), 1)])
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, optimizer=OPTIMIZER))
    plan.save(folder / "R.json")
    state = initial_state(MODEL, seed=3)
    torch.save(state, folder / "init.pt")
    return folder, state


def _argv(folder, tmp, *extra: str) -> list[str]:
    return [str(folder / "R.json"), "--model", MODEL, "--seq", str(SEQ), "--steps", str(STEPS),
            "--timeout", f"{guard_s(30.0):.0f}", "--data", "tests.supervise_data:slow_batches",
            "--loss", "hetpipe.models:lm_loss",
            "--weights", str(folder / "init.pt"), "--checkpoint-dir", str(tmp / "ck"),
            "--checkpoint-every", str(EVERY), "--run-dir", str(tmp / "run"), "--report", str(tmp / "run.json"),
            *extra]


@pytest.mark.slow
def test_a_killed_rank_of_a_replica_plan_relaunches_the_same_plan_equal_to_a_fault_free_run(setup, tmp_path):
    folder, state = setup
    kill = f"kill:rank=2,step={KILL_AT}"
    assert hetpipe_run(_argv(folder, tmp_path, "--max-restarts", "1", "--inject", kill)) == 0
    report = RunReport.load(tmp_path / "run.json")
    (r,) = report.restarts
    assert r.kind == "relaunched" and r.rank == 2 and r.device == "n1:2" and "rank 2 (stage 2" in r.cause
    # the step-2 checkpoint completed before the kill (a collective save); the others' step-3 records may
    # lose the race with torchrun's teardown, so steps every rank finished is 2 or 3
    assert r.resumed_step == 2 and r.failed_step in (2, KILL_AT) and r.steps_redone == r.failed_step - 2
    assert r.old_stages == r.new_stages and report.world_size == 3
    assert "relaunched on the same plan" in r.line()
    losses, model, opt = reference_loop(state, batches(STEPS), lambda p: torch.optim.SGD(  # fault-free
        p, lr=DEFAULT_LR[OPTIMIZER], momentum=MOMENTUM), model_name=MODEL)
    assert list(report.losses) == pytest.approx(losses[r.resumed_step:], rel=RTOL, abs=ATOL)
    saved = read_checkpoint(tmp_path / "ck" / f"step-{STEPS:06d}")
    compared = 0
    for name, param in model.named_parameters():
        if f"model/{name}" in saved:  # a tied head is saved once, under its first name
            compared += 1
            torch.testing.assert_close(saved[f"model/{name}"], param.detach(), rtol=RTOL, atol=ATOL, msg=name)
            torch.testing.assert_close(saved[f"optim/{name}/momentum_buffer"], opt.state[param]["momentum_buffer"],
                                       rtol=RTOL, atol=ATOL, msg=name)
    assert compared >= len(list(model.parameters())) - 1


def test_adapt_is_refused_for_replica_plans_naming_the_fix(setup, tmp_path):
    from hetpipe.runtime.run import run

    folder, _ = setup
    with pytest.raises(ConfigError, match="--adapt re-plans single-pipeline plans only.*--max-restarts"):
        run(folder / "R.json", model=MODEL, steps=2, checkpoint_dir=tmp_path / "ck", adapt=True)
