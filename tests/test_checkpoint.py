"""Checkpoints that move between plans (issue 16, item 1) and the worker's own run folder (item 5).

One 3-stage run of gpt-tiny saves at steps 2 and 4; resumed from step 2 on the same plan it
continues bitwise (losses, parameters and optimizer state); resumed on a 2-stage plan with other
cuts, and on that plan with stage 0 offloading its optimizer state and stage 1 recomputing, it
equals a plain single-device loop within 1e-5 (those two resumes fork their ranks from the test fork
server, `tests.forked_launch`; the first run and the bitwise resume are torchrun launches).
Interrupted (.tmp) checkpoints are never
used, and a checkpoint of another model or lacking names is one ``error:`` line before launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetpipe.errors import ConfigError
from hetpipe.models import build, lm_loss
from hetpipe.partitioner.capture.capture import capture
from hetpipe.partitioner.problem import Stage
from hetpipe.plan.schema import Plan
from hetpipe.runtime.checkpoint.state import StageState, canonical_names, program_fingerprint, save_checkpoint
from hetpipe.runtime.checkpoint.files import (MARKER, CheckpointInfo, find_checkpoint, plan_digest, saved_keys,
                                              tmp_folder)
from hetpipe.runtime.rank import DEFAULT_LR
from hetpipe.runtime.report import RunReport
from hetpipe.runtime.stage.build import build_stage, split_stages
from hetpipe.runtime.stage.weights import saved_names
from tests.forked_launch import forked_launches
from tests.reference_loop import initial_state, reference_loop, seeded_batches
from tests.runtime_plans import plan_for
from tests.synthetic import synthetic_cluster
from tests.test_run_cli import _error, hetpipe_run
from tests.machine_load import guard_s

MODEL, BATCH, SEQ, MICROBATCHES, STEPS, EVERY = "gpt-tiny", 2, 16, 4, 4, 2
RTOL, ATOL = 1e-5, 1e-5  # fp32, the acceptance tolerances
#: The ranks' wait bound (``--timeout``) on an idle machine; `_run` scales it by the load per core (a hang guard).
RANK_WAIT_S = 60.0


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, read in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    sd = {k: torch.empty(s, dtype=d) for k, (s, d) in saved_keys(folder).items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return sd


def _plans(graph, n: int):
    three = plan_for(graph, synthetic_cluster(), (Stage(0, 0, n // 3 - 1), Stage(1, n // 3, 2 * n // 3 - 1),
                                                  Stage(2, 2 * n // 3, n - 1)), microbatches=MICROBATCHES)
    two = plan_for(graph, synthetic_cluster(), (Stage(0, 0, n // 2), Stage(1, n // 2 + 1, n - 1)),
                   microbatches=MICROBATCHES)
    return three, two


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Plans (3 stages; 2 stages with other cuts), initial weights, 4 data batches."""
    folder = tmp_path_factory.mktemp("ckpt")
    meta, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(meta, inputs, name=MODEL)
    three, two = _plans(graph, graph.num_units)
    three.save(folder / "plan3.json")
    two.save(folder / "plan2.json")
    state = initial_state(MODEL, seed=3)
    torch.save(state, folder / "init.pt")
    batches = seeded_batches(STEPS, seed=9)
    torch.save(batches, folder / "data.pt")
    return folder, state, batches, graph, inputs


def _run(folder: Path, plan: str, tmp: Path, *extra: str, forked: bool = False) -> RunReport:
    """`hetpipe run` of ``plan`` (torchrun; ``forked``: ranks forked from the test fork server,
    `tests.forked_launch`), the ranks' wait bound `RANK_WAIT_S` scaled by the load (a hang guard)."""
    report = tmp / f"{plan}-{len(list(tmp.glob('*.json')))}.json"
    start = [] if "--resume" in extra else ["--weights", str(folder / "init.pt")]  # a resume continues its weights
    wait_s = guard_s(RANK_WAIT_S)
    with forked_launches() if forked else contextlib.nullcontext():
        rc = hetpipe_run([str(folder / plan), "--model", MODEL, "--seq", str(SEQ), "--steps", str(STEPS),
                          "--timeout", f"{wait_s:.0f}", "--data", str(folder / "data.pt"),
                          "--loss", "hetpipe.models:lm_loss", *start,
                          "--report", str(report), *extra])
    assert rc == 0
    return RunReport.load(report)


