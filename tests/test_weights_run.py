"""`hetpipe run --weights ... --save-weights ...` end to end: 3 ranks start from a sharded HF-style
checkpoint, train like a plain single-device loop over the same weights and data, and save weights
that reload equal; bad `--weights` are refused before anything is launched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hetpipe.models import build, lm_loss
from hetpipe.partitioner.capture.capture import capture
from hetpipe.partitioner.problem import Stage
from hetpipe.plan.schema import Plan
from hetpipe.runtime.report import RunReport
from hetpipe.runtime.stage.build import build_stage, split_stages
from hetpipe.runtime.stage.weights import SAFE_INDEX_NAME, open_weights
from hetpipe.runtime.rank import DEFAULT_LR, node_to_stage
from tests.reference_loop import initial_state, reference_loop, seeded_batches
from tests.runtime_plans import plan_for
from tests.synthetic import synthetic_cluster
from tests.test_run_cli import _error, hetpipe_run
from tests.test_weights import _shard
from tests.forked_launch import use_forked_launch
from tests.machine_load import guard_s

MODEL, BATCH, SEQ, MICROBATCHES, STEPS = "gpt-tiny", 2, 16, 4, 3
RTOL, ATOL = 1e-5, 1e-5  # fp32, the acceptance tolerances


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The plan (3 stages), a sharded checkpoint without the tied head's name, the data file."""
    return write_setup(tmp_path_factory.mktemp("weights-run"))


