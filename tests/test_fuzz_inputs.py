"""Bad input, as a careless user or an attacker would give it: one clear error, nothing written or lost.

Every case runs the CLI in-process (`hetpipe.cli.app.main`) and asserts exit code 2,
exactly one ``error:`` line on stderr naming the field (a needle per case), no traceback,
and that an existing output file (``-o``, ``--gantt``, ``--report``) and the input files
are byte-for-byte unchanged.  The API cases assert a one-line `HetpipeError`.  A few run
as real subprocesses (what a shell user sees).  Classes: cluster figures (NaN, inf,
negative, overflowing, out of range, wrong types), sizes bounded before work (device
counts, YAML alias bombs, file sizes), broken files (binary, empty, truncated, a folder),
plans with impossible tables (negative bytes, NaN times, deleted links, inflated
usable_bytes, unknown fields), CLI flags out of range, outputs that cannot be written,
API arguments of the wrong type.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from hetpipe.cli.app import main
from hetpipe.errors import HetpipeError

ROOT = Path(__file__).resolve().parents[1]
SENTINEL = b"an existing output that a failing run must not touch\n"

BASE_CLUSTER: dict[str, Any] = {
    "name": "fuzz",
    "nodes": [
        {"name": "a", "intra": "pcie-host", "network": {"bandwidth": "1Gbit/s", "latency": "0.2ms"},
         "devices": [{"gpu": "rtx3090", "count": 2}]},
        {"name": "b", "network": {"bandwidth": "1Gbit/s", "latency": "0.2ms"},
         "devices": [{"name": "custom", "memory": "12GB", "tensor_tflops": 50, "fp32_tflops": 20,
                      "memory_bandwidth": "500GB/s"}]},
    ],
}
NAN, INF = float("nan"), float("inf")
D0 = ("nodes", 0, "devices", 0)  # a catalog card
D1 = ("nodes", 1, "devices", 0)  # a card given by its figures
NET = ("nodes", 0, "network")


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(doc)
    at = out
    for key in path[:-1]:
        at = at[key]
    if value is _DELETE:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return out


_DELETE = object()

# (case id, path in the cluster document, new value, needle the error must contain)
CLUSTER_CASES: list[tuple[str, tuple[Any, ...], Any, str]] = [
    ("memory-1e300TB", (*D1, "memory"), "1e300TB", "memory"),
    ("memory-nan", (*D1, "memory"), NAN, "memory"),
    ("memory-inf", (*D1, "memory"), INF, "memory"),
    ("memory-negative", (*D1, "memory"), "-12GB", "memory"),
    ("memory-zero", (*D1, "memory"), 0, "memory"),
    ("memory-above-bound", (*D1, "memory"), "5PB", "memory"),
    ("memory-word", (*D1, "memory"), "lots", "memory"),
    ("memory-list", (*D1, "memory"), [12], "memory"),
    ("memory-bool", (*D1, "memory"), True, "memory"),
    ("memory-unit", (*D1, "memory"), "12 GBytes", "memory"),
    ("tensor-tflops-nan", (*D1, "tensor_tflops"), NAN, "tensor_tflops"),
    ("tensor-tflops-inf", (*D1, "tensor_tflops"), INF, "tensor_tflops"),
    ("tensor-tflops-negative", (*D1, "tensor_tflops"), -50, "tensor_tflops"),
    ("tensor-tflops-zero", (*D1, "tensor_tflops"), 0, "tensor_tflops"),
    ("tensor-tflops-huge", (*D1, "tensor_tflops"), 1e12, "tensor_tflops"),
    ("tensor-tflops-string", (*D1, "tensor_tflops"), "fast", "tensor_tflops"),
    ("fp32-tflops-nan", (*D1, "fp32_tflops"), NAN, "fp32_tflops"),
    ("fp32-tflops-null", (*D1, "fp32_tflops"), None, "fp32_tflops"),
    ("mem-bandwidth-nan", (*D1, "memory_bandwidth"), NAN, "memory_bandwidth"),
    ("mem-bandwidth-negative", (*D1, "memory_bandwidth"), "-500GB/s", "memory_bandwidth"),
    ("mem-bandwidth-zero", (*D1, "memory_bandwidth"), 0, "memory_bandwidth"),
    ("mem-bandwidth-huge", (*D1, "memory_bandwidth"), "1e30GB/s", "memory_bandwidth"),
    ("catalog-override-nan", (*D0, "tensor_tflops"), NAN, "tensor_tflops"),
    ("net-bandwidth-nan", (*NET, "bandwidth"), NAN, "bandwidth"),
    ("net-bandwidth-inf", (*NET, "bandwidth"), INF, "bandwidth"),
    ("net-bandwidth-negative", (*NET, "bandwidth"), "-1Gbit/s", "bandwidth"),
    ("net-bandwidth-zero", (*NET, "bandwidth"), "0Gbit/s", "bandwidth"),
    ("net-bandwidth-word", (*NET, "bandwidth"), "fast", "bandwidth"),
    ("net-bandwidth-missing", (*NET, "bandwidth"), _DELETE, "bandwidth"),
    ("net-latency-negative", (*NET, "latency"), "-1ms", "latency"),
    ("net-latency-nan", (*NET, "latency"), NAN, "latency"),
    ("net-latency-inf", (*NET, "latency"), INF, "latency"),
    ("net-latency-days", (*NET, "latency"), "1e9s", "latency"),
    ("count-100000", (*D0, "count"), 100000, "count"),
    ("count-5000", (*D0, "count"), 5000, "count"),
    ("count-zero", (*D0, "count"), 0, "count"),
    ("count-negative", (*D0, "count"), -2, "count"),
    ("count-float", (*D0, "count"), 1.5, "count"),
    ("count-string", (*D0, "count"), "two", "count"),
    ("count-bool", (*D0, "count"), True, "count"),
    ("reserve-negative", (*D0, "reserve"), "-1GB", "reserve"),
    ("reserve-1e300TB", (*D0, "reserve"), "1e300TB", "reserve"),
    ("reserve-all-memory", (*D1, "reserve"), "12GB", "reserve"),
    ("kernel-overhead-negative", (*D1, "kernel_overhead"), "-5us", "kernel_overhead"),
    ("kernel-overhead-nan", (*D1, "kernel_overhead"), NAN, "kernel_overhead"),
    ("efficiency-zero", (*D1, "matmul_efficiency"), 0, "matmul_efficiency"),
    ("efficiency-above-one", (*D1, "matmul_efficiency"), 1.5, "matmul_efficiency"),
    ("efficiency-nan", (*D1, "bandwidth_efficiency"), NAN, "bandwidth_efficiency"),
    ("unknown-device-field", (*D1, "memroy"), "12GB", "memroy"),
    ("unknown-gpu", (*D0, "gpu"), "rtx3095", "gpu"),
    ("gpu-not-a-string", (*D0, "gpu"), 3090, "gpu"),
    ("unknown-top-field", ("nodez",), [], "nodez"),
    ("nodes-empty", ("nodes",), [], "nodes"),
    ("nodes-not-a-list", ("nodes",), "a, b", "nodes"),
    ("devices-empty", ("nodes", 0, "devices"), [], "devices"),
    ("device-not-a-mapping", ("nodes", 0, "devices", 0), "rtx3090", "devices[0]"),
    ("node-name-colon", ("nodes", 0, "name"), "a:b", "name"),
    ("duplicate-node", ("nodes", 1, "name"), "a", "name"),
    ("intra-unknown", ("nodes", 0, "intra"), "infiniband", "intra"),
    ("links-unknown-node", ("links",), [{"between": ["a", "zz"], "bandwidth": "1Gbit/s", "latency": "1ms"}],
     "between"),
    ("links-negative-bandwidth", ("links",), [{"between": ["a", "b"], "bandwidth": "-1Gbit/s", "latency": "1ms"}],
     "bandwidth"),
    ("links-nan-latency", ("links",), [{"between": ["a", "b"], "bandwidth": "1Gbit/s", "latency": NAN}], "latency"),
    ("links-not-a-list", ("links",), {"a": "b"}, "links"),
]


def _alias_bomb() -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for k in range(1, 9):
        lines.append(f"a{k}: &a{k} [" + ", ".join([f"*a{k - 1}"] * 9) + "]")
    return "\n".join(lines) + "\nnodes: *a8\n"


# (case id, file name, content, needle)
CLUSTER_FILES: list[tuple[str, str, bytes, str]] = [
    ("alias-bomb", "bomb.yaml", _alias_bomb().encode(), "aliases"),
    ("binary", "c.yaml", bytes(range(256)) * 4, "cluster file"),
    ("empty", "c.yaml", b"", "empty"),
    ("top-level-list", "c.yaml", b"- a\n- b\n", "top level"),
    ("malformed-yaml", "c.yaml", b"nodes: [\n  {name: a\n", "malformed YAML"),
    ("malformed-json", "c.json", b'{"nodes": [}', "malformed JSON"),
    ("huge-file", "c.yaml", b"# padding\n" * 500_000, "bytes"),
    ("json-nan-memory", "c.json", json.dumps(_set(BASE_CLUSTER, (*D1, "memory"), NAN)).encode(), "memory"),
]


def _one_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI in-process; assert exit 2, one `error:` line on stderr, no traceback; return it."""
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err and len(lines[0]) < 2000, err[:300]
    return lines[0]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def good_plan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real plan of mlp-tiny on the mini home lab (one capture and solve for the module)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", "mlp-tiny", "--cluster", str(ROOT / "examples/clusters/homelab-mini.yaml"),
                 "-o", str(path), "--time-limit", "5"]) == 0
    assert main(["check", str(path)]) == 0  # the unedited plan is fine: every failure below is the edit's
    return json.loads(path.read_text())


