"""`torch.export` for training: what capture sets on a model before exporting it.

* **No cache, structured outputs.**  Hugging Face models default to ``use_cache=True``
  and return a ``DynamicCache`` next to the logits, which ``torch.export`` cannot
  flatten; a training forward needs neither.  While tracing, a model whose ``config``
  has ``use_cache`` / ``return_dict`` runs with ``use_cache=False`` and
  ``return_dict=True`` (restored afterwards), so its output is a ``ModelOutput`` that
  the last stage rebuilds (`hetpipe.runtime.stage.build.split_stages`).
* **Inputs on the model's device.**  A model built on a real device (a factory that
  builds on CPU) is exported with zero-filled inputs of the example's shapes on that
  device; export runs on fake tensors, so no model code sees real data.
* **Device-agnostic graph.**  The exported graph's device constants are rewritten to
  meta (`hetpipe.partitioner.capture.devices.retarget_devices`); each stage is rewritten
  again to its own device when it is built.

Example:
    >>> import torch
    >>> class Cfg:
    ...     use_cache, return_dict = True, False
    >>> m = torch.nn.Linear(2, 2)
    >>> m.config = Cfg()
    >>> with training_config(m):
    ...     m.config.use_cache, m.config.return_dict
    (False, True)
    >>> m.config.use_cache
    True
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn

from hetpipe.partitioner.capture.devices import retarget_devices

log = logging.getLogger(__name__)

# Config attributes a training forward needs, and their values (Hugging Face names).
TRAINING_CONFIG = {"use_cache": False, "return_dict": True}


@contextlib.contextmanager
def training_config(model: nn.Module) -> Iterator[None]:
    """Temporarily set `TRAINING_CONFIG` on ``model.config`` (where it has those attributes)."""
    config = getattr(model, "config", None)
    saved = {k: getattr(config, k) for k in TRAINING_CONFIG if config is not None and hasattr(config, k)}
    try:
        for key in saved:
            setattr(config, key, TRAINING_CONFIG[key])
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (meta for an empty model)."""
    for t in [*model.parameters(), *model.buffers()]:
        return t.device
    return torch.device("meta")


def export_for_training(model: nn.Module, inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """``torch.export.export(model, inputs, strict=False).module()``, prepared as the module docstring says."""
    device = model_device(model)
    args = tuple(torch.zeros_like(x, device=device) if x.device != device else x for x in inputs)
    with training_config(model):
        exported = torch.export.export(model, args, strict=False)
    gm = exported.module(check_guards=False)
    moved = retarget_devices(gm, "meta")
    log.info("export: %d device constants made device-agnostic", moved)
    return gm
