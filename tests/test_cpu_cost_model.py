"""Issue 17 item 4: the cost model's CPU terms -- per-op work tables, per-op rates, the per-tensor optimizer loop.

Each formula against a hand computation, the capture's tables against its old totals, and the
catalog (GPU) path unchanged: a profile without measured rates prices exactly as before.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hetpipe.cost_models.calibrate import Calibration, apply_calibration
from hetpipe.cost_models.catalog import load_catalog
from hetpipe.cost_models.cluster import cluster_from_dict
from hetpipe.cost_models.devices import DeviceProfile
from hetpipe.cost_models.flops import CostCounter
from hetpipe.cost_models.op_calibration import (
    MATMUL_WIDTHS, OP_KINDS, measure_backward_op_s, measure_op_rates, measure_step_bytes_s, measure_step_op_s,
    measure_view_op_s,
)
from hetpipe.cost_models.optimizer_step import (
    STEP_KERNELS, loop_traffic_bytes_per_param, loop_unit_step_s, step_launch_s, step_traffic_bytes_per_param,
    tensor_step_s,
)
from hetpipe.cost_models.timing import matmul_rate, pass_time_s, unit_time_s
from hetpipe.cost_models.work import ATTENTION_BWD_KEY, ATTENTION_KEY, PassWork, matmul_key
from hetpipe.errors import ConfigError

CPU = DeviceProfile("cpu-x", 2**30, 1e11, 1e11, 2e10, matmul_efficiency=1.0, bandwidth_efficiency=1.0,
                    kernel_overhead_s=5e-6)


def test_counter_records_attention_flops_and_bytes_per_memory_bound_op() -> None:
    q = torch.empty(2, 4, 16, 8, device="meta", requires_grad=True)
    x = torch.empty(64, 32, device="meta")
    with CostCounter() as cc:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True, False)[0]
        fwd = cc.work()
        out.backward(torch.empty_like(out))
        both = cc.work()
        torch.nn.functional.gelu(x, approximate="tanh")
    bwd = both.minus(fwd)
    # torch's SDPA formulas: forward 2 bmm of 2*b*h*s*s*d each; backward 2.5x that
    assert fwd.amount(ATTENTION_KEY) == 4 * 2 * 4 * 16 * 16 * 8 == fwd.flops
    assert bwd.amount(ATTENTION_BWD_KEY) == 10 * 2 * 4 * 16 * 16 * 8 and bwd.amount(ATTENTION_KEY) == 0
    assert cc.work().amount("gelu") == 2 * 64 * 32 * 4  # read x, write y, fp32
    assert cc.work().traffic_bytes == both.traffic_bytes + 2 * 64 * 32 * 4


def test_pass_time_prices_each_op_kind_at_its_rate_under_the_roofline() -> None:
    cpu = replace(CPU, op_rates=(("attention", 5e10), ("gelu", 4e9), ("sum", 8e10)))
    work = PassWork(flops=int(3e9), traffic_bytes=int(6e8), kernels=10,
                    by_op=(("attention", int(1e9)), ("gelu", int(2e8)), ("silu", int(1e8)), ("sum", int(2e8))))
    expected = (2e9 / 1e11          # matmul FLOPs at the matmul rate
                + 1e9 / 5e10        # attention at its own rate
                + 2e8 / 4e9         # gelu: slower than memory, its own rate
                + 2e8 / 2e10        # sum: faster than memory in cache, so memory bounds it (roofline)
                + 2e8 / 2e10        # silu (no rate) and the rest of the traffic at the copy bandwidth
                + 10 * 5e-6)
    assert pass_time_s(work, profile=cpu, precision="fp32") == pytest.approx(expected, rel=1e-12)
    times = unit_time_s(fwd_flops=0, bwd_flops=0, memory_traffic_bytes=0, op_count=0, profile=cpu, precision="fp32",
                        fwd_work=work, bwd_work=PassWork())
    assert times.fwd_s == pytest.approx(expected, rel=1e-12) and times.bwd_s == 0.0


def test_matmuls_are_recorded_by_narrow_side_and_priced_at_its_interpolated_rate() -> None:
    x = torch.empty(1024, 128, device="meta", requires_grad=True)
    w = torch.empty(512, 128, device="meta", requires_grad=True)
    with CostCounter() as cc:
        y = torch.nn.functional.linear(x, w)  # (1024 x 128) @ (128 x 512): narrow side 128 x 512
        fwd = cc.work()
        y.backward(torch.empty_like(y))
    bwd = cc.work().minus(fwd)
    flops = 2 * 1024 * 128 * 512
    assert fwd.amount("matmul:65536") == flops == fwd.flops
    # grad input (1024 x 512) @ (512 x 128) and grad weight (512 x 1024) @ (1024 x 128): the same narrow side
    assert bwd.amount("matmul:65536") == 2 * flops
    rates = (("matmul:16384", 6e10), ("matmul:262144", 9e10))
    cpu = replace(CPU, op_rates=rates)
    assert matmul_rate(dict(rates), 65536) == pytest.approx(6e10 + 0.5 * 3e10)  # log2 65536 is halfway
    assert pass_time_s(fwd, profile=cpu, precision="fp32") == pytest.approx(flops / 7.5e10 + 5e-6, rel=1e-12)
    assert pass_time_s(fwd, profile=replace(CPU, op_rates=(("gelu", 1e9),)), precision="fp32") == pytest.approx(
        flops / 1e11 + 5e-6, rel=1e-12)  # no matmul rates: the peak x efficiency rate, as before


def test_backward_ops_and_views_pay_their_own_fixed_costs() -> None:
    x = torch.empty(64, 32, device="meta", requires_grad=True)
    with CostCounter() as cc:
        y = x.t().reshape(32, 64).exp()  # a view, a view-or-copy, a kernel
        fwd = cc.work()
    assert fwd.kernels == 1 and fwd.view_ops >= 1
    rated = replace(CPU, op_rates=(("gelu", 1e9),))
    base = pass_time_s(fwd, profile=rated, precision="fp32")
    costed = replace(rated, backward_op_s=9e-6, view_op_s=2e-6)
    assert pass_time_s(fwd, profile=costed, precision="fp32") == pytest.approx(base + fwd.view_ops * 2e-6, rel=1e-12)
    assert pass_time_s(fwd, profile=costed, precision="fp32", backward=True) == pytest.approx(
        base + fwd.view_ops * 2e-6 + fwd.kernels * (9e-6 - 5e-6), rel=1e-12)  # backward kernels at their own cost
    assert pass_time_s(fwd, profile=rated, precision="fp32", backward=True) == base  # unmeasured: as before


def test_profiles_without_rates_price_as_before() -> None:
    """The catalog's cards (no measured rates): the work tables change nothing."""
    work = PassWork(flops=int(1e9), traffic_bytes=int(1e7), kernels=3, by_op=(("gelu", int(1e7)),))
    for prof in (CPU, load_catalog().entries["rtx3090"].profile):
        old = unit_time_s(fwd_flops=int(1e9), bwd_flops=int(2e9), memory_traffic_bytes=int(1e7), op_count=3,
                          profile=prof, precision="bf16-mixed")
        new = unit_time_s(fwd_flops=int(1e9), bwd_flops=int(2e9), memory_traffic_bytes=int(1e7), op_count=3,
                          profile=prof, precision="bf16-mixed", fwd_work=work, bwd_work=work)
        assert new == old


