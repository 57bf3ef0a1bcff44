"""Issue 17 item 4: CPU core groups as devices, measured, planned on and run without emulation.

The plumbing, not the timing: a core-group cluster file carries each device's cores into the plan,
a non-emulated run pins each rank there, and its report sets measured beside predicted per stage
(forward, backward, transfer, optimizer step, held memory).  How close they are is a benchmark
(`benchmarks/cpu_truth.py`): one sample on a shared 2-core machine proves nothing about it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from hetpipe.cost_models import profile as profile_mod
from hetpipe.cost_models.calibrate import Calibration, LinkMeasurement, apply_calibration
from hetpipe.cost_models.cluster import cluster_from_dict
from hetpipe.cost_models.cpu_cores import available_cores, format_cores, parse_cores, split_cores
from hetpipe.cost_models.devices import DeviceProfile
from hetpipe.errors import ConfigError, HetpipeError
from hetpipe.runtime.measured_links import cut_transfers_s
from hetpipe.runtime.report import ActionRecord, RankResult, RankTimeline, build_report
from tests.machine_load import guard_s

MODEL, BATCH, SEQ = "gpt-tiny", 2, 16


def _cal(cores: tuple[int, ...], overhead_s: float = 4e-6) -> Calibration:
    return Calibration("cpu", 2e10, 2e10, 8e9, 1024, "h", "2.13", "2026-12-03", kernel_overhead_s=overhead_s,
                       cores=cores)


def test_core_lists_split_parse_and_print() -> None:
    assert split_cores(2, available=(3, 1, 0, 2)) == ((0, 1), (2, 3))
    assert parse_cores("4-5,0") == (0, 4, 5) and parse_cores([2, 2]) == (2,)
    assert parse_cores(format_cores((0, 1, 2, 7, 9, 10))) == (0, 1, 2, 7, 9, 10)
    with pytest.raises(HetpipeError, match="--cpu-devices 3: this process may use 2 core"):
        split_cores(3, available=(0, 1))
    for bad in ("a-b", True, -1, [], "1.5"):
        with pytest.raises(ValueError):
            parse_cores(bad)


def _cluster_doc(*device_entries: dict) -> dict:
    return {"name": "cg", "nodes": [{"name": "vm", "intra": "pcie-host",
                                     "intra_link": {"bandwidth": "1GB/s", "latency": "100us"},
                                     "devices": list(device_entries)}]}


def test_cluster_file_cores_reach_the_devices_and_the_plan(tmp_path: Path) -> None:
    from hetpipe.models import build
    from hetpipe.plan.build import partition
    from hetpipe.plan.schema import Plan

    doc = _cluster_doc({"gpu": "cpu", "name": "cpu-c0", "cores": "0", "memory": "2GB", "reserve": 0},
                       {"gpu": "cpu", "name": "cpu-c1", "cores": [1], "memory": "2GB", "reserve": 0})
    cluster = cluster_from_dict(doc)
    assert [d.cores for d in cluster.devices] == [(0,), (1,)]
    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    plan = partition(model, cluster, example_inputs=inputs, global_batch=4 * BATCH)
    assert [d.cores for d in plan.devices] == [(0,), (1,)]
    plan.save(tmp_path / "plan.json")
    assert [d.cores for d in Plan.load(tmp_path / "plan.json").devices] == [(0,), (1,)]
    plain = partition(model, cluster_from_dict(_cluster_doc({"gpu": "cpu", "count": 2})), example_inputs=inputs,
                      global_batch=4 * BATCH)
    plain.save(tmp_path / "plain.json")
    assert all("cores" not in d for d in json.loads((tmp_path / "plain.json").read_text())["devices"])


def test_cluster_file_refuses_bad_cores() -> None:
    with pytest.raises(ConfigError, match=r"devices\[0\]\.cores: .*write e.g. cores: 0"):
        cluster_from_dict(_cluster_doc({"gpu": "cpu", "cores": "x"}))
    with pytest.raises(ConfigError, match=r"devices\[0\]\.count: must be 1 with cores"):
        cluster_from_dict(_cluster_doc({"gpu": "cpu", "count": 2, "cores": "0"}))


def test_calibration_sets_the_cost_per_op_and_names_the_cores() -> None:
    cpu = DeviceProfile("cpu", 2**30, 5e10, 5e10, 1e10, kernel_overhead_s=None)
    tuned = apply_calibration(cpu, _cal((1,), overhead_s=7e-6))
    assert tuned.kernel_overhead_s == 7e-6 and tuned.fp32_flops_s == 2e10 and tuned.matmul_efficiency == 1.0
    assert "pinned to cores 1, 1 thread(s)" in tuned.source and "7 us per op" in tuned.source
    assert apply_calibration(cpu, Calibration("cpu", 2e10, 2e10, 8e9, 1024, "h", "2.13", "d")).kernel_overhead_s is None


def test_profile_writes_one_device_per_core_group(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_groups(groups, **kw):
        seen["groups"], seen["cpu_clock"] = groups, kw.get("cpu_clock")
        return tuple(_cal(tuple(g), overhead_s=(3 + i) * 1e-6) for i, g in enumerate(groups))

    def fake_link(*, core_groups, **_):
        seen["link"] = core_groups
        return LinkMeasurement(5e-5, 2e9, (1, 2), (1.0, 2.0), 2, method="framed one-way messages")

    monkeypatch.setattr(profile_mod, "measure_core_groups", fake_groups)
    monkeypatch.setattr(profile_mod, "measure_message_link", fake_link)
    monkeypatch.setattr(profile_mod, "measure_memory_bandwidth_bytes_s", lambda *a, **k: 1e10)
    monkeypatch.setattr(profile_mod, "split_cores", lambda n: ((0,), (1,)))
    detection = profile_mod.Detection((), False, "no GPUs")
    doc = profile_mod.profile_document(detection, calibrate=True, cpu_devices=2)
    assert seen["groups"] == ((0,), (1,)) and tuple(seen["link"]) == ((0,), (1,))
    cluster = cluster_from_dict(doc)
    assert [(d.kind, d.cores) for d in cluster.devices] == [("cpu-c0", (0,)), ("cpu-c1", (1,))]
    assert [d.profile.kernel_overhead_s for d in cluster.devices] == pytest.approx([3e-6, 4e-6])
    link = cluster.link(cluster.devices[0].id, cluster.devices[1].id)
    assert link.latency_s == pytest.approx(5e-5) and link.bandwidth_bytes_s == pytest.approx(2e9)
    assert "framed one-way messages" in doc["calibration"]["link"]["method"]
    assert doc["calibration"]["link"]["median_times_s"] == [1.0, 2.0]
    with pytest.raises(ConfigError, match="--cpu-devices 2 .* needs --calibrate"):
        profile_mod.profile_document(detection, calibrate=False, cpu_devices=2)
    assert seen["cpu_clock"] is False and "CPU time" not in cluster.devices[0].profile.source
    cpu_timed = cluster_from_dict(profile_mod.profile_document(detection, calibrate=True, cpu_devices=2, cpu_clock=True))
    assert seen["cpu_clock"] is True and "timed in thread CPU time (--clock cpu)" in cpu_timed.devices[0].profile.source
    with pytest.raises(ConfigError, match="--clock cpu .* needs --cpu-devices N and --calibrate"):
        profile_mod.profile_document(detection, calibrate=True, cpu_clock=True)


def _timeline(rank: int, origin_s: float, *actions: tuple[str, float, float]) -> RankTimeline:
    return RankTimeline(rank, rank, tuple(a if isinstance(a, ActionRecord) else ActionRecord(*a) for a in actions),
                        origin_s=origin_s)


def test_transfers_count_only_messages_whose_receiver_was_waiting() -> None:
    # rank 1's clock starts 1 ms after rank 0's: its times are shifted by that on CLOCK_MONOTONIC
    r0 = _timeline(0, 10.000, ("0F0", 0.0, 0.010), ("0SEND_F0", 0.010, 0.0005), ("0F1", 0.0105, 0.010),
                   ("0SEND_F1", 0.0205, 0.0005), ("0RECV_B0", 0.021, 0.020))
    r1 = _timeline(1, 10.001, ("1RECV_F0", 0.0, 0.0100), ("1F0", 0.010, 0.004), ("1B0", 0.014, 0.005),
                   ("1SEND_B0", 0.019, 0.0005), ("1RECV_F1", 0.0197, 0.0001))
    got = cut_transfers_s([r0, r1])
    # F0: sent at 10.010, received at 10.011 (1 ms); F1 arrived before its RECV began: not counted;
    # B0: sent at 10.020, but rank 0 began waiting for it only at 10.021: not counted
    assert list(got) == [0] and got[0] == pytest.approx([0.001])
    r0_waiting = _timeline(0, 10.000, *r0.actions[:4], ("0RECV_B0", 0.0195, 0.003))
    assert sorted(cut_transfers_s([r0_waiting, r1])[0]) == pytest.approx([0.001, 0.0025])
    assert cut_transfers_s([_timeline(0, 0.0, *r0.actions), r1]) == {}  # no origin: no claim


def test_transfers_leave_out_a_receiver_waiting_on_its_own_send() -> None:
    # steady 1F1B on 2 stages: rank 1 sends B1, then waits in RECV_F2; its RECV first waits for B1 to be
    # received, which rank 0 does only after posting F2: F2's span covers both transfers (not counted)
    r0 = _timeline(0, 20.0, ("0F2", 0.0, 0.010), ("0SEND_F2", 0.010, 0.0002), ("0RECV_B1", 0.0102, 0.0008))
    r1 = _timeline(1, 20.0, ("1B1", 0.0, 0.005), ("1SEND_B1", 0.005, 0.0002), ("1RECV_F2", 0.0052, 0.0060))
    assert cut_transfers_s([r0, r1]) == {}
    # had rank 0 received B1 before it sent F2, F2 would be one message, seen whole
    r0_early = _timeline(0, 20.0, ("0RECV_B1", 0.0, 0.0055), ("0F2", 0.0055, 0.004), ("0SEND_F2", 0.010, 0.0002))
    assert cut_transfers_s([r0_early, r1])[0] == pytest.approx([0.0005, 0.0012])  # B1 (rank 0 waited), F2


def _report_results(plan) -> list[RankResult]:
    """Three ranks of one step's worth of figures; each stage's SEND_F0 finds the next one waiting."""
    results = []
    for s in range(3):
        acts = (ActionRecord(f"{s}SEND_F0", 0.010, 0.001),) if s < 2 else ()
        acts += (ActionRecord(f"{s}RECV_F0", 0.0, 0.0125),) if s > 0 else ()
        results.append(RankResult(rank=s, stage=s, device=plan.stages[s].device, kind="k", step_s=(2.0, 1.0),
                                  losses=(1.0, 0.5) if s == 2 else (), fwd_s=(0.1,) * 8, bwd_s=(0.2,) * 8,
                                  fwd_compute_s=(0.1,) * 8, bwd_compute_s=(0.2,) * 8, peak_bytes=10,
                                  last_step_actions=acts, step_origin_s=50.0, cores=(s,), update_s=(0.5, 0.03)))
    return results


def _message_step(origin_s: float, send_f_s: float, send_b_s: float) -> tuple[RankTimeline, ...]:
    """One step's messages on cut 0 of a 3-stage plan: rank 1 waits for F0 (send_f_s one way), rank 0 for B0
    (send_b_s); rank 2 waits for an F0 that rank 1 never sends in this toy (not counted)."""
    r0 = _timeline(0, origin_s, ("0SEND_F0", 0.010, 0.0005), ("0RECV_B0", 0.011, 0.020 + send_b_s))
    r1 = _timeline(1, origin_s, ("1RECV_F0", 0.0, 0.010 + send_f_s), ("1SEND_B0", 0.031, 0.0005))
    return r0, r1, _timeline(2, origin_s, ("2RECV_F0", 0.0, 0.05))


def test_report_measures_transfers_over_every_step_after_the_first_per_direction() -> None:
    from tests.runtime_plans import synthetic_plan

    import dataclasses

    plan = synthetic_plan()
    plan = dataclasses.replace(plan, devices=tuple(dataclasses.replace(d, node="vm") for d in plan.devices))
    steps = [_message_step(10.0 * k, 0.001 * (k + 1), 0.0005) for k in range(4)]  # step 0's F: 1 ms (warm-up)
    results = [RankResult(rank=s, stage=s, device=plan.stages[s].device, kind="k", step_s=(1.0,) * 4,
                          losses=(1.0,) * 4 if s == 2 else (), fwd_s=(0.1,) * 4, bwd_s=(0.2,) * 4,
                          fwd_compute_s=(0.1,) * 4, bwd_compute_s=(0.2,) * 4, last_step_actions=steps[-1][s].actions,
                          step_origin_s=30.0, message_steps=tuple(step[s] for step in steps[1:]),
                          message_steps_from=1) for s in range(3)]
    rep = build_report(plan, results, schedule="1f1b", emulate=False)
    s0 = rep.stages[0]
    assert s0.transfer_messages == 3 and s0.transfer_s == pytest.approx(0.003)  # 2, 3, 4 ms: steps 1-3
    assert s0.transfer_grad_messages == 3 and s0.transfer_grad_s == pytest.approx(0.0005)
    assert rep.stages[1].transfer_s is None and rep.stages[1].transfer_grad_s is None
    link = next(k for k in plan.links if (k.src, k.dst) == (plan.stages[1].device, plan.stages[0].device))
    unit = plan.units[plan.stages[0].last_unit]
    grad_bytes = unit.boundary_grad_bytes if plan.memory_model >= 2 else unit.boundary_bytes
    assert s0.predicted_transfer_grad_s == pytest.approx(link.latency_s + grad_bytes / link.bandwidth_bytes_s)
    assert rep.stages[2].predicted_transfer_grad_s == 0.0  # the last stage has no cut after it
    kept_all = [dataclasses.replace(r, message_steps=tuple(step[r.stage] for step in steps), message_steps_from=0)
                for r in results]  # step 0 kept too: still left out as the warm-up
    assert build_report(plan, kept_all, schedule="1f1b", emulate=False).stages[0].transfer_messages == 3


def test_report_sets_measured_beside_predicted_per_stage(tmp_path: Path) -> None:
    from hetpipe.runtime.report import RunReport
    from hetpipe.runtime.run import summary_tables
    from tests.runtime_plans import synthetic_plan

    import dataclasses

    plan = synthetic_plan()
    multi_node = build_report(plan, _report_results(plan), schedule="1f1b", emulate=False)
    assert len({d.node for d in plan.devices}) > 1 and multi_node.stages[0].transfer_s is None  # clocks differ
    one_node = tuple(dataclasses.replace(d, node="vm") for d in plan.devices)
    plan = dataclasses.replace(plan, devices=one_node)
    rep = build_report(plan, _report_results(plan), schedule="1f1b", emulate=False)
    s0, s2 = rep.stages[0], rep.stages[2]
    assert s0.transfer_s == pytest.approx(0.0025) and s0.transfer_messages == 1
    assert s0.predicted_transfer_s == plan.stages[0].send_s and s2.transfer_s is None
    assert s0.update_real_s == 0.03 and s0.predicted_step_s == plan.stages[0].step_s and s0.cores == (0,)
    assert any(n.startswith("not emulated: times are this machine's") for n in rep.notes)  # no core groups
    assert rep.timelines[0].origin_s == 50.0
    rep.save(tmp_path / "run.json")
    assert RunReport.load(tmp_path / "run.json") == rep
    stages_table = summary_tables(rep)[1]
    headers = [c.header for c in stages_table.columns]
    assert {"C (s)", "C plan", "S (s)", "S plan", "peak MiB", "plan MiB"} <= set(headers)


def test_ranks_time_each_compute_action_in_thread_cpu_time() -> None:
    """`RecordingHooks` keeps every F and B's CPU seconds beside its wall seconds; a W adds to its B's entry; the
    report's stage record takes their medians (None for a rank result from before session 16)."""
    from hetpipe.runtime.emulate.pipeline import RecordingHooks
    from tests.runtime_plans import synthetic_plan

    hooks, after_b = RecordingHooks(), 0.0
    for op in ("F", "B", "W"):
        action = NS(op=NS(value=op), microbatch=0)
        hooks.before(action)
        sum(range(20000))  # some CPU work in the action
        hooks.after(action, 0.001)
        after_b = hooks.bwd_cpu_s[0] if op == "B" else after_b
    assert len(hooks.fwd_cpu_s) == 1 and len(hooks.bwd_cpu_s) == 1 and hooks.fwd_cpu_s[0] > 0
    assert hooks.bwd_cpu_s[0] > after_b > 0  # W's CPU time added to its B's entry
    plan = synthetic_plan()
    results = [dataclasses.replace(r, fwd_cpu_s=(0.05,) * 8, bwd_cpu_s=(0.1,) * 8) if r.stage == 0 else r
               for r in _report_results(plan)]
    rep = build_report(plan, results, schedule="1f1b", emulate=False)
    assert (rep.stages[0].fwd_cpu_s, rep.stages[0].bwd_cpu_s) == (0.05, 0.1) and rep.stages[1].fwd_cpu_s is None


