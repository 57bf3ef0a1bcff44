"""The user's own loss and data, named on the command line: imported, looked at, tried on meta.

``hetpipe plan/inspect --loss package.module:function`` costs what the loss saves for backward
exactly like ``capture(..., loss_fn=, targets=)`` does (`loss_for_capture`); its targets are
one micro-batch from ``--data`` (``package.module:factory`` returning an iterable of
``(inputs, targets)`` global batches, or a file of such a list saved with ``torch.save``),
or a built-in model's synthetic targets.  Every mistake is a `ConfigError` naming the
option, the value and the fix.

Example:
    >>> fn = import_callable("hetpipe.models:lm_loss", option="--loss")
    >>> fn.__name__
    'lm_loss'
    >>> import_callable("hetpipe.models:no_such_loss", option="--loss")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hetpipe.errors.ConfigError: --loss 'hetpipe.models:no_such_loss': module 'hetpipe.models' has no attribute ...
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map

from hetpipe.errors import ConfigError

FORMAT = {"--loss": "package.module:function(output, targets) returning a scalar tensor",
          "--data": "package.module:factory returning an iterable of (inputs, targets) global batches"}


def _import_module(name: str, *, option: str, spec: str) -> Any:
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path  # console scripts leave the working directory off
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except Exception as err:  # ImportError, or whatever the module raises at import time
        raise ConfigError(f"{option} {spec!r}: cannot import module {name!r} ({type(err).__name__}: {err}); check "
                          "the spelling and that it is on PYTHONPATH or in the working directory") from None
    finally:
        if added:
            sys.path.remove(cwd)


def import_callable(spec: str, *, option: str) -> Callable[..., Any]:
    """The callable ``"package.module:name"`` names (``name`` may be dotted), or a `ConfigError` naming ``option``."""
    module_name, _, attr = str(spec).partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigError(f"{option} {spec!r} is malformed; expected {FORMAT.get(option, 'package.module:name')}")
    obj: Any = _import_module(module_name, option=option, spec=spec)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{option} {spec!r}: module {module_name!r} has no attribute {attr!r}; expected "
                              f"{FORMAT.get(option, 'package.module:name')}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{option} {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable; expected "
                          f"{FORMAT.get(option, 'package.module:name')}")
    return obj


def first_batch(data: str) -> tuple[Any, Any]:
    """The first ``(inputs, targets)`` of ``--data`` (a factory spec or a ``torch.save``'d list of batches)."""
    if ":" not in data and Path(data).is_file():
        try:
            items: Any = torch.load(data, weights_only=False)
        except Exception as err:
            raise ConfigError(f"--data {data!r}: cannot load the file ({type(err).__name__}: {err}); save a list of "
                              "(inputs, targets) batches with torch.save") from None
        what = "the file"
    else:
        factory = import_callable(data, option="--data")
        try:
            items = factory()
        except Exception as err:
            raise ConfigError(f"--data {data!r}: the factory raised {type(err).__name__}: {err}") from None
        what = "the factory's iterable"
    try:
        item = next(iter(items), None)
    except TypeError:
        raise ConfigError(f"--data {data!r}: the factory returned a {type(items).__name__}, which is not iterable; "
                          f"expected {FORMAT['--data']}") from None
    if item is None:
        raise ConfigError(f"--data {data!r}: {what} yielded no batch; it must yield (inputs, targets) global batches")
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(f"--data {data!r}: the first item is a {type(item).__name__}"
                          f"{f' of length {len(item)}' if isinstance(item, (tuple, list)) else ''}; each item must be "
                          "(inputs, targets) for one global batch")
    return item[0], item[1]


def as_tensors(part: Any) -> tuple[torch.Tensor, ...]:
    """A batch part (a tensor or a tuple/list of tensors) as a tuple of tensors."""
    return (part,) if isinstance(part, torch.Tensor) else tuple(part) if isinstance(part, (tuple, list)) else ()


def meta_rows(part: Any, rows: int) -> Any:
    """The first ``rows`` rows of every tensor in ``part``, as meta tensors (one micro-batch for capture)."""
    return tree_map(lambda t: torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device="meta")
                    if isinstance(t, torch.Tensor) else t, part)


