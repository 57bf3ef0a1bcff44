"""Hugging Face transformers models, built from a config with no network access.

Two ways to name one wherever hetpipe takes a MODEL (``hetpipe plan/run``, `resolve`):

* a **built-in tiny config**: ``hf-llama-tiny``, ``hf-qwen2-tiny``, ``hf-gpt2-tiny``,
  ``hf-bert-mlm-tiny``, ``hf-bert-tiny`` (the base model), ``hf-t5-tiny`` (`HF_ZOO`);
* a **local config**: ``hf:path/to/config.json`` or ``hf:path/to/model_dir`` (its
  ``config.json``); the model class is the config's ``architectures[0]``, or name it
  with ``hf:path/to/config.json#BertForMaskedLM``.  Read with ``AutoConfig.for_model``,
  nothing is downloaded.

The model is built with ``cls(config)`` under ``torch.device(device)`` (meta: no memory)
and traced with ``torch.export``; capture runs it with ``use_cache=False`` and
``return_dict=True`` (`hetpipe.partitioner.capture.export`), so the last stage returns
the model's ``ModelOutput``.  Tasks, inputs, synthetic targets and losses (`loss_fn`):

===========  ====================================  =================================  ==========================
task         classes                               inputs / targets                   loss
===========  ====================================  =================================  ==========================
``causal``   ``*ForCausalLM``, ``*LMHeadModel``    ids; the next token                 `lm_loss` on ``.logits``
``mlm``      ``*ForMaskedLM``                      ids; the ids themselves             `lm_loss` on ``.logits``
``seq2seq``  encoder-decoder (T5), via             (ids, decoder ids); the next        `lm_loss` on the logits
             `Seq2SeqTraining`                     decoder token
``hidden``   base models (``BertModel``)           ids; N(0, 1) of the hidden shape    `hidden_loss` (MSE)
===========  ====================================  =================================  ==========================

Encoder-decoder models take two positional inputs, which their ``forward`` does not
(T5's second parameter is ``attention_mask``): `Seq2SeqTraining` wraps the class in a
subclass whose ``forward(input_ids, decoder_input_ids)`` returns the logits; the
parameter names are the original ones, so checkpoints load unchanged.  Dropout makes
a pipelined run differ from a single-device one (different random streams): the tiny
configs set every dropout to 0.

Example:
    >>> model, (ids,) = build_hf("hf-llama-tiny", device="meta", batch=2, seq=8)
    >>> type(model).__name__, tuple(ids.shape), task_of("hf-llama-tiny")
    ('LlamaForCausalLM', (2, 8), 'causal')
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetpipe.errors import ConfigError

log = logging.getLogger(__name__)

HF_PREFIX = "hf:"
DEFAULT_BATCH = 2
DEFAULT_SEQ = 32
_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
_SMALL = {"vocab_size": 128, "max_position_embeddings": 64}

# name -> (class, config dict, description).  Sizes: hidden 32, 2-3 layers, vocab 128.
HF_ZOO: dict[str, tuple[str, dict[str, Any], str]] = {
    "hf-llama-tiny": ("LlamaForCausalLM", dict(
        model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, **_SMALL), "HF LlamaForCausalLM: 3 layers, h=32, GQA 4/2"),
    "hf-qwen2-tiny": ("Qwen2ForCausalLM", dict(
        model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, **_SMALL), "HF Qwen2ForCausalLM: 3 layers, h=32, tied"),
    "hf-gpt2-tiny": ("GPT2LMHeadModel", dict(
        model_type="gpt2", n_embd=32, n_layer=3, n_head=4, n_positions=64, vocab_size=128, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), "HF GPT2LMHeadModel: 3 layers, h=32, tied"),
    "hf-bert-mlm-tiny": ("BertForMaskedLM", dict(
        model_type="bert", hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        **_NO_DROPOUT, **_SMALL), "HF BertForMaskedLM: 3 layers, h=32, tied decoder"),
    "hf-bert-tiny": ("BertModel", dict(
        model_type="bert", hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        **_NO_DROPOUT, **_SMALL), "HF BertModel (no head): 3 layers, h=32, MSE on last_hidden_state"),
    "hf-t5-tiny": ("T5ForConditionalGeneration", dict(
        model_type="t5", d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, vocab_size=128, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
        "HF T5ForConditionalGeneration via Seq2SeqTraining: 2+2 layers, d=32"),
}


def is_hf(spec: str) -> bool:
    """Whether ``spec`` names a Hugging Face model (a tiny built-in or ``hf:PATH``).

    Example:
        >>> is_hf("hf-bert-tiny"), is_hf("hf:cfg/config.json"), is_hf("gpt-tiny")
        (True, True, False)
    """
    return spec in HF_ZOO or spec.startswith(HF_PREFIX)


def takes_size(spec: str) -> bool:
    """Whether `hetpipe.models.resolve` sizes ``spec``'s inputs with batch/seq (built-in and HF models do).

    Example:
        >>> takes_size("gpt-tiny"), takes_size("hf:cfg.json"), takes_size("pkg.mod:factory")
        (True, True, False)
    """
    return ":" not in spec or is_hf(spec)


def input_vocab(spec: str) -> int | None:
    """Vocabulary of a Hugging Face model's token ids (None for others: read it from the nn.Embedding)."""
    return vocab_size(spec) if is_hf(spec) else None


