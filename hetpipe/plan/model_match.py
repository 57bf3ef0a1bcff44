"""Is a captured model the one a plan was made for (`verify_model`)?

The fingerprint hashes the captured graph's shapes, so the same model captured at another
sequence length or micro-batch size has another fingerprint.  A plan records its micro-batch
size but not the sequence length it was captured at, so where the names match the error names
the shapes this capture used and the flags that set them (`shape_hint`).

Example:
    >>> from types import SimpleNamespace
    >>> plan = SimpleNamespace(model=SimpleNamespace(name="m", fingerprint="ab"))
    >>> verify_model(plan, SimpleNamespace(fingerprint="ab"))   # the same: nothing to say
"""

from __future__ import annotations

from typing import Any, Sequence

from hetpipe.errors import PlanError


def verify_model(plan: Any, graph: Any, inputs: Sequence[Any] = ()) -> None:
    """Refuse to use `plan` (a `plan.schema.Plan`) for a model whose captured graph (a `UnitGraph`) differs
    from the one planned; `inputs` (the captured micro-batch, optional) lets the error name its shapes."""
    if graph.fingerprint != plan.model.fingerprint:
        same_name = graph.model_name == plan.model.name
        raise PlanError(
            f"this plan was made for model {plan.model.name!r} (fingerprint {plan.model.fingerprint[:12]}), but the "
            f"given model {graph.model_name!r} captures to fingerprint {graph.fingerprint[:12]} "
            f"({graph.num_units} units, {graph.param_count:,} parameters)"
            + (f"; {shape_hint(plan, graph, inputs)}" if same_name else "")
            + "; re-plan it with `hetpipe plan`"
        )


def shape_hint(plan: Any, graph: Any, inputs: Sequence[Any] = ()) -> str:
    """Why the same model may capture to another fingerprint: its input shapes, and the flags that set them.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> plan = NS(training=NS(micro_batch_size=2))
        >>> shape_hint(plan, NS(micro_batch_size=2), [NS(shape=(2, 64))])  # doctest: +NORMALIZE_WHITESPACE
        'this run captured inputs of shape (2, 64) (batch 2, seq 64): the same model at another sequence length or
        micro-batch captures to another fingerprint: pass the --seq N the plan was made with (`hetpipe plan ...
        --seq N`; seq=N in hetpipe.Trainer and hetpipe.run)'
        >>> shape_hint(plan, NS(micro_batch_size=4)).split(": pass ")[1][:30]
        'the --batch 2 and --seq N the '
    """
    shapes = [tuple(t.shape) for t in inputs if hasattr(t, "shape")]
    seen = ""
    if shapes:
        seq = f", seq {shapes[0][1]}" if len(shapes[0]) >= 2 else ""
        seen = (f"this run captured inputs of shape {', '.join(str(s) for s in shapes)} "
                f"(batch {shapes[0][0] if shapes[0] else '?'}{seq}): ")
    batch = plan.training.micro_batch_size
    # the plan records its micro-batch size, so a batch that differs is named exactly; its seq is not recorded
    flags = f"--batch {batch} and --seq N" if graph.micro_batch_size != batch else "--seq N"
    return (f"{seen}the same model at another sequence length or micro-batch captures to another fingerprint: "
            f"pass the {flags} the plan was made with (`hetpipe plan ... --seq N`; seq=N in hetpipe.Trainer "
            "and hetpipe.run)")
