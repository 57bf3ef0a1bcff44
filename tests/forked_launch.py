"""`hetpipe run` with its ranks forked from the test fork server instead of started by torchrun.

`forked_launch` takes the place of `hetpipe.runtime.launch.launch` (`use_forked_launch` patches it where
`hetpipe.runtime.run` calls it): everything else of ``hetpipe run`` is the real path -- the CLI,
preflight, the run folder, the data and weights files, the report merge, ``--save-weights`` -- and every
rank runs the worker's own ``main`` on the same argv (`hetpipe.runtime.launch.worker_args`), with the
environment torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, one
OpenMP thread).  The ranks join the gloo group `tests.dist_helpers.run_world` opens (the worker's
`join_process_group` reuses an initialised group) and fork from a server that imported torch and the runtime
once, so a 3-rank launch skips torchrun (~2.5 s of CPU) and each rank's imports (~2-3 s of CPU each).

Use it where a test's claim is what the ranks compute (losses, weights, memory), not how torchrun starts
or tears down a job: failure teardown, watchdogs and killed ranks stay on `launch` (tests/test_run_cli.py,
the fault and supervise tests), and every feature keeps at least one real torchrun launch.

    >>> _rank_env(1, 3)["LOCAL_WORLD_SIZE"]
    '3'
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from hetpipe.errors import RuntimeFailure
from hetpipe.runtime.launch import LaunchOutcome, LaunchSpec, first_error, worker_args
from tests.dist_helpers import run_world
from tests.machine_load import load_per_core, scaled_limit_s

#: Start-up and teardown allowance on top of the ranks' own wait bound (``--timeout``), on an idle machine:
#: forked ranks import nothing heavy, so a fraction of `hetpipe.runtime.launch`'s torchrun start-up bound.
STARTUP_S = 60.0


def _rank_env(rank: int, world_size: int) -> dict[str, str]:
    """What torchrun's ``--standalone`` single-node launch sets for a rank (the part the worker reads)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "OMP_NUM_THREADS": "1"}


def _worker_rank(rank: int, world_size: int, argv: list[str], environ: dict[str, str]) -> int:
    """One rank of the job: the worker's ``main`` (it exits the process itself after writing an error file).

    ``environ`` is the launching process's environment now, as torchrun's ranks inherit it (the fork server's
    own is the one it started with: a variable a test set since would be missing)."""
    os.environ.clear()
    os.environ.update({**environ, **_rank_env(rank, world_size)})
    from hetpipe.runtime import worker

    return worker.main(argv)


def forked_launch(spec: LaunchSpec, *, env: dict[str, str] | None = None) -> LaunchOutcome:
    """`hetpipe.runtime.launch.launch`'s contract on forked ranks: the outcome, or `RuntimeFailure` naming the
    first rank error (`first_error`, as a torchrun launch reports it)."""
    assert not env, "forked_launch takes no extra environment (use the real launch)"
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    timeout_s = scaled_limit_s(spec.timeout_s + STARTUP_S, load_per_core=load_per_core())
    outcomes = run_world(_worker_rank, world_size=spec.nproc, args=(worker_args(spec), dict(os.environ)),
                         timeout_s=timeout_s, out_dir=spec.run_dir / "forked", fail_fast=True)
    failed = [o for o in outcomes if o.exitcode != 0 or o.error_type is not None]
    if failed:
        detail = "; ".join(f"rank {o.rank}: exit {o.exitcode} {o.error_type or ''} {o.error or ''}".strip()
                           for o in failed)
        raise RuntimeFailure(f"{first_error(spec.run_dir, '')} ({detail})")
    return LaunchOutcome(0, time.time() - started, spec.run_dir / "forked", "")


def use_forked_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``hetpipe run`` (CLI or `hetpipe.runtime.run.run`) of the calling test launches with `forked_launch`."""
    monkeypatch.setattr("hetpipe.runtime.run.launch", forked_launch)


@contextmanager
def forked_launches() -> Iterator[None]:
    """`use_forked_launch` for a block (a session fixture, which cannot take the per-test ``monkeypatch``)."""
    with pytest.MonkeyPatch.context() as patch:
        use_forked_launch(patch)
        yield
