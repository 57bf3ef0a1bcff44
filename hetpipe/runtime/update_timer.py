"""Time ``optimizer.step()`` itself, apart from the rest of the STEP action.

The executor's STEP action also waits for outstanding sends and for the tied-parameter
all-reduce, which waits for the slowest stage holding a replica (the last stage's STEP of a
tied-head GPT waits for the first stage's last backward).  The plan's S_s prices the
optimizer update only (`hetpipe.cost_models.optimizer_step`), so the run report compares it
with this: torch's optimizer step pre/post hooks around each ``step()``.

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(3))
    >>> opt = torch.optim.SGD([p], lr=0.1)
    >>> timer = UpdateTimer.attach(opt)
    >>> p.grad = torch.ones(3); opt.step()
    >>> len(timer.durations_s), timer.durations_s[0] >= 0.0
    (1, True)
    >>> class Plain:  # no step hooks: its step is wrapped
    ...     def step(self): return "stepped"
    >>> plain = Plain(); other = UpdateTimer.attach(plain)
    >>> plain.step(), len(other.durations_s)
    ('stepped', 1)
"""

from __future__ import annotations

import time
from typing import Any


class UpdateTimer:
    """Real seconds of every ``optimizer.step()`` since `attach`."""

    def __init__(self) -> None:
        self.durations_s: list[float] = []
        self._start_s = 0.0

    @classmethod
    def attach(cls, optimizer: Any) -> "UpdateTimer":
        """Hooks on a torch optimizer; an optimizer without them (the offload lever's
        `HostOffloadOptimizer`, whose whole step -- copies and host update -- is the plan's O_s)
        has its ``step`` wrapped on the instance instead."""
        timer = cls()
        if hasattr(optimizer, "register_step_pre_hook"):
            optimizer.register_step_pre_hook(timer._before)
            optimizer.register_step_post_hook(timer._after)
            return timer
        inner = optimizer.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            timer._before(optimizer, args, kwargs)
            try:
                return inner(*args, **kwargs)
            finally:
                timer._after(optimizer, args, kwargs)

        optimizer.step = timed_step
        return timer

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._start_s = time.perf_counter()

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.durations_s.append(time.perf_counter() - self._start_s)
