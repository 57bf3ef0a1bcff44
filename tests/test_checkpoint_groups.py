"""Checkpoints and resume of plans with tensor-parallel groups (issues 15 and 16, item 1).

One chain of ``hetpipe run`` calls on gpt-tiny (tied head), 6 global batches of 8 samples, SGD +
momentum (as tests/test_checkpoint_replicas.py: its update is linear in the gradient):

* steps 0-1 on a 2-stage pipeline (P2), checkpoint at 2 (one launch shared with
  tests/test_checkpoint_replicas.py: the session fixture ``momentum_start``);
* steps 2-3 resumed on G: stage 0 on a group of two cards at shares 0.7 / 0.3 (heads 3:1, MLP
  columns 179:77; tests/test_tp_runtime.py's plan), stage 1 one card; checkpoints at 3 and 4;
* steps 4-5 resumed on P2 from G's step-4 checkpoint, checkpoint at 6;

every step's loss, and the parameters and momentum in G's and P2's last checkpoints, equal a plain
single-device loop within 1e-5: G saves its members' slices gathered whole under the model's
names (each tensor written by one rank, the lead) and reads its slices back from whole tensors.
G resumed on itself from step 3 continues bitwise (losses and every saved tensor).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetpipe.runtime.report import RunReport
from tests.checkpoint_runs import MODEL, OPTIMIZER, SEQ, run_with_checkpoints
from tests.test_checkpoint import read_checkpoint
from tests.test_tp_runtime import tp_graph, tp_plan
from tests.machine_load import guard_s

RTOL, ATOL = 1e-5, 1e-5  # fp32, the acceptance tolerances


@pytest.fixture(scope="module")
def setup(momentum_inputs):
    """The shared folder (P2, inputs) with G saved beside P2; the group plans' graph; the reference loop."""
    folder, p2 = momentum_inputs.folder, momentum_inputs.p2
    grouped = tp_plan()
    assert grouped.stages[0].group_shares == (0.7, 0.3) and grouped.training.optimizer == OPTIMIZER
    assert (p2.training.global_batch, p2.training.microbatches, p2.training.optimizer) == (8, 4, OPTIMIZER)
    assert (grouped.training.global_batch, grouped.training.microbatches) == (8, 4)
    grouped.save(folder / "G.json")
    return folder, tp_graph(MODEL), momentum_inputs.reference


def _run(folder: Path, plan: str, out: Path, *, steps: int, resume: Path | None, every: int | None = None,
         forked: bool = False) -> RunReport:
    return run_with_checkpoints(folder, plan, out, model=MODEL, seq=SEQ, steps=steps, resume=resume, every=every,
                                forked=forked, timeout_s=120)


@pytest.fixture(scope="module")
def chain(setup, momentum_start, tmp_path_factory):
    """P2 (steps 0-1, the shared start) -> G (2-3) -> P2 (4-5), each resumed from the one before.  The chain's
    two resumes fork their ranks from the test fork server (`tests.forked_launch`: what they check is what the
    ranks compute); the shared start and the bitwise resume below are torchrun launches."""
    folder, *_ = setup
    tmp = tmp_path_factory.mktemp("chain")
    grouped = _run(folder, "G", tmp / "g", steps=4, resume=momentum_start.checkpoint, every=1, forked=True)
    last = _run(folder, "P2", tmp / "p2b", steps=6, resume=tmp / "g" / "ck" / "step-000004", forked=True)
    return tmp, {"P2": momentum_start.report, "G": grouped, "P2b": last}


def _assert_is_reference(folder: Path, graph, snapshot) -> None:
    """The checkpoint holds the reference's parameters and momentum, whole, each once by the model's names."""
    params, momentum = snapshot
    saved = read_checkpoint(folder)
    head = graph.tied[0].qualified_names[-1]
    assert sorted(k for k in saved if k.startswith("model/")) == sorted(f"model/{n}" for n in params if n != head)
    for name, value in params.items():
        if name != head:  # the tie is saved once, under the embedding's name
            torch.testing.assert_close(saved[f"model/{name}"], value, rtol=RTOL, atol=ATOL, msg=name)
    for name, value in momentum.items():
        torch.testing.assert_close(saved[f"optim/{name}/momentum_buffer"], value, rtol=RTOL, atol=ATOL, msg=name)


