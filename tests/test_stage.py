"""Stage splitting and building, in one process: stages chained by hand equal the unsplit model."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Iterator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hetpipe.errors import CaptureError, RuntimeFailure, ScheduleError
from hetpipe.runtime.stage.build import StageModule, build_stage, split_stages
from tests.dist_helpers import SkipNet, TinyGPT, gpt_loss, node_units, stage_mapping

RTOL, ATOL = 1e-5, 4e-5  # torch's pipelining test tolerances (fp32)


def _skip_case(seed: int = 0) -> tuple[nn.Module, tuple[str, ...], torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(seed)
    return SkipNet(), SkipNet.UNITS, torch.randn(4, 8), torch.randn(4, 8), F.mse_loss


def _gpt_case(seed: int = 0) -> tuple[nn.Module, tuple[str, ...], torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(seed)
    model = TinyGPT()
    return model, model.units, torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8)), gpt_loss


def _split(model: nn.Module, units: tuple[str, ...], x: torch.Tensor, per_stage: list[int]):
    gm = fx.symbolic_trace(model)
    return split_stages(gm, stage_mapping(gm, units, per_stage), example_inputs=(x,))


def _chain(stages: list[StageModule], x: torch.Tensor, y: torch.Tensor, loss_fn: Any) -> torch.Tensor:
    """Run the stages like the executor does: detached cut tensors, backward stage by stage."""
    inputs, outputs = [], []
    args: tuple[torch.Tensor, ...] = (x,)
    for s in stages[:-1]:
        out = s(*args)
        inputs.append(args)
        outputs.append(out)
        args = tuple(t.detach().requires_grad_(spec.requires_grad) for t, spec in zip(out, s.out_cut.tensors))
    loss = loss_fn(stages[-1](*args), y)
    loss.backward()
    grads_in = [a.grad for a, spec in zip(args, stages[-1].in_cut.tensors) if spec.requires_grad] \
        if len(stages) > 1 else []
    for s, out, ins in zip(reversed(stages[:-1]), reversed(outputs), reversed(inputs)):
        roots = [o for o, spec in zip(out, s.out_cut.tensors) if spec.requires_grad]
        torch.autograd.backward(roots, grads_in)
        if s.in_cut is not None:
            grads_in = [a.grad if a.grad is not None else torch.zeros_like(a)
                        for a, spec in zip(ins, s.in_cut.tensors) if spec.requires_grad]
    return loss.detach()


def _assert_matches_reference(model: nn.Module, stages: list[StageModule], x, y, loss_fn) -> None:
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    loss = _chain(stages, x, y, loss_fn)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    tied: dict[str, list[torch.Tensor]] = {}
    for s in stages:
        canonical = {g.local_name(s.stage): g.canonical_name for g in s.tied_groups}
        for name, p in s.named_parameters():
            if name in canonical:
                tied.setdefault(canonical[name], []).append(p.grad)
            else:
                torch.testing.assert_close(p.grad, ref_grads[name], rtol=RTOL, atol=ATOL, msg=name)
    for name, parts in tied.items():  # the executor all-reduces these; here we sum by hand
        torch.testing.assert_close(sum(parts), ref_grads[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("case,per_stage", [
    (_skip_case, [7]), (_skip_case, [5, 2]), (_skip_case, [1, 4, 2]), (_skip_case, [2, 1, 2, 2]),
    (_gpt_case, [9]), (_gpt_case, [3, 6]), (_gpt_case, [4, 1, 4]), (_gpt_case, [3, 1, 2, 3]),
])
def test_chained_stages_equal_the_model(case, per_stage):
    model, units, x, y, loss_fn = case()
    program = _split(model, units, x, per_stage)
    stages = [build_stage(program, k, state_dict=model.state_dict(), device="cpu") for k in range(len(per_stage))]
    _assert_matches_reference(model, stages, x, y, loss_fn)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=3), min_size=7, max_size=7).map(sorted))
def test_any_monotone_split_of_the_skip_net_is_exact(unit_stages):
    model, units, x, y, loss_fn = _skip_case()
    gm = fx.symbolic_trace(model)
    per_unit = dict(zip(units, unit_stages))
    mapping = {n: per_unit[u] for n, u in node_units(gm, units).items()}
    program = split_stages(gm, mapping, example_inputs=(x,), num_stages=4)
    assert program.num_stages == 4  # empty stages are pass-through stages
    stages = [build_stage(program, k, state_dict=model.state_dict(), device="cpu") for k in range(4)]
    _assert_matches_reference(model, stages, x, y, loss_fn)


def test_cut_specs_list_skips_forwarded_through_stages():
    model, units, x, _, _ = _skip_case()
    program = _split(model, units, x, [2, 1, 2, 2])  # [inp, down1] [down2] [mid, up2] [up1, out]
    names = [[t.name for t in c.tensors] for c in program.cuts]
    # d1 (down1's output) skips stage 1: it is forwarded to stage 2, where the unmapped top-level
    # cat([u2, d1]) lands (the latest stage of its inputs); h0 ('inp') and x travel on to stage 3.
    assert names[0] == ["x", "inp", "down1_1"]
    assert names[1] == ["x", "inp", "down1_1", "down2_1"]
    assert names[2] == ["x", "inp", "cat_1"]
    assert program.node_stages["cat_1"] == 2 and program.node_stages["add"] == 3
    spec = {t.name: t for t in program.cuts[1].tensors}
    assert spec["x"].requires_grad is False and spec["inp"].requires_grad is True
    assert spec["down2_1"].shape == (4, 12) and spec["down2_1"].dtype == torch.float32
    assert [c.baked for c in program.cuts] == [(("size", "4"),)] * 3  # x.size(0) is baked, not sent
    assert program.cuts[0].num_bytes == 4 * (8 + 16 + 16) * 4
    assert [t.name for t in program.cuts[1].grad_tensors] == ["inp", "down1_1", "down2_1"]


def test_integer_tensors_cross_without_gradients():
    class Ids(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 1)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(idx)).squeeze(-1) * idx.float()

    gm = fx.symbolic_trace(Ids())
    program = split_stages(gm, {"emb": 0, "head": 1, "float_1": 1}, example_inputs=(torch.zeros(3, 5, dtype=torch.long),))
    by_name = {t.name: t for t in program.cuts[0].tensors}
    assert by_name["idx"].dtype == torch.int64 and not by_name["idx"].requires_grad
    assert by_name["emb"].requires_grad


class _RecordingDict(Mapping):
    """A state dict that remembers which keys were read."""

    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        self.data, self.read = data, set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return self.data[key]

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("build_stage must not iterate over the whole state dict")

    def __len__(self) -> int:
        return len(self.data)


def test_a_stage_reads_and_holds_only_its_own_tensors():
    model, units, x, _, _ = _gpt_case()
    program = _split(model, units, x, [3, 1, 2, 3])  # stage 1 holds h.1 only
    sd = _RecordingDict(model.state_dict())
    stage = build_stage(program, 1, state_dict=sd, device="cpu")
    own = {n for n, _ in stage.named_parameters()}
    assert own == {n for n, _ in model.h[1].named_parameters(prefix="h.1")}
    assert sd.read == own
    for name, p in stage.named_parameters():
        assert torch.equal(p, model.state_dict()[name])


def test_tied_embedding_is_replicated_on_first_and_last_stage():
    model, units, x, _, _ = _gpt_case()
    program = _split(model, units, x, [3, 1, 2, 3])
    assert [(g.canonical_name, g.members) for g in program.tied] == [
        ("wte.weight", ((0, "wte.weight"), (3, "lm_head.weight")))]
    only_lm_head = {"lm_head.weight": model.state_dict()["lm_head.weight"]}  # one alias is enough
    first = build_stage(program, 0, state_dict=model.state_dict(), device="cpu")
    last = build_stage(program, 3, state_dict={**only_lm_head, **{
        k: v for k, v in model.state_dict().items() if k.startswith(("h.4", "ln_f"))}}, device="cpu")
    assert first.tied_parameters() == {"wte.weight": (0, 3)}
    assert last.tied_parameters() == {"lm_head.weight": (0, 3)}
    assert torch.equal(dict(first.named_parameters())["wte.weight"], dict(last.named_parameters())["lm_head.weight"])


def test_get_attr_tie_and_in_stage_tie_survive_materialisation():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.mid = nn.Embedding(6, 4), nn.Linear(4, 4)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return F.linear(self.mid(self.wte(idx)), self.wte.weight)

    torch.manual_seed(0)
    net = Functional()
    gm = fx.symbolic_trace(net)
    x = torch.randint(0, 6, (2, 3))
    program = split_stages(gm, {"wte": 0, "mid": 1, "linear": 1}, example_inputs=(x,))
    assert program.tied[0].members == ((0, "wte.weight"), (1, "wte.weight"))
    whole = split_stages(fx.symbolic_trace(model := TinyGPT()), {}, example_inputs=(x,))
    single = build_stage(whole, 0, state_dict=model.state_dict(), device="cpu")
    assert single.module.lm_head.weight is single.module.wte.weight  # Module.to_empty would untie them
    assert single.tied_parameters() == {}


def test_seeded_init_is_deterministic_tied_and_partition_independent():
    model, units, x, _, _ = _gpt_case()
    three = _split(model, units, x, [4, 1, 4])
    two = _split(model, units, x, [3, 6])
    a = build_stage(three, 2, state_dict=None, device="cpu", seed=3)
    b = build_stage(two, 1, state_dict=None, device="cpu", seed=3)
    first = build_stage(two, 0, state_dict=None, device="cpu", seed=3)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=0, atol=0)
    torch.testing.assert_close(pb["lm_head.weight"], dict(first.named_parameters())["wte.weight"], rtol=0, atol=0)
    other = build_stage(two, 1, state_dict=None, device="cpu", seed=4)
    assert not torch.equal(pb["h.4.fc.weight"], dict(other.named_parameters())["h.4.fc.weight"])


def test_buffers_come_from_the_traced_module_when_the_state_dict_lacks_them():
    class NonPersistent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.register_buffer("shift", torch.arange(3.0), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + self.shift + torch.tensor([1.0, 2.0, 3.0])

    net = NonPersistent()
    x = torch.randn(2, 3)
    program = split_stages(fx.symbolic_trace(net), {"a": 0, "b": 1}, example_inputs=(x,))
    s0, s1 = (build_stage(program, k, state_dict=net.state_dict(), device="cpu") for k in range(2))
    torch.testing.assert_close(s1(*s0(x)), net(x))
    meta_gm = fx.symbolic_trace(copy.deepcopy(net).to("meta"))
    meta_program = split_stages(meta_gm, {"a": 0, "b": 1}, example_inputs=(x,))
    with pytest.raises(RuntimeFailure, match=r"stage 1: buffer 'shift' .* not in the traced module"):
        build_stage(meta_program, 1, state_dict=None, device="cpu")


def test_a_meta_traced_model_loads_from_a_state_dict():
    model, units, x, y, loss_fn = _gpt_case()
    gm = fx.symbolic_trace(copy.deepcopy(model).to("meta"))  # Module.to unties lm_head from wte ...
    assert gm.lm_head.weight is not gm.wte.weight
    program = split_stages(gm, stage_mapping(gm, units, [3, 6]), example_inputs=(x.to("meta"),),
                           tied=[("wte.weight", "lm_head.weight")])  # ... so capture's TiedParameter names re-tie it
    assert program.tied[0].members == ((0, "wte.weight"), (1, "lm_head.weight"))
    stages = [build_stage(program, k, state_dict=model.state_dict(), device="cpu") for k in range(2)]
    _assert_matches_reference(model, stages, x, y, loss_fn)


def test_bad_mappings_and_values_are_rejected_with_named_errors():
    model, units, x, _, _ = _skip_case()
    gm = fx.symbolic_trace(model)
    with pytest.raises(ScheduleError, match=r"1 nodes the graph does not have \('nope'\)"):
        split_stages(gm, {"nope": 0}, example_inputs=(x,))
    with pytest.raises(ScheduleError, match=r"node 'down2_0' is on stage 0 but uses 'down1_1' from the later stage 1; .* move 'down2_0' to stage >= 1"):
        split_stages(gm, {"down1_0": 1, "down1_1": 1, "down2_0": 0, "down2_1": 0}, example_inputs=(x,))
    with pytest.raises(ScheduleError, match=r"mapped to stage -1"):
        split_stages(gm, {"inp": -1}, example_inputs=(x,))

    class Device(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x).to(x.device)

    dgm = fx.symbolic_trace(Device())
    with pytest.raises(ScheduleError, match=r"node 'getattr_1' \(stage 0\) produces a device"):
        split_stages(dgm, {"a": 0, "to": 1}, example_inputs=(torch.zeros(1, 2),))
    with pytest.raises(CaptureError, match=r"model input 'x' is a int"):
        split_stages(dgm, {}, example_inputs=(3,))


def test_state_dict_problems_name_the_stage_and_tensor():
    model, units, x, _, _ = _skip_case()
    program = _split(model, units, x, [5, 2])
    sd = dict(model.state_dict())
    del sd["out.weight"]
    with pytest.raises(RuntimeFailure, match=r"stage 1: parameter 'out.weight' .* is not in the state dict"):
        build_stage(program, 1, state_dict=sd, device="cpu")
    sd["out.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeFailure, match=r"'out.weight' has shape \(3, 3\) in the state dict"):
        build_stage(program, 1, state_dict=sd, device="cpu")
    with pytest.raises(ScheduleError, match="stage 2 is not a stage of this 2-stage program"):
        build_stage(program, 2, state_dict=None, device="cpu")


def test_fingerprints_differ_when_a_cut_differs():
    model, units, x, _, _ = _skip_case()
    a = _split(model, units, x, [5, 2]).cuts[0]
    b = _split(model, units, torch.randn(2, 8), [5, 2]).cuts[0]  # another micro-batch size
    c = _split(model, units, x, [4, 3]).cuts[0]
    assert a.fingerprint() == _split(model, units, x, [5, 2]).cuts[0].fingerprint()
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3