def test_pinning_only_without_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    from hetpipe.runtime import pinning

    pinned = []
    monkeypatch.setattr(pinning, "pin_cores", pinned.append)
    devices = (NS(id="vm:0", cores=(1,)), NS(id="vm:1", cores=()))
    plan = NS(devices=devices, stages=(NS(device="vm:0"), NS(device="vm:1")))
    assert pinning.pin_stage(plan, 0, emulate=True) == () and pinned == []
    assert pinning.pin_stage(plan, 1, emulate=False) == () and pinned == []
    assert pinning.pin_stage(plan, 0, emulate=False) == (1,) and pinned == [(1,)]


@pytest.mark.slow
def test_core_group_measured_in_a_pinned_process() -> None:
    from hetpipe.cost_models.group_calibration import measure_core_groups

    core = available_cores()[-1:]
    (cal,) = measure_core_groups((core,), size=64, repeats=1, copy_bytes=2**20)
    assert cal.cores == core and cal.fp32_matmul_flops_s > 0 and cal.memory_bandwidth_bytes_s > 0
    assert cal.kernel_overhead_s is not None and 0 < cal.kernel_overhead_s < 1e-2
    (cpu_timed,) = measure_core_groups((core,), size=64, repeats=1, copy_bytes=2**20, cpu_clock=True)  # --clock cpu
    assert cpu_timed.cores == core and cpu_timed.fp32_matmul_flops_s > 0 and cpu_timed.kernel_overhead_s > 0


