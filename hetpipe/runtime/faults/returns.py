"""A lost device coming back (``--wait-for-return SECONDS``, issue 16 item 4).

A supervised run (`hetpipe.runtime.supervise`) that lost a rank may wait for its device to be
back instead of re-planning on the survivors, and then resume on the **same** plan (bitwise the
run it would have been).  A device counts as back when either says so:

* a **marker file** ``RUN_DIR/back-<device>`` (``:`` in the id written ``_``: ``back-n1_2``) --
  what an operator (or a node agent) creates once the machine is up again; its content is
  not read;
* the **injected kill's own record** ``ATTEMPT_DIR/down-rank<R>.json`` (``--inject
  kill:rank=R,step=K,down=S``, written by the rank just before it exits): the device is back
  at the wall time it names.

`wait_for_return` polls both until every lost device is back or the time is up.

Example:
    >>> import tempfile
    >>> run_dir = Path(tempfile.mkdtemp())
    >>> back_marker(run_dir, "n1:2").name
    'back-n1_2'
    >>> write_down(run_dir, rank=2, device="n1:2", down_s=0.0)
    >>> wait_for_return({2: "n1:2"}, attempt_dir=run_dir, run_dir=run_dir, timeout_s=5.0) is not None
    True
    >>> wait_for_return({1: "n0:1"}, attempt_dir=run_dir, run_dir=run_dir, timeout_s=0.0) is None
    True
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often the markers are looked for: far below any useful wait


def back_marker(run_dir: Path, device: str) -> Path:
    """The file that says ``device`` is back: ``RUN_DIR/back-<device>`` (``:`` and ``/`` written ``_``)."""
    return Path(run_dir) / f"back-{device.replace(':', '_').replace('/', '_')}"


def down_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"down-rank{rank}.json"


def write_down(run_dir: Path, *, rank: int, device: str, down_s: float) -> None:
    """Record (atomically) that ``rank``'s device is gone for ``down_s`` seconds from now."""
    path = down_path(run_dir, rank)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"rank": rank, "device": device, "down_s": down_s, "back_at": time.time() + down_s}))
    os.replace(tmp, path)


def back_at(attempt_dir: Path, rank: int) -> float:
    """Wall time at which ``rank``'s device is back by its injected kill's record (inf: no record)."""
    try:
        return float(json.loads(down_path(attempt_dir, rank).read_text())["back_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return math.inf


def is_back(rank: int, device: str, *, attempt_dir: Path, run_dir: Path) -> bool:
    """Whether the lost ``rank``'s ``device`` is back (its marker exists, or its kill's time is up)."""
    return back_marker(run_dir, device).exists() or time.time() >= back_at(attempt_dir, rank)


def wait_for_return(lost: Mapping[int, str], *, attempt_dir: Path, run_dir: Path, timeout_s: float,
                    poll_s: float = POLL_S) -> float | None:
    """Wait until every lost rank's device (``lost``: rank -> device id) is back; the seconds waited,
    or None when one is still away after ``timeout_s``."""
    start = time.monotonic()
    for rank, device in lost.items():
        log.warning("waiting up to %.3g s for %s (rank %d) to return (create %s when it is back)", timeout_s,
                    device, rank, back_marker(run_dir, device))
    while True:
        if all(is_back(r, d, attempt_dir=attempt_dir, run_dir=run_dir) for r, d in lost.items()):
            return time.monotonic() - start
        if time.monotonic() - start >= timeout_s:
            return None
        time.sleep(poll_s)
