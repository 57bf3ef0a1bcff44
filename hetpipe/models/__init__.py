"""The built-in model zoo: named models with example inputs, targets and losses.

Every model is randomly initialised (nothing is downloaded) and constructed
under ``torch.device(device)``, so on the default ``"meta"`` device no memory is
allocated and even ``llama-7b`` builds in well under a second.  Random values
(weights, token ids, images, targets) come from torch's global RNG: call
``torch.manual_seed`` first for reproducible runs.

Tasks and their losses (`loss_fn`, all with mean reduction):

- ``"lm"``: token ids ``(batch, seq)`` int64 -> logits ``(batch, seq, vocab)``;
  targets are the next token, cross-entropy over the flattened tokens.
- ``"image"``: images ``(batch, 3, H, W)`` -> logits ``(batch, classes)``;
  targets are class indices, cross-entropy.
- ``"regression"``: ``x`` -> a tensor of ``x``'s shape; targets are Gaussian
  noise of that shape, mean squared error.

Tracers (checked in ``tests/test_models.py``): ``torch.fx.symbolic_trace`` and
``torch.export.export(strict=False)`` both work on every built-in model; the Llama
rotary tables are cut with ``torch.narrow`` for that reason (see `hetpipe.models.llama`).

`resolve` also accepts ``"package.module:factory"``, where ``factory()`` returns an
``nn.Module`` or ``(nn.Module, example_inputs)``, and Hugging Face models: the tiny
``hf-*`` configs and ``hf:path/to/config.json[#Class]`` (`hetpipe.models.hf`).

Example:
    >>> model, (ids,) = build("gpt-tiny", batch=2, seq=16)
    >>> ids.shape, ids.dtype, ids.device.type
    (torch.Size([2, 16]), torch.int64, 'meta')
    >>> targets = example_targets("gpt-tiny", (ids,))
    >>> loss_fn("gpt-tiny")(model(ids), targets).shape
    torch.Size([])
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.models import hf
from hetpipe.models.losses import classification_loss, lm_loss, regression_loss
from hetpipe.models.hf import input_vocab, takes_size  # noqa: F401 - public here
from hetpipe.models.gpt import GPT, GPTConfig
from hetpipe.models.llama import Llama, LlamaConfig
from hetpipe.models.mlp import MLP, MLPConfig
from hetpipe.models.resnet import ResNet, ResNetConfig
from hetpipe.models.unet import UNet, UNetConfig

Task = Literal["lm", "image", "regression", "causal", "mlm", "seq2seq", "hidden"]  # the last four: hf.task_of
ModelConfig = GPTConfig | LlamaConfig | ResNetConfig | UNetConfig | MLPConfig

__all__ = [
    "ModelSpec",
    "ResolvedModel",
    "build",
    "example_targets",
    "list_models",
    "lm_loss",
    "classification_loss",
    "loss_fn",
    "regression_loss",
    "resolve",
]


@dataclass(frozen=True)
class ModelSpec:
    """What the zoo knows about one built-in model.

    Attributes:
        name: the name `build` takes (``"gpt2-small"``).
        description: one line for ``hetpipe inspect`` listings.
        task: ``"lm"``, ``"image"`` or ``"regression"`` (see the module docstring).
        default_batch: batch size of the example inputs when `build` gets none.
        default_seq: sequence length of the example inputs (``None`` for non-``lm`` models).

    Example:
        >>> [s.name for s in list_models() if s.task == "image"]
        ['resnet50', 'resnet-tiny']
    """

    name: str
    description: str
    task: Task
    default_batch: int
    default_seq: int | None


@dataclass(frozen=True)
class _Entry:
    """A registry row: the public spec plus what building needs."""

    spec: ModelSpec
    config: ModelConfig
    make: Callable[[Any], nn.Module]  # config -> model, called under torch.device(device)


def _lm(name: str, description: str, cfg: GPTConfig | LlamaConfig, *, batch: int, seq: int) -> _Entry:
    make: Callable[[Any], nn.Module] = GPT if isinstance(cfg, GPTConfig) else Llama
    return _Entry(ModelSpec(name, description, "lm", batch, seq), cfg, make)


_ENTRIES: tuple[_Entry, ...] = (
    _lm("gpt2-small", "GPT-2 small: 12 layers, h=768, 12 heads, vocab 50257, ctx 1024, tied head (124.4M)",
        GPTConfig(n_layer=12, n_embd=768, n_head=12), batch=8, seq=1024),
    _lm("gpt2-medium", "GPT-2 medium: 24 layers, h=1024, 16 heads, tied head (354.8M)",
        GPTConfig(n_layer=24, n_embd=1024, n_head=16), batch=8, seq=1024),
    _lm("gpt2-xl", "GPT-2 XL: 48 layers, h=1600, 25 heads, tied head (1.56B)",
        GPTConfig(n_layer=48, n_embd=1600, n_head=25), batch=4, seq=1024),
    _lm("gpt-tiny", "test GPT: 4 layers, h=64, 4 heads, vocab 256, ctx 64",
        GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_ctx=64), batch=4, seq=64),
    _lm("gpt-demo", "demo GPT: 8 layers, h=128, 4 heads, vocab 512, ctx 128",
        GPTConfig(n_layer=8, n_embd=128, n_head=4, vocab_size=512, n_ctx=128), batch=8, seq=128),
    # Llama 3.2 1B ties its head to the embedding (tie_word_embeddings in its config); so do we.
    # max_seq 8192: its pre-training context before long-context extension.
    _lm("llama-1b", "Llama-3.2-1B-like: 16 layers, h=2048, 32 heads / 8 kv, ffn 8192, vocab 128256, tied (1.24B)",
        LlamaConfig(n_layer=16, dim=2048, n_head=32, n_kv_head=8, ffn_dim=8192, vocab_size=128256,
                    max_seq=8192, rope_theta=500000.0, tie_embeddings=True), batch=4, seq=2048),
    _lm("llama-7b", "Llama-2-7B: 32 layers, h=4096, 32 heads, ffn 11008, vocab 32000, ctx 4096 (6.74B)",
        LlamaConfig(n_layer=32, dim=4096, n_head=32, n_kv_head=32, ffn_dim=11008, vocab_size=32000,
                    max_seq=4096), batch=1, seq=4096),
    _lm("llama-tiny", "test Llama: 4 layers, h=64, 4 heads / 2 kv, ffn 176, vocab 256, ctx 64, untied",
        LlamaConfig(n_layer=4, dim=64, n_head=4, n_kv_head=2, ffn_dim=176, vocab_size=256, max_seq=64),
        batch=4, seq=64),
    _Entry(ModelSpec("resnet50", "ResNet-50 (v1.5 bottlenecks, torchvision layout), 224x224, 1000 classes (25.6M)",
                     "image", 32, None), ResNetConfig(blocks=(3, 4, 6, 3)), ResNet),
    _Entry(ModelSpec("resnet-tiny", "test ResNet: 4 bottlenecks, widths 8-64, 32x32, 10 classes",
                     "image", 8, None),
           ResNetConfig(blocks=(1, 1, 1, 1), base_width=8, num_classes=10, stem="cifar", image_size=32), ResNet),
    _Entry(ModelSpec("unet-tiny", "test U-Net: 2 levels, widths 8-32, 3x32x32 -> 3x32x32 regression",
                     "regression", 4, None), UNetConfig(), UNet),
    _Entry(ModelSpec("mlp-tiny", "test MLP: 8 x Linear(64, 64) + ReLU, 64 -> 64 regression",
                     "regression", 32, None), MLPConfig(dim=64, n_layer=8), MLP),
)
_REGISTRY: dict[str, _Entry] = {e.spec.name: e for e in _ENTRIES}


def list_models() -> tuple[ModelSpec, ...]:
    """Every built-in model, in listing order.

    Example:
        >>> "gpt2-small" in [s.name for s in list_models()]
        True
    """
    hf_specs = tuple(ModelSpec(n, hf.describe(n), hf.task_of(n), hf.DEFAULT_BATCH, hf.DEFAULT_SEQ)  # type: ignore[arg-type]
                     for n in hf.HF_ZOO)
    return tuple(e.spec for e in _ENTRIES) + hf_specs


def _entry(name: str) -> _Entry:
    """The registry row for ``name`` or a ConfigError naming the choices."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    names = [spec.name for spec in list_models()]  # the hf-* ones too: every name `build` takes
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f" did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"unknown model {name!r};{hint} built-in models: {', '.join(names)} (`hetpipe models` describes them;"
        " or pass 'package.module:factory' for your own model)"
    )


