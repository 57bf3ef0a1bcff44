"""Opt-in pytest plugin: the CPU seconds of every test, for finding what makes the suite slow on a shared machine.

Wall times (``--durations``) on a loaded 2-core machine are inflated several-fold by other processes; CPU
seconds are not.  Each test's figure is this process's own CPU, plus its waited children's (``hetpipe run``'s
torchrun and ranks, subprocesses), plus the CPU of the ranks `tests.dist_helpers.run_world` started (they are
children of the fork server, which ``RUSAGE_CHILDREN`` does not see; the server's own imports, about 5 s once
per session, are not counted).  A session fixture's cost is charged to the first test that uses it.  Use::

    HETPIPE_CPU_PROFILE=/tmp/cpu.jsonl python -m pytest -p tests.cpu_profile tests/test_executor.py

and sum or sort the JSON lines (``id``, ``self_s``, ``children_s``, ``ranks_s``, ``wall_s``, and ``worker``:
the pytest-xdist worker that ran it, "" in a serial run).  Under xdist every worker appends to the file.

    >>> _cpu_s()[0] > 0
    True
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Iterator

import pytest


def _cpu_s() -> tuple[float, float, float]:
    """(this process, its waited children, `run_world` ranks so far) in CPU seconds (user + system)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    helpers = sys.modules.get("tests.dist_helpers")
    ranks = helpers.RANKS_CPU_S[0] if helpers is not None else 0.0
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime, ranks


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Append one JSON line per test (set-up, call and tear-down) to $HETPIPE_CPU_PROFILE."""
    before, start = _cpu_s(), time.perf_counter()
    yield
    after, wall = _cpu_s(), time.perf_counter() - start
    path = os.environ.get("HETPIPE_CPU_PROFILE")
    if path:
        row = {"id": item.nodeid, "self_s": after[0] - before[0], "children_s": after[1] - before[1],
               "ranks_s": after[2] - before[2], "wall_s": wall, "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")
