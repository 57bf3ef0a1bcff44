"""Fixtures shared across test files: one multi-process run that several files assert on.

A launch costs every rank a torch import, a capture and a stage build (seconds each on a loaded
2-core machine), so a run whose report two tests read is launched once per session.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def plain_peak_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, object]]:
    """``get(model, batch, seq) -> (plan path, RunReport)``: 2 steps of the 3-stage plan of
    `tests.test_memory_truth._plan` (no recomputation), launched once per (model, batch, seq).

    tests/test_memory_truth.py checks its measured peaks against the plan; tests/test_recompute_runtime.py
    compares the same plan's peaks with a recomputing copy's.  Peak held bytes are the executor's
    ledger (deterministic), so both may read one run.
    """
    from hetpipe.runtime.run import run
    from tests.test_memory_truth import _plan

    runs: dict[tuple[str, int, int | None], tuple[Path, object]] = {}

    def get(model: str, batch: int, seq: int | None) -> tuple[Path, object]:
        key = (model, batch, seq)
        if key not in runs:
            path = _plan(model, batch, seq, tmp_path_factory.mktemp(f"plain-{model}"))
            runs[key] = (path, run(path, model=model, steps=2, seq=seq, timeout_s=90.0))
        return runs[key]

    return get
