"""Two plan nodes as network namespaces joined by a tc-shaped veth (issue 16, item 5), end to end.

Where the machine cannot (not root, no iproute2, no netns), the same call must refuse with one line naming
why -- that is then what is tested.  The shaped run's step time is held to a lower bound the token bucket
imposes (the bytes every step sends across, less one bucket, at the shaped rate): noise only adds to it.
"""

from __future__ import annotations

import os
import subprocess
from statistics import median

import pytest

from hetpipe.errors import ConfigError
from hetpipe.runtime.faults.netns import MIN_BURST_BYTES, netns_support, run_on_netns
from tests.machine_load import guard_s

pytestmark = pytest.mark.slow

MODEL, BATCH, SEQ, MICROBATCHES = "gpt-tiny", 8, 64, 4  # 128 KiB of activations per micro-batch
LINK_BYTES_S = 1e6  # 8 Mbit/s between the nodes: each step's activations take ~0.5 s on the wire
LAB = f"""
name: netns-lab
nodes:
  - name: n0
    network: {{bandwidth: {LINK_BYTES_S:g}, latency: 1ms}}
    devices:
      - {{name: fast, memory: 24GB, reserve: 1GB, tensor_tflops: 80, fp32_tflops: 40, memory_bandwidth: 900GB/s}}
      - {{name: mid, memory: 24GB, reserve: 1GB, tensor_tflops: 60, fp32_tflops: 30, memory_bandwidth: 900GB/s}}
  - name: n1
    network: {{bandwidth: {LINK_BYTES_S:g}, latency: 1ms}}
    devices:
      - {{name: slow, memory: 12GB, reserve: 1GB, tensor_tflops: 20, fp32_tflops: 10, memory_bandwidth: 900GB/s}}
"""


def test_two_nodes_in_namespaces_train_over_a_rate_limited_link(tmp_path):
    from tests.runtime_plans import thirds_plan

    (tmp_path / "lab.yaml").write_text(LAB)
    _, plan = thirds_plan(MODEL, tmp_path / "lab.yaml", batch=BATCH, seq=SEQ, microbatches=MICROBATCHES)
    reason = netns_support()
    if reason:
        with pytest.raises(ConfigError, match=f"cannot run on network namespaces here: {reason}"):
            run_on_netns(plan, model=MODEL, seq=SEQ, steps=3, run_dir=tmp_path / "run")
        return
    rep = run_on_netns(plan, model=MODEL, seq=SEQ, steps=4, run_dir=tmp_path / "run", timeout_s=guard_s(60.0))
    assert len(rep.losses) == 4 and rep.world_size == 3
    assert any("network namespaces shaped by tc (tbf 8 Mbit/s" in note for note in rep.notes), rep.notes
    cut_bytes = plan.units[plan.stages[1].last_unit].boundary_bytes  # n0:1 -> n1:0, per micro-batch
    floor_s = (MICROBATCHES * cut_bytes - MIN_BURST_BYTES) / LINK_BYTES_S
    assert floor_s > 0.2  # the bound means something: the link, not the CPU, sets it
    steps = [r.step_s for r in rep.step_records[1:]]
    assert median(steps) >= floor_s, (steps, floor_s)
    print(f"netns: {cut_bytes} B per micro-batch across, step median {median(steps):.3f} s >= floor {floor_s:.3f} s")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"hp{os.getpid()}n" not in listed  # the namespaces (and the veth with them) are gone
