"""`--weights` / `--save-weights` in one process: every checkpoint layout, per-stage lazy loading,
named errors, the save round trip, and a rank's resident memory while it loads its stage."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.models import build
from hetpipe.partitioner.capture.capture import capture
from hetpipe.runtime.stage.build import build_stage, split_stages
from hetpipe.runtime.stage.weights import (
    SAFE_INDEX_NAME,
    Checkpoint,
    check_stage,
    open_weights,
    save_stage,
    saved_names,
    shard_name,
    write_index,
)
from hetpipe.runtime.rank import node_to_stage
from tests.runtime_plans import plan_for
from tests.synthetic import synthetic_cluster
from hetpipe.partitioner.problem import Stage

MODEL, BATCH, SEQ = "gpt-tiny", 2, 16
RTOL, ATOL = 1e-5, 1e-5


def _shard(state: dict[str, torch.Tensor], folder: Path, parts: int) -> None:
    """A save_pretrained-style sharded folder: ``parts`` shards and the index."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = list(state)
    weight_map = {}
    for i in range(parts):
        name = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {k: state[k].contiguous() for k in keys[i::parts]}
        save_file(chunk, str(folder / name))
        weight_map.update(dict.fromkeys(chunk, name))
    (folder / SAFE_INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def tied_lm():
    """gpt-tiny on the CPU (tied embedding / head), its HF-style state (lm_head.weight omitted) and a 3-stage program."""
    torch.manual_seed(3)
    model, inputs = build(MODEL, device="cpu", batch=BATCH, seq=SEQ)
    meta, meta_inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    graph = capture(meta, meta_inputs, name=MODEL)
    assert graph.tied, "gpt-tiny ties its embedding and LM head"
    n = graph.num_units
    plan = plan_for(graph, synthetic_cluster(), (Stage(0, 0, n // 3 - 1), Stage(1, n // 3, 2 * n // 3 - 1),
                                                 Stage(2, 2 * n // 3, n - 1)), microbatches=2)
    program = split_stages(graph.module, node_to_stage(plan, graph.module), example_inputs=meta_inputs, num_stages=3)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tied_names = graph.tied[0].qualified_names
    hf_state = {k: v for k, v in state.items() if k != tied_names[-1]}  # keep the embedding's name only
    return model, inputs, program, state, hf_state


def _chain(program, ckpt, x: torch.Tensor) -> torch.Tensor:
    out: tuple = (x,)
    for s in range(program.num_stages):
        res = build_stage(program, s, state_dict=ckpt, device="cpu")(*out)
        out = res if isinstance(res, tuple) else (res,)
    return out[0]


@pytest.mark.parametrize("layout", ["safetensors-file", "folder", "sharded-folder", "torch-file", "save_model"])
def test_every_layout_loads_per_stage_and_equals_the_model(tied_lm, tmp_path, layout):
    model, inputs, program, state, hf_state = tied_lm
    if layout == "safetensors-file":
        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in hf_state.items()}, str(path))
    elif layout == "folder":
        path = tmp_path / "hf"
        path.mkdir()
        save_file({k: v.contiguous() for k, v in hf_state.items()}, str(path / "model.safetensors"))
    elif layout == "sharded-folder":
        path = tmp_path / "hf"
        _shard(hf_state, path, 3)
    elif layout == "torch-file":
        path = tmp_path / "w.pt"
        torch.save(state, path)
    else:  # safetensors' own dedup of the tie keeps one of the two names
        path = tmp_path / "m.safetensors"
        save_model(model, str(path))
    ckpt = open_weights(path)
    for s in range(program.num_stages):
        check_stage(program, s, ckpt)
    with torch.no_grad():
        torch.testing.assert_close(_chain(program, ckpt, inputs[0]), model(*inputs), rtol=RTOL, atol=ATOL)


def test_a_stage_reads_only_its_own_tensors(tied_lm, tmp_path, monkeypatch):
    _, _, program, _, hf_state = tied_lm
    _shard(hf_state, tmp_path / "hf", 2)
    ckpt = Checkpoint(tmp_path / "hf")
    read: list[str] = []
    original = Checkpoint.__getitem__
    monkeypatch.setattr(Checkpoint, "__getitem__", lambda self, k: read.append(k) or original(self, k))
    stage = build_stage(program, 1, state_dict=ckpt, device="cpu")
    own = {n for n, _ in stage.module.named_parameters()}
    assert read and set(read) == own  # every parameter of stage 1 read once, nothing else
    assert len(read) == len(own) < len(hf_state)


def test_missing_and_misshaped_tensors_are_one_named_error(tied_lm, tmp_path):
    _, _, program, _, hf_state = tied_lm
    key = next(k for k in hf_state if ".h.1." in k and k.endswith("weight"))
    stage = next(s for s in range(3) if key in dict(program.modules[s].named_parameters()))
    save_file({k: v.contiguous() for k, v in hf_state.items() if k != key}, str(tmp_path / "a.safetensors"))
    with pytest.raises(ConfigError, match=rf"stage {stage} needs parameter '{re.escape(key)}'.*a\.safetensors.*"
                                          r"--save-weights"):
        check_stage(program, stage, Checkpoint(tmp_path / "a.safetensors"))
    bad = dict(hf_state, **{key: torch.zeros(3, 3)})
    _shard(bad, tmp_path / "hf", 2)
    with pytest.raises(ConfigError, match=rf"'{re.escape(key)}' in .*model-0000\d-of-00002\.safetensors has shape "
                                          r"\(3, 3\), the model expects"):
        check_stage(program, stage, Checkpoint(tmp_path / "hf"))


@pytest.mark.parametrize("what, make", [
    ("no such file", lambda p: p / "nope"),
    ("a folder must hold", lambda p: (p / "empty").mkdir() or p / "empty"),
    ("cannot read it as a torch state dict", lambda p: (p / "x.pt").write_text("junk") and p / "x.pt"),
    ("not a readable safetensors file", lambda p: (p / "x.safetensors").write_bytes(b"\x00" * 16) and
     p / "x.safetensors"),
    ("not a flat state dict", lambda p: torch.save({"model": {"w": torch.zeros(1)}}, p / "n.pt") or p / "n.pt"),
    ("names shard", lambda p: (p / "i").mkdir() or (p / "i" / SAFE_INDEX_NAME).write_text(
        '{"weight_map": {"w": "model-1.safetensors"}}') and p / "i"),
])
def test_bad_weights_paths_are_refused_with_the_fix(tmp_path, what, make):
    with pytest.raises(ConfigError, match=re.escape(what)):
        open_weights(make(tmp_path))


def test_saved_stages_form_an_index_folder_that_reloads_equal(tied_lm, tmp_path):
    model, inputs, program, state, hf_state = tied_lm
    src = tmp_path / "src.safetensors"
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(src))
    out = tmp_path / "saved"
    out.mkdir()  # an earlier save of 2 stages into the same folder: its shards go, other files stay
    stale = [shard_name(s, 2) for s in range(2)]
    for name in stale:
        save_file({"lm_head.weight": torch.zeros(1)}, str(out / name))
    (out / "config.json").write_text("{}")
    shards = []
    for s in range(program.num_stages):
        stage = build_stage(program, s, state_dict=Checkpoint(src), device="cpu")
        shards.append(save_stage(stage.module, saved_names(program, s), out, stage=s, num_stages=3))
    write_index(out, shards)
    index = json.loads((out / SAFE_INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == sorted(hf_state)  # the tie saved once, under the embedding's name
    assert set(index["weight_map"].values()) == {shard_name(s, 3) for s in range(3)}
    assert sorted(p.name for p in out.glob("*.safetensors")) == [shard_name(s, 3) for s in range(3)]
    assert (out / "config.json").exists()
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in hf_state.values())
    merged = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    for k, v in hf_state.items():
        assert torch.equal(merged[k], v), k
    reloaded = build(MODEL, device="cpu", batch=BATCH, seq=SEQ)[0]
    missing, unexpected = reloaded.load_state_dict(merged, strict=False)
    assert not unexpected and all(k not in hf_state for k in missing)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(*inputs), model(*inputs), rtol=0, atol=0)
        torch.testing.assert_close(_chain(program, open_weights(out), inputs[0]), model(*inputs), rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- resident memory while loading

# 16 x Linear(1024, 1024) in 4 stages: the model is 67 MB, a stage 16.8 MB.
LAYERS, WIDTH, STAGES, LOADED_STAGE = 16, 1024, 4, 1
# A rank that reads its stage lazily holds the stage's tensors (allocated, then filled) and, while
# copying, the file pages of those same tensors (safetensors and torch mmap both map the file):
# 2 x stage bytes.  The margin covers one-off allocations of the first build (Python objects, the
# allocator's arenas): measured 1.0-2.3 MB on this box; 8 MiB is 3.5x that and still far from the
# whole model.
MARGIN_BYTES = 8 * 2**20

_CHILD = r"""
import re, sys, torch
from pathlib import Path
from torch import nn
from hetpipe.runtime.stage.build import build_stage, split_stages
from hetpipe.runtime.stage.weights import check_stage, open_weights

def status(field):
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024

path, mode, layers, width, stages, k = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
with torch.device("meta"):
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
gm = torch.fx.symbolic_trace(net)
names = [n.name for n in gm.graph.nodes if n.op == "call_module"]
prog = split_stages(gm, {n: i * stages // layers for i, n in enumerate(names)},
                    example_inputs=(torch.zeros(2, width),), num_stages=stages)
Path("/proc/self/clear_refs").write_text("5")  # reset the resident high-water mark (Linux >= 4.0)
base = status("VmRSS")
if mode == "whole":  # the control: what loading the whole state dict costs
    weights = torch.load(path, weights_only=True)
else:
    weights = open_weights(path)
    check_stage(prog, k, weights)
stage = build_stage(prog, k, state_dict=weights, device="cpu")
print(status("VmHWM") - base, sum(p.numel() * p.element_size() for p in stage.parameters()))
"""


@pytest.fixture(scope="module")
def big_checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("big")
    torch.manual_seed(0)
    state = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).state_dict()
    _shard(state, folder / "hf", 4)
    torch.save(state, folder / "w.pt")
    return folder, sum(v.numel() * v.element_size() for v in state.values())


def _peak_while_loading(path: Path, mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), mode, str(LAYERS), str(WIDTH), str(STAGES),
                          str(LOADED_STAGE)], capture_output=True, text=True, timeout=120, check=True)
    peak, stage = map(int, out.stdout.split())
    return peak, stage


