"""A lost device or a cut link coming back (``--wait-for-return SECONDS``, issue 16 item 4).

A supervised run (`hetpipe.runtime.supervise`) that lost a rank (or whose emulated link was
cut) may wait for the device (the link) to be back instead of re-planning, and then resume on
the **same** plan (bitwise the run it would have been).  What is waited for is named by a
*key*: a device id (``n1:2``) or a link (``n0:1 -> n1:2``).  It counts as back when either says so:

* a **marker file** ``RUN_DIR/back-<key>`` (``:``, ``/``, spaces and ``->`` written ``_``:
  ``back-n1_2``, ``back-n0_1_n1_2``) -- what an operator (or a node agent) creates once the
  machine or network is up again; its content is not read;
* the **injected fault's own record** ``ATTEMPT_DIR/down-<key>.json`` (``--inject
  kill:rank=R,step=K,down=S``, written by the rank just before it exits; ``link:...,factor=cut,
  step=K,down=S``, written by the sender at step K): back at the wall time it names.

`wait_for_return` polls both until every key is back or the time is up.

Example:
    >>> import tempfile
    >>> run_dir = Path(tempfile.mkdtemp())
    >>> back_marker(run_dir, "n1:2").name, back_marker(run_dir, "n0:1 -> n1:2").name
    ('back-n1_2', 'back-n0_1_n1_2')
    >>> write_down(run_dir, "n1:2", down_s=0.0)
    >>> wait_for_return(["n1:2"], attempt_dir=run_dir, run_dir=run_dir, timeout_s=5.0) is not None
    True
    >>> wait_for_return(["n0:1"], attempt_dir=run_dir, run_dir=run_dir, timeout_s=0.0) is None
    True
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often the markers are looked for: far below any useful wait


def safe_key(key: str) -> str:
    """A device id or link as a file-name part: ``n0:1 -> n1:2`` -> ``n0_1_n1_2``."""
    return "_".join(filter(None, re.split(r"[:/\s]+|->", key)))


def back_marker(run_dir: Path, key: str) -> Path:
    """The file that says ``key`` (a device id or ``a -> b`` link) is back: ``RUN_DIR/back-<key>``."""
    return Path(run_dir) / f"back-{safe_key(key)}"


def down_path(run_dir: Path, key: str) -> Path:
    return Path(run_dir) / f"down-{safe_key(key)}.json"


def write_down(run_dir: Path, key: str, *, down_s: float) -> None:
    """Record (atomically) that ``key`` is gone for ``down_s`` seconds from now."""
    path = down_path(run_dir, key)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"key": key, "down_s": down_s, "back_at": time.time() + down_s}))
    os.replace(tmp, path)


def back_at(attempt_dir: Path, key: str) -> float:
    """Wall time at which ``key`` is back by its injected fault's record (inf: no record)."""
    try:
        return float(json.loads(down_path(attempt_dir, key).read_text())["back_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return math.inf


def is_back(key: str, *, attempt_dir: Path, run_dir: Path) -> bool:
    """Whether ``key`` is back (its marker exists, or its fault's time is up)."""
    return back_marker(run_dir, key).exists() or time.time() >= back_at(attempt_dir, key)


def wait_for_return(keys: Sequence[str], *, attempt_dir: Path, run_dir: Path, timeout_s: float,
                    poll_s: float = POLL_S) -> float | None:
    """Wait until every one of ``keys`` (device ids, ``a -> b`` links) is back; the seconds waited, or
    None when one is still away after ``timeout_s``."""
    start = time.monotonic()
    for key in keys:
        log.warning("waiting up to %.3g s for %s to return (create %s when it is back)", timeout_s, key,
                    back_marker(run_dir, key))
    while True:
        if all(is_back(k, attempt_dir=attempt_dir, run_dir=run_dir) for k in keys):
            return time.monotonic() - start
        if time.monotonic() - start >= timeout_s:
            return None
        time.sleep(poll_s)