def _read_config(spec: str) -> tuple[dict[str, Any], str | None]:
    """(config dict, class name or None) of ``hf:PATH[#Class]``."""
    path_text, _, cls_name = spec[len(HF_PREFIX):].partition("#")
    path = Path(path_text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"model {spec!r}: no config file at {str(path)!r}; use hf:path/to/config.json or "
                          "hf:path/to/model_dir (holding config.json), optionally with #ModelClass")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"model {spec!r}: {path} is not a readable JSON config ({err})") from err
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"model {spec!r}: {path} has no 'model_type'; write the config with "
                          "config.save_pretrained(dir) or add \"model_type\": \"llama\" (or bert, t5, ...)")
    return data, cls_name or None


@functools.lru_cache(maxsize=32)
def config_and_class(spec: str) -> tuple[Any, str]:
    """(transformers config, model class name) of a zoo name or ``hf:PATH[#Class]``."""
    from transformers import AutoConfig

    if spec in HF_ZOO:
        cls_name, data, _ = HF_ZOO[spec]
        data = dict(data)
    else:
        data, cls_name = _read_config(spec)
        archs = data.get("architectures") or []
        cls_name = cls_name or (archs[0] if archs else None)
        if cls_name is None:
            raise ConfigError(f"model {spec!r}: the config has no 'architectures'; name the class: {spec}#"
                              "LlamaForCausalLM (any transformers model class)")
    data.pop("architectures", None)
    try:
        config = AutoConfig.for_model(data.pop("model_type"), **data)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"model {spec!r}: transformers cannot build its config ({err})") from err
    return config, cls_name


def task_of(spec: str) -> str:
    """``causal``, ``mlm``, ``seq2seq`` or ``hidden`` (see the module docstring)."""
    if spec in HF_ZOO:  # without importing transformers (``hetpipe models`` lists them)
        return _class_task(spec, HF_ZOO[spec][0], HF_ZOO[spec][0].endswith("ForConditionalGeneration"))
    config, cls_name = config_and_class(spec)
    return _class_task(spec, cls_name, bool(getattr(config, "is_encoder_decoder", False)))


def _class_task(spec: str, cls_name: str, encoder_decoder: bool) -> str:
    if encoder_decoder:
        return "seq2seq"
    if cls_name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    if cls_name.endswith("ForMaskedLM"):
        return "mlm"
    if cls_name.endswith("Model"):
        return "hidden"
    raise ConfigError(f"model {spec!r}: hetpipe has no task for {cls_name}; use a *ForCausalLM, *ForMaskedLM, "
                      "encoder-decoder or base *Model class, or a package.module:factory with --loss")