def test_the_base_cluster_is_valid(tmp_path: Path) -> None:
    from hetpipe.cost_models.cluster import load_cluster

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE_CLUSTER))
    assert len(load_cluster(path).devices) == 3


@pytest.mark.parametrize("path, value, needle", [c[1:] for c in CLUSTER_CASES], ids=[c[0] for c in CLUSTER_CASES])
def test_bad_cluster_figure_is_one_error_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           path: tuple[Any, ...], value: Any, needle: str) -> None:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_set(BASE_CLUSTER, path, value), sort_keys=False))
    (tmp_path / "plan.json").write_bytes(SENTINEL)
    before = _snapshot(tmp_path)
    line = _one_error(capsys, ["plan", "mlp-tiny", "--cluster", str(tmp_path / "c.yaml"), "-o",
                               str(tmp_path / "plan.json")])
    assert needle in line, line
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("name, content, needle", [c[1:] for c in CLUSTER_FILES], ids=[c[0] for c in CLUSTER_FILES])
def test_broken_cluster_file_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                                          content: bytes, needle: str) -> None:
    (tmp_path / name).write_bytes(content)
    (tmp_path / "plan.json").write_bytes(SENTINEL)
    before = _snapshot(tmp_path)
    line = _one_error(capsys, ["plan", "mlp-tiny", "--cluster", str(tmp_path / name),
                               "-o", str(tmp_path / "plan.json")])
    assert needle in line, line
    assert _snapshot(tmp_path) == before