@pytest.mark.slow
def test_reference_measured_in_pinned_processes() -> None:
    """Structure only: one sample per core group, labelled with its cores (`hetpipe.cost_models.host_reference`;
    its arithmetic: tests/test_cpu_truth_drift.py)."""
    from hetpipe.cost_models.host_reference import REFERENCE_TIMEOUT_S, measure_reference
    from tests.machine_load import load_per_core, scaled_limit_s

    core = available_cores()[-1:]
    (t,) = measure_reference((core,), repeats=2,
                             timeout_s=scaled_limit_s(REFERENCE_TIMEOUT_S, load_per_core=load_per_core()))
    assert t.cores == core and t.wall_s > 0 and t.cpu_s > 0
    with pytest.raises(ConfigError, match="at least one non-empty core group"):
        measure_reference(((),))


def test_message_link_refuses_what_it_cannot_fit() -> None:
    from hetpipe.cost_models.link_calibration import measure_message_link

    with pytest.raises(ConfigError, match="at least two distinct sizes"):
        measure_message_link(sizes_bytes=(4096, 4096))
    with pytest.raises(ConfigError, match="repeats must be at least 1, sender_busy_s and receiver_idle_s at least 0, got 0,"):
        measure_message_link(sizes_bytes=(4096, 8192), repeats=0)
    with pytest.raises(ConfigError, match="receiver_idle_s at least 0, got 3, 0.002 and -0.001"):
        measure_message_link(sizes_bytes=(4096, 8192), repeats=3, receiver_idle_s=-0.001)
    with pytest.raises(ConfigError, match="core_groups has 3 groups"):
        measure_message_link(core_groups=((0,), (1,), (2,)))