def _reference(state, batches):
    """A plain single-device loop: Adam (the plan's optimizer, the runtime's default rate)."""
    return reference_loop(state, batches, lambda p: torch.optim.Adam(p, lr=DEFAULT_LR["adam"]), model_name=MODEL)


@pytest.fixture(scope="module")
def first_run(setup, tmp_path_factory):
    """4 steps on the 3-stage plan, checkpoints at 2 and 4 (and the single-device reference)."""
    folder, state, batches, *_ = setup
    tmp = tmp_path_factory.mktemp("first")
    rep = _run(folder, "plan3.json", tmp, "--checkpoint-dir", str(tmp / "ck"), "--checkpoint-every", str(EVERY))
    return tmp, rep, _reference(state, batches)


@pytest.mark.slow
def test_resume_on_the_same_plan_continues_bitwise(setup, first_run, tmp_path):
    folder, *_ = setup
    tmp, full, _ = first_run
    assert sorted(p.name for p in (tmp / "ck").iterdir()) == ["step-000002", "step-000004"]
    assert CheckpointInfo.load(tmp / "ck" / "step-000002").global_batch == \
        Plan.load(folder / "plan3.json").training.global_batch  # recorded: a resume on another one is refused
    again = _run(folder, "plan3.json", tmp_path, "--resume", str(tmp / "ck" / "step-000002"),
                 "--checkpoint-dir", str(tmp_path / "ck"))
    assert list(again.losses) == list(full.losses[EVERY:])  # exactly: same cuts, same order of operations
    assert any("resumed from" in n for n in again.notes)
    ended, resumed = read_checkpoint(tmp / "ck" / "step-000004"), read_checkpoint(tmp_path / "ck" / "step-000004")
    assert sorted(ended) == sorted(resumed)
    for key, value in ended.items():  # parameters, buffers, Adam moments and steps, random generators
        assert torch.equal(value, resumed[key]), key


@pytest.mark.slow
def test_resume_on_another_plan_equals_a_single_device_run(setup, first_run, tmp_path):
    folder, state, batches, graph, _ = setup
    tmp, full, (ref_losses, ref_model, ref_opt) = first_run
    assert list(full.losses) == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    other = _run(folder, "plan2.json", tmp_path, "--resume", str(tmp / "ck" / "step-000002"),
                 "--checkpoint-dir", str(tmp_path / "ck"), forked=True)
    assert other.world_size == 2
    assert list(other.losses) == pytest.approx(ref_losses[EVERY:], rel=RTOL, abs=ATOL)
    assert_checkpoint_is_the_reference(tmp_path / "ck" / "step-000004", graph, ref_model, ref_opt)


def assert_checkpoint_is_the_reference(folder, graph, ref_model, ref_opt) -> None:
    """The checkpoint in ``folder`` holds the single-device loop's parameters, buffers and Adam state."""
    saved = read_checkpoint(folder)
    head = graph.tied[0].qualified_names[-1]
    for name, p in ref_model.state_dict().items():
        if name != head:  # the tie is saved once, under the embedding's name
            torch.testing.assert_close(saved[f"model/{name}"], p, rtol=RTOL, atol=ATOL, msg=name)
    for name, p in ref_model.named_parameters():
        for key, value in ref_opt.state[p].items():
            torch.testing.assert_close(saved[f"optim/{name}/{key}"], value, rtol=RTOL, atol=ATOL, msg=f"{name} {key}")