def write_setup(folder: Path) -> tuple:
    """Write `setup`'s files into ``folder`` (also the Trainer case's, on tests/conftest.py's ``trainer_world``):
    (folder, initial state, batches, graph, example inputs); deterministic (seeds 11 and 5)."""
    meta, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(meta, inputs, name=MODEL)
    n = graph.num_units
    plan = plan_for(graph, synthetic_cluster(), (Stage(0, 0, n // 3 - 1), Stage(1, n // 3, 2 * n // 3 - 1),
                                                 Stage(2, 2 * n // 3, n - 1)), microbatches=MICROBATCHES)
    plan.save(folder / "plan.json")
    state = initial_state(MODEL, seed=11)
    head = graph.tied[0].qualified_names[-1]
    _shard({k: v for k, v in state.items() if k != head}, folder / "init", 2)
    batches = seeded_batches(STEPS, seed=5)
    torch.save(batches, folder / "data.pt")
    return folder, state, batches, graph, inputs


def _reference(state: dict[str, torch.Tensor], batches) -> tuple[list[float], torch.nn.Module]:
    """A plain single-device loop: Adam (the plan's optimizer, the runtime's default rate), the mean
    loss over the plan's micro-batches."""
    losses, model, _ = reference_loop(state, batches, lambda p: torch.optim.Adam(p, lr=DEFAULT_LR["adam"]), model_name=MODEL)
    return losses, model


@pytest.mark.slow
def test_run_from_weights_trains_like_a_single_device_loop_and_saves_them(setup, tmp_path, capsys):
    folder, state, batches, graph, inputs = setup
    saved = tmp_path / "trained"
    saved.mkdir()  # an earlier save with 2 stages: its shards must not stay beside the new 3 (the index is right)
    stale = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name in stale:
        save_file({"stale": torch.zeros(1)}, str(saved / name))
    (saved / "notes.txt").write_text("the user's own file")
    capsys.readouterr()
    rc = hetpipe_run([str(folder / "plan.json"), "--model", MODEL, "--seq", str(SEQ), "--steps", str(STEPS),
                      "--timeout", f"{guard_s(30.0):.0f}", "--data", str(folder / "data.pt"),
                      "--loss", "hetpipe.models:lm_loss",
                      "--weights", str(folder / "init"), "--save-weights", str(saved),
                      "--report", str(tmp_path / "run.json")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"wrote {saved}" in out.replace("\n", "")  # where the weights went, as the report's line says
    assert not any((saved / name).exists() for name in stale) and (saved / "notes.txt").exists()
    ref_losses, ref_model = _reference(state, batches)
    rep = RunReport.load(tmp_path / "run.json")
    assert list(rep.losses) == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    # Saved: one shard per stage and the index; the tie once, under the embedding's name.
    index = json.loads((saved / SAFE_INDEX_NAME).read_text())
    head = graph.tied[0].qualified_names[-1]
    assert sorted(index["weight_map"]) == sorted(k for k in state if k != head)
    assert len(set(index["weight_map"].values())) == 3
    merged = {k: v for f in sorted(saved.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    for name, p in ref_model.state_dict().items():
        if name != head:
            torch.testing.assert_close(merged[name], p, rtol=RTOL, atol=ATOL, msg=name)
    # Reloaded with --weights (the same per-stage loader), the stages compute what the trained model does.
    plan = Plan.load(folder / "plan.json")
    program = split_stages(graph.module, node_to_stage(plan, graph.module), example_inputs=inputs, num_stages=3)
    ckpt = open_weights(saved)
    out: tuple = (batches[0][0][:BATCH],)
    with torch.no_grad():
        for s in range(3):
            res = build_stage(program, s, state_dict=ckpt, device="cpu")(*out)
            out = res if isinstance(res, tuple) else (res,)
        torch.testing.assert_close(out[0], ref_model(batches[0][0][:BATCH]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", ["missing", "other-model"])
def test_bad_weights_are_refused_before_launch(setup, tmp_path, capsys, case):
    folder, state, *_ = setup
    if case == "missing":
        weights, expect = tmp_path / "nope", "no such file or folder"
    else:  # a checkpoint of another configuration: the first block's weights have another shape
        weights = tmp_path / "other.safetensors"
        save_file({k: (torch.zeros(3, 3) if ".h.0." in k and v.dim() == 2 else v).contiguous()
                   for k, v in state.items()}, str(weights))
        expect = "has shape (3, 3), the model expects"
    run_dir = tmp_path / "run"
    rc = hetpipe_run([str(folder / "plan.json"), "--model", MODEL, "--seq", str(SEQ), "--steps", "1",
                      "--weights", str(weights), "--run-dir", str(run_dir)])
    err = _error(capsys.readouterr().err)
    assert rc == 2 and "--weights" in err and expect in err, err
    assert not (run_dir / "torchrun.log").exists()  # nothing was launched


def trainer_job(rank: int, world: int, plan_path: str) -> dict:
    """The Trainer case as a job of tests/conftest.py's ``trainer_world`` (its last: `Trainer.close` leaves the
    process group): trains from the weights beside ``plan_path``, saves them to ``saved/`` there."""
    folder = Path(plan_path).parent
    return {"losses": _trainer_worker(rank, world, str(folder), str(folder / "saved")), "saved": str(folder / "saved")}


def _trainer_worker(rank: int, world: int, folder: str, out: str) -> list:
    from hetpipe.runtime.trainer import Trainer

    trainer = Trainer(f"{folder}/plan.json", model=MODEL, seq=SEQ, loss=lm_loss, timeout_s=60.0,
                      weights=f"{folder}/init")
    losses = [trainer.step(ids if trainer.is_first else None, targets if trainer.is_last else None).loss
              for ids, targets in torch.load(f"{folder}/data.pt")]
    trainer.save_weights(out)
    trainer.close()
    return losses


@pytest.mark.slow
def test_trainer_loads_and_saves_weights_like_the_cli(setup, trainer_world):
    _, state, batches, graph, _ = setup  # the same files as the ones trainer_world trained from (same seeds)
    _, results = trainer_world["weights"]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result['error']}"
    last = results[2]["value"]
    saved = Path(last["saved"])
    ref_losses, ref_model = _reference(state, batches)
    assert last["losses"] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    merged = {k: v for f in sorted(saved.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    head = graph.tied[0].qualified_names[-1]
    assert sorted(merged) == sorted(k for k in state if k != head)
    for name, p in ref_model.state_dict().items():
        if name != head:
            torch.testing.assert_close(merged[name], p, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.slow
def test_a_replica_plan_starts_from_the_weights_and_refuses_save_weights(setup, tmp_path, monkeypatch):
    """Replica plans (version 2) load --weights too (each replica its own stages); --save-weights is refused
    before launch (not supported for them yet).  The run's ranks fork from the test fork server
    (`tests.forked_launch`, ~10 s of CPU less); the CLI test above is the torchrun launch from weights."""
    use_forked_launch(monkeypatch)
    from hetpipe.errors import ConfigError
    from hetpipe.runtime.run import run
    from tests.runtime_plans import replica_plan_for

    folder, state, batches, graph, _ = setup
    n = graph.num_units
    plan = replica_plan_for(graph, synthetic_cluster(), [((Stage(0, 0, n // 2 - 1), Stage(1, n // 2, n - 1)), 3),
                                                         ((Stage(2, 0, n - 1),), 1)])
    plan.save(tmp_path / "replicas.json")
    with pytest.raises(ConfigError, match="--save-weights is not supported for replica plans"):
        run(tmp_path / "replicas.json", model=MODEL, steps=1, seq=SEQ, weights=folder / "init",
            save_weights=tmp_path / "out")
    ids, targets = batches[0]
    rep = run(tmp_path / "replicas.json", model=MODEL, steps=1, data=[(ids, targets)], loss=lm_loss, seq=SEQ,
              timeout_s=guard_s(30.0), weights=folder / "init")
    model, _ = build(MODEL, device="cpu", batch=BATCH, seq=SEQ)
    model.load_state_dict(state)
    with torch.no_grad():
        expected = lm_loss(model(ids), targets).item()  # the mean over the global batch, both replicas
    assert rep.losses[0] == pytest.approx(expected, rel=RTOL, abs=ATOL)