@pytest.mark.slow
def test_message_link_measured_between_pinned_ends() -> None:
    """Structure and ranges only: one sample on a shared machine says nothing about the figures."""
    from hetpipe.cost_models.link_calibration import METHOD, measure_message_link

    cores = available_cores()
    groups = split_cores(2, available=cores) if len(cores) >= 2 else ((cores[0],), (cores[0],))
    # sizes far apart, taking turns (a burst of load lands on both): the 8 MiB median stays the larger
    from hetpipe.cost_models.calibrate import LINK_TIMEOUT_S
    from tests.machine_load import load_per_core, scaled_limit_s

    m = measure_message_link(sizes_bytes=(2**12, 2**23), repeats=5, core_groups=groups,
                             timeout_s=scaled_limit_s(LINK_TIMEOUT_S, load_per_core=load_per_core()))
    assert m.method == METHOD and m.world_size == 2 and m.sizes_bytes == (2**12, 2**23)
    assert len(m.median_times_s) == 2 and all(0 < t < 5.0 for t in m.median_times_s)
    assert m.latency_s >= 0 and m.bandwidth_bytes_s > 0


def test_message_link_names_its_method_and_reads_the_cache() -> None:
    """Structure only: the record names how it was measured; the eviction size is the host's cache."""
    from hetpipe.cost_models import link_calibration as lc

    assert lc.method_name(True, lc.SENDER_BUSY_S, None) == lc.METHOD
    assert lc.method_name(True, lc.SENDER_BUSY_S, object()) == lc.METHOD_RUNTIME
    assert lc.method_name(False, 0.0, None) == "bare one-way messages, sender busy 0 ms"
    assert lc.method_name(False, 0.0, None, 0.0) == "bare one-way messages, sender busy 0 ms, receiver idle 0 ms"
    llc = lc.last_level_cache_bytes()
    assert 2**16 <= llc <= 2**32  # 64 KiB .. 4 GiB: a cache, not a parse error
    assert lc.last_level_cache_bytes(cpu=10**6) == lc.FALLBACK_LLC_BYTES  # no such CPU in sysfs


