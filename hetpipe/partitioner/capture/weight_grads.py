"""The gradients a split backward keeps from B to W, per unit (issue 17 item 2; the memory model's
``weight_grad_bytes``).

A zero-bubble schedule splits each backward into B (the stage inputs' gradient) and W (the
parameters'); `hetpipe.runtime.execute.split_backward` keeps, from a micro-batch's B to its W,
besides the graph's saved tensors (already priced as the in-flight micro-batch's activations):

* the gradient arriving at every *frontier* node (`graph_shape.analyse`: on a path to an input,
  with an edge into the part of the graph that reaches only parameters) -- the input of W's
  weight-gradient matmuls.  For a Linear ``Y = X W^T + b`` that is dY, shape (b, s, out): dW =
  dY^T X also needs X, (b, s, in), but autograd saved X in the forward (it is in A already);
  a LayerNorm keeps its output gradient (b, s, d) the same way;
* the gradient of every output that reaches no input (W runs it alone).

For a GPT block of width d that is 11 d values per token (ln_1 d, c_attn 3d, attn c_proj d,
ln_2 d, c_fc 4d, mlp c_proj d); the two c_proj gradients are the residual stream's gradient
(an add passes its gradient on unchanged), the last one the very gradient the unit receives.

`unit_weight_grad_bytes` runs that B on one unit's meta graph (its inputs fresh leaves, a fresh
gradient for each output, as `measure.measure_training` builds it) and counts the unique storages
of what W would keep, the unit's output gradient included when a kept tensor is a view of it: in
a stage, that storage is the received gradient (last unit) or the next unit's input gradient,
which nothing else holds after B.  A stage whose inputs need no gradient (the first) keeps none
of it: its W is its whole backward (`hetpipe.partitioner.problem.stage_memory_terms`).

Example (one Linear, 4 x 3 -> 4 x 2: W keeps dY, 8 floats):
    >>> lin = torch.nn.Linear(3, 2, device="meta")
    >>> x = torch.empty(4, 3, device="meta", requires_grad=True)
    >>> unit_weight_grad_bytes([lin(x)], [x], list(lin.parameters()), precision="fp32")
    32
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge

from hetpipe.cost_models.activations import storage_bytes, storage_key
from hetpipe.partitioner.capture.graph_shape import analyse, walk


def unit_weight_grad_bytes(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                           params: Sequence[torch.Tensor], *, precision: str) -> int:
    """Bytes W keeps from B for this graph (module docstring); 0 when no input needs a gradient."""
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    roots = [t for t in outputs if t.requires_grad]
    if not wanted or not roots:
        return 0
    nodes, topology = walk(roots, wanted, params)
    shape = analyse(topology)
    grads = [torch.empty_like(t) for t in roots]
    captures = [GradientEdge(nodes[k], i) for k, outs in shape.frontier for i in outs]
    got = torch.autograd.grad(roots, [*wanted, *captures], grad_outputs=grads, retain_graph=True,
                              allow_unused=True)
    kept = [g for g in got[len(wanted):] if g is not None]
    kept += [grads[r] for _, root_ids, _ in shape.groups for r in root_ids]
    unique = {storage_key(t): storage_bytes(t, precision) for t in kept}
    return sum(unique.values())
