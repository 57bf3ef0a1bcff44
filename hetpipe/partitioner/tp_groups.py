"""Price a run of captured units on a tensor-parallel group of cards (issue 15).

The bridge from the captured `Unit` tables to `hetpipe.cost_models.tensor_parallel`: what
splits (each unit's ``tp_flops_fraction`` / ``tp_param_fraction``), each member's time for the
whole run under the same roofline model the pipeline solver uses
(`hetpipe.cost_models.timing.unit_time_s`), the ring over the group's slowest link, and the
shares (``"uneven"``: equal finish, capped by memory; ``"even"``: Megatron's ``1/k``).
The DP and CP-SAT do not call it yet: a stage is still one card in every plan.

Approximations, stated: the backward splits like the forward (its matmuls are the
forward's, transposed); of the saved activations, the blocks' per-head / per-column storages
(`TensorParallelBlock.activation_bytes`, measured by the capture) split with the shares and the
rest is held whole by every member; the all-reduces are not overlapped with compute.

Example:
    >>> from hetpipe.cost_models.cluster import cluster_from_dict
    >>> from hetpipe.models import build
    >>> from hetpipe.partitioner.capture.capture import capture
    >>> g = capture(*build("gpt-tiny", device="meta", batch=4, seq=64))
    >>> c = cluster_from_dict({"nodes": [{"name": "box", "intra": "pcie-host",
    ...     "devices": [{"gpu": "rtx3090"}, {"gpu": "rtx3060-12gb"}]}]})
    >>> shares, cost = price_group(g.units[1:5], c.devices, c, precision="fp32")
    >>> shares.weights[0] > 0.5, cost.allreduce_s > 0, cost.fits
    (True, True, True)
"""

from __future__ import annotations

from collections.abc import Sequence

from hetpipe.cost_models.devices import Cluster, Device
from hetpipe.cost_models.tensor_parallel import (
    GroupCost, TensorParallelWork, TensorShares, even_shares, group_cost, memory_caps, proportional_shares)
from hetpipe.cost_models.timing import unit_time_s
from hetpipe.errors import ConfigError
from hetpipe.partitioner.capture.graph import Unit

SHARE_RULES = ("uneven", "even")


def group_work(units: Sequence[Unit], *, in_flight: int = 1) -> TensorParallelWork:
    """The run's FLOPs, what splits, and its all-reduces (approximations in the module docstring).

    ``in_flight``: micro-batches whose saved activations a member holds at once.
    """
    flops = sum(u.fwd_flops + u.bwd_flops for u in units)
    split_flops = sum(u.tp_flops_fraction * (u.fwd_flops + u.bwd_flops) for u in units)
    blocks = [b for u in units for b in u.tensor_parallel]
    split_state = sum(round(u.tp_param_fraction * u.state_bytes) for u in units)
    split_act = in_flight * sum(b.activation_bytes for b in blocks)
    total = sum(u.state_bytes for u in units) + in_flight * sum(u.activation_bytes for u in units)
    return TensorParallelWork(
        flops=float(flops), shardable_fraction=split_flops / flops if flops else 0.0,
        shardable_bytes=split_state + split_act, replicated_bytes=total - split_state - split_act,
        allreduce_bytes=round(sum(b.allreduce_bytes for b in blocks) / len(blocks)) if blocks else 0,
        blocks=len(blocks))


def run_time_s(units: Sequence[Unit], device: Device, *, precision: str) -> float:
    """Forward + backward seconds of the whole run on ``device`` alone (the pipeline's time model)."""
    total = 0.0
    for u in units:
        t = unit_time_s(fwd_flops=u.fwd_flops, bwd_flops=u.bwd_flops, memory_traffic_bytes=u.memory_traffic_bytes,
                        op_count=u.op_count, profile=device.profile, precision=precision)
        total += t.fwd_s + t.bwd_s
    return total


def ring_link(cluster: Cluster, devices: Sequence[Device]) -> tuple[float, float]:
    """(bandwidth, latency) of the group's ring: its slowest link and its largest latency."""
    pairs = [cluster.link(a.id, b.id) for a in devices for b in devices if a.id != b.id]
    if not pairs:
        return float("inf"), 0.0
    return min(p.bandwidth_bytes_s for p in pairs), max(p.latency_s for p in pairs)


def price_group(units: Sequence[Unit], devices: Sequence[Device], cluster: Cluster, *, precision: str,
                rule: str = "uneven", in_flight: int = 1) -> tuple[TensorShares, GroupCost]:
    """Shares by ``rule`` and the `GroupCost` of ``units`` on ``devices`` (per micro-batch, fwd + bwd)."""
    if rule not in SHARE_RULES:
        raise ConfigError(f"share rule {rule!r} is not one of {SHARE_RULES}")
    work = group_work(units, in_flight=in_flight)
    # Effective FLOP/s of each member on this run: its roofline time, so the group's member
    # time (f·w + 1 - f)·flops/speed is that fraction of the single-card time the DP uses.
    speeds = [work.flops / run_time_s(units, d, precision=precision) for d in devices]
    usable = [d.usable_bytes for d in devices]
    if rule == "even":
        shares = even_shares(len(devices))
    else:
        caps = memory_caps(usable, shardable_bytes=work.shardable_bytes, replicated_bytes=work.replicated_bytes)
        shares = proportional_shares(speeds, caps, replicated_fraction=1.0 - work.shardable_fraction)
    bandwidth, latency = ring_link(cluster, devices)
    return shares, group_cost(work, shares, speeds_flops_s=speeds, memory_bytes=usable,
                              bandwidth_bytes_s=bandwidth, latency_s=latency)


def rounded_member_s(units: Sequence[Unit], shares: TensorShares, devices: Sequence[Device], *,
                     precision: str) -> tuple[float, ...]:
    """Each member's compute seconds with its *integer* parts of every block (largest remainder).

    `price_group` prices the continuous shares; a block of 16 heads on shares (0.4, 0.4, 0.2)
    really runs 6 / 6 / 4 heads (6.4, 6.4, 3.2 rounded), and this is what each member then does:
    its parts of every block's FLOPs plus the replicated rest, at its speed on the run.
    """
    out = []
    for m, d in enumerate(devices):
        seconds = 0.0
        for u in units:
            flops = u.fwd_flops + u.bwd_flops
            t = unit_time_s(fwd_flops=u.fwd_flops, bwd_flops=u.bwd_flops, memory_traffic_bytes=u.memory_traffic_bytes,
                            op_count=u.op_count, profile=d.profile, precision=precision)
            block_flops = sum(b.fwd_flops for b in u.tensor_parallel) or 1
            split = u.tp_flops_fraction  # of this unit's FLOPs, shared between its blocks by their forward FLOPs
            mine = sum(shares.parts(b.parts)[m] / b.parts * b.fwd_flops / block_flops for b in u.tensor_parallel)
            seconds += (t.fwd_s + t.bwd_s) * (split * mine + (1.0 - split)) if flops else 0.0
        out.append(seconds)
    return tuple(out)
