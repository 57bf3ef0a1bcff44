"""Devices and clusters (issue #2): catalog, unit parsing, cluster files, link model, `hetpipe profile`."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.cli.app import main
from hetpipe.cost_models.catalog import load_catalog, lookup_gpu
from hetpipe.cost_models.cluster import DEFAULT_RESERVE_BYTES, cluster_from_dict, load_cluster
from hetpipe.cost_models.links import (
    NVLINK_DIRECTIONS, PCIE_HOST_BANDWIDTH_BYTES_S, PCIE_HOST_LATENCY_S,
)
from hetpipe.cost_models.profile import detect_gpus, profile_document, run_profile
from hetpipe.cost_models.quantities import (
    BYTE_UNITS, format_bytes, parse_bandwidth_bytes_s, parse_bytes, parse_latency_s,
)
from hetpipe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "clusters").glob("*.yaml"))
CATALOG_JSON = json.loads((ROOT / "hetpipe" / "cost_models" / "catalog.json").read_text())["gpus"]
GPU_KEYS = [k for k in CATALOG_JSON if k != "cpu"]


# ---------------------------------------------------------------- examples


def test_the_documented_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"homelab.yaml", "homelab-mini.yaml", "lab-a100-v100.yaml", "community-16.yaml", "mixed-64.yaml",
            "homogeneous-4x3090.yaml", "homogeneous-8xa100.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads_with_a_link_for_every_ordered_pair(path):
    cluster = load_cluster(path)
    ids = [d.id for d in cluster.devices]
    assert len(set(ids)) == len(ids) > 0
    assert set(cluster.links) == {(a, b) for a in ids for b in ids if a != b}
    for (src, dst), link in cluster.links.items():
        assert (link.src, link.dst) == (src, dst)
        assert link.bandwidth_bytes_s > 0 and link.latency_s >= 0
        same_node = cluster.device(src).node == cluster.device(dst).node
        assert (link.kind != "network") == same_node
    for dev in cluster.devices:
        assert dev.id.startswith(f"{dev.node}:") and 0 < dev.usable_bytes < dev.memory_bytes


def test_homelab_figures():
    c = load_cluster(ROOT / "examples/clusters/homelab.yaml")
    assert c.kinds == ("rtx3090", "rtx4090", "rtx3060-12gb")
    assert [d.id for d in c.devices] == ["desk:0", "desk:1", "shelf:0"]
    desk = c.link("desk:0", "desk:1")
    assert (desk.kind, desk.bandwidth_bytes_s, desk.latency_s) == ("pcie-host", PCIE_HOST_BANDWIDTH_BYTES_S,
                                                                  PCIE_HOST_LATENCY_S)
    net = c.link("shelf:0", "desk:1")
    assert (net.bandwidth_bytes_s, net.latency_s) == (125e6, 2e-4)  # 1 Gbit/s, 0.2 ms
    assert c.device("desk:0").reserve_bytes == DEFAULT_RESERVE_BYTES


def test_lab_and_large_examples():
    lab = load_cluster(ROOT / "examples/clusters/lab-a100-v100.yaml")
    assert lab.link("a100:0", "a100:3").bandwidth_bytes_s == 600e9 / NVLINK_DIRECTIONS
    assert lab.link("a100:0", "v100:0").bandwidth_bytes_s == 100e9 / 8
    community = load_cluster(ROOT / "examples/clusters/community-16.yaml")
    assert len(community.devices) == 16 and len({d.node for d in community.devices}) >= 6
    for (a, b), link in community.links.items():
        if link.kind == "network" and {a.split(":")[0], b.split(":")[0]} != {"alice", "bob"}:
            assert 100e6 / 8 <= link.bandwidth_bytes_s <= 500e6 / 8 and 0.02 <= link.latency_s <= 0.06
    mixed = load_cluster(ROOT / "examples/clusters/mixed-64.yaml")
    assert len(mixed.devices) == 64 and len({d.node for d in mixed.devices}) == 8 and 3 <= len(mixed.kinds) <= 4


def test_homelab_mini_keeps_the_speed_ratios_and_starves_the_3060():
    mini = load_cluster(ROOT / "examples/clusters/homelab-mini.yaml")
    real = [lookup_gpu(k) for k in ("rtx3090", "rtx4090", "rtx3060-12gb")]
    small = [d.profile for d in mini.devices]
    for attr in ("tensor_flops_s", "fp32_flops_s", "memory_bandwidth_bytes_s"):
        for p, q in zip(small, real):
            assert getattr(p, attr) / getattr(small[0], attr) == pytest.approx(
                getattr(q, attr) / getattr(real[0], attr), rel=1e-3)
    usable = [d.usable_bytes for d in mini.devices]
    assert usable[2] < usable[0] / 2 and usable[0] == usable[1]


# ---------------------------------------------------------------- catalog


def test_catalog_has_at_least_15_gpus_with_sources_and_positive_figures():
    catalog = load_catalog()
    assert len([k for k in catalog.entries if k != "cpu"]) >= 15 and "cpu" in catalog.entries
    for key, row in CATALOG_JSON.items():
        assert row["source"] and row["fp32_source"], key
        for f in ("memory_bytes", "tensor_flops_s", "fp32_flops_s", "memory_bandwidth_bytes_s"):
            assert row[f] > 0, (key, f)
        assert row["accumulate"] == "fp32" and row["dense"] is True
        assert row["tensor_flops_s"] >= row["fp32_flops_s"], key


@pytest.mark.parametrize("key", GPU_KEYS)
def test_catalog_accumulate_mode(key):
    """GeForce: FP32-accumulate is half the FP16-accumulate rate; pro and datacentre cards: full rate."""
    row = CATALOG_JSON[key]
    factor = 2 if "GeForce" in row["name"] else 1
    assert row["fp16_acc_tensor_flops_s"] == pytest.approx(factor * row["tensor_flops_s"], rel=0.02)
    assert ("not in gpu_specs.md" in row["source"]) == (key == "l4")


@pytest.mark.parametrize(("key", "tflops", "gib"), [
    ("rtx3090", 71, 24), ("rtx4090", 165.2, 24), ("rtx3060-12gb", 25.5, 12), ("a100-80gb", 312, 80),
    ("h100-sxm", 989.4, 80), ("t4", 65, 16), ("a6000", 154.8, 48)])
def test_catalog_matches_gpu_specs(key, tflops, gib):
    p = lookup_gpu(key)
    assert p.tensor_flops_s == tflops * 1e12 and p.memory_bytes == gib * 2**30


def test_interconnect_flags_follow_gpu_specs():
    assert not lookup_gpu("rtx4090").p2p and not lookup_gpu("rtx4090").nvlink
    assert lookup_gpu("rtx3090").p2p and lookup_gpu("rtx3090").nvlink
    assert lookup_gpu("a100-40gb").nvlink


@pytest.mark.parametrize(("name", "key"), [
    ("RTX 3090", "rtx3090"), ("3090", "rtx3090"), ("NVIDIA GeForce RTX 3090", "rtx3090"),
    ("A100 80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("Tesla T4", "t4"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA L4", "l4"),
    ("rtx3060-12gb", "rtx3060-12gb"), ("RTX 3060 12GB", "rtx3060-12gb"), ("NVIDIA RTX A6000", "a6000"),
    ("Tesla V100-SXM2-32GB", "v100-32gb"), ("rtx 4070", "rtx4070")])
def test_aliases_resolve(name, key):
    assert load_catalog().resolve(name) == key
    assert lookup_gpu(name).kind == key


def test_unknown_gpu_lists_close_matches():
    with pytest.raises(ConfigError, match=r"unknown GPU 'RTX 3095'; did you mean 'rtx3090'"):
        lookup_gpu("RTX 3095")
    with pytest.raises(ConfigError, match=r"'v100-16gb'|'v100-32gb'"):
        lookup_gpu("v100")  # ambiguous on purpose: the memory size must be given


# ---------------------------------------------------------------- units

_DECIMAL_OR_BINARY = sorted(u for u in BYTE_UNITS if u != "B")


@given(n=st.integers(0, 10**6), unit=st.sampled_from(_DECIMAL_OR_BINARY), space=st.sampled_from(["", " "]))
def test_parse_bytes_scales_by_the_unit(n, unit, space):
    assert parse_bytes(f"{n}{space}{unit}") == n * BYTE_UNITS[unit]


@given(st.integers(0, 2**50))
def test_format_bytes_round_trips(n):
    assert parse_bytes(format_bytes(n)) == n


@given(x=st.floats(0.001, 1e4), prefix=st.sampled_from(["", "K", "M", "G"]))
def test_bits_are_an_eighth_of_bytes(x, prefix):
    as_bits = parse_bandwidth_bytes_s(f"{x}{prefix}bit/s")
    assert as_bits == pytest.approx(parse_bandwidth_bytes_s(f"{x}{prefix}B/s") / 8, rel=1e-12)
    assert parse_bandwidth_bytes_s(f"{x} {prefix}bps") == pytest.approx(as_bits, rel=1e-12)


@given(st.floats(0.0, 1e4))
def test_latency_units(x):
    assert parse_latency_s(f"{x}ms") == pytest.approx(x / 1e3, rel=1e-12)
    assert parse_latency_s(f"{x} us") == pytest.approx(x / 1e6, rel=1e-12)
    assert parse_latency_s(x) == x


@pytest.mark.parametrize(("text", "value"), [
    ("24GB", 24 * 10**9), ("24 GiB", 24 * 2**30), ("24e9", 24 * 10**9), (12345, 12345), ("512MB", 512 * 10**6)])
def test_memory_spellings(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(("parse", "text", "match"), [
    (parse_bytes, "24Gb", "unknown unit 'Gb'"), (parse_bytes, "lots", "cannot read"),
    (parse_bytes, "1.5B", "whole number"), (parse_bandwidth_bytes_s, "1 Gbit", "unknown unit"),
    (parse_latency_s, "3 fortnights", "unknown unit"), (parse_bytes, True, "expected"),
    (parse_latency_s, "nan ms", "cannot read")])
def test_bad_quantities(parse, text, match):
    with pytest.raises(ValueError, match=match):
        parse(text)


# ---------------------------------------------------------------- link model

_CARDS = ["rtx3090", "rtx4090", "a100-80gb", "v100-32gb", "rtx3060-12gb", "a6000"]


@st.composite
def _cluster_docs(draw):
    nodes = []
    for i in range(draw(st.integers(1, 4))):
        devices = [{"gpu": draw(st.sampled_from(_CARDS)), "count": draw(st.integers(1, 3))}
                   for _ in range(draw(st.integers(1, 2)))]
        nodes.append({"name": f"n{i}", "intra": draw(st.sampled_from(["nvlink", "pcie-p2p", "pcie-host"])),
                      "network": {"bandwidth": draw(st.integers(1, 100)) * 1e8,
                                  "latency": draw(st.integers(0, 50)) * 1e-3},
                      "devices": devices})
    return {"nodes": nodes}


@settings(max_examples=40, deadline=None)
@given(_cluster_docs())
def test_link_model_invariants(doc):
    c = cluster_from_dict(doc, source="generated")
    ids = [d.id for d in c.devices]
    assert set(c.links) == {(a, b) for a in ids for b in ids if a != b}
    nets = {n["name"]: n["network"] for n in doc["nodes"]}
    intra = {n["name"]: n["intra"] for n in doc["nodes"]}
    for (a, b), link in c.links.items():
        da, db = c.device(a), c.device(b)
        assert c.link(b, a).bandwidth_bytes_s == link.bandwidth_bytes_s  # symmetric figures
        if da.node != db.node:
            assert link.bandwidth_bytes_s == min(nets[da.node]["bandwidth"], nets[db.node]["bandwidth"])
            assert link.latency_s == max(nets[da.node]["latency"], nets[db.node]["latency"])
            continue
        if link.kind == "nvlink":
            assert intra[da.node] == "nvlink" and da.profile.nvlink and db.profile.nvlink
        if link.kind == "pcie-p2p":
            assert intra[da.node] in ("nvlink", "pcie-p2p") and da.profile.p2p and db.profile.p2p
        if intra[da.node] == "pcie-p2p" and da.profile.p2p and db.profile.p2p:
            assert link.kind == "pcie-p2p"


def _doc(*devices, intra="pcie-host", **extra):
    return {"nodes": [{"name": "n", "intra": intra, "devices": list(devices)}], **extra}


def test_p2p_without_p2p_falls_back_to_host_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        c = cluster_from_dict(_doc({"gpu": "rtx3090"}, {"gpu": "rtx4090"}, intra="pcie-p2p"), source="lab.yaml")
    assert c.link("n:0", "n:1").kind == "pcie-host"
    assert c.link("n:0", "n:1").bandwidth_bytes_s == PCIE_HOST_BANDWIDTH_BYTES_S
    assert "pcie-host" in caplog.text and "lab.yaml" in caplog.text


def test_nvlink_pairs_and_overrides():
    c = cluster_from_dict(_doc({"gpu": "rtx3090", "count": 2}, intra="nvlink"))
    assert c.link("n:0", "n:1").bandwidth_bytes_s == 112.5e9 / 2
    measured = _doc({"gpu": "rtx3090", "count": 2}, intra="nvlink")
    measured["nodes"][0]["intra_link"] = {"bandwidth": "40GB/s", "latency": "8us"}
    link = cluster_from_dict(measured).link("n:1", "n:0")
    assert (link.bandwidth_bytes_s, link.latency_s, link.kind) == (40e9, 8e-6, "nvlink")
    two = {"nodes": [{"name": "a", "network": {"bandwidth": "1Gbit/s", "latency": "1ms"}, "devices": [{"gpu": "t4"}]},
                     {"name": "b", "network": {"bandwidth": "1Gbit/s", "latency": "1ms"}, "devices": [{"gpu": "t4"}]}],
           "links": [{"between": ["b", "a"], "bandwidth": "100Mbit/s", "latency": "30 ms"}]}
    c = cluster_from_dict(two)
    for pair in (("a:0", "b:0"), ("b:0", "a:0")):
        assert (c.link(*pair).bandwidth_bytes_s, c.link(*pair).latency_s) == (12.5e6, 0.03)


def test_explicit_cards_and_overrides():
    c = cluster_from_dict(_doc({"gpu": "rtx4090", "count": 2, "reserve": "3GB"},
                               {"name": "mycard", "memory": "16GiB", "tensor_tflops": 50, "fp32_tflops": 20,
                                "memory_bandwidth": "500GB/s", "matmul_efficiency": 0.5}))
    assert [d.reserve_bytes for d in c.devices] == [3 * 10**9, 3 * 10**9, DEFAULT_RESERVE_BYTES]
    mine = c.profile("mycard")
    assert (mine.memory_bytes, mine.tensor_flops_s, mine.fp32_flops_s, mine.memory_bandwidth_bytes_s,
            mine.matmul_efficiency) == (16 * 2**30, 50e12, 20e12, 500e9, 0.5)
    renamed = cluster_from_dict(_doc({"gpu": "rtx3080", "name": "rtx3080-12gb", "memory": "12GiB"}))
    p = renamed.profile("rtx3080-12gb")
    assert p.memory_bytes == 12 * 2**30 and p.tensor_flops_s == lookup_gpu("rtx3080").tensor_flops_s


# ---------------------------------------------------------------- bad input


def _write(tmp_path, text, name="lab.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _fails(path_or_doc, *needles):
    with pytest.raises(ConfigError) as info:
        if isinstance(path_or_doc, Path):
            load_cluster(path_or_doc)
        else:
            cluster_from_dict(path_or_doc, source="lab.yaml")
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = _write(tmp_path, "name: x\nnodes:\n  - name: a\n    devices: [{gpu: rtx3090}\n  - name: b\n")
    message = _fails(path, str(path), "malformed YAML", "fix")
    assert f"{path}:4:" in message or f"{path}:5:" in message


def test_malformed_json_names_file_and_line(tmp_path):
    path = _write(tmp_path, '{"nodes": [\n  {"name": "a",}\n]}', name="lab.json")
    _fails(path, f"{path}:2:", "malformed JSON")


def test_unknown_gpu_in_a_file_names_line_field_and_suggestions(tmp_path):
    path = _write(tmp_path, "nodes:\n  - name: a\n    devices:\n      - {gpu: rtx3095}\n")
    _fails(path, f"{path}:4:", "nodes[0].devices[0].gpu", "unknown GPU 'rtx3095'", "did you mean 'rtx3090'")


_NESTED = """\
name: lab
nodes:
  - name: desk
    intra: {intra}
    network:
      {bandwidth}: {rate}
      latency: {latency}
    devices:
      - gpu: rtx3090
      - gpu: rtx4090
        reserve: {reserve}
  - name: shelf
    network: {{bandwidth: 1Gbit/s, latency: 0.2ms}}
    devices: [{{gpu: rtx3060-12gb}}]