def test_captured_tables_agree_with_the_unit_totals() -> None:
    from hetpipe.plan.build import capture_builtin

    graph = capture_builtin("gpt-tiny", batch=2, seq=16, optimizer="adam", precision="fp32", granularity="block")
    for u in graph.units[:-1]:  # the last unit also carries the loss's work (its totals carry its FLOPs only)
        assert (u.fwd_work.flops, u.fwd_work.traffic_bytes, u.fwd_work.kernels) == (
            u.fwd_flops, u.memory_traffic_bytes, u.op_count)
    assert all(u.bwd_work.flops == u.bwd_flops for u in graph.units)
    blocks = [u for u in graph.units if ".h." in u.name]
    assert all(u.fwd_work.amount(ATTENTION_KEY) > 0 and u.bwd_work.amount(ATTENTION_BWD_KEY) > 0 for u in blocks)
    assert all(u.fwd_work.amount("gelu") > 0 and u.bwd_work.amount("gelu_backward") > 0 for u in blocks)
    assert graph.units[-1].fwd_work.amount("_log_softmax") > 0  # the loss, on the last unit
    # each block: ln_1, ln_2 (weight, bias), c_attn, c_proj, c_fc, mlp c_proj (weight, bias) = 12 tensors;
    # the tied embedding counts once, on its owner
    assert [u.param_tensors for u in blocks] == [12] * len(blocks)
    from hetpipe.models import build
    model, _ = build("gpt-tiny", device="meta", batch=2, seq=16)
    assert sum(u.param_tensors for u in graph.units) == len(list(model.parameters()))


