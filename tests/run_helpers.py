"""Helpers imported by worker processes in `tests/test_run_cli.py` (they must be importable by name)."""

from __future__ import annotations

import os
import signal

from hetpipe.models import lm_loss

# The loss call on which `lm_loss_then_die` kills its own process: 4 micro-batches per
# step without emulation (no calibration passes), so call 6 is step 1's second micro-batch.
DIE_AT_CALL = 6
_calls = 0


def lm_loss_then_die(logits, targets):  # noqa: ANN001, ANN201 - a loss_fn(output, targets)
    """The LM loss, except that the process SIGKILLs itself mid-step (a crashed rank)."""
    global _calls
    _calls += 1
    if _calls == DIE_AT_CALL:
        os.kill(os.getpid(), signal.SIGKILL)
    return lm_loss(logits, targets)
