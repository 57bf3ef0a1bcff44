"""tests/suite_groups.py: which modules form the ``world`` work unit under pytest-xdist, and the order.

The classification is read off the sources, so these pin it on files whose behaviour is known from a
CPU profile (tests/cpu_profile.py: the launching ones have ``children_s`` or ``ranks_s`` from their
torchrun or `run_world` ranks; the others none, or one single child process).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.suite_groups import WORLD_GROUP, launches_processes, slow_modules_first, work_unit

ROOT = Path(__file__).resolve().parent.parent
#: Modules seen launching worlds: run_world, `hetpipe run` (torchrun; test_model_zoo's through
#: `tests.zoo_harness.zoo_case`), run(), supervise, netns, shared fixtures.
LAUNCHING = ("test_executor.py", "test_run_cli.py", "test_faults_run.py", "test_checkpoint_groups.py",
             "test_supervise_return.py", "test_netns.py", "test_trainer.py", "test_memory_truth.py",
             "test_adapt_decisions.py", "test_plan_tables.py", "test_model_zoo.py")
#: Single-process modules, two of them with one plain child process (`subprocess.run([sys.executable, ...])`),
#: two running ``hetpipe demo --fast`` (plans only).
SINGLE = ("test_contract_property.py", "test_solver.py", "test_capture.py", "test_weights.py", "test_architecture.py",
          "test_demo.py", "test_fit_hints.py")


@pytest.mark.parametrize("name", LAUNCHING)
def test_launching_modules_are_one_world_unit(name: str) -> None:
    assert launches_processes((ROOT / "tests" / name).read_text(encoding="utf-8")), name
    assert work_unit(f"tests/{name}::test_any", ROOT, {}) == WORLD_GROUP


@pytest.mark.parametrize("name", SINGLE)
def test_single_process_modules_are_spread_test_by_test(name: str) -> None:
    assert not launches_processes((ROOT / "tests" / name).read_text(encoding="utf-8")), name
    assert work_unit(f"tests/{name}::test_any", ROOT, {}) == f"tests/{name}::test_any"


def test_doctests_of_the_package_are_units_of_their_own() -> None:
    nodeid = "hetpipe/partitioner/solvers/cap_walk.py::hetpipe.partitioner.solvers.cap_walk"
    assert work_unit(nodeid, ROOT, {}) == nodeid


@dataclass
class _Item:
    """What `slow_modules_first` reads of a pytest item."""

    fspath: str
    name: str
    slow: bool = False

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "slow" and self.slow else None


def test_modules_with_a_slow_test_come_first_and_stay_whole() -> None:
    items = [_Item("a.py", "a1"), _Item("b.py", "b1"), _Item("b.py", "b2", slow=True), _Item("c.py", "c1"),
             _Item("d.py", "d1", slow=True), _Item("d.py", "d2")]
    slow_modules_first(items)  # type: ignore[arg-type]
    assert [i.name for i in items] == ["b1", "b2", "d1", "d2", "a1", "c1"]