def _with_levers(plan: Plan) -> Plan:
    stages = list(plan.stages)
    stages[0] = dataclasses.replace(stages[0], offload=True)
    units = range(stages[1].first_unit, stages[1].last_unit + 1)
    heaviest = sorted(units, key=lambda u: -plan.units[u].activation_bytes)[:max(1, len(units) // 2)]
    stages[1] = dataclasses.replace(stages[1], recompute_units=tuple(sorted(heaviest)))
    return dataclasses.replace(plan, stages=tuple(stages))


@pytest.mark.slow
def test_resume_onto_a_plan_with_offload_and_recompute_equals_a_single_device_run(setup, first_run, tmp_path):
    folder, _, _, graph, _ = setup
    tmp, _, (ref_losses, ref_model, ref_opt) = first_run
    levers = _with_levers(Plan.load(folder / "plan2.json"))
    assert levers.stages[0].offload and levers.stages[1].recompute_units
    levers.save(folder / "plan2-levers.json")
    other = _run(folder, "plan2-levers.json", tmp_path, "--resume", str(tmp / "ck" / "step-000002"),
                 "--checkpoint-dir", str(tmp_path / "ck"), forked=True)
    assert other.world_size == 2
    assert list(other.losses) == pytest.approx(ref_losses[EVERY:], rel=RTOL, abs=ATOL)
    assert_checkpoint_is_the_reference(tmp_path / "ck" / "step-000004", graph, ref_model, ref_opt)


# ----------------------------------------------------------------------------- no processes


def _one_stage_checkpoint(graph, inputs, root: Path, *, step: int, drop: str | None = None) -> Path:
    """A real checkpoint written by one process holding the whole model as one stage (optionally
    without the tensor ``drop``)."""
    from hetpipe.runtime.rank import make_optimizer

    program = split_stages(graph.module, {}, example_inputs=inputs, num_stages=1)
    stage = build_stage(program, 0, state_dict=None, device="cpu", seed=0)
    opt = make_optimizer("adam", list(stage.parameters()), lr=None)
    stage(torch.zeros(inputs[0].shape, dtype=inputs[0].dtype))[0].float().sum().backward()  # inputs are on meta
    opt.step()
    owned = {k: v for k, v in saved_names(program, 0).items() if v != drop}
    st = StageState(stage.module, canonical_names(program, 0), owned, opt, 0)
    plan = _plans(graph, graph.num_units)[0]
    info = CheckpointInfo(step=step, batches_consumed=step, model=MODEL, params_fingerprint=program_fingerprint(program),
                          plan_digest=plan_digest(plan), num_stages=1, optimizer="adam", seed=0, saved_time_s=0.0)
    return save_checkpoint(root, step=step, state=st, info=info)


def test_an_interrupted_checkpoint_is_never_used(setup, tmp_path, capsys):
    folder, _, _, graph, inputs = setup
    root = tmp_path / "ck"
    _one_stage_checkpoint(graph, inputs, root, step=2)
    crashed = _one_stage_checkpoint(graph, inputs, root, step=4)
    crashed.rename(tmp_folder(root, 4))  # as if rank 0 died before its rename: marker and all, still .tmp
    assert find_checkpoint(root)[0].name == "step-000002"
    (root / "step-000002" / MARKER).unlink()  # a crash before the marker: not complete either
    with pytest.raises(ConfigError, match="no complete checkpoint .*step-000004.tmp.* interrupted mid-write"):
        find_checkpoint(root)
    with pytest.raises(ConfigError, match="interrupted mid-write"):
        find_checkpoint(tmp_folder(root, 4))
    rc = hetpipe_run([str(folder / "plan3.json"), "--model", MODEL, "--seq", str(SEQ), "--steps", "6",
                      "--resume", str(root), "--run-dir", str(tmp_path / "run")])
    err = _error(capsys.readouterr().err)
    assert rc == 2 and "no complete checkpoint" in err and err.count("error:") == 1, err
    assert not (tmp_path / "run" / "torchrun.log").exists()  # refused before launch


@pytest.mark.parametrize("case", ["other-model", "missing-name", "past-steps"])
def test_a_wrong_checkpoint_is_one_error_line_before_launch(setup, tmp_path, capsys, case):
    folder, _, _, graph, inputs = setup
    root, model, steps = tmp_path / "ck", MODEL, "6"
    names = sorted(canonical_names(split_stages(graph.module, {}, example_inputs=inputs, num_stages=1), 0).values())
    drop = next(n for n in names if ".1." in n and n.endswith("weight")) if case == "missing-name" else None
    _one_stage_checkpoint(graph, inputs, root, step=2, drop=drop)
    plan = folder / "plan3.json"
    if case == "other-model":  # llama-tiny: another model with its own plan
        meta, ins = build("llama-tiny", device="meta", batch=BATCH, seq=SEQ)
        g = capture(meta, ins, name="llama-tiny")
        _plans(g, g.num_units)[0].save(tmp_path / "llama.json")
        plan, model = tmp_path / "llama.json", "llama-tiny"
    if case == "past-steps":
        steps = "2"
    rc = hetpipe_run([str(plan), "--model", model, "--seq", str(SEQ), "--steps", steps, "--resume", str(root),
                      "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    err = _error(err)
    assert rc == 2 and err.count("error:") == 1 and str(root / "step-000002") in err, err
    assert "resuming" not in out, out  # refused before the run says it resumes
    expect = {"other-model": "checkpoint of model 'gpt-tiny' lacks", "missing-name": f"lacks 1 tensor(s) the model "
              f"needs: {drop}", "past-steps": "pass --steps larger than 2"}[case]
    assert expect in err, err
    assert not (tmp_path / "run" / "torchrun.log").exists()


def test_checkpoint_options_are_checked_before_launch(setup, tmp_path, capsys):
    folder, *_ = setup
    rc = hetpipe_run([str(folder / "plan3.json"), "--model", MODEL, "--seq", str(SEQ), "--steps", "2",
                      "--checkpoint-every", "0", "--checkpoint-dir", str(tmp_path / "ck")])
    err = _error(capsys.readouterr().err)
    assert rc == 2 and "--checkpoint-every must be a positive number of steps, got 0" in err, err


def _with_global_batch(folder: Path, global_batch: int) -> None:
    """Rewrite a checkpoint's marker as if a run at ``global_batch`` had saved it."""
    info = CheckpointInfo.load(folder)
    dataclasses.replace(info, global_batch=global_batch).save(folder)


def test_a_reused_checkpoint_dir_is_refused_without_resume(setup, tmp_path, capsys):
    """A new run into a folder holding an earlier run's checkpoints would overwrite some and leave
    ``--resume`` to pick the other run's newest: refused before anything is printed or launched."""
    folder, _, _, graph, inputs = setup
    root = tmp_path / "ck"
    _one_stage_checkpoint(graph, inputs, root, step=2)
    marker = (root / "step-000002" / MARKER).read_text()
    rc = hetpipe_run([str(folder / "plan3.json"), "--model", MODEL, "--seq", str(SEQ), "--steps", "2", "--emulate",
                      "--seed", "7", "--checkpoint-dir", str(root), "--checkpoint-every", "2",
                      "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    err = _error(err)
    assert rc == 2 and err.count("error:") == 1, err
    assert f"--checkpoint-dir {root}: already holds 1 checkpoint(s)" in err and "step-000002" in err, err
    assert f"pass --resume {root}" in err and "an empty or new folder" in err, err
    assert out == "" and (root / "step-000002" / MARKER).read_text() == marker
    assert not (tmp_path / "run" / "torchrun.log").exists()


def test_a_resume_with_another_seed_is_refused(setup, tmp_path, capsys):
    folder, _, _, graph, inputs = setup
    root = tmp_path / "ck"
    _one_stage_checkpoint(graph, inputs, root, step=2)  # saved with seed 0
    rc = hetpipe_run([str(folder / "plan3.json"), "--model", MODEL, "--seq", str(SEQ), "--steps", "4",
                      "--seed", "7", "--resume", str(root), "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    err = _error(err)
    assert rc == 2 and err.count("error:") == 1, err
    assert "saved by a run with --seed 0 but this run has --seed 7" in err and "pass --seed 0" in err, err
    assert "resuming" not in out and not (tmp_path / "run" / "torchrun.log").exists()


def test_a_resume_with_another_global_batch_is_refused(setup, tmp_path, capsys):
    """The marker records the global batch; a plan of another one would not continue the data stream.
    An older marker without it (what `_one_stage_checkpoint` writes) is not taken for a mismatch."""
    from hetpipe.runtime.checkpoint.files import check_run_settings

    folder, _, _, graph, inputs = setup
    root = tmp_path / "ck"
    ck = _one_stage_checkpoint(graph, inputs, root, step=2)
    gb = Plan.load(folder / "plan3.json").training.global_batch
    check_run_settings(ck, CheckpointInfo.load(ck), seed=0, global_batch=gb)  # unknown: accepted
    _with_global_batch(ck, 2 * gb)
    rc = hetpipe_run([str(folder / "plan3.json"), "--model", MODEL, "--seq", str(SEQ), "--steps", "4",
                      "--resume", str(root), "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    err = _error(err)
    assert rc == 2 and err.count("error:") == 1 and str(ck) in err, err
    assert f"saved at global batch {2 * gb}" in err and f"the plan's global batch is {gb}" in err, err
    assert f"re-plan with --global-batch {2 * gb}" in err, err
    assert "resuming" not in out and not (tmp_path / "run" / "torchrun.log").exists()


def test_weights_with_resume_are_refused(setup, tmp_path, capsys):
    """The checkpoint holds the weights: ``--weights`` would be silently ignored, in the CLI, `run` and `Trainer`."""
    from hetpipe.runtime.run import run
    from hetpipe.runtime.trainer import Trainer

    folder, _, _, graph, inputs = setup
    root = tmp_path / "ck"
    _one_stage_checkpoint(graph, inputs, root, step=2)
    rc = hetpipe_run([str(folder / "plan3.json"), "--model", MODEL, "--seq", str(SEQ), "--steps", "4",
                      "--weights", str(folder / "init.pt"), "--resume", str(root), "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    err = _error(err)
    assert rc == 2 and err.count("error:") == 1, err
    assert f"--weights {folder / 'init.pt'} with --resume {root}: the checkpoint holds the weights" in err, err
    assert "drop --weights" in err and "resuming" not in out
    for call in (lambda: run(folder / "plan3.json", model=MODEL, seq=SEQ, steps=4, weights=folder / "init.pt",
                             resume=root, run_dir=tmp_path / "run"),
                 lambda: Trainer(folder / "plan3.json", model=MODEL, seq=SEQ, weights=folder / "init.pt", resume=root)):
        with pytest.raises(ConfigError, match="the checkpoint holds the weights"):
            call()
    assert not (tmp_path / "run" / "torchrun.log").exists()


def test_option_and_file_errors_come_before_any_output(setup, tmp_path, capsys):
    """Nothing ("resuming from", the wall-time estimate) is printed before a refused option or file."""
    folder, _, _, graph, inputs = setup
    root = tmp_path / "ck"
    _one_stage_checkpoint(graph, inputs, root, step=2)
    base = ["--model", MODEL, "--seq", str(SEQ), "--steps", "4", "--emulate"]
    for argv, expect in (([str(tmp_path / "nope.json"), *base, "--resume", str(root)], "nope.json"),
                         ([str(folder / "plan3.json"), *base, "--checkpoint-every", "2"],
                          "--checkpoint-every 2 needs --checkpoint-dir"),
                         ([str(folder / "plan3.json"), *base, "--resume", str(root), "--checkpoint-every", "2"],
                          "--checkpoint-every 2 needs --checkpoint-dir")):
        rc = hetpipe_run(argv)
        out, err = capsys.readouterr()
        assert rc == 2 and expect in _error(err) and out == "", (out, err)


@pytest.mark.slow
def test_the_worker_creates_its_run_folder(setup, tmp_path):
    """The README's two-node commands, run as written on one host: two torchrun launchers joined by a
    c10d rendezvous, each with its own --plan-node and a --run-dir nobody created (issue 16, item 5:
    it failed with FileNotFoundError 'desk-run/progress-rank0'); `collect_report` merges them."""
    import socket

    from hetpipe.runtime.run import collect_report

    folder, *_ = setup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node, nproc in (("n0", 2), ("n1", 1)):  # plan3: stages 0-1 on node n0, stage 2 on n1
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ckpt-test", "--max-restarts=0",
               "-m", "hetpipe.runtime.worker", str(folder / "plan3.json"), "--model", MODEL, "--seq", str(SEQ),
               "--steps", "1", "--run-dir", str(tmp_path / f"{node}-run" / "nested"),
               "--timeout", f"{guard_s(60.0):.0f}",
               "--plan-node", node]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    report = collect_report(folder / "plan3.json", [tmp_path / f"{n}-run" / "nested" for n in ("n0", "n1")])
    assert report.world_size == 3 and len(report.losses) == 1


def _trainer_worker(rank: int, world: int, folder: str, plan: str, steps: int, resume: str | None, out: str) -> list:
    """`Trainer` in a user's loop: resume (skipping the consumed batches), step, save a checkpoint."""
    from hetpipe.runtime.trainer import Trainer

    trainer = Trainer(f"{folder}/{plan}", model=MODEL, seq=SEQ, loss=lm_loss,
                      weights=None if resume else f"{folder}/init.pt", resume=resume)
    batches = torch.load(f"{folder}/data.pt")[trainer.steps_done:steps]
    losses = [trainer.step(ids if trainer.is_first else None, targets if trainer.is_last else None).loss
              for ids, targets in batches]
    trainer.save_checkpoint(out)
    trainer.close()
    return losses


@pytest.mark.slow
def test_trainer_saves_and_resumes_on_another_plan(setup, tmp_path):
    """2 steps on 2 stages with `Trainer`, then 2 more on 3 stages from its checkpoint: the single-device losses."""
    from tests.dist_helpers import run_world

    folder, state, batches, *_ = setup
    ref_losses, *_ = _reference(state, batches)
    ck = tmp_path / "ck"
    losses = []
    for world, plan, steps, resume in ((2, "plan2.json", EVERY, None), (3, "plan3.json", STEPS, str(ck))):
        outcomes = run_world(_trainer_worker, world_size=world, args=(str(folder), plan, steps, resume, str(ck)),
                             timeout_s=240.0, out_dir=tmp_path / f"world{world}")
        for o in outcomes:
            assert o.error is None, f"rank {o.rank}: {o.error}"
        losses += outcomes[-1].value
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002", "step-000004"]
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)


@pytest.mark.parametrize("data", [None, "file", "factory"])
def test_the_data_position_resumes(setup, data):
    """Step k of a resumed stream is the batch an uninterrupted stream gives at k: synthetic, file, factory."""
    import itertools

    from hetpipe.runtime.data import data_stream

    folder, _, batches, graph, inputs = setup
    spec = {None: None, "file": str(folder / "data.pt"), "factory": "tests.test_checkpoint:_factory"}[data]
    kw = dict(model=MODEL, global_batch=BATCH * MICROBATCHES, seed=4, example=inputs, meta_model=graph.module)
    whole = list(itertools.islice(data_stream(spec, **kw), STEPS))
    resumed = list(itertools.islice(data_stream(spec, start=2, **kw), STEPS - 2))
    for (a_in, a_t), (b_in, b_t) in zip(whole[2:], resumed, strict=True):
        assert torch.equal(torch.as_tensor(a_in[0] if isinstance(a_in, tuple) else a_in),
                           torch.as_tensor(b_in[0] if isinstance(b_in, tuple) else b_in)) and torch.equal(a_t, b_t)


def _factory():
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (BATCH * MICROBATCHES, SEQ), generator=gen)
        yield ids, torch.roll(ids, -1, 1)


def test_a_one_stage_checkpoint_restores_into_every_stage_of_another_cut(setup, tmp_path):
    """In one process: the whole model as one stage (the tied embedding and head in the same module) is
    saved, then each stage of the 3-stage cut restores its part -- both replicas of the tie included --
    with every parameter and Adam state equal to the source's by name."""
    from hetpipe.runtime.checkpoint.state import restore_checkpoint
    from hetpipe.runtime.rank import make_optimizer, node_to_stage
    from hetpipe.plan.schema import Plan

    folder, _, _, graph, inputs = setup
    source = _one_stage_checkpoint(graph, inputs, tmp_path / "ck", step=2)
    saved = read_checkpoint(source)
    plan = Plan.load(folder / "plan3.json")
    program = split_stages(graph.module, node_to_stage(plan, graph.module), example_inputs=inputs, num_stages=3)
    restored_names = set()
    for s in range(3):
        stage = build_stage(program, s, state_dict=None, device="cpu", seed=123)  # other weights, then restored
        opt = make_optimizer("adam", list(stage.parameters()), lr=None)
        names = canonical_names(program, s)
        restore_checkpoint(source, StageState(stage.module, names, saved_names(program, s), opt, s), same_plan=False)
        for local, p in stage.module.named_parameters():
            assert torch.equal(p.detach(), saved[f"model/{names[local]}"]), names[local]
            for key, value in opt.state[p].items():
                assert torch.equal(value, saved[f"optim/{names[local]}/{key}"]), (names[local], key)
            assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}, names[local]
            restored_names.add(names[local])
    assert {k[len("model/"):] for k in saved if k.startswith("model/")} >= restored_names
    assert len(restored_names) == sum(1 for k in saved if k.startswith("optim/") and k.endswith("/step"))


def test_random_generators_are_restored_on_the_same_plan_only(setup, tmp_path):
    import random

    from hetpipe.runtime.checkpoint.state import restore_checkpoint
    from hetpipe.runtime.rank import make_optimizer

    _, _, _, graph, inputs = setup
    torch.manual_seed(5)
    random.seed(5)
    source = _one_stage_checkpoint(graph, inputs, tmp_path / "ck", step=2)  # the generators as saved
    after = (torch.rand(3), random.random())
    program = split_stages(graph.module, {}, example_inputs=inputs, num_stages=1)
    stage = build_stage(program, 0, state_dict=None, device="cpu")
    st = StageState(stage.module, canonical_names(program, 0), saved_names(program, 0),
                    make_optimizer("adam", list(stage.parameters()), lr=None), 0)
    restore_checkpoint(source, st, same_plan=False)
    assert not torch.equal(torch.rand(3), after[0])
    restore_checkpoint(source, st, same_plan=True)
    assert torch.equal(torch.rand(3), after[0]) and random.random() == after[1]


def test_diloco_replica_plans_are_refused_clearly(tmp_path):
    """DiLoCo replicas differ between outer steps: one error naming the fix, before launch (synchronous
    replica plans checkpoint and resume: tests/test_checkpoint_replicas.py)."""
    from types import SimpleNamespace

    from hetpipe.runtime.checkpoint.options import checkpoint_args

    diloco = SimpleNamespace(replicas=(object(),), sync=SimpleNamespace(policy="diloco", outer_steps=4))
    for ck, resume, flag in ((tmp_path, None, "--checkpoint-dir"), (None, "ck", "--resume")):
        with pytest.raises(ConfigError, match=f"^{flag}: the replica plan syncs with DiLoCo .*policy=\"synchronous\""):
            checkpoint_args(diloco, ck, None, resume, model=MODEL, seq=None, steps=4)


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
