"""Training data on a rank: seeded synthetic global batches, saved batches, or a user iterable;
cut into the plan's micro-batches.

Every rank that reads data (the first and last stage of each pipeline) draws the same
global batches: `synthetic_batch` is seeded by (seed, step), a saved file is read in full,
and a ``"package.module:factory"`` iterable must yield the same batches on every rank.

Example:
    >>> [t.shape[0] for t in split_microbatches(torch.zeros(8, 3), 4, what="inputs")]
    [2, 2, 2, 2]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.models import example_targets, load_factory

_DATA_SEED_STRIDE = 1_000_003  # seed * stride + step: one independent stream per step


def _vocab_size(meta_model: nn.Module) -> int:
    for mod in meta_model.modules():
        if isinstance(mod, nn.Embedding):
            return int(mod.num_embeddings)
    raise ConfigError("the model takes integer inputs but has no nn.Embedding to size synthetic token ids; "
                      "pass --data")


def synthetic_batch(model: str, example: Sequence[torch.Tensor], *, global_batch: int, vocab: int | None,
                    seed: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Seeded (inputs, targets) of one global batch shaped like ``example`` (one meta micro-batch).

    Integer inputs are token ids in ``[0, vocab)``, float inputs standard normal; targets
    come from `hetpipe.models.example_targets`.  Every rank calling it with the same
    arguments gets the same tensors.

    Example:
        >>> ex = (torch.empty(2, 8, dtype=torch.int64, device="meta"),)
        >>> a, _ = synthetic_batch("gpt-tiny", ex, global_batch=4, vocab=256, seed=0, step=1)
        >>> b, t = synthetic_batch("gpt-tiny", ex, global_batch=4, vocab=256, seed=0, step=1)
        >>> a[0].shape, torch.equal(a[0], b[0]), torch.equal(t, torch.roll(a[0], -1, 1))
        (torch.Size([4, 8]), True, True)
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * _DATA_SEED_STRIDE + step)
        inputs = []
        for t in example:
            shape = (global_batch, *t.shape[1:])
            if t.dtype.is_floating_point:
                inputs.append(torch.randn(shape, dtype=t.dtype))
            else:
                if vocab is None:
                    raise ConfigError(f"model {model!r} takes integer inputs; pass --data")
                inputs.append(torch.randint(0, vocab, shape, dtype=t.dtype))
        targets = example_targets(model, tuple(inputs))
    return tuple(inputs), targets


def import_object(spec: str, what: str) -> Any:
    """The object ``"package.module:name"`` names (`hetpipe.models.load_factory`), errors prefixed by ``what``.

    Example:
        >>> import_object("hetpipe.models:loss_fn", "--loss").__name__
        'loss_fn'
    """
    try:
        return load_factory(spec)
    except ConfigError as err:
        raise ConfigError(f"{what}: {err}") from None


def data_stream(data: str | None, *, model: str, global_batch: int, seed: int, example: Sequence[torch.Tensor],
                meta_model: nn.Module, start: int = 0) -> Iterator[tuple[Any, Any]]:
    """Global batches (inputs, targets): synthetic (``data=None``), a file `save_data` wrote, or
    the iterable a ``"package.module:factory"`` returns (it must yield the same batches on every rank).

    ``start`` global batches are skipped (a resumed run's data position): synthetic batches are
    drawn from step ``start`` on, a file or an iterable is read past its first ``start`` items.
    """
    if data is None:
        ints = any(not t.dtype.is_floating_point for t in example)
        from hetpipe.models import input_vocab

        vocab = (input_vocab(model) or _vocab_size(meta_model)) if ints else None
        step = start
        while True:
            yield synthetic_batch(model, example, global_batch=global_batch, vocab=vocab, seed=seed, step=step)
            step += 1
    elif ":" not in data and Path(data).is_file():
        yield from itertools.islice(torch.load(data, weights_only=False), start, None)
    else:
        yield from itertools.islice(import_object(data, "--data")(), start, None)


def split_microbatches(batch: Any, microbatches: int, *, what: str) -> list[Any]:
    """Cut a global batch (a tensor or tuple of tensors) into ``microbatches`` along dim 0.

    Example:
        >>> [t.shape[0] for t in split_microbatches(torch.zeros(6, 2), 3, what="x")]
        [2, 2, 2]
    """
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    n = tensors[0].shape[0]
    if n % microbatches:
        raise ConfigError(f"{what}: batch of {n} is not divisible into {microbatches} micro-batches; "
                          f"yield global batches of {microbatches} x micro-batch size")
    # Each micro-batch gets its own storage (a chunk is a view of the whole batch): a stage keeps only
    # its in-flight micro-batches' inputs and targets, as on a GPU, where `.to(device)` copies each one
    # (the memory model counts them so; a view would hold the whole global batch in the ledger).
    parts = [[c.clone() for c in t.chunk(microbatches)] for t in tensors]
    mbs = [tuple(p[i] for p in parts) for i in range(microbatches)]
    return [m[0] for m in mbs] if isinstance(batch, torch.Tensor) else mbs