def test_runtime_path_sends_one_cut_as_a_run_does() -> None:
    """`RuntimePath`: float32 cuts where the size allows, uint8 otherwise; picklable for the spawned ends."""
    import pickle

    import torch

    from hetpipe.runtime.execute.comm_probe import RuntimePath

    path = pickle.loads(pickle.dumps(RuntimePath()))
    assert path.spec(2**19).shape == (2**17,) and path.spec(2**19).dtype == torch.float32
    assert path.spec(10).dtype == torch.uint8 and path.payload(10).numel() == 10
    p = path.payload(4096)
    assert p.numel() * p.element_size() == 4096
    from hetpipe.runtime.stage.types import TensorSpec

    # a cut of several tensors (the HF Llama's mask and rotary tables besides its hidden states), same bytes
    extra = (TensorSpec("mask", (2, 1, 4, 4), torch.bool, False), TensorSpec("cos", (1, 4, 2), torch.float32, False))
    several = pickle.loads(pickle.dumps(RuntimePath(extra)))
    assert [t.numel() * t.element_size() for t in several.tensors(4096)] == [32, 32, 4032]
    assert several.spec(4096).shape == (1008,) and several.payload(4096).numel() == 1008
    with pytest.raises(ValueError, match="cannot hold"):
        several.tensors(64)


