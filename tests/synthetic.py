"""Synthetic unit graphs and clusters for tests that need no tracing."""

from __future__ import annotations

from hetpipe.cost_models.devices import Cluster, Device, DeviceProfile, Link
from hetpipe.partitioner.capture.graph import Unit, UnitGraph

GB = 10**9


def synthetic_graph(num_units: int = 6, *, layer_flops: int = 2 * 10**12, micro_batch_size: int = 2) -> UnitGraph:
    """A GPT-like chain: embedding, equal blocks, head; costs per micro-batch."""
    units = []
    for i in range(num_units):
        heavy = 0 < i < num_units - 1
        units.append(
            Unit(
                index=i,
                name=f"block.{i}" if heavy else ("embed" if i == 0 else "head"),
                node_names=(f"n{i}a", f"n{i}b"),
                fwd_flops=layer_flops if heavy else layer_flops // 4,
                bwd_flops=2 * layer_flops if heavy else layer_flops // 2,
                param_count=10**8,
                param_bytes=4 * 10**8,
                state_bytes=16 * 10**8,
                activation_bytes=3 * 10**8,
                boundary_bytes=0 if i == num_units - 1 else 8 * 2**20,
                memory_traffic_bytes=10**8,
                op_count=20,
            )
        )
    return UnitGraph(
        model_name="synthetic",
        fingerprint="f" * 64,
        units=tuple(units),
        param_count=num_units * 10**8,
        micro_batch_size=micro_batch_size,
        optimizer="adam",
        precision="fp32",
    )


def profile(kind: str, tflops: float, memory_gb: float) -> DeviceProfile:
    return DeviceProfile(
        kind=kind,
        memory_bytes=int(memory_gb * GB),
        tensor_flops_s=2 * tflops * 1e12,
        fp32_flops_s=tflops * 1e12,
        memory_bandwidth_bytes_s=900e9,
        source="synthetic",
    )


def synthetic_cluster(spec: tuple[tuple[str, str, float, float], ...] = (
    ("n0", "fast", 40.0, 24.0), ("n0", "mid", 30.0, 24.0), ("n1", "slow", 10.0, 12.0)),
    *, intra_bytes_s: float = 16e9, inter_bytes_s: float = 125e6) -> Cluster:
    """Devices (node, kind, fp32 TFLOP/s, memory GB); PCIe inside a node, 1 GbE between nodes."""
    devices = tuple(
        Device(id=f"{node}:{i}", node=node, profile=profile(kind, tf, mem), reserve_bytes=GB)
        for i, (node, kind, tf, mem) in enumerate(spec)
    )
    links = {}
    for a in devices:
        for b in devices:
            if a.id != b.id:
                same = a.node == b.node
                links[(a.id, b.id)] = Link(a.id, b.id, intra_bytes_s if same else inter_bytes_s,
                                           5e-6 if same else 2e-4, "pcie-host" if same else "network")
    return Cluster(name="synthetic", devices=devices, links=links)