def _seq2seq_forward(self: Any, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
    base = type(self).hf_base
    return base.forward(self, input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False,
                        return_dict=True).logits


@functools.lru_cache(maxsize=None)
def Seq2SeqTraining(cls: type) -> type:  # noqa: N802 - a class factory, named like the class it returns
    """``cls`` with ``forward(input_ids, decoder_input_ids) -> logits``: an encoder-decoder as two positional inputs.

    Example:
        >>> import transformers
        >>> Seq2SeqTraining(transformers.T5ForConditionalGeneration).__name__
        'T5ForConditionalGenerationSeq2SeqTraining'
    """
    return type(f"{cls.__name__}Seq2SeqTraining", (cls,), {"forward": _seq2seq_forward, "hf_base": cls,
                                                             "__module__": __name__})


def model_class(spec: str) -> type:
    """The transformers class ``spec`` builds (wrapped by `Seq2SeqTraining` for encoder-decoders)."""
    import transformers

    config, cls_name = config_and_class(spec)
    cls = getattr(transformers, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ConfigError(f"model {spec!r}: {cls_name!r} is not a transformers model class; name one with "
                          "#ClassName, e.g. #LlamaForCausalLM")
    return Seq2SeqTraining(cls) if getattr(config, "is_encoder_decoder", False) else cls


def _max_positions(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return None


def build_hf(spec: str, *, device: str | torch.device = "meta", batch: int | None = None, seq: int | None = None,
             dtype: torch.dtype | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """(model on ``device``, one random micro-batch of token ids) for a zoo name or ``hf:PATH``."""
    config, _ = config_and_class(spec)
    b, t = batch or DEFAULT_BATCH, seq or min(DEFAULT_SEQ, _max_positions(config) or DEFAULT_SEQ)
    limit = _max_positions(config)
    if b < 1 or t < 1 or (limit is not None and t > limit):
        raise ConfigError(f"model {spec!r}: batch={b}, seq={t}; both must be >= 1 and seq <= {limit}")
    with torch.device(device):
        model = model_class(spec)(config)
    if dtype is not None:
        model = model.to(dtype=dtype)
    ids = torch.randint(0, config.vocab_size, (b, t), device=device)
    inputs = (ids, torch.randint(0, config.vocab_size, (b, t), device=device)) if task_of(spec) == "seq2seq" else (ids,)
    return model, inputs


def vocab_size(spec: str) -> int:
    """The vocabulary synthetic token ids are drawn from."""
    return int(config_and_class(spec)[0].vocab_size)


def example_targets(spec: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Synthetic targets for ``inputs`` by task (the module docstring's table), on the inputs' device."""
    task = task_of(spec)
    if task == "causal":
        return torch.roll(inputs[0], shifts=-1, dims=1)
    if task == "mlm":
        return inputs[0].clone()
    if task == "seq2seq":
        return torch.roll(inputs[1], shifts=-1, dims=1)
    hidden = config_and_class(spec)[0].hidden_size
    return torch.randn(*inputs[0].shape, hidden, device=inputs[0].device)


def _field(output: Any, name: str) -> torch.Tensor:
    """``output.name`` of a ModelOutput / dict, or the tensor itself, or its first element."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and name in output:
        return output[name]
    if hasattr(output, name):
        return getattr(output, name)
    return output[0]


def lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``output.logits`` (or a logits tensor) against token ids.

    Example:
        >>> round(lm_loss({"logits": torch.zeros(1, 2, 4)}, torch.zeros(1, 2, dtype=torch.long)).item(), 4)
        1.3863
    """
    logits = _field(output, "logits")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def hidden_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error of ``output.last_hidden_state`` against ``targets``.

    Example:
        >>> hidden_loss({"last_hidden_state": torch.ones(1, 2, 3)}, torch.zeros(1, 2, 3)).item()
        1.0
    """
    return F.mse_loss(_field(output, "last_hidden_state"), targets)


def loss_fn(spec: str) -> Any:
    """The loss of ``spec``'s task (module-level, importable by worker processes)."""
    return hidden_loss if task_of(spec) == "hidden" else lm_loss


def describe(spec: str) -> str:
    """One line for ``hetpipe models``."""
    return HF_ZOO[spec][2] if spec in HF_ZOO else f"Hugging Face model from {spec[len(HF_PREFIX):]}"