def _writers(folder: Path) -> dict[str, set[str]]:
    """Saved key -> the DCP data files (one per rank: ``__<rank>_0.distcp``) holding its bytes."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(folder)).read_metadata()
    out: dict[str, set[str]] = {}
    for index, info in meta.storage_data.items():
        out.setdefault(index.fqn, set()).add(info.relative_path)
    return out


@pytest.mark.slow
def test_pipeline_to_group_to_pipeline_equals_a_single_device_run(setup, chain):
    _, graph, (ref_losses, snapshots) = setup
    tmp, reports = chain
    assert (reports["P2"].world_size, reports["G"].world_size, reports["P2b"].world_size) == (2, 3, 2)
    got = [*reports["P2"].losses, *reports["G"].losses, *reports["P2b"].losses]
    assert got == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    grouped = tmp / "g" / "ck" / "step-000004"
    _assert_is_reference(grouped, graph, snapshots[4])  # the group's slices, gathered whole
    _assert_is_reference(tmp / "p2b" / "ck" / "step-000006", graph, snapshots[6])  # read back as slices
    writers = _writers(grouped)  # ranks: 0 = the group's lead (0.7), 1 = its member (0.3), 2 = stage 1
    for key, files in writers.items():
        if not key.startswith("rng/"):
            assert len(files) == 1 and not files & {"__1_0.distcp"}, (key, files)
    assert {"rng/stage-0/torch", "rng/stage-0-member-1/torch", "rng/stage-1/torch"} <= set(writers)
    marker = json.loads((grouped / "hetpipe-checkpoint.json").read_text())
    assert marker["stage_gather_bytes"][0] > 0 and marker["stage_gather_bytes"][1] == 0
    moved = max(float((snapshots[6][0][n] - v).abs().max()) for n, v in snapshots[2][0].items())
    assert moved > 100 * ATOL, "the steps must move the parameters well beyond the tolerance"


@pytest.mark.slow
def test_a_group_resumed_on_its_own_plan_continues_bitwise(setup, chain, tmp_path):
    folder, *_ = setup
    tmp, reports = chain
    again = _run(folder, "G", tmp_path, steps=4, resume=tmp / "g" / "ck" / "step-000003")
    assert list(again.losses) == list(reports["G"].losses[1:])  # exactly: same cuts, shares, order of operations
    ended = read_checkpoint(tmp / "g" / "ck" / "step-000004")
    resumed = read_checkpoint(tmp_path / "ck" / "step-000004")
    assert sorted(ended) == sorted(resumed)
    for key, value in ended.items():  # parameters, momentum, every rank's random generators
        assert torch.equal(value, resumed[key]), key


# ----------------------------------------------------------------------------- no processes


def test_a_member_resumes_its_rows_and_their_momentum_from_whole_tensors(tmp_path):
    """A whole Linear's checkpoint (one process) read by member 1 of a 0.75 / 0.25 group holding 1 of
    its 4 output rows: the member keeps row 3 of the weight, the bias and their momentum; the
    replicated parameter (not split) is read whole."""
    from hetpipe.partitioner.capture.tensor_blocks import ShardedParameter
    from hetpipe.runtime.checkpoint.files import CheckpointInfo
    from hetpipe.runtime.checkpoint.groups import GroupSlices
    from hetpipe.runtime.checkpoint.state import StageState, restore_checkpoint, save_checkpoint
    from hetpipe.runtime.tp_shard import MemberShare

    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
    whole(torch.randn(3, 2)).pow(2).sum().backward()
    opt.step()
    names = {n: n for n, _ in whole.named_parameters()}
    info = CheckpointInfo(step=1, batches_consumed=1, model="m", params_fingerprint="f", plan_digest="d",
                          num_stages=1, optimizer="momentum", seed=0, saved_time_s=0.0)
    folder = save_checkpoint(tmp_path, step=1, state=StageState(whole, names, names, opt, 0), info=info)
    member = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.LayerNorm(4))  # row 3 of 4
    mine = torch.optim.SGD(member.parameters(), lr=0.1, momentum=0.9)
    specs = {"0.weight": (ShardedParameter("0.weight", dim=0, part_size=1), 4),
             "0.bias": (ShardedParameter("0.bias", dim=0, part_size=1), 4)}
    slices = GroupSlices(specs, MemberShare(1, (0.75, 0.25)), group=None)
    restore_checkpoint(folder, StageState(member, names, {}, mine, 0, member=1, slices=slices), same_plan=False)
    wp, mp = dict(whole.named_parameters()), dict(member.named_parameters())
    for name in names:
        want = wp[name].detach()[3:] if name in specs else wp[name].detach()
        assert torch.equal(mp[name].detach(), want), name
        momentum = opt.state[wp[name]]["momentum_buffer"]
        assert torch.equal(mine.state[mp[name]]["momentum_buffer"], momentum[3:] if name in specs else momentum)


# ----------------------------------------------------------------------------- supervised


KILL_AT = 5  # the group's member (rank 1) exits at once at the start of step 5: no error file, whatever the load


@pytest.mark.slow
def test_a_killed_group_member_relaunches_the_grouped_plan_equal_to_a_single_device_run(setup, momentum_start,
                                                                                         tmp_path):
    """G resumed from the shared step-2 checkpoint under ``--max-restarts 1``, checkpoints every 2 steps; its
    member is killed in step 5: the supervisor relaunches G from step 4, and steps 5-6, the parameters and
    the momentum equal the single-device loop."""
    from tests.test_run_cli import hetpipe_run

    folder, graph, (ref_losses, snapshots) = setup
    assert hetpipe_run([str(folder / "G.json"), "--model", MODEL, "--seq", str(SEQ), "--steps", "6",
                        "--timeout", f"{guard_s(120.0):.0f}", "--data", str(folder / "data.pt"),
                        "--loss", "hetpipe.models:lm_loss",
                        "--resume", str(momentum_start.checkpoint),
                        "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
                        "--run-dir", str(tmp_path / "run"), "--report", str(tmp_path / "run.json"),
                        "--max-restarts", "1", "--inject", f"kill:rank=1,step={KILL_AT}"]) == 0
    report = RunReport.load(tmp_path / "run.json")
    (r,) = report.restarts
    assert r.kind == "relaunched" and r.rank == 1 and r.device == "box:0" and "rank 1 (stage 0" in r.cause
    assert r.resumed_step == 4 and r.old_stages == r.new_stages and report.world_size == 3
    assert list(report.losses) == pytest.approx(ref_losses[4:6], rel=RTOL, abs=ATOL)
    _assert_is_reference(tmp_path / "ck" / "step-000006", graph, snapshots[6])
