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

from tests.reference_loop import BATCH, MICROBATCHES, SEQ, seeded_batches

__all__ = ["BATCH", "MICROBATCHES", "SEQ", "batches", "slow_batches"]

STEPS_MAX = 256
DELAY_ENV = "HETPIPE_TEST_DATA_DELAY_S"


def batches(n: int = STEPS_MAX) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches of token ids and next-token targets (seeded)."""
    return seeded_batches(n, seed=9)


def slow_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`batches`, each after the environment's delay."""
    delay_s = float(os.environ.get(DELAY_ENV, "0"))
    for item in batches():
        time.sleep(delay_s)
        yield item
