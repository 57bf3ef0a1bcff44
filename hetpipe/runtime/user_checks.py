"""Before launch: the run's ``--data`` and ``--loss`` imported and tried on one batch, on meta.

Without this a wrong option surfaces 20-40 s after launch on one rank (issue 11).  Checked,
in order, each mistake one `ConfigError` naming the option, the value and the fix: a
model factory needs ``--data`` (hetpipe cannot make targets for it) and ``--loss``; the
data imports, yields ``(inputs, targets)``, and its first global batch has the plan's
global batch of samples shaped like the model's example input; the loss imports and
``loss(output, targets)`` gives a differentiable scalar on meta stand-ins of the model's
output and one micro-batch of targets.

Example:
    >>> check_user_code(plan, model="gpt-tiny", data=None, loss="tests.nope:f",
    ...                 example=example, meta_model=gm)                           # doctest: +SKIP
    ConfigError: --loss 'tests.nope:f': cannot import module 'tests.nope' ...
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hetpipe.errors import ConfigError
from hetpipe.plan.schema import Plan
from hetpipe.plan.user_code import (
    check_inputs,
    check_loss,
    check_targets,
    first_batch,
    import_callable,
    meta_output,
    meta_rows,
)


def check_user_code(plan: Plan, *, model: str, data: str | Sequence[Any] | None, loss: str | None,
                    example: tuple[torch.Tensor, ...], meta_model: torch.nn.Module) -> None:
    """Refuse, before launch, data or a loss the workers would fail on (see the module docstring).

    ``data`` is ``--data`` (an import spec or a data file) or, from `hetpipe.run`, the list of
    ``(inputs, targets)`` batches it was given.
    """
    from hetpipe import models

    g, b = plan.training.global_batch, plan.training.micro_batch_size
    if not models.takes_size(model) and data is None:
        raise ConfigError(f"--data is missing: model {model!r} is not built in, so hetpipe cannot make synthetic "
                          f"targets for it; pass --data package.module:factory returning an iterable of "
                          f"(inputs, targets) global batches of {g} samples")
    if not models.takes_size(model) and loss is None:
        raise ConfigError(f"--loss is missing: model {model!r} is not built in, so hetpipe has no loss for it; "
                          "pass --loss package.module:function(output, targets) returning a scalar tensor")
    fn = import_callable(loss, option="--loss") if loss else models.loss_fn(model)
    if data is not None:
        label = data if isinstance(data, str) else "data"
        inputs, targets = first_batch(data) if isinstance(data, str) else data[0]
        check_inputs(label, inputs, example, batch=g)
        check_targets(label, targets, batch=g)
        micro_targets: Any = meta_rows(targets, b)
    else:
        micro_targets = models.example_targets(model, example)
    check_loss(fn, loss or f"{model}'s built-in loss", meta_output(meta_model, example), micro_targets)