def check_inputs(data: str, inputs: Any, example: tuple[torch.Tensor, ...], *, batch: int) -> None:
    """``--data``'s inputs must be ``batch`` rows of the model's example inputs (same trailing shape and dtype)."""
    got = as_tensors(inputs)
    if len(got) != len(example):
        raise ConfigError(f"--data {data!r}: inputs are {len(got)} tensor(s) but the model takes {len(example)}; "
                          "yield (inputs, targets) with inputs a tensor or a tuple of the model's positional inputs")
    for i, (t, ex) in enumerate(zip(got, example)):
        want = (batch, *ex.shape[1:])
        if tuple(t.shape) != want or t.dtype != ex.dtype:
            raise ConfigError(f"--data {data!r}: input {i} of the first batch is {tuple(t.shape)} {t.dtype}, the plan "
                              f"needs {want} {ex.dtype} ({batch} samples per global batch, each shaped like the model's "
                              "example input); yield global batches of that shape or re-plan")


def check_targets(data: str, targets: Any, *, batch: int) -> None:
    leaves = [t for t in tree_leaves(targets) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise ConfigError(f"--data {data!r}: the first batch's targets hold no tensor; yield (inputs, targets)")
    bad = [tuple(t.shape) for t in leaves if t.dim() == 0 or t.shape[0] != batch]
    if bad:
        raise ConfigError(f"--data {data!r}: targets of shape {bad[0]} do not have the global batch of {batch} "
                          "samples in dimension 0; yield targets with one row per sample")


def check_loss(loss: Callable[..., Any], spec: str, output: Any, targets: Any) -> None:
    """Call ``loss(output, targets)`` on meta stand-ins; it must give a scalar that depends on the output."""
    stand_in = tree_map(lambda t: torch.empty_like(t, device="meta").requires_grad_(t.is_floating_point())
                        if isinstance(t, torch.Tensor) else t, output)
    meta_targets = tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t,
                            targets)
    try:
        with torch.enable_grad():
            value = loss(stand_in, meta_targets)
    except Exception as err:
        shapes = [tuple(t.shape) for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        tshapes = [tuple(t.shape) for t in tree_leaves(targets) if isinstance(t, torch.Tensor)]
        raise ConfigError(f"--loss {spec!r} failed on one micro-batch (output {shapes}, targets {tshapes}): "
                          f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; it is called as "
                          "loss(output, targets) with the model's output and one micro-batch of targets") from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = type(value).__name__ if not isinstance(value, torch.Tensor) else f"a tensor of shape {tuple(value.shape)}"
        raise ConfigError(f"--loss {spec!r} returned {got}; it must return a scalar tensor (reduce with .mean() or .sum())")
    if not value.requires_grad:
        raise ConfigError(f"--loss {spec!r} returned a value that does not depend on the output differentiably "
                          "(.item(), argmax or detach inside?); return a differentiable scalar tensor")


def meta_output(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Any:
    """The model's output on meta stand-ins of ``inputs`` (no memory allocated)."""
    with torch.no_grad():
        return model(*(torch.empty_like(t, device="meta") for t in inputs))


def loss_for_capture(model_name: str, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *,
                     loss: str | None, data: str | None) -> tuple[Callable[..., Any] | None, Any]:
    """(loss function, one micro-batch of meta targets) for `capture`, or ``(None, None)`` when no loss is known.

    The function is ``--loss``, else the built-in model's; the targets come from ``--data``'s
    first batch, else the built-in model's synthetic targets.  The loss is tried on meta first.
    """
    from hetpipe import models

    builtin = models.takes_size(model_name)  # built-in and Hugging Face models
    fn: Callable[..., Any] | None = import_callable(loss, option="--loss") if loss else None
    if fn is None and builtin:
        fn = models.loss_fn(model_name)
    if fn is None:
        return None, None
    rows = int(inputs[0].shape[0])
    if data:
        got_inputs, got_targets = first_batch(data)
        lead = as_tensors(got_inputs)
        check_inputs(data, got_inputs, inputs, batch=int(lead[0].shape[0]) if lead else rows)
        if lead and lead[0].shape[0] < rows:
            raise ConfigError(f"--data {data!r}: the first batch has {lead[0].shape[0]} samples, fewer than the "
                              f"micro-batch of {rows}; yield global batches of at least --batch samples")
        check_targets(data, got_targets, batch=int(lead[0].shape[0]))
        targets = meta_rows(got_targets, rows)
    elif builtin:
        targets = models.example_targets(model_name, inputs)
    else:
        raise ConfigError(f"--loss {loss!r}: model {model_name!r} is a factory, so hetpipe has no targets to call "
                          "the loss with; pass --data package.module:factory (its first batch's targets are used)")
    check_loss(fn, loss or f"{model_name}'s built-in loss", meta_output(model, inputs), targets)
    return fn, targets