links:
  - between: [desk, shelf]
    bandwidth: 1Gbit/s
    latency: {link_latency}
"""
_GOOD = {"intra": "pcie-host", "bandwidth": "bandwidth", "rate": "1Gbit/s", "latency": "0.2ms", "reserve": "2GB",
         "link_latency": "1ms"}


@pytest.mark.parametrize(("change", "line", "field"), [
    ({"intra": "nvlnk"}, 4, "nodes[0].intra"),                          # a node's field
    ({"bandwidth": "bandwith"}, 6, "nodes[0].network.bandwith"),         # an unknown key two levels down
    ({"rate": "fast"}, 6, "nodes[0].network.bandwidth"),                 # a bad value two levels down
    ({"latency": "-1ms"}, 7, "nodes[0].network.latency"),
    ({"reserve": "lots"}, 11, "nodes[0].devices[1].reserve"),           # a field of a list item's mapping
    ({"link_latency": "soon"}, 18, "links[0].latency"),                 # a top-level list's item
])
def test_errors_name_the_line_of_the_offending_key(tmp_path, change, line, field):
    path = _write(tmp_path, _NESTED.format(**{**_GOOD, **change}))
    assert load_cluster(_write(tmp_path, _NESTED.format(**_GOOD), name="good.yaml")).devices
    _fails(path, f"{path}:{line}: {field}:")


@pytest.mark.parametrize(("device", "needles"), [
    ({"name": "x", "memory": "-1GB", "tensor_tflops": 1, "fp32_tflops": 1, "memory_bandwidth": "1GB/s"},
     ("devices[0].memory", "must be positive")),
    ({"name": "x", "memory": "1GB"}, ("lacks tensor_tflops, fp32_tflops, memory_bandwidth", "e.g. memory")),
    ({"name": "x", "memory": "1GB", "tensor_tflops": 0, "fp32_tflops": 1, "memory_bandwidth": "1GB/s"},
     ("tensor_tflops", "must be positive")),
    ({"gpu": "rtx3090", "memory": None}, ("memory", "missing a value")),
    ({"gpu": "rtx3090", "memory": "24Gb"}, ("memory", "unknown unit 'Gb'")),
    ({"gpu": "rtx3090", "reserve": "30GB"}, ("reserve", "set reserve: below memory")),
    ({"gpu": "rtx3090", "count": 0}, ("count", "at least 1")),
    ({"gpu": "rtx3090", "matmul_efficiency": 1.5}, ("matmul_efficiency", "(0, 1]")),
    ({"gpu": "rtx3090", "memroy": "1GB"}, ("memroy", "did you mean 'memory'")),
    ({"memory": "1GB"}, ("give gpu:",)),
    ({"name": "x", "memory": "16GB", "tensor_tflops": 1, "fp32_tflops": 1, "memory_bandwidth": "1GB/s",
      "nvlink": True}, ("nvlink", "needs nvlink_bandwidth")),
])
def test_bad_devices(device, needles):
    _fails(_doc(device), "lab.yaml", *needles)


def test_bad_nodes_and_links():
    net = {"bandwidth": "1Gbit/s", "latency": "1ms"}
    a = {"name": "a", "network": net, "devices": [{"gpu": "t4"}]}
    b = {"name": "b", "devices": [{"gpu": "t4"}]}
    _fails({"nodes": [a, b]}, "nodes[1].network", "no network figures", "add network:")
    _fails({"nodes": [a, {**b, "network": {"bandwidth": "-1Gbit/s", "latency": "1ms"}}]},
           "nodes[1].network.bandwidth", "must be positive")
    _fails({"nodes": [a, {**b, "network": {"bandwidth": "1Gbit/s", "latency": "-1ms"}}]}, "latency", "non-negative")
    _fails({"nodes": [a, {**b, "network": {"bandwith": "1Gbit/s", "latency": "1ms"}}]}, "did you mean 'bandwidth'")
    _fails({"nodes": [a, {**a}]}, "nodes[1].name", "duplicate node name 'a'")
    _fails({"nodes": [a], "links": [{"between": ["a", "garage"], **net}]}, "links[0].between", "no node named 'garage'")
    _fails({"nodes": [a, {**b, "network": net}], "links": [{"between": ["a", "b"]}]}, "links[0].bandwidth", "missing")
    _fails({"nodes": [{**a, "intra": "nvswitch"}]}, "intra", "nvlink, pcie-p2p, pcie-host")
    _fails({"nodes": [{**a, "name": "a:b"}]}, "contains ':'")
    _fails({"nodes": [a], "nodez": []}, "nodez", "did you mean 'nodes'")


def test_same_kind_with_different_figures_is_refused():
    _fails(_doc({"gpu": "rtx3090"}, {"gpu": "rtx3090", "memory": "20GiB"}), "both kind 'rtx3090'",
           "give the modified card its own name")


@pytest.mark.parametrize("doc", [{"nodes": []}, {"name": "x"}, _doc(), [1, 2]])
def test_zero_devices_is_a_config_error(doc):
    message = _fails(doc, "lab.yaml")
    assert "no devices" in message or "mapping" in message


def test_missing_and_empty_files(tmp_path):
    _fails(tmp_path / "nope.yaml", "not found", "hetpipe profile")
    _fails(_write(tmp_path, "# nothing\n"), "empty")


# ---------------------------------------------------------------- profile


def test_profile_writes_a_file_that_loads_back(tmp_path):
    out = tmp_path / "me.yaml"
    cluster, summary = run_profile(output=out, calibrate=False)
    unwritten, _ = run_profile(output=None, calibrate=False)
    assert load_cluster(out).devices == unwritten.devices == cluster.devices and len(cluster.devices) >= 1
    assert f"wrote {out}" in summary
    if not detect_gpus().gpus:
        assert "profiling the CPU" in summary and cluster.kinds == ("cpu",)


def test_profile_without_a_driver_profiles_the_cpu(monkeypatch):
    import pynvml

    def no_driver():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    detection = detect_gpus()
    assert detection.gpus == () and "no NVIDIA driver" in detection.note and "\n" not in detection.note
    cluster = cluster_from_dict(profile_document(detection, calibrate=False))
    assert cluster.kinds == ("cpu",) and cluster.devices[0].memory_bytes > 0


def test_profile_reads_nvml(monkeypatch):
    """A fake NVML with two P2P-capable 3090s and an unknown-memory 3080 variant."""
    names = [b"NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3090"]
    fake = types.SimpleNamespace(
        NVMLError=RuntimeError, NVML_FEATURE_ENABLED=1, NVML_P2P_CAPS_INDEX_READ=0, NVML_P2P_STATUS_OK=0,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: len(names),
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: names[h],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=24 * 2**30),
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=f"00000000:0{h}:00.0"),
        nvmlDeviceGetNvLinkState=lambda h, link: 0, nvmlDeviceGetP2PStatus=lambda a, b, caps: 0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    detection = detect_gpus()
    assert [g.name for g in detection.gpus] == ["NVIDIA GeForce RTX 3090"] * 2 and detection.all_p2p
    doc = profile_document(detection, calibrate=False)
    assert doc["nodes"][0]["intra"] == "pcie-p2p"
    cluster = cluster_from_dict(doc)
    assert cluster.kinds == ("rtx3090",) and len(cluster.links) == 2


@pytest.mark.slow
def test_profile_calibrate_records_measurements(tmp_path, monkeypatch):
    from hetpipe.cost_models import calibrate, profile
    from tests.machine_load import load_per_core, scaled_limit_s

    # The link measurement's 60 s guard (`calibrate.LINK_TIMEOUT_S`: 2 spawned processes importing torch)
    # scaled by the load per core: beside a CPU burner at load 17-20 on 2 cores it ran out before the ranks met.
    real = profile.measure_link
    timeout_s = scaled_limit_s(calibrate.LINK_TIMEOUT_S, load_per_core=load_per_core())
    monkeypatch.setattr(profile, "measure_link", lambda *a, **kw: real(*a, **{"timeout_s": timeout_s, **kw}))
    out = tmp_path / "cal.yaml"
    cluster, summary = run_profile(output=out, calibrate=True)
    back = load_cluster(out)
    assert back == cluster
    assert all(d.profile.matmul_efficiency is not None and "calibrated" in d.profile.source for d in back.devices)
    import yaml

    doc = yaml.safe_load(out.read_text())
    record = doc["calibration"]["devices"]
    for dev in back.devices:
        measured = record[dev.kind]["tensor_matmul_flops_s"]
        # catalog peak x efficiency (or the measured peak for the CPU) reproduces the measurement
        assert dev.profile.tensor_flops_s * dev.profile.matmul_efficiency == pytest.approx(measured, rel=1e-5)
    link = back.link(*[d.id for d in back.devices][:2]) if len(back.devices) > 1 else None
    assert doc["nodes"][0]["intra_link"]["bandwidth"] and doc["calibration"]["link"]["bandwidth_bytes_s"] > 0
    assert link is None or link.bandwidth_bytes_s == pytest.approx(doc["calibration"]["link"]["bandwidth_bytes_s"],
                                                                   rel=1e-5)
    assert "local link" in summary
    # the host's copy bandwidth, which the offload lever's host step runs at, is measured and used
    assert all(d.host_memory_bytes_s > 0 for d in back.devices) and "host_memory_bandwidth" in doc["nodes"][0]


def test_cli_profile_exits_0_and_the_file_loads(tmp_path, capsys):
    out = tmp_path / "cli.yaml"
    assert main(["profile", "-o", str(out)]) == 0
    assert load_cluster(out).devices
    assert "wrote" in capsys.readouterr().out


def test_cli_bad_output_exits_2_with_one_error_line(tmp_path, capsys):
    assert main(["profile", "-o", str(tmp_path)]) == 2  # a directory: cannot be written
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: cannot write") and "choose a writable path with -o" in lines[0]
