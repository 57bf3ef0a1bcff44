"""The selective recompute level in a built stage (issue 14): a unit's dropped outputs are re-made in the backward.

The planner (`partitioner/selective.py`) drops, per unit, the outputs of memory-bound nodes (norms,
activations) whose inputs are held anyway and whose readers are all compute-bound (matmuls, attention),
and prices the level as: the readers' saved copies of those outputs are not held (``freed_bytes``), the
dropped nodes re-run once in the backward (their forward seconds) and nothing else re-runs.
`apply_selective` runs exactly that on a stage's ``GraphModule``, rewritten in place:

* each dropped node becomes a call of a `DroppedNode`, which runs the node and tags its output with a
  `Recipe` (the node's callable, its inputs, the RNG state before it ran);
* each node reading a dropped output becomes a call of a `SavingReader`, which runs the reader under
  ``torch.autograd.graph.saved_tensors_hooks``: a saved tensor on a dropped output's storage is packed as
  its recipe and view geometry, and unpacked in the backward by re-running the node (under ``no_grad``,
  RNG replayed, the node's buffers restored afterwards: `RestoredBuffers`), once per micro-batch.

This is the policy of PyTorch's selective activation checkpoint
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``: the readers ``MUST_SAVE``, the
dropped ops ``PREFER_RECOMPUTE``) without its unit-wide region: a region re-runs every op it does not
cache on recompute, so matching the planner's seconds would need every other op cached, which holds
outputs (a projection's, a residual add's) that nothing holds without the level.  What a dropped node
saves for its own backward (a norm's mean and rstd) stays held: the planner frees the outputs' bytes only.

Parameter names, the state dict and the optimizer are untouched (the rewritten nodes call the same
submodules).  Units the stage recomputes whole (`stage.recompute`) are left out: their forward re-runs
anyway.

Example (LayerNorm's output, which the last Linear saves, is dropped and re-made in the backward):
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    >>> gm = torch.fx.symbolic_trace(net)
    >>> (level,) = apply_selective(gm, {0: ("_1",)}, stage=0)
    >>> x = torch.randn(3, 4, requires_grad=True)
    >>> y = gm(x); torch.allclose(y, net(x)), level.nodes, level.dropped_bytes   # LayerNorm's 3x8 output
    (True, ('_1',), 96)
    >>> y.sum().backward(); level.recomputes
    1
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from hetpipe.errors import ScheduleError
from hetpipe.runtime.stage.recompute import RestoredBuffers

log = logging.getLogger(__name__)

_CALL_OPS = ("call_function", "call_method", "call_module")
#: Reads of a tensor's metadata (``x.shape``, its items): they save nothing, so they are not wrapped.
_METADATA = (getattr, operator.getitem)
#: Attribute a dropped node's output carries while the forward runs: its `Recipe` (readers look for it).
RECIPE_ATTR = "_hetpipe_selective_recipe"


class UnitLevel:
    """The level on one unit of a stage: its dropped nodes, and what they dropped and re-ran (measured).

    Attributes:
        unit: the plan's global unit index.
        nodes: the dropped fx nodes' names.
        dropped_bytes: bytes of the dropped outputs of one micro-batch (None until a forward with autograd).
        recomputes: how many times a dropped node re-ran in a backward (for tests and reports).
    """

    def __init__(self, unit: int, nodes: tuple[str, ...]) -> None:
        self.unit, self.nodes = unit, nodes
        self.dropped_bytes: int | None = None
        self.recomputes = 0
        self._seen: dict[str, int] = {}

    def observed(self, node: str, out: torch.Tensor) -> None:
        """Record one dropped output's bytes (the unit's bytes: the sum over its nodes)."""
        self._seen[node] = out.untyped_storage().nbytes()
        if len(self._seen) == len(self.nodes):
            self.dropped_bytes = sum(self._seen.values())


class Recipe:
    """How to re-make one dropped output in the backward: its node's callable, inputs and RNG state."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, level: UnitLevel,
                 buffers: Sequence[torch.Tensor], rng: tuple[torch.Tensor, torch.Tensor | None],
                 device: torch.device) -> None:
        self.fn, self.args, self.kwargs, self.level, self.buffers = fn, args, kwargs, level, tuple(buffers)
        self.rng, self.device = rng, device  # (CPU state, the CUDA device's state or None)
        self.value: torch.Tensor | None = None

    def remake(self) -> torch.Tensor:
        """The output again (once per micro-batch: every unpack of its views shares it)."""
        if self.value is None:
            cuda = self.device.type == "cuda"
            with torch.no_grad(), torch.random.fork_rng(devices=[self.device.index or 0] if cuda else [],
                                                        device_type="cuda"), RestoredBuffers(self.buffers):
                torch.set_rng_state(self.rng[0])  # dropout in a dropped node draws the forward's mask again
                if cuda and self.rng[1] is not None:
                    torch.cuda.set_rng_state(self.rng[1], self.device)
                self.value = self.fn(*self.args, **self.kwargs)
            self.level.recomputes += 1
        return self.value


