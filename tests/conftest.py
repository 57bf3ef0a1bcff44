"""Fixtures shared across test files: one multi-process run that several files assert on.

A launch costs every rank a torch import, a capture and a stage build (2-4 s of CPU each, many
more seconds of wall time on a loaded 2-core machine), so a run whose results tests in two files
read is launched once per session (`plain_peak_run`; `momentum_start`, the first run of two files'
checkpoint chains), and cases that need the same world size run one after another on one world
(`trainer_world`, `replica_numerics`, `replica_pair_world`).  Each test still asserts everything it
asserted on its own run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.machine_load import guard_s


@pytest.fixture(scope="session")
def plain_peak_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, object]]:
    """``get(model, batch, seq) -> (plan path, RunReport)``: 2 steps of the 3-stage plan of
    `tests.test_memory_truth._plan` (no recomputation), launched once per (model, batch, seq).

    tests/test_memory_truth.py checks its measured peaks against the plan; tests/test_recompute_runtime.py
    compares the same plan's peaks with a recomputing copy's.  Peak held bytes are the executor's
    ledger (deterministic), so both may read one run.  Its ranks fork from the test fork server
    (`tests.forked_launch`).
    """
    from hetpipe.runtime.run import run
    from tests.forked_launch import forked_launches
    from tests.test_memory_truth import _plan

    runs: dict[tuple[str, int, int | None], tuple[Path, object]] = {}

    def get(model: str, batch: int, seq: int | None) -> tuple[Path, object]:
        key = (model, batch, seq)
        if key not in runs:
            path = _plan(model, batch, seq, tmp_path_factory.mktemp(f"plain-{model}"))
            with forked_launches():  # the ledger's bytes, not the launch: the zoo's torchrun runs check those too
                runs[key] = (path, run(path, model=model, steps=2, seq=seq, timeout_s=guard_s(90.0)))
        return runs[key]

    return get


def _trainer_plans_worker(rank: int, world: int, jobs: list[tuple[str, str, object]]) -> dict:
    """Each (label, "module:function", plan or plan path) in turn on one world (an initialised process group
    is reused by `Trainer` and `ReplicaTrainer`); an error is kept per label."""
    import importlib
    import traceback

    out = {}
    for label, spec, path in jobs:
        module, name = spec.split(":")
        try:
            out[label] = {"value": getattr(importlib.import_module(module), name)(rank, world, path)}
        except Exception:  # noqa: BLE001 - the parent asserts on it, label by label
            out[label] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="session")
def trainer_world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, list[dict]]]:
    """`hetpipe.Trainer` in a user loop on 3 gloo ranks, once per session for two plans of gpt-tiny with the
    stages of tests/test_trainer.py: ``"plain"`` (that file's test) and ``"recompute"`` (every stage
    recomputing all but its last unit, tests/test_recompute_runtime.py's); then ``"weights"``,
    tests/test_weights_run.py's plan trained from its sharded weights and saved (last: `Trainer.close`
    leaves the process group).  Label -> (plan, each rank's {"value": ...} or {"error": ...})."""
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.partitioner.problem import Stage
    from tests import test_trainer as tt
    from tests.dist_helpers import run_world
    from tests.runtime_plans import plan_for
    from tests.synthetic import synthetic_cluster
    from hetpipe.plan.schema import Plan
    from tests.test_recompute_runtime import all_but_last, with_recompute
    from tests.test_weights_run import write_setup as write_weights_setup

    folder = tmp_path_factory.mktemp("trainer-world")
    meta, example = build(tt.MODEL, device="meta", batch=tt.BATCH, seq=tt.SEQ)
    graph = capture(meta, example, name=tt.MODEL)
    n = graph.num_units
    stages = (Stage(0, 0, 1), Stage(1, 2, n - 3), Stage(2, n - 2, n - 1))  # uneven: 2 | n-4 | 2 units
    plain = plan_for(graph, synthetic_cluster(), stages, microbatches=tt.MICROBATCHES)
    plans = {"plain": plain, "recompute": with_recompute(plain, all_but_last)}
    workers = {"plain": "tests.test_trainer:_trainer_worker", "recompute": "tests.test_recompute_runtime:_trainer_worker"}
    jobs = []
    for label, plan in plans.items():
        plan.save(folder / f"{label}.json")
        jobs.append((label, workers[label], str(folder / f"{label}.json")))
    (folder / "weights").mkdir()
    write_weights_setup(folder / "weights")
    plans["weights"] = Plan.load(folder / "weights" / "plan.json")
    jobs.append(("weights", "tests.test_weights_run:trainer_job", str(folder / "weights" / "plan.json")))
    outcomes = run_world(_trainer_plans_worker, world_size=3, args=(jobs,), timeout_s=3 * tt.WORLD_TIMEOUT_S,
                         out_dir=folder / "ranks")
    return {label: (plans[label], [o.value[label] if o.value is not None else
                                   {"error": f"rank {o.rank} (exit {o.exitcode}): {o.error}"} for o in outcomes])
            for label in plans}


@pytest.fixture(scope="session")
def replica_numerics(tmp_path_factory: pytest.TempPathFactory) -> list:
    """tests/test_replica_runtime.py's uneven replicas (a 2-stage and a 1-stage pipeline) on 3 gloo ranks,
    once per session: its three sync modes, then the same plan with every stage recomputing all but its
    last unit (tests/test_recompute_runtime.py's case, under the key ``RECOMPUTE``)."""
    from tests import test_replica_runtime as tr
    from tests.dist_helpers import run_world
    from tests.test_recompute_runtime import all_but_last, with_recompute

    plan = tr._numerics_plan()
    outcomes = run_world(tr._numerics_worker, world_size=3, args=(plan, with_recompute(plan, all_but_last)),
                         timeout_s=2 * tr.WORLD_TIMEOUT_S, out_dir=tmp_path_factory.mktemp("replica-numerics"))
    for o in outcomes:
        assert o.error is None and o.value is not None, f"rank {o.rank} (exit {o.exitcode}): {o.error}"
    return outcomes


@pytest.fixture(scope="session")
def momentum_inputs(tmp_path_factory: pytest.TempPathFactory):
    """The plan P2, the weights, the batches and the reference loop of the momentum checkpoint chains of
    tests/test_checkpoint_replicas.py and tests/test_checkpoint_groups.py (`tests.checkpoint_runs.MomentumInputs`)."""
    from tests.checkpoint_runs import write_momentum_inputs

    return write_momentum_inputs(tmp_path_factory.mktemp("momentum-chain"))


@pytest.fixture(scope="session")
def momentum_start(momentum_inputs):
    """Steps 0-1 on P2, checkpoint at 2: the first link of both chains (one 2-rank launch); each chain
    resumes its own plans from that checkpoint."""
    from tests.checkpoint_runs import start_momentum_chain

    return start_momentum_chain(momentum_inputs)


@pytest.fixture(scope="session")
def replica_pair_world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Two one-card replicas on 2 gloo ranks, once per session: tests/test_replica_runtime.py's DiLoCo case
    (``"diloco"``: its synchronous and DiLoCo trainers, then `finish`), then tests/test_shard_tied_runtime.py's
    sharded tied embedding (``"shard_tied"``), one after another on one world (`ReplicaTrainer` reuses an
    initialised process group).  Label -> each rank's {"value": ...} or {"error": ...}."""
    from tests import test_replica_runtime as tr
    from tests import test_shard_tied_runtime as ts
    from tests.dist_helpers import run_world

    jobs = [("diloco", "tests.test_replica_runtime:_diloco_worker", tr._diloco_plans()),
            ("shard_tied", "tests.test_shard_tied_runtime:_worker", ts.sharded_plan())]
    outcomes = run_world(_trainer_plans_worker, world_size=2, args=(jobs,), timeout_s=tr.WORLD_TIMEOUT_S + 300.0,
                         out_dir=tmp_path_factory.mktemp("replica-pair"))
    return {label: [o.value[label] if o.value is not None else {"error": f"rank {o.rank} (exit {o.exitcode}): {o.error}"}
                    for o in outcomes] for label, *_ in jobs}


def _hypothesis_profile() -> None:
    """Every property test without a per-example deadline or a too-slow health check (both wall-time limits):
    beside a CPU burner on 2 cores an example takes several times its quiet time, and hypothesis's default
    200 ms deadline failed test_sharding_cost under load.  A test's own ``@settings`` still wins field by field."""
    from hypothesis import HealthCheck, settings

    settings.register_profile("hetpipe-suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("hetpipe-suite")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, multi-process tests run one after another on one worker (tests/suite_groups.py);
    the property tests run without wall-time limits (`_hypothesis_profile`)."""
    _hypothesis_profile()
    if config.pluginmanager.hasplugin("xdist"):
        from tests.suite_groups import XdistPlugin

        config.pluginmanager.register(XdistPlugin(), "hetpipe-suite-groups")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker, modules with a slow test first (every worker sorts the same collection alike)."""
    if hasattr(config, "workerinput"):
        from tests.suite_groups import slow_modules_first

        slow_modules_first(items)
