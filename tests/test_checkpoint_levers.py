"""Checkpoints that move between plans (issue 16, item 1) onto a plan with the memory levers: resumed
from the 3-stage plan's checkpoint of step 2 onto the 2-stage plan whose stage 0 keeps its optimizer
state on the host (offload) and whose stage 1 recomputes half its units, the run equals a plain
single-device loop within 1e-5 -- losses, parameters and Adam's moments by name.  (Replica plans are
refused for checkpoints: tests/test_checkpoint.py::test_replica_plans_are_refused_clearly.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hetpipe.plan.schema import Plan
from tests.test_checkpoint import ATOL, EVERY, RTOL, _run, first_run, read_checkpoint, setup  # noqa: F401
from tests.test_recompute_runtime import heaviest_half


def _with_levers(plan: Plan) -> Plan:
    stages = list(plan.stages)
    stages[0] = dataclasses.replace(stages[0], offload=True)
    stages[1] = dataclasses.replace(stages[1], recompute_units=tuple(heaviest_half(plan, stages[1])))
    return dataclasses.replace(plan, stages=tuple(stages))


@pytest.mark.slow
def test_resume_onto_a_plan_with_offload_and_recompute_equals_a_single_device_run(setup, first_run,  # noqa: F811
                                                                                  tmp_path):
    folder, _, _, graph, _ = setup
    tmp, _, (ref_losses, ref_model, ref_opt) = first_run
    levers = _with_levers(Plan.load(folder / "plan2.json"))
    assert levers.stages[0].offload and levers.stages[1].recompute_units
    levers.save(folder / "plan2-levers.json")
    other = _run(folder, "plan2-levers.json", tmp_path, "--resume", str(tmp / "ck" / "step-000002"),
                 "--checkpoint-dir", str(tmp_path / "ck"))
    assert other.world_size == 2
    assert list(other.losses) == pytest.approx(ref_losses[EVERY:], rel=RTOL, abs=ATOL)
    saved = read_checkpoint(tmp_path / "ck" / "step-000004")
    head = graph.tied[0].qualified_names[-1]
    for name, p in ref_model.state_dict().items():
        if name != head:  # the tie is saved once, under the embedding's name
            torch.testing.assert_close(saved[f"model/{name}"], p, rtol=RTOL, atol=ATOL, msg=name)
    for name, p in ref_model.named_parameters():
        for key, value in ref_opt.state[p].items():
            torch.testing.assert_close(saved[f"optim/{name}/{key}"], value, rtol=RTOL, atol=ATOL, msg=f"{name} {key}")


def test_an_offloading_optimizer_steps_the_weights_restored_into_its_stage():
    """A checkpoint restore replaces the device weights after the optimizer was built: the host copies
    the next step updates must follow (before the fix the step undid the restore from stale copies)."""
    from hetpipe.runtime.stage.offload import HostOffloadOptimizer

    w, plain_w = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    opt = HostOffloadOptimizer([w], lambda ps: torch.optim.Adam(ps, lr=0.1))
    plain = torch.optim.Adam([plain_w], lr=0.1)
    with torch.no_grad():  # what restore_checkpoint does: load into the device parameters
        w.copy_(torch.arange(4.0))
        plain_w.copy_(torch.arange(4.0))
    opt.reload_weights()
    for p, o in ((w, opt), (plain_w, plain)):
        p.grad = torch.ones(4)
        o.step()
    assert torch.equal(w.detach(), plain_w.detach())
