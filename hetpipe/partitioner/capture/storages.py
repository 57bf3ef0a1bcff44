"""Which storages a stage holds for backward: each counted once, in the unit that makes it.

`measure_training` runs every unit on its own (values from earlier units arrive as fresh
autograd leaves), so a unit's own saved-tensor meter sees a *copy* of a tensor another
unit made.  A pipeline stage does not copy: inside it, a storage saved by two units (a
residual stream read by a norm in the next block, a U-Net skip read by a later conv), or
saved and also sent on to the next stage, is one allocation; and a received tensor the
stage's first op saves is the received frame itself.

`StorageTracker` maps every leaf copy back to the storage it stands for, notes the unit
that first produced each storage, and which storages are *held* for the backward of one
micro-batch: saved by some unit (or the loss), or a model input (the first stage keeps
the micro-batch's inputs until its backward).  Per unit it reports

* ``held_bytes[u]``: bytes of the held storages unit u produces (each storage once);

and per fx node the bytes of its output tensors whose storage is held
(`node_held_bytes`) and of those that require grad (`node_grad_bytes`), from which
`hetpipe.partitioner.capture.capture` sums the held share of every cut
(`Unit.boundary_held_bytes`) and the size of its gradient message (`Unit.boundary_grad_bytes`).  A stage on units [l, r] then holds per
in-flight micro-batch (the optimisation contract's ``A_s``, see
`hetpipe.partitioner.problem`)::

    A_s + in_s + out_s  with  A_s = sum_{u=l..r} held_bytes[u] - boundary_held_bytes[r]

exactly the unique storages of its saved tensors, received inputs and outputs, except a
tensor that only passes through the stage (received, sent on, never saved): counted in
``in_s`` and ``out_s``, held once (the bound stays above the runtime).

Example:
    >>> import torch
    >>> tr = StorageTracker(set(), "fp32")
    >>> x = torch.empty(4, 8, device="meta")            # produced in unit 0, read by unit 1
    >>> tr.produced(0, "x", x)
    >>> copy = x.clone()                                 # unit 1's stand-in for x
    >>> tr.alias(copy, x); tr.hold(1, copy.t())          # unit 1 saves a view of its copy
    >>> tr.held_bytes(2), tr.node_held_bytes("x")        # one storage, made by unit 0
    ((128, 0), 128)
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.utils._pytree import tree_leaves

from hetpipe.cost_models.activations import storage_bytes, storage_key
from hetpipe.cost_models.memory import tensor_bytes


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class StorageTracker:
    """Storages of one training pass: producer unit, held or not, bytes (see the module docstring).

    ``state_keys`` are the storage keys of parameters and buffers (never activations),
    read live like `hetpipe.cost_models.activations.SavedTensorMeter`'s.
    """

    def __init__(self, state_keys: set[int], precision: str) -> None:
        self.state_keys, self.precision = state_keys, precision
        self._alias: dict[int, int] = {}  # storage of a leaf copy -> storage it stands for
        self._keep: list[torch.UntypedStorage] = []  # alive while we count: keys are addresses
        self._producer: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._held: set[int] = set()
        self._node_outputs: dict[str, list[tuple[int, int]]] = {}  # node -> (storage, tensor bytes)
        self._node_grad: dict[str, int] = {}  # node -> bytes of its outputs that require grad
        self._saved_in: dict[int, set[int]] = {}  # unit -> storages autograd saved while it ran

    def key(self, t: torch.Tensor) -> int:
        """The storage ``t`` stands for (a leaf copy maps to the original)."""
        k = storage_key(t)
        return self._alias.get(k, k)

    def _note(self, unit: int, t: torch.Tensor) -> int:
        k = self.key(t)
        if k not in self._producer:
            self._producer[k] = unit
            self._bytes[k] = storage_bytes(t, self.precision)
            self._keep.append(t.untyped_storage())
        return k

    def alias(self, copy: Any, original: Any) -> None:
        """``copy`` (a unit's fresh leaf) stands for ``original`` (the producing unit's value)."""
        for c, o in zip(_tensors(copy), _tensors(original)):
            if storage_key(c) != storage_key(o):
                self._keep.append(c.untyped_storage())
                self._alias[storage_key(c)] = self.key(o)

    def produced(self, unit: int, node: str, value: Any) -> None:
        """fx node ``node`` of ``unit`` returned ``value``."""
        tensors = _tensors(value)
        self._node_outputs[node] = [(self._note(unit, t), tensor_bytes(t, self.precision)) for t in tensors]
        self._node_grad[node] = sum(tensor_bytes(t, self.precision) for t in tensors if t.requires_grad)

    def hold(self, unit: int, t: torch.Tensor) -> None:
        """``t`` is kept for the backward: saved by autograd in ``unit``, or a model input."""
        k = self.key(t)
        if k in self.state_keys:
            return
        self._held.add(self._note(unit, t))

    def saved(self, unit: int, t: torch.Tensor) -> None:
        """Autograd saved ``t`` while a node of ``unit`` ran: held, and part of that unit's own saves."""
        if self.key(t) not in self.state_keys:
            self.hold(unit, t)
            self._saved_in.setdefault(unit, set()).add(self.key(t))

    def own_saved_bytes(self, num_units: int) -> tuple[int, ...]:
        """Per unit, the storages it makes and saves itself: what a recompute of it allocates again."""
        return tuple(sum(self._bytes[k] for k in self._saved_in.get(u, ()) if self._producer[k] == u)
                     for u in range(num_units))

    def held_bytes(self, num_units: int) -> tuple[int, ...]:
        """Bytes of the held storages each unit produces, each storage once."""
        out = [0] * num_units
        for k in self._held:
            out[self._producer[k]] += self._bytes[k]
        return tuple(out)

    def node_grad_bytes(self, node: str) -> int:
        """Bytes of ``node``'s output tensors that require grad: what a gradient message carries back."""
        return self._node_grad.get(node, 0)

    def node_held_storages(self, node: str) -> tuple[tuple[int, int], ...]:
        """(storage, storage bytes) of ``node``'s outputs that are held: views of one storage share its key."""
        return tuple((k, self._bytes[k]) for k, _ in self._node_outputs.get(node, []) if k in self._held)

    def node_held_bytes(self, node: str) -> int:
        """Bytes of ``node``'s output tensors whose storage is held (0 for an unknown node)."""
        return sum(b for k, b in self._node_outputs.get(node, []) if k in self._held)


def unit_buffer_bytes(gm: torch.fx.GraphModule, unit_of: Mapping[str, int], num_units: int) -> list[int]:
    """Bytes of the module buffers (BatchNorm statistics, rotary tables) each unit reads first.

    A stage keeps the buffers its nodes read: a leaf module's own buffers, and tensors read
    by ``get_attr`` that are not parameters; each buffer counts once, in the first unit.
    """
    out, seen = [0] * num_units, set()
    params = {id(p) for p in gm.parameters()}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            found = list(gm.get_submodule(node.target).buffers())
        elif node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            found = [value] if isinstance(value, torch.Tensor) and id(value) not in params else []
        else:
            continue
        for b in found:
            if id(b) not in seen:
                seen.add(id(b))
                out[unit_of[node.name]] += b.numel() * b.element_size()
    return out