class _Packed:
    """A saved tensor that was a view of a dropped output: the recipe and the view's geometry."""

    def __init__(self, recipe: Recipe, t: torch.Tensor, base_offset: int) -> None:
        self.recipe, self.size, self.stride = recipe, t.size(), t.stride()
        self.offset = t.storage_offset() - base_offset

    def unpack(self) -> torch.Tensor:
        out = self.recipe.remake()
        return out.as_strided(self.size, self.stride, out.storage_offset() + self.offset)


class DroppedNode:
    """A dropped node, called from the stage graph: runs it and tags its output with its `Recipe`."""

    def __init__(self, fn: Callable[..., Any], level: UnitLevel, name: str,
                 buffers: Sequence[torch.Tensor]) -> None:
        self.fn, self.level, self.name, self.buffers = fn, level, name, tuple(buffers)
        self.__name__ = f"selective_drop_{name}"  # torch.fx writes a call_function target by this name
        self.__module__ = __name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved without autograd: nothing to drop
            return self.fn(*args, **kwargs)
        cuda = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(cuda) if cuda is not None else None)
        out = self.fn(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise ScheduleError(f"selective level: node {self.name!r} returned {type(out).__name__}, not one tensor; "
                                "re-plan with `--recompute none` or without the level for this model")
        setattr(out, RECIPE_ATTR, Recipe(self.fn, args, kwargs, self.level, self.buffers, rng, out.device))
        self.level.observed(self.name, out)
        return out


class SavingReader:
    """A node reading dropped outputs: what it saves on their storages is packed as their recipes."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn, self.name = fn, name
        self.__name__ = f"selective_read_{name}"
        self.__module__ = __name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tagged = [(a, getattr(a, RECIPE_ATTR)) for a in (*args, *kwargs.values())
                  if isinstance(a, torch.Tensor) and hasattr(a, RECIPE_ATTR)]
        if not tagged or not torch.is_grad_enabled():
            return self.fn(*args, **kwargs)
        by_storage = {a.untyped_storage().data_ptr(): (a, r) for a, r in tagged}

        def pack(t: torch.Tensor) -> Any:
            hit = by_storage.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
            return _Packed(hit[1], t, hit[0].storage_offset()) if hit is not None else t

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            return self.fn(*args, **kwargs)


def _unpack(p: Any) -> torch.Tensor:
    return p.unpack() if isinstance(p, _Packed) else p


def apply_selective(module: fx.GraphModule, units: Mapping[int, Sequence[str]], *,
                    stage: int) -> tuple[UnitLevel, ...]:
    """Run the level on ``units`` (global unit index -> the fx node names it drops, `Plan.selective`).

    ``module`` is a built stage (tensors materialised); it is rewritten in place and recompiled.
    Raises `ScheduleError` naming the node when a dropped node is not on this stage.
    """
    nodes = {n.name: n for n in module.graph.nodes}
    levels, dropped = [], set()
    for unit, names in sorted(units.items()):
        level = UnitLevel(unit, tuple(names))
        for name in names:
            node = nodes.get(name)
            if node is None or node.op not in _CALL_OPS:
                raise ScheduleError(f"stage {stage}: the selective level of unit {unit} drops node {name!r}, which "
                                    "this stage does not compute; re-plan with `hetpipe plan`")
            fn, buffers = _callable(module, node)
            dropped.add(_replace(module.graph, node, DroppedNode(fn, level, name, buffers)))
        levels.append(level)
    for node in list(module.graph.nodes):
        if (node.op in _CALL_OPS and node.target not in _METADATA and node not in dropped
                and any(p in dropped for p in node.all_input_nodes)):
            _replace(module.graph, node, SavingReader(_callable(module, node)[0], node.name))
    module.graph.lint()
    module.recompile()
    return tuple(levels)


def _callable(module: fx.GraphModule, node: fx.Node) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    """(what ``node`` calls, the buffers it may update: a submodule's own) on ``module``."""
    if node.op == "call_module":
        sub = module.get_submodule(str(node.target))
        return sub, tuple(sub.buffers())
    if node.op == "call_method":
        name = str(node.target)
        return (lambda obj, *a, **k: getattr(obj, name)(*a, **k)), ()
    if isinstance(node.target, (DroppedNode, SavingReader)):
        return node.target.fn, ()
    return node.target, ()  # type: ignore[return-value]


def _replace(graph: fx.Graph, node: fx.Node, target: Any) -> fx.Node:
    """``node`` replaced by a call of ``target`` with the same arguments, under the same name (recompute and
    reports find the plan's nodes by name; the generated code names values afresh); the new node."""
    with graph.inserting_after(node):
        new = graph.call_function(target, node.args, node.kwargs)
    node.replace_all_uses_with(new)
    name = node.name
    graph.erase_node(node)
    new.name = name  # unique: the node that had it is gone
    return new
