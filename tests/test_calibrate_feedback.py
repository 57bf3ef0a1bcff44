"""`hetpipe calibrate` without torchrun: a run report with known measured/predicted ratios -> the cluster file."""

from __future__ import annotations

import dataclasses

import pytest

from hetpipe.cli import app
from hetpipe.cost_models.cluster import load_cluster
from hetpipe.errors import ConfigError
from hetpipe.partitioner.problem import Stage
from hetpipe.runtime.faults.feedback import calibrate_from_report
from hetpipe.runtime.faults.straggler import StepRatios
from hetpipe.runtime.report import RankResult, build_report
from tests.runtime_plans import plan_for
from tests.synthetic import synthetic_graph

# Two cards of kind mid on n0 (count: 2): the run uses n0:0 fast, n0:1 mid and n1:0 slow.
LAB = """
name: lab
nodes:
  - name: n0
    intra_link: {bandwidth: 16GB/s, latency: 5us}
    network: {bandwidth: 1Gbit/s, latency: 0.2ms}
    devices:
      - {name: fast, memory: 24GB, reserve: 1GB, tensor_tflops: 80, fp32_tflops: 40, memory_bandwidth: 900GB/s}
      - {name: mid, count: 2, memory: 24GB, reserve: 1GB, tensor_tflops: 60, fp32_tflops: 30, memory_bandwidth: 900GB/s}
  - name: n1
    network: {bandwidth: 1Gbit/s, latency: 0.2ms}
    devices:
      - {name: slow, memory: 12GB, reserve: 1GB, tensor_tflops: 20, fp32_tflops: 10, memory_bandwidth: 900GB/s}
"""


def _figures(device):
    """A card's profile but for ``source`` (which names the file it was read from)."""
    return dataclasses.replace(device.profile, source=""), device.reserve_bytes


def _report(tmp_path, ratios: dict[int, list[dict[str, float]]]):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(LAB)
    stages = (Stage(0, 0, 1), Stage(1, 2, 3), Stage(3, 4, 5))  # device indices: fast, mid n0:1, slow n1:0
    plan = plan_for(synthetic_graph(6), load_cluster(cluster), stages, microbatches=4)
    results = []
    for s, st in enumerate(plan.stages):
        dev = plan.devices[plan.device_index()[st.device]]
        steps = tuple(StepRatios(i + 1, r) for i, r in enumerate(ratios[s]))
        results.append(RankResult(rank=s, stage=s, device=dev.id, kind=dev.kind, step_s=(1.0,) * 4,
                                  losses=(1.0,) * 4 if s == 2 else (), step_ratios=steps))
    return cluster, build_report(plan, results, schedule="1f1b", emulate=True)


def test_slow_card_and_slow_link_are_calibrated_and_the_rest_is_copied(tmp_path):
    same = {"fwd": 1.0, "bwd": 1.01, "send->1": 1.0}
    # Stage 1 (mid n0:1): F 2x, B 3x over the last 3 steps (step 1 was before the slowdown); its sends
    # to stage 2 (n1:0, another node) 4x.
    mid = [{"fwd": 1.0, "bwd": 1.0, "send->2": 1.0, "send->0": 1.0}] + \
          [{"fwd": 2.0, "bwd": 3.0, "send->2": 4.0, "send->0": 1.0}] * 3
    cluster, rep = _report(tmp_path, {0: [same] * 4, 1: mid, 2: [{"fwd": 1.0, "bwd": 1.0, "send->1": 1.0}] * 4})
    out = tmp_path / "out.yaml"
    cal = calibrate_from_report(rep, cluster, output=out)
    assert cal.steps == (2, 3, 4)
    st = rep.stages[1]
    factor = (2.0 * st.predicted_fwd_s + 3.0 * st.predicted_bwd_s) / (st.predicted_fwd_s + st.predicted_bwd_s)
    before, after = load_cluster(cluster), load_cluster(out)
    slowed = after.device("n0:1")
    assert slowed.kind == "mid-calibrated-n0-1"  # n0:2 is a mid too and keeps the catalog figures
    assert _figures(after.device("n0:2")) == _figures(before.device("n0:2"))
    assert slowed.profile.fp32_flops_s == pytest.approx(before.device("n0:1").profile.fp32_flops_s / factor)
    assert _figures(after.device("n0:0")) == _figures(before.device("n0:0"))  # 1% is within the tolerance
    link, was = after.link("n0:1", "n1:0"), before.link("n0:1", "n1:0")
    assert (link.bandwidth_bytes_s, link.latency_s) == pytest.approx((was.bandwidth_bytes_s / 4, was.latency_s * 4))
    assert after.link("n0:0", "n0:1") == before.link("n0:0", "n0:1")  # intra-node: unmeasured change, untouched
    assert [d.device for d in cal.devices] == ["n0:0", "n0:1", "n1:0"]
    assert cal.devices[1].factor == pytest.approx(factor)


def test_reports_that_cannot_be_calibrated_are_one_line_errors(tmp_path, capsys):
    one = {"fwd": 1.0, "bwd": 1.0}
    cluster, rep = _report(tmp_path, {0: [one], 1: [], 2: [one]})
    with pytest.raises(ConfigError, match="stage 1 has no per-step measured/predicted times"):
        calibrate_from_report(rep, cluster)
    other = tmp_path / "other.yaml"
    other.write_text(LAB.replace("name: slow", "name: slower"))
    with pytest.raises(ConfigError, match=r"stage 2 ran on n1:0 \(slow\), but .*other.yaml has it as kind 'slower'; "
                                          r"pass the cluster file the run's plan was made from"):
        calibrate_from_report(rep, other)
    with pytest.raises(ConfigError, match="--window must be a whole number of steps >= 1"):
        calibrate_from_report(rep, cluster, window_steps=0)
    rep.save(tmp_path / "run.json")
    assert app.main(["calibrate", str(tmp_path / "run.json"), "--cluster", str(cluster), "-o",
                     str(tmp_path / "missing" / "c.yaml")]) == 2
    assert capsys.readouterr().err.startswith("error: -o/--output")