@pytest.mark.slow
def test_message_link_through_the_runtime_with_caches_streamed() -> None:
    """Structure and ranges only: the runtime's StageComm carries the calibration's messages end to end."""
    import torch

    from hetpipe.cost_models.calibrate import LINK_TIMEOUT_S
    from hetpipe.cost_models.link_calibration import METHOD_RUNTIME, measure_message_link
    from hetpipe.runtime.execute.comm_probe import RuntimePath
    from tests.machine_load import load_per_core, scaled_limit_s

    cores = available_cores()
    groups = split_cores(2, available=cores) if len(cores) >= 2 else ((cores[0],), (cores[0],))
    # two spawned ends importing torch: the guard scaled by the load per core, as the profile's test does
    timeout_s = scaled_limit_s(LINK_TIMEOUT_S, load_per_core=load_per_core())
    # sizes far apart: with the caches streamed a message's fixed cost is ~1 ms, so 1 MiB vs 4 KiB can tie
    m = measure_message_link(sizes_bytes=(2**12, 2**23), repeats=3, core_groups=groups, path=RuntimePath(),
                             timeout_s=timeout_s)
    assert m.method == METHOD_RUNTIME and m.sizes_bytes == (2**12, 2**23)
    assert all(0 < t < 5.0 for t in m.median_times_s) and m.bandwidth_bytes_s > 0
    from hetpipe.runtime.stage.types import TensorSpec

    extra = (TensorSpec("mask", (8, 1, 4, 4), torch.bool, False), TensorSpec("cos", (1, 4, 8), torch.float32, False))
    warm = measure_message_link(sizes_bytes=(2**12, 2**23), repeats=2, core_groups=groups, path=RuntimePath(extra),
                                evict_caches=False, timeout_s=timeout_s)  # a cut of three tensors, caches warm
    assert warm.method == METHOD_RUNTIME + ", caches warm" and all(0 < t < 5.0 for t in warm.median_times_s)


