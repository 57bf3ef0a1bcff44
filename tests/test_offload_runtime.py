"""Optimizer-state offload in the runtime (issue 14): the stage's optimizer state and step on the host.

Fast: `HostOffloadOptimizer` steps exactly like the plain optimizer (same arithmetic on host
copies), keeps no state on the card (the ledger's optimizer bytes are 0), and its state is keyed
by the device parameters (what checkpoints save by name).  Slow: 3 gloo stages, the middle one
offloading, train 3 steps like a plain single-device loop (fp32, rtol = atol = 1e-5), and a
checkpoint taken mid-run resumes to the same result.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from hetpipe.runtime.execute.held import optimizer_bytes
from hetpipe.runtime.stage.offload import HostOffloadOptimizer
from tests.machine_load import guard_s

log = logging.getLogger(__name__)
RTOL = ATOL = 1e-5  # fp32; the acceptance


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)])
def test_offloaded_optimizer_steps_exactly_like_the_plain_one(make):
    plain, off = _net(), _net()
    opt_plain, opt_off = make(list(plain.parameters())), HostOffloadOptimizer(list(off.parameters()), make)
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    for _ in range(3):
        for net, opt in ((plain, opt_plain), (off, opt_off)):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    for a, b in zip(plain.parameters(), off.parameters()):
        assert torch.equal(a, b)  # the same operations on bitwise copies
    assert optimizer_bytes(opt_plain) > 0 and optimizer_bytes(opt_off) == 0  # nothing of it on the card
    # the state is keyed by the device parameters, and lives in tensors apart from them
    first = next(off.parameters())
    state = opt_off.state[first]
    assert set(state) == set(opt_plain.state[next(plain.parameters())])
    assert all(v.data_ptr() != first.data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
    assert len(opt_off.state) == 4 and opt_off.param_groups is opt_off.inner.param_groups


def test_restoring_state_by_device_parameter_puts_it_on_the_host():
    net = _net()
    opt = HostOffloadOptimizer(list(net.parameters()), lambda ps: torch.optim.Adam(ps, lr=1e-2))
    w = next(net.parameters())
    opt.state[w] = {"step": torch.tensor(3.0), "exp_avg": torch.ones_like(w), "exp_avg_sq": torch.ones_like(w)}
    held = opt.inner.state[opt.host_of[id(w)]]
    assert held["exp_avg"].device.type == "cpu" and float(held["step"]) == 3.0


def _offload_stage(plan, index: int):
    """`plan` with stage `index` keeping its optimizer state on the host (the other stages as planned)."""
    stages = tuple(dataclasses.replace(st, offload=st.index == index) for st in plan.stages)
    return dataclasses.replace(plan, stages=stages)


@pytest.mark.slow
def test_three_stages_one_offloading_train_like_a_single_device_loop(tmp_path):
    """3 steps, 3 stages (gloo), stage 1 offloads: losses and parameters equal a plain single-device
    loop with the same Adam (fp32, rtol = atol = 1e-5)."""
    from hetpipe.plan.schema import Plan
    from hetpipe.runtime.run import run
    from tests import zoo_harness as zh

    family = zh.Family("GPT (built-in)", "gpt-tiny", "hetpipe.models:lm_loss", True)
    plan_path, _ = zh.plan_family(family, tmp_path)
    plan = _offload_stage(Plan.load(plan_path), 1)
    assert len(plan.stages) == 3 and plan.version == 9  # 4: offload; 8: the loss's transient table; 9: the step's
    ref_model, example = zh.reference_model(family)
    weights = zh.write_weights(family, ref_model, tmp_path)
    batches = zh.make_batches(family, example)
    report = run(plan, model=family.model, steps=zh.STEPS, seq=family.seq, weights=weights, data=batches,
                 loss=family.loss, save_weights=tmp_path / "trained", timeout_s=guard_s(120.0))
    ref = zh.reference_losses(family, ref_model, batches)
    torch.testing.assert_close(torch.tensor(report.losses), torch.tensor(ref), rtol=RTOL, atol=ATOL)
    saved = zh.saved_state(tmp_path / "trained")
    worst, missing = zh.state_difference(ref_model, saved)
    assert not missing and worst <= ATOL + RTOL, worst
    # the offloading stage's ledger holds no optimizer state, the others hold Adam's moments
    held = [s.peak_breakdown.get("optimizer", 0) for s in report.stages]
    assert held[1] == 0 and held[0] > 0 and held[2] > 0, held
    log.info("offload runtime: losses %s vs %s; max parameter diff %.1e; optimizer bytes %s",
             report.losses, ref, worst, held)


def test_offloaded_state_is_checkpointed_and_restored_by_name(tmp_path):
    """One stage stepping on the host saves Adam's state under each parameter's name; it restores into
    a plain optimizer and into another offloading one, equal by name (device parameters as keys)."""
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.runtime.checkpoint.files import CheckpointInfo
    from hetpipe.runtime.checkpoint.state import (StageState, canonical_names, program_fingerprint,
                                                  restore_checkpoint, save_checkpoint)
    from hetpipe.runtime.rank import make_optimizer
    from hetpipe.runtime.stage.build import build_stage, split_stages
    from hetpipe.runtime.stage.weights import saved_names

    meta, inputs = build("gpt-tiny", device="meta", batch=2, seq=16)
    graph = capture(meta, inputs, name="gpt-tiny")
    program = split_stages(graph.module, {}, example_inputs=inputs, num_stages=1)
    names, owned = canonical_names(program, 0), saved_names(program, 0)

    def stage_and(offload: bool, seed: int):
        stage = build_stage(program, 0, state_dict=None, device="cpu", seed=seed)
        params = list(stage.parameters())
        opt = (HostOffloadOptimizer(params, lambda ps: make_optimizer("adam", ps, lr=None)) if offload
               else make_optimizer("adam", params, lr=None))
        return stage, opt

    stage, opt = stage_and(True, 0)
    stage(torch.zeros(inputs[0].shape, dtype=inputs[0].dtype))[0].float().sum().backward()
    opt.step()
    info = CheckpointInfo(step=1, batches_consumed=1, model="gpt-tiny", params_fingerprint=program_fingerprint(program),
                          plan_digest="x", num_stages=1, optimizer="adam", seed=0, saved_time_s=0.0)
    folder = save_checkpoint(tmp_path / "ck", step=1, state=StageState(stage.module, names, owned, opt, 0), info=info)
    want = {local: opt.state[p] for local, p in stage.module.named_parameters()}
    for offload in (False, True):
        other, other_opt = stage_and(offload, 123)
        restore_checkpoint(folder, StageState(other.module, names, owned, other_opt, 0), same_plan=False)
        for local, p in other.module.named_parameters():
            got = other_opt.state[p]
            assert set(got) == {"step", "exp_avg", "exp_avg_sq"}, local
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[key], want[local][key]), (offload, local, key)
                assert got[key].device.type == "cpu"