def _edit(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of the plan document at a dotted path (``units.0.state_bytes``); DELETE removes the key."""
    keys = [int(k) if k.lstrip("-").isdigit() else k for k in path.split(".")]

    def apply(doc: dict[str, Any]) -> None:
        at: Any = doc
        for key in keys[:-1]:
            at = at[key]
        if value is _DELETE:
            del at[keys[-1]]
        else:
            at[keys[-1]] = value(at[keys[-1]]) if callable(value) else value
    return apply


def _drop_link(doc: dict[str, Any]) -> None:
    doc["links"].pop(0)


def _dup_link(doc: dict[str, Any]) -> None:
    doc["links"].append(doc["links"][0])


def _dup_device(doc: dict[str, Any]) -> None:
    doc["devices"][1]["id"] = doc["devices"][0]["id"]


KIND = "rtx3090-mini"
# (case id, edit of the plan document, needle)
PLAN_EDITS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("microbatches-zero", _edit("training.microbatches", 0), "microbatches"),
    ("microbatches-negative", _edit("training.microbatches", -3), "microbatches"),
    ("microbatches-float", _edit("training.microbatches", 1.5), "microbatches"),
    ("microbatches-null", _edit("training.microbatches", None), "microbatches"),
    ("micro-batch-size-zero", _edit("training.micro_batch_size", 0), "micro_batch_size"),
    ("global-batch-negative", _edit("training.global_batch", -192), "global_batch"),
    ("activation-negative", _edit("units.0.activation_bytes", -16384), "activation_bytes"),
    ("state-negative", _edit("units.1.state_bytes", -1), "state_bytes"),
    ("state-below-params", _edit("units.0.state_bytes", 1), "state_bytes"),
    ("boundary-negative", _edit("units.0.boundary_bytes", -8192), "boundary_bytes"),
    ("param-bytes-negative", _edit("units.0.param_bytes", -1), "param_bytes"),
    ("flops-negative", _edit("units.2.fwd_flops", -5), "fwd_flops"),
    ("bytes-overflow", _edit("units.0.activation_bytes", 10**30), "activation_bytes"),
    ("time-nan", _edit(f"units.0.time_s.{KIND}.fwd", NAN), "fwd"),
    ("time-inf", _edit(f"units.1.time_s.{KIND}.bwd", INF), "bwd"),
    ("time-negative", _edit(f"units.0.time_s.{KIND}.fwd", -1.0), "fwd"),
    ("time-string", _edit(f"units.0.time_s.{KIND}.fwd", "fast"), "fwd"),
    ("time-kind-missing", _edit(f"units.0.time_s.{KIND}", _DELETE), "time_s"),
    ("link-deleted", _drop_link, "no link"),
    ("link-duplicated", _dup_link, "twice"),
    ("link-bandwidth-negative", _edit("links.0.bandwidth_bytes_s", -125e6), "bandwidth_bytes_s"),
    ("link-bandwidth-zero", _edit("links.0.bandwidth_bytes_s", 0.0), "bandwidth_bytes_s"),
    ("link-bandwidth-nan", _edit("links.1.bandwidth_bytes_s", NAN), "bandwidth_bytes_s"),
    ("link-bandwidth-inf", _edit("links.1.bandwidth_bytes_s", INF), "bandwidth_bytes_s"),
    ("link-latency-negative", _edit("links.0.latency_s", -0.1), "latency_s"),
    ("link-unknown-device", _edit("links.0.src", "nowhere:0"), "links[0]"),
    ("device-usable-above-memory", _edit("devices.0.usable_bytes", 10**12), "usable_bytes"),
    ("device-usable-zero", _edit("devices.0.usable_bytes", 0), "usable_bytes"),
    ("device-memory-float", _edit("devices.0.memory_bytes", 1e30), "memory_bytes"),
    ("device-duplicate-id", _dup_device, "twice"),
    ("stage-usable-inflated", _edit("stages.0.usable_bytes", lambda v: v * 4), "usable_bytes"),
    ("stage-unknown-device", _edit("stages.0.device", "nowhere:0"), "device"),
    ("stage-fwd-nan", _edit("stages.0.fwd_s", NAN), "fwd_s"),
    ("stage-send-negative", _edit("stages.0.send_s", -1.0), "send_s"),
    ("stage-memory-negative", _edit("stages.1.memory_bytes", -1), "memory_bytes"),
    ("stage-last-unit-beyond", _edit("stages.1.last_unit", 99), "last_unit"),
    ("predicted-nan", _edit("predicted.iteration_s", NAN), "iteration_s"),
    ("objective-negative", _edit("solver.objective_s", -131072.0), "objective_s"),
    ("unknown-top-field", _edit("activations_checked", True), "activations_checked"),
    ("unknown-stage-field", _edit("stages.0.usable_gb", 99), "usable_gb"),
    ("unknown-unit-field", _edit("units.0.recompute", True), "recompute"),
    ("format-wrong", _edit("format", "other.plan"), "format"),
    ("version-future", _edit("version", 99), "version"),
    ("version-string", _edit("version", "1"), "version"),
    ("stages-not-a-list", _edit("stages", {"0": 1}), "stages"),
]


def _bad_plan(tmp_path: Path, good: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> Path:
    doc = copy.deepcopy(good)
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("edit, needle", [c[1:] for c in PLAN_EDITS], ids=[c[0] for c in PLAN_EDITS])
def test_impossible_plan_is_one_error_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       good_plan: dict[str, Any], edit: Any, needle: str) -> None:
    path = _bad_plan(tmp_path, good_plan, edit)
    before = _snapshot(tmp_path)
    line = _one_error(capsys, ["check", str(path)])
    assert needle in line, line
    assert _snapshot(tmp_path) == before


# every plan-reading command refuses an impossible plan the same way, and writes nothing
PLAN_COMMANDS = [
    ("show-gantt", ["show", "{plan}", "--gantt", "{out}"]),
    ("show-trace", ["show", "{plan}", "--trace", "{out}"]),
    ("simulate", ["simulate", "{plan}", "--gantt", "{out}"]),
    ("compare", ["compare", "{plan}"]),
    ("run", ["run", "{plan}", "--model", "mlp-tiny", "--steps", "1", "--emulate", "--report", "{out}"]),
]


@pytest.mark.parametrize("edit_id", ["microbatches-zero", "link-deleted", "stage-usable-inflated", "time-nan"])
@pytest.mark.parametrize("argv", [c[1] for c in PLAN_COMMANDS], ids=[c[0] for c in PLAN_COMMANDS])
def test_every_plan_command_refuses_an_impossible_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       good_plan: dict[str, Any], edit_id: str,
                                                       argv: list[str]) -> None:
    edit = dict((c[0], c[1]) for c in PLAN_EDITS)[edit_id]
    path = _bad_plan(tmp_path, good_plan, edit)
    (tmp_path / "out.png").write_bytes(SENTINEL)
    before = _snapshot(tmp_path)
    _one_error(capsys, [a.format(plan=path, out=tmp_path / "out.png") for a in argv])
    assert _snapshot(tmp_path) == before


PLAN_FILES: list[tuple[str, bytes, str]] = [
    ("binary", bytes(range(256)) * 8, "not a text file"),
    ("empty", b"", "not valid JSON"),
    ("json-array", b"[1, 2, 3]", "not a hetpipe plan"),
    ("json-string", b'"plan"', "not a hetpipe plan"),
    ("truncated", b'{"format": "hetpipe.plan", "version": 1, "model": {', "truncated"),
    ("utf16", '{"format": "hetpipe.plan"}'.encode("utf-16"), "not a text file"),
]


@pytest.mark.parametrize("content, needle", [c[1:] for c in PLAN_FILES], ids=[c[0] for c in PLAN_FILES])
def test_broken_plan_file_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes,
                                       needle: str) -> None:
    (tmp_path / "p.json").write_bytes(content)
    assert needle in _one_error(capsys, ["check", str(tmp_path / "p.json")])


def test_plan_path_that_is_a_folder_or_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "cannot read plan" in _one_error(capsys, ["show", str(tmp_path)])
    assert "cannot read plan" in _one_error(capsys, ["show", str(tmp_path / "missing.json")])


FLAG_CASES: list[tuple[str, list[str], str]] = [
    ("time-limit-negative", ["--time-limit", "-5"], "--time-limit"),
    ("time-limit-zero", ["--time-limit", "0"], "--time-limit"),
    ("time-limit-zero-cpsat", ["--time-limit", "0", "--solver", "cpsat"], "--time-limit"),
    ("time-limit-nan", ["--time-limit", "nan"], "--time-limit"),
    ("time-limit-inf", ["--time-limit", "inf"], "--time-limit"),
    ("time-limit-word", ["--time-limit", "soon"], "--time-limit"),
    ("time-limit-a-year", ["--time-limit", "3e7"], "--time-limit"),
    ("solver-unknown", ["--solver", "gurobi"], "--solver"),
    ("seed-negative", ["--seed", "-1"], "--seed"),
    ("global-batch-zero", ["--global-batch", "0"], "--global-batch"),
    ("global-batch-negative", ["--global-batch", "-64"], "--global-batch"),
    ("batch-zero", ["--batch", "0"], "--batch"),
    ("seq-negative", ["--seq", "-1"], "--seq"),
    ("output-missing-folder", ["-o", "{tmp}/missing/dir/p.json"], "does not exist"),
    ("output-is-a-folder", ["-o", "{tmp}"], "is a directory"),
    ("unknown-flag", ["--fast-please"], "unrecognized"),
]


@pytest.mark.parametrize("extra, needle", [c[1:] for c in FLAG_CASES], ids=[c[0] for c in FLAG_CASES])
def test_plan_flags_are_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                extra: list[str], needle: str) -> None:
    (tmp_path / "plan.json").write_bytes(SENTINEL)
    before = _snapshot(tmp_path)
    argv = ["plan", "mlp-tiny", "--cluster", str(ROOT / "examples/clusters/homelab-mini.yaml"),
            "-o", str(tmp_path / "plan.json"), *[a.format(tmp=tmp_path) for a in extra]]
    assert needle in _one_error(capsys, argv)
    assert _snapshot(tmp_path) == before


OTHER_FLAGS: list[tuple[str, list[str], str]] = [
    ("simulate-microbatches-zero", ["simulate", "{plan}", "--microbatches", "0"], "--microbatches"),
    ("simulate-microbatches-negative", ["simulate", "{plan}", "--microbatches", "-2"], "--microbatches"),
    ("compare-microbatches-zero", ["compare", "{plan}", "--microbatches", "0"], "--microbatches"),
    ("show-gantt-missing-folder", ["show", "{plan}", "--gantt", "{tmp}/missing/dir/g.png"], "--gantt"),
    ("show-trace-folder", ["show", "{plan}", "--trace", "{tmp}"], "--trace"),
    ("simulate-gantt-missing-folder", ["simulate", "{plan}", "--gantt", "{tmp}/no/g.png"], "--gantt"),
    ("run-steps-zero", ["run", "{plan}", "--model", "mlp-tiny", "--steps", "0"], "--steps"),
    ("run-timeout-negative", ["run", "{plan}", "--model", "mlp-tiny", "--steps", "1", "--timeout", "-1"],
     "--timeout"),
    ("run-lr-nan", ["run", "{plan}", "--model", "mlp-tiny", "--steps", "1", "--lr", "nan"], "--lr"),
    ("run-report-missing-folder", ["run", "{plan}", "--model", "mlp-tiny", "--steps", "1", "--report",
                                   "{tmp}/missing/r.json"], "--report"),
    ("run-model-missing", ["run", "{plan}", "--steps", "1"], "--model"),
    ("demo-out-is-a-file", ["demo", "--fast", "--out", "{plan}"], "--out"),
    ("check-model-for-another-plan", ["check", "{plan}", "--model", "gpt-tiny"], "made for model"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in OTHER_FLAGS], ids=[c[0] for c in OTHER_FLAGS])
def test_other_flags_are_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 good_plan: dict[str, Any], argv: list[str], needle: str) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(good_plan))
    before = _snapshot(tmp_path)
    assert needle in _one_error(capsys, [a.format(plan=plan, tmp=tmp_path) for a in argv])
    assert _snapshot(tmp_path) == before


def _api_cases() -> list[tuple[str, Callable[[], Any], str]]:
    import dataclasses

    import hetpipe
    from hetpipe.cost_models.cluster import cluster_from_dict
    from hetpipe.models import build

    model, batch = build("mlp-tiny", device="meta")
    good = cluster_from_dict(BASE_CLUSTER)
    dev = good.devices[2]
    nan_dev = dataclasses.replace(dev, profile=dataclasses.replace(dev.profile, tensor_flops_s=NAN))
    nan_cluster = dataclasses.replace(good, devices=(*good.devices[:2], nan_dev))
    no_link = dataclasses.replace(good, links={k: v for k, v in good.links.items() if k != ("a:0", "b:0")})
    neg_link = dataclasses.replace(good, links={k: dataclasses.replace(v, bandwidth_bytes_s=-1.0)
                                                for k, v in good.links.items()})

    def part(cluster: Any, m: Any = model, **kw: Any) -> Callable[[], Any]:
        return lambda: hetpipe.partition(m, cluster, example_inputs=batch, **kw)

    return [
        ("cluster-none", part(None), "cluster"),
        ("cluster-int", part(42), "cluster"),
        ("cluster-list", part([BASE_CLUSTER]), "cluster"),
        ("cluster-dict-nan", part(_set(BASE_CLUSTER, (*D1, "memory"), NAN)), "memory"),
        ("cluster-dict-count", part(_set(BASE_CLUSTER, (*D0, "count"), 100000)), "count"),
        ("cluster-object-nan", part(nan_cluster), "tensor_flops_s"),
        ("cluster-object-missing-link", part(no_link), "no link"),
        ("cluster-object-negative-link", part(neg_link), "bandwidth_bytes_s"),
        ("model-none", part(BASE_CLUSTER, None), "model"),
        ("model-string", part(BASE_CLUSTER, "gpt2"), "model"),
        ("time-limit-zero", part(BASE_CLUSTER, time_limit_s=0.0), "time limit"),
        ("time-limit-nan", part(BASE_CLUSTER, time_limit_s=NAN), "time limit"),
        ("check-plan-dict", lambda: hetpipe.check_plan({"format": "hetpipe.plan"}), "expected a Plan"),
        ("check-plan-none", lambda: hetpipe.check_plan(None), "expected a Plan"),
        ("plan-from-dict-list", lambda: hetpipe.Plan.from_dict([1, 2]), "not a hetpipe plan"),
    ]


API_IDS = ["cluster-none", "cluster-int", "cluster-list", "cluster-dict-nan", "cluster-dict-count",
           "cluster-object-nan", "cluster-object-missing-link", "cluster-object-negative-link", "model-none",
           "model-string", "time-limit-zero", "time-limit-nan", "check-plan-dict", "check-plan-none",
           "plan-from-dict-list"]


@pytest.mark.parametrize("case", API_IDS)
def test_api_refuses_bad_arguments_with_one_line(case: str) -> None:
    fn, needle = {c[0]: (c[1], c[2]) for c in _api_cases()}[case]
    with pytest.raises(HetpipeError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and needle in message, message


def test_api_accepts_a_cluster_dict() -> None:
    from hetpipe.cost_models.cluster_checks import as_cluster

    assert [d.id for d in as_cluster(BASE_CLUSTER).devices] == ["a:0", "a:1", "b:0"]


@pytest.mark.parametrize("argv, needle", [
    (["plan", "mlp-tiny", "--cluster", "{bomb}", "-o", "{tmp}/p.json"], "aliases"),
    (["plan", "mlp-tiny", "--cluster", "examples/clusters/homelab-mini.yaml", "--time-limit", "-5"], "--time-limit"),
    (["check", "{binary}"], "not a text file"),
    (["plan", "mlp-tiny"], "--cluster"),
], ids=["alias-bomb", "time-limit", "binary-plan", "usage"])
def test_a_shell_user_sees_one_line_and_exit_2(tmp_path: Path, argv: list[str], needle: str) -> None:
    (tmp_path / "bomb.yaml").write_text(_alias_bomb())
    (tmp_path / "bin.json").write_bytes(bytes(range(256)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [a.format(bomb=tmp_path / "bomb.yaml", tmp=tmp_path, binary=tmp_path / "bin.json") for a in argv]
    script = "import sys; from hetpipe.cli.app import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (
        proc.returncode, proc.stderr[-500:])
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("plan", [None, {"format": "hetpipe.plan"}, 3.5, ["plan.json"]],
                         ids=["none", "dict", "float", "list"])
def test_run_and_trainer_refuse_a_plan_that_is_not_a_plan(plan: Any) -> None:
    import hetpipe

    for call in (lambda: hetpipe.run(plan, model="mlp-tiny", steps=1), lambda: hetpipe.Trainer(plan, model="mlp-tiny")):
        with pytest.raises(HetpipeError, match="expected a plan file path or a Plan") as info:
            call()
        assert "\n" not in str(info.value)
