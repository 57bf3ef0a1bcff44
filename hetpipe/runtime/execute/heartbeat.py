"""Per-action progress for the launcher's watchdog: a file touched while a rank is working.

The watchdog in `hetpipe.runtime.launch` kills a job when no rank's
``progress-rank<r>`` file changed for ``timeout_s + PROGRESS_GRACE_S``.  A step of a
real-size model under emulation can last far longer than that (issue 11: gpt2-small on
the home lab, 930 s without a finished step), so the executor beats after **every
action** (and the calibration passes run through the same executor).  A beat rewrites
the file at most every `MIN_INTERVAL_S`, so a 2 ms action does not cost a file write.

The heartbeat is per process: the worker calls `install` with its progress file, and
`beat` is a no-op in any process that did not (tests, `Trainer` in a user script).

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "progress-rank0"
    >>> install(path); beat(); path.exists()
    True
    >>> uninstall()
"""

from __future__ import annotations

import time
from pathlib import Path

#: Fewest seconds between two writes of the progress file: 1 s is far below any watchdog
#: limit (timeout_s >= 1 plus a 30 s grace) and keeps the write rate negligible.
MIN_INTERVAL_S = 1.0

_path: Path | None = None
_last_s = -float("inf")


def touch(path: Path) -> None:
    """Write the wall time into ``path``; its mtime is what the watchdog reads (no temporary file:
    the watchdog globs ``progress-rank*`` and must not see one vanish)."""
    path.write_text(str(time.time()))


def install(path: Path) -> None:
    """Beat into ``path`` from now on (touches it once)."""
    global _path, _last_s
    _path, _last_s = Path(path), time.monotonic()
    touch(_path)


def uninstall() -> None:
    global _path
    _path = None


def beat() -> None:
    """Record progress: touch the installed file unless it was touched under `MIN_INTERVAL_S` ago."""
    global _last_s
    if _path is None:
        return
    now = time.monotonic()
    if now - _last_s >= MIN_INTERVAL_S:
        _last_s = now
        touch(_path)
