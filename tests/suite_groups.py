"""How the suite shares two cores under pytest-xdist (``-n auto``, pyproject's addopts).

Single-process tests (solvers, property tests, captures, doctests) are spread over the workers test by
test.  Tests that start a world of processes -- `tests.dist_helpers.run_world`, ``hetpipe run`` and
its torchrun, `hetpipe.runtime.run.run`, `supervise`, network namespaces, or a session fixture of
tests/conftest.py that does -- already keep both cores busy with their 2-4 ranks: every test of a
module that launches is one work unit, ``world``, so they run one after another on one worker (as in a
serial run) and never two worlds beside each other; the session fixtures they share are then also built
once.  A module is classed by its source (`launches_processes`): a new test file that calls one of these
entry points joins the unit without being listed anywhere.  `WorldScheduling` is xdist's ``loadscope``
scheduler with that unit in place of scopes (xdist's own ``loadgroup`` marks do not reach its scheduler
under pytest 9.2, whose node ids no longer come from ``item._nodeid``); every other test is a unit of its
own, handed to whichever worker is free.

Order (under xdist only, so a plain serial run keeps the files' order): modules holding a ``slow`` test
come first among the single-process ones, so the longest tests (the 10,000-instance property test) start
while the ``world`` group runs instead of ending the run alone; a module's tests stay together.

    >>> launches_processes("from tests.dist_helpers import run_world")
    True
    >>> launches_processes("from hetpipe.partitioner.solvers.dp import solve_exact")
    False
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

#: The xdist group of every test in a module that starts processes of its own.
WORLD_GROUP = "world"
#: Words in a test module's source that start a multi-process world (entry points, their test
#: helpers, and the session fixtures of tests/conftest.py that launch).  A single child process
#: (``subprocess.run([sys.executable, ...])``) is not a world: it may run beside other tests; nor is
#: ``hetpipe demo --fast`` (it plans, never launches).  A word that also matches a refusal before launch
#: (``main(["run", ...])`` of a bad plan) only costs balance: that module's tests run on the world worker.
_LAUNCH_WORDS = re.compile(
    r"run_world|hetpipe_run|torchrun|torch\.distributed\.run|from hetpipe\.runtime\.run import"
    r"|main\(\[\"(?:run|supervise)\"|\bsupervise\(|run_on_netns|checkpoint_runs|zoo_case"
    r"|trainer_world|replica_numerics|replica_pair_world|plain_peak_run|momentum_start|forked_launch")


def launches_processes(source: str) -> bool:
    """Whether a test module's source starts a multi-process world (`_LAUNCH_WORDS`)."""
    return _LAUNCH_WORDS.search(source) is not None


def _module_launches(path: Path, cache: dict[Path, bool]) -> bool:
    if path not in cache:
        cache[path] = path.suffix == ".py" and path.name.startswith("test_") and launches_processes(
            path.read_text(encoding="utf-8"))
    return cache[path]


def work_unit(nodeid: str, root: Path, cache: dict[Path, bool]) -> str:
    """The scheduling unit of a test: `WORLD_GROUP` for a test of a launching module, else its own id.

    >>> work_unit("tests/test_executor.py::test_x", Path(__file__).parent.parent, {})
    'world'
    >>> work_unit("tests/test_solver.py::test_x", Path(__file__).parent.parent, {})
    'tests/test_solver.py::test_x'
    """
    module = root / nodeid.split("::", 1)[0]
    return WORLD_GROUP if module.is_file() and _module_launches(module, cache) else nodeid


def world_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's ``loadscope`` scheduling over `work_unit`s (largest unit first: the ``world`` one)."""
    from xdist.scheduler import LoadScopeScheduling

    class WorldScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, config.rootpath, cache)

    cache: dict[Path, bool] = {}
    return WorldScheduling(config, log)


class XdistPlugin:
    """Registered by tests/conftest.py only where pytest-xdist is loaded (its hook is unknown elsewhere)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
        """`world_scheduler` for ``--dist load`` (what ``-n`` implies); any other --dist keeps xdist's."""
        return world_scheduler(config, log) if config.getoption("dist") == "load" else None


def slow_modules_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: modules with a ``slow`` test first, each module's tests together
    and in their order (a stable sort on a per-module key, so module fixtures are built once)."""
    slow = {str(item.fspath) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: str(item.fspath) not in slow)