def _check_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"invalid device {device!r} ({err}); use e.g. 'meta', 'cpu' or 'cuda:0'") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available; use 'cpu' or 'meta'")
    return dev


def _check_size(what: str, value: int | None, default: int, *, limit: int | None = None) -> int:
    size = default if value is None else value
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    if limit is not None and size > limit:
        raise ConfigError(f"{what}={size} exceeds the model's maximum context of {limit}; use {what} <= {limit}")
    return size


def _max_seq(cfg: ModelConfig) -> int:
    if isinstance(cfg, GPTConfig):
        return cfg.n_ctx
    assert isinstance(cfg, LlamaConfig)
    return cfg.max_seq


def _inputs(entry: _Entry, *, batch: int, seq: int | None, device: torch.device,
            dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Random example inputs of the model's input shape."""
    cfg, name = entry.config, entry.spec.name
    if entry.spec.task == "lm":
        assert isinstance(cfg, (GPTConfig, LlamaConfig)) and entry.spec.default_seq is not None
        t = _check_size("seq", seq, entry.spec.default_seq, limit=_max_seq(cfg))
        return (torch.randint(0, cfg.vocab_size, (batch, t), dtype=torch.int64, device=device),)
    if seq is not None:
        raise ConfigError(f"seq applies to language models only; {name!r} is a {entry.spec.task} model")
    if isinstance(cfg, (ResNetConfig, UNetConfig)):
        channels = 3 if isinstance(cfg, ResNetConfig) else cfg.in_channels
        shape: tuple[int, ...] = (batch, channels, cfg.image_size, cfg.image_size)
    else:
        assert isinstance(cfg, MLPConfig)
        shape = (batch, cfg.dim)
    return (torch.randn(shape, dtype=dtype, device=device),)


def build(
    name: str,
    *,
    device: str | torch.device = "meta",
    batch: int | None = None,
    seq: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Construct a built-in model and random example inputs on ``device``.

    Args:
        name: a name from `list_models`.
        device: where parameters and inputs live; ``"meta"`` allocates nothing.
        batch: example batch size (default: the spec's ``default_batch``).
        seq: sequence length for ``lm`` models (default: ``default_seq``; at most the context).
        dtype: floating dtype of parameters, buffers (incl. rotary tables) and float inputs;
            token ids are always int64.

    Raises:
        ConfigError: unknown name, bad device, dtype or sizes.

    Example:
        >>> model, (x,) = build("resnet-tiny", batch=3)
        >>> x.shape, model(x).shape
        (torch.Size([3, 3, 32, 32]), torch.Size([3, 10]))
    """
    if hf.is_hf(name):
        return hf.build_hf(name, device=_check_device(device), batch=batch, seq=seq, dtype=dtype)
    entry = _entry(name)
    dev = _check_device(device)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
    b = _check_size("batch", batch, entry.spec.default_batch)
    inputs = _inputs(entry, batch=b, seq=seq, device=dev, dtype=dtype)
    with torch.device(dev):
        model = entry.make(entry.config)
    return model.to(dtype=dtype), inputs


def _task(name: str) -> Task:
    return _entry(name).spec.task


def example_targets(
    name: str, inputs: tuple[torch.Tensor, ...], *, num_classes: int | None = None
) -> torch.Tensor:
    """Synthetic targets for `build`'s inputs, shaped for `loss_fn` (same device as the inputs).

    - ``lm``: the next token, i.e. the ids shifted one position left (the last position wraps
      around to the first token): ``(batch, seq)`` int64.
    - ``image``: uniform class indices ``(batch,)`` int64 in ``[0, num_classes)``;
      ``num_classes`` defaults to the model's classifier width.
    - ``regression``: standard-normal noise of the input's shape and dtype.

    ``num_classes`` only applies to image models (lm targets come from the ids).

    Example:
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> example_targets("gpt-tiny", (ids,))
        tensor([[2, 3, 1]])
        >>> example_targets("resnet-tiny", (torch.zeros(4, 3, 32, 32),), num_classes=2).shape
        torch.Size([4])
    """
    if hf.is_hf(name):
        return hf.example_targets(name, inputs)
    entry = _entry(name)
    if not inputs or not isinstance(inputs[0], torch.Tensor):
        raise ConfigError(f"example_targets({name!r}) needs the inputs tuple from build(), got {inputs!r}")
    x, task = inputs[0], entry.spec.task
    if num_classes is not None and task != "image":
        raise ConfigError(f"num_classes applies to image models only; {name!r} is a {task} model")
    if task == "lm":
        if x.dim() != 2 or x.dtype != torch.int64:
            raise ConfigError(f"{name!r} expects token ids of shape (batch, seq) int64, got {tuple(x.shape)} {x.dtype}")
        return torch.roll(x, shifts=-1, dims=1)
    if task == "image":
        assert isinstance(entry.config, ResNetConfig)
        n = _check_size("num_classes", num_classes, entry.config.num_classes)
        return torch.randint(0, n, (x.shape[0],), dtype=torch.int64, device=x.device)
    return torch.randn_like(x)


_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "lm": lm_loss,
    "image": classification_loss,
    "regression": regression_loss,
}


def loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss for a built-in model's task (a picklable module-level function).

    Example:
        >>> loss_fn("gpt2-small") is lm_loss, loss_fn("mlp-tiny") is regression_loss
        (True, True)
    """
    return hf.loss_fn(name) if hf.is_hf(name) else _LOSSES[_task(name)]


def training_loss(name: str, inputs: tuple[torch.Tensor, ...]) -> tuple[Callable[..., torch.Tensor], torch.Tensor]:
    """(loss function, one micro-batch of targets) of a built-in model, for `capture` to cost the loss.

    Example:
        >>> fn, targets = training_loss("gpt-tiny", (torch.zeros(2, 8, dtype=torch.long, device="meta"),))
        >>> fn is lm_loss, tuple(targets.shape)
        (True, (2, 8))
    """
    return loss_fn(name), example_targets(name, inputs)


@dataclass(frozen=True)
class ResolvedModel:
    """A model named on the command line, ready to capture.

    Attributes:
        name: the spec as given (a built-in name or ``"package.module:factory"``).
        model: the module.
        example_inputs: inputs to trace with; ``None`` when a factory returned only a module.
        spec: the built-in's `ModelSpec`, ``None`` for a factory.

    Example:
        >>> r = resolve("mlp-tiny", batch=2)
        >>> r.spec.task, r.example_inputs[0].shape
        ('regression', torch.Size([2, 64]))
    """

    name: str
    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...] | None
    spec: ModelSpec | None


@contextmanager
def _cwd_on_path() -> Iterator[None]:
    """Temporarily put the working directory on ``sys.path`` (console scripts leave it off)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def _import_module(spec: str, module_name: str) -> ModuleType:
    try:
        with _cwd_on_path():
            return importlib.import_module(module_name)
    except Exception as err:  # ImportError, or anything the module raises at import time
        raise ConfigError(
            f"model spec {spec!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}); "
            "check the spelling and that the package is installed or on PYTHONPATH"
        ) from err


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``"package.module:factory"`` (``factory`` may be dotted): the one loader
    for model factories, ``--loss`` functions and ``--data`` iterables.

    Example:
        >>> load_factory("hetpipe.models.mlp:MLP").__name__
        'MLP'
        >>> load_factory("hetpipe.models.mlp")
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: model spec 'hetpipe.models.mlp' is malformed; expected 'package.module:factory'
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigError(f"model spec {spec!r} is malformed; expected 'package.module:factory'")
    obj: Any = _import_module(spec, module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"model spec {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"model spec {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable factory")
    return obj


def _normalise_inputs(spec: str, raw: Any) -> tuple[torch.Tensor, ...]:
    items = (raw,) if isinstance(raw, torch.Tensor) else raw
    if not isinstance(items, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in items):
        raise ConfigError(
            f"model spec {spec!r}: example_inputs must be a tensor or a tuple of tensors, "
            f"got {type(raw).__name__}"
        )
    return tuple(items)


def _call_factory(spec: str, *, device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, ...] | None]:
    """Call the factory under ``torch.device(device)`` and check what it returned."""
    factory = load_factory(spec)
    try:
        with torch.device(device):
            result = factory()
    except Exception as err:
        raise ConfigError(f"model spec {spec!r}: the factory raised {type(err).__name__}: {err}") from err
    if isinstance(result, nn.Module):
        return result, None
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], nn.Module):
        return result[0], _normalise_inputs(spec, result[1])
    raise ConfigError(
        f"model spec {spec!r}: the factory returned {type(result).__name__}; "
        "expected an nn.Module or (nn.Module, example_inputs)"
    )


def resolve(
    spec: str,
    *,
    device: str | torch.device = "meta",
    batch: int | None = None,
    seq: int | None = None,
    dtype: torch.dtype | None = None,
) -> ResolvedModel:
    """Build a built-in model by name, or call a user factory given as ``"package.module:factory"``.

    A factory is called with no arguments under ``torch.device(device)`` (so plain
    ``nn.Module`` construction lands on ``device``) and must return an ``nn.Module`` or
    ``(nn.Module, example_inputs)`` with a tensor or a tuple/list of tensors.  ``batch`` and
    ``seq`` only size built-in models; ``dtype`` (default: float32 / as the factory made it)
    casts the model (and, for factories, floating example inputs).

    Raises:
        ConfigError: unknown name; a factory that cannot be imported, does not exist, raises,
            or returns something else.

    Example:
        >>> resolve("gpt-tiny").model.cfg.n_layer
        4
        >>> resolve("hetpipe.models.mlp:MLP").example_inputs is None  # MLP() uses its default config
        True
    """
    if hf.is_hf(spec):
        return ResolvedModel(spec, *build(spec, device=device, batch=batch, seq=seq, dtype=dtype), None)
    if ":" not in spec:
        model, inputs = build(spec, device=device, batch=batch, seq=seq, dtype=dtype or torch.float32)
        return ResolvedModel(spec, model, inputs, _entry(spec).spec)
    if batch is not None or seq is not None:
        raise ConfigError(
            f"batch/seq only size built-in models; make the factory in {spec!r} return inputs of the size you want"
        )
    model, inputs = _call_factory(spec, device=_check_device(device))
    if dtype is not None:
        model = model.to(dtype=dtype)
        if inputs is not None:
            inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    return ResolvedModel(spec, model, inputs, None)