@pytest.mark.parametrize("layout", ["hf", "w.pt"])
def test_loading_a_stage_stays_within_its_share(big_checkpoints, layout):
    folder, whole = big_checkpoints
    peak, stage = _peak_while_loading(folder / layout, "lazy")
    assert stage == whole // STAGES
    assert peak <= 2 * stage + MARGIN_BYTES, (peak, stage, whole)
    assert peak < 0.7 * whole


def test_the_memory_check_catches_a_whole_model_load(big_checkpoints):
    """The control: reading the whole state dict shows up in the same measurement."""
    folder, whole = big_checkpoints
    peak, stage = _peak_while_loading(folder / "w.pt", "whole")
    assert peak > 2 * stage + MARGIN_BYTES and peak >= whole


# ----------------------------------------------------------------------------- initial weights


def test_seeded_initial_weights_are_what_every_stage_of_a_run_starts_from(tied_lm, tmp_path):
    from hetpipe.cli.app import main

    _, _, program, _, hf_state = tied_lm
    assert main(["init-weights", MODEL, "-o", str(tmp_path / "init"), "--seed", "4"]) == 0
    written = load_file(str(tmp_path / "init" / "model.safetensors"))
    assert sorted(written) == sorted(hf_state)  # HF layout: the tied head once, under the embedding's name
    ckpt = open_weights(tmp_path / "init")
    for s in range(program.num_stages):
        seeded = build_stage(program, s, state_dict=None, device="cpu", seed=4)  # a run without --weights
        loaded = build_stage(program, s, state_dict=ckpt, device="cpu")
        for (name, a), (_, b) in zip(seeded.module.named_parameters(), loaded.module.named_parameters()):
            assert torch.equal(a, b), name
    other = build_stage(program, 0, state_dict=None, device="cpu", seed=5)
    assert not all(torch.equal(a, written[n]) for n, a in other.module.named_parameters() if n in written)


def test_model_init_is_the_models_own_constructor_under_the_seed(tmp_path):
    from hetpipe.runtime.stage.initial import write_initial_weights

    path = write_initial_weights(MODEL, tmp_path, seed=9, init="model")
    torch.manual_seed(9)
    model, _ = build(MODEL, device="cpu")
    written = load_file(str(path))
    state = model.state_dict()
    assert set(written) < set(state) and len(state) - len(written) == 1  # the tied head once
    for k, v in written.items():
        assert torch.equal(v, state[k]), k
    with pytest.raises(ConfigError, match="init='bogus'"):
        write_initial_weights(MODEL, tmp_path, init="bogus")
