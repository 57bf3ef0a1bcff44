"""Scenarios shared by the benchmarks: analytic GPT unit graphs and generated mixed clusters.

`gpt_graph` builds a GPT-style `UnitGraph` from the published formulas instead of
tracing (so planner benchmarks can reach 96 layers and 64 devices in seconds); per
micro-batch of b sequences of s tokens, hidden h, vocabulary V, bf16 mixed precision:

* layer forward FLOPs 24·b·s·h² + 4·b·s²·h, backward twice that (Narayanan et al.
  SC'21; cost_formulas.md §3.1); parameters 12·h² + 13·h;
* model state 16 B/param (mixed-precision Adam, ZeRO paper; `cost_models.memory`);
* saved activations 34·s·b·h bytes per layer with fused attention (Korthikanti et al.
  2022, FlashAttention removes the 5·a·s/h term; cost_formulas.md §3.2), of which all but
  its 2·s·b·h output (saved by the next layer's norm) are what recomputing the layer frees
  (`Unit.recompute_bytes`; without it the planner's recompute lever would free nothing);
* a cut carries the b·s·h hidden state in 16 bit: 2·b·s·h bytes (cost_formulas.md §3.4);
* embedding: V·h + s·h parameters, no FLOPs; head: final norm + tied LM head, 2·b·s·h·V
  forward FLOPs and fp32 logits of 4·s·b·V bytes (cost_formulas.md §3.2).

Example:
    >>> g = gpt_graph(layers=2, hidden=64, seq=16, batch=1, vocab=100)
    >>> [u.name for u in g.units]
    ['embed', 'layer.0', 'layer.1', 'head']
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetpipe.cost_models.cluster import cluster_from_dict
from hetpipe.cost_models.devices import Cluster
from hetpipe.cost_models.memory import state_bytes_per_param
from hetpipe.partitioner.capture.graph import Unit, UnitGraph

#: The example cluster files every scenario names.
CLUSTERS_DIR = Path(__file__).resolve().parents[1] / "examples" / "clusters"


@dataclass(frozen=True)
class Scenario:
    """One benchmark case: a cluster file under examples/clusters and a built-in model's shape.

    Example:
        >>> Scenario("homelab.yaml", "gpt2-small", 4, 1024).cluster_path().name
        'homelab.yaml'
    """

    cluster: str  # file under examples/clusters
    model: str  # built-in model name (hetpipe.models)
    batch: int  # micro-batch size
    seq: int | None = None  # sequence length (None: the model's default)
    mixed: bool = True  # heterogeneous cluster (hetpipe must win) or homogeneous control
    global_batch: int | None = None  # None: the planner's default (two micro-batches per card)

    def cluster_path(self) -> Path:
        return CLUSTERS_DIR / self.cluster


#: Korthikanti et al. 2022, bytes per (s·b·h) of one layer's saved activations, fused attention.
ACTIVATION_BYTES_PER_SBH = 34
#: 16-bit hidden state crossing a cut, bytes per element.
HALF_BYTES = 2
#: fp32 logits kept for the loss, bytes per element.
FP32_BYTES = 4


def _unit(index: int, name: str, *, fwd: int, params: int, act: int, boundary: int, own: int) -> Unit:
    per_param = state_bytes_per_param("adam", "bf16-mixed")
    return Unit(index=index, name=name, node_names=(name,), fwd_flops=fwd, bwd_flops=2 * fwd,
                param_count=params, param_bytes=HALF_BYTES * params, state_bytes=int(per_param * params),
                activation_bytes=act, boundary_bytes=boundary, recompute_bytes=own)


def gpt_graph(*, layers: int, hidden: int = 1024, seq: int = 1024, batch: int = 4, vocab: int = 50257) -> UnitGraph:
    """An analytic GPT `UnitGraph` (see the module docstring)."""
    b, s, h, V = batch, seq, hidden, vocab
    cut = HALF_BYTES * b * s * h
    # recompute_bytes (what a unit makes and saves itself, `Unit`): a layer's 34·s·b·h less its
    # output, which the next unit's first norm saves; the embedding's output likewise; the head's logits
    units = [_unit(0, "embed", fwd=0, params=V * h + s * h, act=0, boundary=cut, own=0)]
    layer_act = ACTIVATION_BYTES_PER_SBH * s * b * h
    for i in range(layers):
        units.append(_unit(i + 1, f"layer.{i}", fwd=24 * b * s * h * h + 4 * b * s * s * h,
                           params=12 * h * h + 13 * h, act=layer_act, boundary=cut, own=layer_act - cut))
    logits = FP32_BYTES * s * b * V
    units.append(_unit(layers + 1, "head", fwd=2 * b * s * h * V, params=2 * h, act=logits, boundary=0, own=logits))
    return UnitGraph(model_name=f"gpt-{layers}L-h{h}", fingerprint=f"analytic-{layers}-{h}-{s}-{b}-{V}",
                     units=tuple(units), param_count=sum(u.param_count for u in units), micro_batch_size=b,
                     optimizer="adam", precision="bf16-mixed")


#: Card kinds cycled through the nodes of generated clusters (3-4 kinds).
MIXED_KINDS = ("rtx4090", "rtx3090", "a5000", "rtx3060-12gb")


def mixed_cluster(devices: int, *, per_node: int = 4, kinds: tuple[str, ...] = MIXED_KINDS,
                  network: str = "10Gbit/s") -> Cluster:
    """`devices` cards, `per_node` per node; node i holds kind i mod len(kinds); PCIe inside, `network` between."""
    nodes = []
    for n in range(max(1, devices // per_node)):
        count = min(per_node, devices - n * per_node)
        nodes.append({"name": f"node{n}", "intra": "pcie-host",
                      "network": {"bandwidth": network, "latency": "0.1ms"},
                      "devices": [{"gpu": kinds[n % len(kinds)], "count": count}]})
    return cluster_from_dict({"name": f"mixed-{devices}", "nodes": nodes}, source=f"mixed-{devices}")