@pytest.mark.slow
def test_a_plan_over_core_groups_runs_pinned_without_emulation(tmp_path: Path) -> None:
    """Two core-group devices, a 2-stage plan, 2 real steps: the report carries every per-stage figure."""
    from hetpipe.models import build
    from hetpipe.plan.build import partition
    from hetpipe.runtime.run import run

    cores = available_cores()
    groups = split_cores(2, available=cores) if len(cores) >= 2 else ((cores[0],), (cores[0],))
    doc = _cluster_doc(*({"gpu": "cpu", "name": f"cpu-g{i}", "cores": format_cores(g), "memory": "2GB", "reserve": 0}
                         for i, g in enumerate(groups)))
    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    plan = partition(model, cluster_from_dict(doc), example_inputs=inputs, global_batch=4 * BATCH)
    assert len(plan.stages) == 2, "both core groups should hold a stage"
    plan.save(tmp_path / "plan.json")
    rep = run(tmp_path / "plan.json", model=MODEL, steps=2, emulate=False, seq=SEQ, timeout_s=guard_s(60.0),
              run_dir=tmp_path / "run")
    assert not rep.emulate and rep.time_scale == 1.0 and rep.measured_iteration_s > 0
    by_id = {d.id: d for d in plan.devices}
    for st, planned in zip(rep.stages, plan.stages):
        assert st.cores == by_id[planned.device].cores  # the rank ran pinned to its device's cores
        assert st.fwd_compute_s > 0 and st.bwd_compute_s > 0 and st.update_real_s > 0
        assert st.fwd_cpu_s > 0 and st.bwd_cpu_s > 0  # the rank's own CPU time per F and B (session 16)
        assert (st.predicted_fwd_s, st.predicted_bwd_s) == (planned.fwd_s, planned.bwd_s)
        assert (st.predicted_step_s, st.predicted_transfer_s) == (planned.step_s, planned.send_s)
        assert st.peak_bytes > 0 and st.predicted_memory_bytes > 0  # ratios: benchmarks/cpu_truth.py
    assert all(t.origin_s > 0 for t in rep.timelines) and len(rep.timelines) == 2
    assert any("every rank pinned to its device's cores" in n for n in rep.notes)
    # whichever messages found their receiver waiting, per direction; 2 steps: the last is the one measured
    assert rep.stages[0].transfer_messages == len(cut_transfers_s(rep.timelines, "F").get(0, []))
    assert rep.stages[0].transfer_grad_messages == len(cut_transfers_s(rep.timelines, "B").get(0, []))
    assert rep.stages[0].predicted_transfer_grad_s > 0
    assert rep.stages[1].transfer_s is None  # the last stage sends nothing forward