def test_per_tensor_optimizer_loop_prices_each_tensor() -> None:
    assert tensor_step_s(tensors=10, optimizer="sgd", step_op_s=2e-6) == pytest.approx(10 * 1 * 2e-6)
    assert tensor_step_s(tensors=3, optimizer="adamw", step_op_s=1e-6) == pytest.approx(3 * STEP_KERNELS["adamw"] * 1e-6)
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'"):
        tensor_step_s(tensors=1, optimizer="lion", step_op_s=1e-6)


def test_per_tensor_loop_bytes_follow_torchs_single_tensor_code() -> None:
    """Values read + written per parameter, op by op (optimizer_step's docstring), at 4 B each."""
    adam = (3 + 2 + 3 + 2 + 2 + 2 + 4) * 4   # lerp, mul, addcmul, sqrt, div, add, addcdiv
    assert loop_traffic_bytes_per_param("adam", "fp32") == adam == 72
    assert loop_traffic_bytes_per_param("adamw", "fp32") == adam + 2 * 4  # + the decoupled p.mul_
    assert loop_traffic_bytes_per_param("momentum", "fp32") == (2 + 3 + 3) * 4
    assert loop_traffic_bytes_per_param("sgd", "fp32") == step_traffic_bytes_per_param("sgd", "fp32")
    for opt in ("sgd", "momentum", "adam", "adamw"):  # mixed precision: the fused pass's bytes plus the same extras
        extra = loop_traffic_bytes_per_param(opt, "fp32") - step_traffic_bytes_per_param(opt, "fp32")
        mixed = step_traffic_bytes_per_param(opt, "bf16-mixed")
        assert loop_traffic_bytes_per_param(opt, "bf16-mixed") == mixed + extra
    got = loop_unit_step_s(params=10**6, tensors=4, optimizer="adam", precision="fp32", step_bytes_s=36e9,
                           step_op_s=3e-6)
    assert got == pytest.approx(72e6 / 36e9 + 4 * 8 * 3e-6, rel=1e-12)
    assert loop_unit_step_s(params=0, tensors=0, optimizer="adam", precision="fp32", step_bytes_s=1.0,
                            step_op_s=1.0) == 0


def test_step_tables_per_tensor_where_measured_foreach_elsewhere() -> None:
    from hetpipe.plan.build import capture_builtin, step_tables

    graph = capture_builtin("gpt-tiny", batch=2, seq=16, optimizer="adam", precision="fp32", granularity="block")
    doc = {"name": "c", "nodes": [{"name": "vm", "intra": "pcie-host",
                                   "intra_link": {"bandwidth": "1GB/s", "latency": "100us"},
                                   "devices": [{"gpu": "cpu", "name": "cpu-loop", "memory": "2GB", "reserve": 0,
                                                "kernel_overhead": "5us", "optimizer_op": "4us"},
                                               {"gpu": "cpu", "name": "cpu-foreach", "memory": "2GB", "reserve": 0,
                                                "kernel_overhead": "5us"}]}]}
    tables = step_tables(graph, cluster_from_dict(doc))
    loop, loop_launch = tables["cpu-loop"]
    foreach, foreach_launch = tables["cpu-foreach"]
    assert loop_launch == 0.0 and foreach_launch == pytest.approx(step_launch_s("adam", 5e-6))
    for u, a, b in zip(graph.units, loop, foreach):
        assert a == pytest.approx(b + u.param_tensors * STEP_KERNELS["adam"] * 4e-6, rel=1e-12)
    # with the loop's measured rate, its 72 B per parameter are priced at that rate instead
    doc["nodes"][0]["devices"][0]["optimizer_bandwidth"] = "36GB/s"
    rated, rated_launch = step_tables(graph, cluster_from_dict(doc))["cpu-loop"]
    assert rated_launch == 0.0
    for u, a in zip(graph.units, rated):
        assert a == pytest.approx(u.param_count * 72 / 36e9 + u.param_tensors * STEP_KERNELS["adam"] * 4e-6, rel=1e-12)


