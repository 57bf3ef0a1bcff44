"""Device-agnostic graphs: the devices baked into a traced graph's node arguments.

``torch.export`` records every tensor a forward creates with ``device=x.device`` as a
constant of the device it traced on -- ``aten.arange(8, device=meta)``, ``aten.zeros``,
``aten.full``, ``aten.to.device(t, meta, ...)``, ``aten._assert_tensor_metadata(t,
device=meta)`` (32 of them in a 2-layer Hugging Face Llama, 34 in T5).  hetpipe traces on
meta and runs each stage on its rank's device, so the device is a property of where a
graph runs, not of the graph: `retarget_devices` rewrites every ``torch.device`` in node
arguments (positional, keyword, nested in lists) to one target device, and
`device_constants` lists the nodes that still name another device.

The capture's fingerprint ignores devices (`capture.fingerprint`), so a graph traced
from a CPU-built model and one traced on meta get the same plan.

Example:
    >>> import torch, torch.fx as fx
    >>> g = fx.Graph()
    >>> x = g.placeholder("x")
    >>> r = g.call_function(torch.ops.aten.arange.default, (4,), {"device": torch.device("meta")})
    >>> _ = g.output(g.call_function(torch.ops.aten.add.Tensor, (x, r)))
    >>> gm = fx.GraphModule(torch.nn.Module(), g)
    >>> device_constants(gm, "cpu")
    ['arange_default']
    >>> retarget_devices(gm, "cpu"), device_constants(gm, "cpu")
    (1, [])
    >>> gm(torch.ones(4)).tolist()
    [1.0, 2.0, 3.0, 4.0]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def _rewrite(value: Any, device: torch.device) -> tuple[Any, int]:
    """(value with every torch.device replaced by ``device``, how many were replaced)."""
    if isinstance(value, torch.device):
        return device, int(value != device)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [_rewrite(v, device) for v in value]
        count = sum(c for _, c in items)
        if not count:
            return value, 0
        rebuilt = [v for v, _ in items]
        return (type(value)(rebuilt) if type(value) in (list, tuple) else type(value)(*rebuilt)), count
    if isinstance(value, dict):
        items_d = {k: _rewrite(v, device) for k, v in value.items()}
        count = sum(c for _, c in items_d.values())
        return ({k: v for k, (v, _) in items_d.items()} if count else value), count
    return value, 0


def retarget_devices(gm: fx.GraphModule, device: torch.device | str) -> int:
    """Rewrite every device in ``gm``'s node arguments to ``device`` and recompile; returns the count.

    Node ``kwargs`` are immutable dicts, so changed ones are replaced, never edited.
    """
    target = torch.device(device)
    changed = 0
    for node in gm.graph.nodes:
        args, n_args = _rewrite(node.args, target)
        kwargs, n_kwargs = _rewrite(dict(node.kwargs), target)
        if n_args:
            node.args = tuple(args)
        if n_kwargs:
            node.kwargs = kwargs
        changed += n_args + n_kwargs
    if changed:
        gm.recompile()
    return changed


def device_constants(gm: fx.GraphModule, device: torch.device | str) -> list[str]:
    """Names of the nodes whose arguments name a device other than ``device`` (empty when runnable there)."""
    target = torch.device(device)

    def other(value: Any) -> bool:
        if isinstance(value, torch.device):
            return value != target
        if isinstance(value, (list, tuple)):
            return any(other(v) for v in value)
        if isinstance(value, dict):
            return any(other(v) for v in value.values())
        return False

    return [n.name for n in gm.graph.nodes if other(n.args) or other(dict(n.kwargs))]
