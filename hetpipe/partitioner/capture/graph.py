"""The captured model as an ordered list of partitionable units.

A *unit* is the smallest piece a pipeline stage boundary may fall between
(a transformer block, a ResNet bottleneck, the embedding, the head).  Every
cost a solver needs is a field of `Unit`, per micro-batch, under the names the
plan file uses.  `UnitGraph` also keeps the node-level networkx graph and the
traced `torch.fx.GraphModule` so the runtime can build stage modules later.

Example:
    >>> u = Unit(index=0, name="embed", node_names=("wte", "wpe", "add"),
    ...          fwd_flops=0, bwd_flops=0, param_count=10, param_bytes=40,
    ...          state_bytes=160, activation_bytes=4096, boundary_bytes=4096)
    >>> u.boundary_bytes
    4096
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from hetpipe.cost_models.work import PassWork
from hetpipe.partitioner.capture.tensor_blocks import TensorParallelBlock


@dataclass(frozen=True)
class Unit:
    """One partitionable unit; every cost is per micro-batch.

    Attributes:
        index: position in pipeline order (0-based).
        name: module path of the unit (e.g. ``transformer.h.3``) or a synthetic name.
        node_names: fx node names that belong to the unit, in graph order.
        fwd_flops: forward FLOPs (matmul/conv/attention from the flop counter
            plus the documented elementwise/norm formulas).
        bwd_flops: backward FLOPs (input and weight gradients).
        param_count: parameters owned by the unit (a tied parameter is owned by
            the first unit that uses it and counted once).
        param_bytes: bytes of those parameters in the training precision's
            stored dtype.
        state_bytes: params + grads + optimizer state bytes for the chosen
            optimizer and precision (see `cost_models.memory`), plus the module
            buffers the unit reads first (BatchNorm statistics: the stage keeps them).
        grad_bytes: the parameter gradients within ``state_bytes`` (a step holds
            them from its first backward on).
        activation_bytes: bytes one micro-batch keeps for backward that this unit
            produces: the storages autograd saves (in this unit or any later one, the
            loss included) and the model inputs, each storage once, in its producer.
        boundary_bytes: bytes of all tensors produced at or before this unit
            and consumed after it (the cut after this unit); 0 for the last unit.
        boundary_held_bytes: the part of ``boundary_bytes`` whose storage the stage
            ending here also holds for backward (saved, or a model input); a stage
            holds such a storage once, not as an activation and again as its output.
        boundary_grad_bytes: the part of ``boundary_bytes`` that requires grad: the
            gradient message sent back over the cut.
        recompute_bytes: the storages the unit makes and saves itself: what recomputing
            it (activation checkpointing) frees per micro-batch and allocates again.
        memory_traffic_bytes: forward bytes read+written by memory-bound ops
            (elementwise, norms, softmax); used by the time model.
        op_count: number of compute nodes (kernel launches) in the forward.
        weight_grad_bytes: what a split (zero-bubble) backward keeps from the unit's B to its W
            per micro-batch beyond its saved activations: the gradients W's matmuls read
            (`hetpipe.partitioner.capture.weight_grads`); 0 on a stage whose inputs need none.
        transient_bwd_bytes: the most bytes its backward allocates at once beyond what the memory
            ledger holds (memory model 4; `hetpipe.partitioner.capture.transients`): measured for
            the loss's backward (on the last unit); 0 elsewhere (not yet measured per unit).
        tensor_parallel: the unit's blocks a tensor-parallel group can split (issue 15);
            empty: the unit runs width-1 (``tp_note`` says why).
        tp_flops_fraction: share of ``fwd_flops`` inside ``tensor_parallel`` blocks.
        tp_param_fraction: share of ``param_count`` that splits (the rest is replicated).
        tp_note: why the unit, or a part of it, cannot split ("" when nothing to say).
        fwd_work, bwd_work: the forward's and the backward's counts with the per-op table a
            calibrated CPU prices (`hetpipe.cost_models.work`); None: not measured (the
            roofline then charges the backward twice the forward's traffic and kernels).
        param_tensors: trainable parameter tensors the unit owns: a per-tensor optimizer loop
            (PyTorch's default on a CPU) pays its ops once per tensor (`cost_models.optimizer_step`).
        step_param_bytes, step_tensor_bytes: the bytes of those tensors as the optimizer steps them (fp32),
            all and the largest: its step's transient is a multiple of one or the other (memory model 5,
            `hetpipe.cost_models.step_transient`).
    """

    index: int
    name: str
    node_names: tuple[str, ...]
    fwd_flops: int
    bwd_flops: int
    param_count: int
    param_bytes: int
    state_bytes: int
    activation_bytes: int
    boundary_bytes: int
    memory_traffic_bytes: int = 0
    op_count: int = 0
    boundary_held_bytes: int = 0
    grad_bytes: int = 0
    boundary_grad_bytes: int = 0
    recompute_bytes: int = 0
    weight_grad_bytes: int = 0
    transient_bwd_bytes: int = 0
    tensor_parallel: tuple[TensorParallelBlock, ...] = ()
    tp_flops_fraction: float = 0.0
    tp_param_fraction: float = 0.0
    tp_note: str = ""
    fwd_work: PassWork | None = None
    bwd_work: PassWork | None = None
    param_tensors: int = 0
    step_param_bytes: int = 0
    step_tensor_bytes: int = 0


@dataclass(frozen=True)
class TiedParameter:
    """A parameter used by more than one unit (e.g. GPT-2's wte and lm_head).

    The runtime replicates it on every stage holding one of `unit_indices`
    and sums its gradients between them before the optimizer step.
    """

    qualified_names: tuple[str, ...]  # every module path under which it is reachable
    unit_indices: tuple[int, ...]  # units that use it, ascending; the first owns it
    numel: int


@dataclass(frozen=True)
class UnitGraph:
    """A model captured into ordered units with per-unit costs.

    Attributes:
        model_name: a user-facing name (class name or built-in name).
        fingerprint: sha256 over the graph structure and shapes; plans record it
            so a plan cannot be run against another model.
        units: ordered units.
        param_count: total parameters, tied parameters counted once.
        micro_batch_size: batch dimension of the example inputs the costs were measured at.
        optimizer, precision: what `state_bytes` assumes.
        tied: parameters shared between units.
        tracer: ``"symbolic_trace"`` or ``"export"``.
        graph: node-level networkx DiGraph (node attrs: ``unit``, ``op``, ``bytes``).
        module: the traced ``torch.fx.GraphModule`` (on the meta device).
    """

    model_name: str
    fingerprint: str
    units: tuple[Unit, ...]
    param_count: int
    micro_batch_size: int
    optimizer: str
    precision: str
    tied: tuple[TiedParameter, ...] = ()
    tracer: str = "symbolic_trace"
    graph: nx.DiGraph = field(default_factory=nx.DiGraph, compare=False, repr=False)
    module: Any = field(default=None, compare=False, repr=False)

    @property
    def num_units(self) -> int:
        return len(self.units)

    def total(self, attr: str) -> int:
        """Sum of one numeric unit field, e.g. ``g.total("fwd_flops")``."""
        return sum(getattr(u, attr) for u in self.units)
