"""Wall-time bounds that scale with the machine's load, for tests that must pass beside other processes.

A wall-time bound written for a quiet machine fails on a shared one: on 2 cores at a 1-minute load average
of 16 every runnable process gets about 1/8 of a core, so a launch that takes 30 s of wall time alone takes
several minutes.  A test that bounds wall time (to show that a broken run fails instead of hanging) scales
its bound by the load per core, measured at the start and at the end of what it times (the larger of the
two: the 1-minute average lags a load that just began).

    >>> scaled_limit_s(240.0, load_per_core=0.5)
    240.0
    >>> scaled_limit_s(240.0, load_per_core=8.0)
    1920.0
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


def load_per_core() -> float:
    """The 1-minute load average divided by the number of cores (1.0: every core busy)."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def scaled_limit_s(base_s: float, *, load_per_core: float) -> float:
    """``base_s`` (a bound that holds on a machine with every core free) times the load per core, never less."""
    return base_s * max(1.0, load_per_core)


def guard_s(base_s: float) -> float:
    """A hang guard's bound now (a rank's ``--timeout`` / ``timeout_s``): ``base_s`` (enough on an idle machine)
    scaled by the load per core at this moment.  Never what a test measures: only how long a broken run may
    hang before it fails.

    >>> guard_s(60.0) >= 60.0
    True
    """
    return scaled_limit_s(base_s, load_per_core=load_per_core())


@dataclass
class LoadTimer:
    """Wall time since creation and the bound it must stay under, scaled by the larger load seen.

    >>> timer = LoadTimer(base_limit_s=60.0)
    >>> timer.within_limit()
    True
    """

    base_limit_s: float
    start_s: float = field(default_factory=time.monotonic)
    start_load_per_core: float = field(default_factory=load_per_core)

    def elapsed_s(self) -> float:
        """Wall seconds since the timer started."""
        return time.monotonic() - self.start_s

    def limit_s(self) -> float:
        """The bound now: ``base_limit_s`` scaled by the larger of the loads at start and now."""
        return scaled_limit_s(self.base_limit_s, load_per_core=max(self.start_load_per_core, load_per_core()))

    def within_limit(self) -> bool:
        """Whether the elapsed wall time is under the load-scaled bound."""
        return self.elapsed_s() < self.limit_s()

    def why(self) -> str:
        """The figures, for an assertion message."""
        return (f"{self.elapsed_s():.1f} s of wall time, limit {self.limit_s():.0f} s "
                f"({self.base_limit_s:.0f} s x load per core, start {self.start_load_per_core:.2f})")
