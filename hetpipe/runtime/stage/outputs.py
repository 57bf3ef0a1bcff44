"""The last stage returns what the model returns: a ``ModelOutput``, a dict, a tuple.

A ``torch.export`` graph returns a flat list of tensors and rebuilds the model's output
structure in its generated code (fx's pytree code generator, with the output's tree
spec).  `hetpipe.runtime.stage.build.split_stages` builds every stage graph afresh with
flat inputs; `keep_output_structure` gives the last stage the source graph's output spec
again, so ``loss_fn(output, targets)`` sees exactly what the unsplit model returns
(``output.logits`` on a Hugging Face model).  Graphs without an output spec (torch.fx
symbolic traces, which return their containers directly) are left alone.

Example:
    >>> import torch
    >>> class TwoHeads(torch.nn.Module):
    ...     def forward(self, x):
    ...         return {"a": x + 1, "b": x * 2}
    >>> ep = torch.export.export(TwoHeads(), (torch.zeros(2),))
    >>> src = ep.module()
    >>> g = torch.fx.Graph()
    >>> x = g.placeholder("x")
    >>> _ = g.output((g.call_function(torch.add, (x, 1)), g.call_function(torch.mul, (x, 2))))
    >>> stage = torch.fx.GraphModule(torch.nn.Module(), g)
    >>> keep_output_structure(stage, src)
    True
    >>> sorted(stage(torch.ones(2)))
    ['a', 'b']
"""

from __future__ import annotations

import copy

import torch.fx as fx
import torch.utils._pytree as pytree  # torch's pytree: the registry Hugging Face's ModelOutput is in


def output_spec(source: fx.GraphModule) -> pytree.TreeSpec | None:
    """The tree spec ``source``'s generated code rebuilds its output with, if any."""
    info = getattr(source.graph._codegen, "pytree_info", None)  # torch.fx has no public getter for the codegen
    return getattr(info, "out_spec", None)


def keep_output_structure(stage: fx.GraphModule, source: fx.GraphModule) -> bool:
    """Give ``stage`` (flat inputs and outputs) ``source``'s output structure; False when there is none."""
    spec = output_spec(source)
    if spec is None:
        return False
    names = [n.name for n in stage.graph.nodes if n.op == "placeholder"]
    codegen = copy.copy(source.graph._codegen)
    # Inputs stay flat: one leaf per placeholder, in order.
    codegen.pytree_info = codegen.pytree_info._replace(orig_args=names,
                                                       in_spec=pytree.tree_structure(list(range(len(names)))))
    stage.graph.set_codegen(codegen)
    stage.recompile()
    return True
