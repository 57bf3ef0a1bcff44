"""Deterministic gpt-tiny batches for tests/test_supervise.py, optionally slowed per batch.

`slow_batches` is a ``--data`` factory: each global batch is yielded after
``HETPIPE_TEST_DATA_DELAY_S`` seconds (an environment variable the workers inherit), so that
a test can act on a step of a still running job; the batches do not depend on the delay.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import torch

BATCH, SEQ, MICROBATCHES, VOCAB, STEPS_MAX = 2, 16, 4, 256, 256
DELAY_ENV = "HETPIPE_TEST_DATA_DELAY_S"


def batches(n: int = STEPS_MAX) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches of token ids and next-token targets (seeded)."""
    gen = torch.Generator().manual_seed(9)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH * MICROBATCHES, SEQ), generator=gen)
        out.append((ids, torch.roll(ids, -1, 1)))
    return out


def slow_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`batches`, each after the environment's delay."""
    delay_s = float(os.environ.get(DELAY_ENV, "0"))
    for item in batches():
        time.sleep(delay_s)
        yield item
