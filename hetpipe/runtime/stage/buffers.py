"""Real values for a stage's buffers, from the model's own initialisation, one owner at a time.

hetpipe captures and builds models on the meta device, so their buffers have no values.
Persistent buffers (BatchNorm running statistics) can come from a weights file; the
non-persistent ones (Llama's ``rotary_emb.inv_freq``, BERT's ``position_ids``) are in no
state dict and must be recomputed the way the model computes them.  `ModelBuffers` maps
qualified buffer names to values:

* a buffer the model holds on a real device (a factory that builds on CPU) is used as is;
* a meta buffer is **recomputed on the CPU by its owning module's own initialiser**, on a
  shallow copy of that one module whose buffers alone are allocated (its parameters and
  children stay meta): ``reset_buffers()`` (hetpipe's convention, e.g.
  `hetpipe.models.llama.RotaryEmbedding`), ``reset_running_stats()`` (torch's norm layers:
  BatchNorm running mean 0, variance 1, ``num_batches_tracked`` 0), or the Hugging Face
  root model's ``_init_weights(module)`` (rotary tables from the config, position ids).

The initialiser runs twice, on buffers pre-filled with 0 and with 1; a buffer that comes
out different was not (or not deterministically) set by it, and is refused with a message
naming it and the fixes.  Cost: one owner's buffers, never the model -- a 7B Llama's
rotary table is 64 floats, a stage asks only for the buffers it holds, and nothing of
the size of a weight is allocated (measured in `benchmarks/model_zoo.py`).

Example:
    >>> import torch
    >>> with torch.device("meta"):
    ...     net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
    >>> bufs = ModelBuffers(net)
    >>> sorted(bufs)
    ['1.num_batches_tracked', '1.running_mean', '1.running_var']
    >>> bufs["1.running_var"].tolist(), bufs["1.num_batches_tracked"].item()
    ([1.0, 1.0, 1.0, 1.0], 0)
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from hetpipe.errors import RuntimeFailure

log = logging.getLogger(__name__)

_PREFILLS = (0, 1)  # two different starting values: an initialiser that sets a buffer erases the difference


def _initialise(root: nn.Module, clone: nn.Module) -> str | None:
    """Run the first initialiser ``clone`` has (see the module docstring); its name, or None."""
    for method in ("reset_buffers", "reset_running_stats"):
        fn = getattr(clone, method, None)
        if callable(fn):
            fn()
            return method
    init = getattr(root, "_init_weights", None)  # Hugging Face PreTrainedModel's per-module initialiser
    if callable(init):
        init(clone)
        return "_init_weights"
    return None


def _cpu_clone(owner: nn.Module, fill: int) -> nn.Module:
    """A shallow copy of ``owner`` whose own buffers are CPU tensors filled with ``fill``."""
    clone = copy.copy(owner)
    clone._parameters = dict(owner._parameters)  # still meta: an initialiser writing them allocates nothing
    clone._buffers = {k: None if b is None else torch.full(b.shape, fill, dtype=b.dtype, device="cpu")
                      for k, b in owner._buffers.items()}
    clone._modules = dict(owner._modules)
    return clone


def recompute_buffers(root: nn.Module, owner_name: str) -> dict[str, torch.Tensor]:
    """Every buffer of the module ``owner_name`` (local name -> CPU tensor), from its own initialiser."""
    owner = root.get_submodule(owner_name)
    runs, how = [], None
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for fill in _PREFILLS:
            clone = _cpu_clone(owner, fill)
            how = _initialise(root, clone)
            runs.append(clone._buffers)
    where = f"{owner_name or 'the root module'} ({type(owner).__name__})"
    out = {}
    for key, first in runs[0].items():
        if first is None:
            continue
        if how is None or not torch.equal(first, runs[1][key]):
            why = "has no initialiser hetpipe knows" if how is None else f"is not set by its {how}()"
            raise RuntimeFailure(
                f"buffer {f'{owner_name}.{key}' if owner_name else key!r} of {where} {why}, so its value cannot be "
                "recomputed on the stage; give the module a reset_buffers() method that fills it, build the model "
                "on a real device in the factory (small models), or pass weights that contain it")
        out[key] = first
    log.info("recomputed buffers %s of %s with %s()", sorted(out), where, how)
    return out


class ModelBuffers(Mapping[str, torch.Tensor]):
    """Qualified buffer name -> real value for ``model`` (see the module docstring); computed on first use."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._buffers = dict(model.named_buffers(remove_duplicate=False))
        self._done: dict[str, dict[str, torch.Tensor]] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        buf = self._buffers[name]
        if buf.device.type != "meta":
            return buf.detach()
        owner, _, attr = name.rpartition(".")
        if owner not in self._done:
            self._done[owner] = recompute_buffers(self.model, owner)
        return self._done[owner][attr]

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)



@contextlib.contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """Restore every buffer of ``module`` on exit (passes that must not count, e.g. timing calibration).

    Example:
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> with kept_buffers(bn):
        ...     _ = bn(torch.randn(4, 2))
        >>> bn.num_batches_tracked.item(), bn.running_mean.tolist()
        (0, [0.0, 0.0])
    """
    saved = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(saved[name])
