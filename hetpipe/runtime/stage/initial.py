"""Write a model's initial weights to a folder, so the same weights can be used anywhere.

``hetpipe run`` without ``--weights`` starts from `seeded_init` (drawn per tensor from
``--seed`` and the tensor's name, so every partition of the model starts from the same
values).  `write_initial_weights` writes exactly those (``init="seeded"``), or the
model's own initialisation, ``torch.manual_seed(seed)`` then its constructor on the CPU
(``init="model"``: the weights a plain PyTorch script gets; this builds the whole model
once, in this process).  The folder is in ``save_pretrained`` layout (``model.safetensors``,
a tied parameter once under its first name): pass it to ``hetpipe run --weights`` or load it
in plain PyTorch with ``model.load_state_dict(safetensors.torch.load_file(...), strict=False)``
(``strict=False``: a tied head is saved once, under the embedding's name).

Example:
    >>> import tempfile
    >>> from safetensors.torch import load_file
    >>> d = tempfile.mkdtemp()
    >>> path = write_initial_weights("mlp-tiny", d, seed=3)
    >>> path.name, sorted(load_file(str(path)))[:2]
    ('model.safetensors', ['layers.0.linear.bias', 'layers.0.linear.weight'])
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hetpipe.errors import ConfigError
from hetpipe.runtime.stage.weights import SAFE_WEIGHTS_NAME

INITS = ("seeded", "model")


def _seeded_state(model: str, *, seed: int, batch: int | None, seq: int | None) -> dict[str, torch.Tensor]:
    from hetpipe import models
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.runtime.stage.buffers import ModelBuffers
    from hetpipe.runtime.stage.build import build_stage, split_stages
    from hetpipe.runtime.stage.weights import saved_names

    builtin = models.takes_size(model)
    resolved = models.resolve(model, device="meta", batch=batch if builtin else None, seq=seq if builtin else None)
    if resolved.example_inputs is None:
        raise ConfigError(f"model factory {model!r} returned no example inputs; return (module, example_inputs) "
                          "so hetpipe can trace it")
    graph = capture(resolved.model, resolved.example_inputs, name=model)
    program = split_stages(graph.module, {}, example_inputs=resolved.example_inputs, num_stages=1)
    stage = build_stage(program, 0, state_dict=None, device="cpu", seed=seed,  # what every rank draws
                        buffers=ModelBuffers(models.resolve(model, device="meta", batch=batch if builtin else None,
                                                            seq=seq if builtin else None).model))
    local = dict(stage.module.named_parameters(remove_duplicate=False))
    local.update(stage.module.named_buffers(remove_duplicate=False))
    return {key: local[name].detach() for name, key in saved_names(program, 0).items()}


def _model_state(model: str, *, seed: int, batch: int | None, seq: int | None) -> dict[str, torch.Tensor]:
    from hetpipe import models

    builtin = models.takes_size(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = models.resolve(model, device="cpu", batch=batch if builtin else None,
                                seq=seq if builtin else None).model
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():  # persistent tensors only, like save_pretrained
        if t.device.type == "meta":
            raise ConfigError(f"model {model!r} left {name!r} on the meta device when built on the CPU; build "
                              "every tensor on the device the factory runs under, or use init='seeded'")
        if id(t) not in seen:  # a tied parameter once, under its first name
            seen.add(id(t))
            out[name] = t.detach()
    return out


def write_initial_weights(model: str, out_dir: str | os.PathLike[str], *, seed: int = 0, init: str = "seeded",
                          batch: int | None = None, seq: int | None = None) -> Path:
    """Write ``model``'s initial weights to ``out_dir/model.safetensors`` (see the module docstring).

    ``model`` is a built-in name or ``package.module:factory``; ``batch``/``seq`` size a
    built-in model's example (they do not change the weights).  Returns the file written.
    """
    from safetensors.torch import save_file

    if init not in INITS:
        raise ConfigError(f"init={init!r}; use one of {', '.join(INITS)}")
    make = _seeded_state if init == "seeded" else _model_state
    state = make(model, seed=seed, batch=batch, seq=seq)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create {out} ({err.strerror}); pass a writable folder") from None
    path = out / SAFE_WEIGHTS_NAME
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"format": "pt", "hetpipe_init": init, "seed": str(seed)})
    return path