def test_cluster_file_reads_rates_and_refuses_bad_ones() -> None:
    def doc(**extra: object) -> dict:
        return {"name": "c", "nodes": [{"name": "vm", "devices": [{"gpu": "cpu", "memory": "2GB", "reserve": 0, **extra}]}]}

    prof = cluster_from_dict(doc(op_rates={"gelu": 3.5e9, "attention": 4e10, "matmul:16384": 6e10},
                                 optimizer_op="3.7us")).devices[0].profile
    assert prof.op_rates == (("attention", 4e10), ("gelu", 3.5e9), ("matmul:16384", 6e10))
    assert prof.step_op_s == pytest.approx(3.7e-6)
    with pytest.raises(ConfigError, match=r"op_rates\.gelu: must be a positive number"):
        cluster_from_dict(doc(op_rates={"gelu": -1}))
    with pytest.raises(ConfigError, match="op_rates: must map op kinds to rates"):
        cluster_from_dict(doc(op_rates=[1, 2]))


def test_calibration_carries_rates_into_the_profile_and_the_cluster_file() -> None:
    from hetpipe.cost_models import profile as profile_mod

    cal = Calibration("cpu", 7e10, 7e10, 2e10, 1024, "h", "2.13", "2026-12-03", kernel_overhead_s=6e-6,
                      op_rates=(("attention", 4e10), ("gelu", 3.5e9)), step_op_s=3.7e-6, step_bytes_s=3.6e10,
                      backward_op_s=5.5e-6, view_op_s=1.5e-6)
    cpu = load_catalog().entries["cpu"].profile
    tuned = apply_calibration(cpu, cal)
    assert tuned.op_rates == cal.op_rates and tuned.step_op_s == 3.7e-6
    assert "rates of 2 op kinds" in tuned.source and "3.7 us per op" in tuned.source
    fields = profile_mod._calibrated_fields(cpu, cal)  # noqa: SLF001 -- the writer's own round trip
    doc = {"name": "c", "nodes": [{"name": "vm", "devices": [{"gpu": "cpu", "memory": "2GB", "reserve": 0, **fields}]}]}
    back = cluster_from_dict(doc).devices[0].profile
    assert back.op_rates == tuned.op_rates and back.step_op_s == pytest.approx(3.7e-6)
    assert tuned.step_bytes_s == 3.6e10 and back.step_bytes_s == pytest.approx(3.6e10)
    assert (back.backward_op_s, back.view_op_s) == pytest.approx((5.5e-6, 1.5e-6))
    assert "5.5 us per backward op, 1.5 us per view" in tuned.source


def test_op_rates_and_the_optimizer_op_are_measured_on_this_cpu() -> None:
    rates = dict(measure_op_rates("cpu", repeats=1, kinds=("gelu", "sum")))
    matmuls = {matmul_key(1024, w, w) for w in MATMUL_WIDTHS}
    assert set(rates) == {ATTENTION_KEY, ATTENTION_BWD_KEY, "gelu", "sum", *matmuls}
    assert all(r > 0 for r in rates.values())
    assert {"gelu", "gelu_backward", "native_layer_norm_backward", "silu"} <= set(OP_KINDS)
    op_s = measure_step_op_s(repeats=1)
    assert 0 < op_s < 1e-2
    assert measure_step_bytes_s(step_op_s=op_s, repeats=1, tensors=2) > 1e8  # any CPU streams over 0.1 GB/s
    assert 0 < measure_backward_op_s(repeats=1) < 1e-2 and 0 < measure_view_op_s(repeats=1) < 1e-2
    with pytest.raises(ConfigError, match="measured on a CPU only"):
        measure_op_rates("cuda:0")
    with pytest.raises(ConfigError, match="no calibration call for op kind"):
        measure_op_rates("cpu", kinds=("bogus",))


def test_feedback_slows_every_forward_and_backward_term_of_a_calibrated_cpu() -> None:
    from hetpipe.runtime.faults import feedback

    prof = replace(CPU, op_rates=(("gelu", 4e9),), backward_op_s=6e-6, view_op_s=2e-6)
    out = feedback._entry({"gpu": "cpu"}, prof, 2.0, name=None, note="slowed")  # noqa: SLF001 -- its own terms
    assert out["op_rates"] == {"gelu": 2e9} and out["kernel_overhead"] == pytest.approx(1e-5)
    assert out["backward_op_overhead"] == pytest.approx(1.2e-5) and out["view_overhead"] == pytest.approx(4e-6)
    doc = {"name": "c", "nodes": [{"name": "vm", "devices": [{**out, "memory": "2GB", "reserve": 0}]}]}
    back = cluster_from_dict(doc).devices[0].profile  # the written entry loads
    assert (back.backward_op_s, back.view_op_s) == pytest.approx((1.2e-5, 4e-6))
