"""Helpers shared by the benchmark scripts: machine description, medians, markdown tables.

Example:
    >>> markdown_table(["a", "b"], [[1, "x"]])
    '| a | b |\\n|---|---|\\n| 1 | x |'
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def machine() -> str:
    """One line naming this machine (CPU count, OS, Python, torch)."""
    try:
        import torch

        tv = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        tv = "n/a"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}, torch {tv}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, body: str) -> Path:
    """Write benchmarks/results/<name>.md with the date and machine; `run_all.py` assembles RESULTS.md."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.md"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    path.write_text(f"## {title}\n\n_{stamp}; {machine()}_\n\n{body.strip()}\n")
    return path


def emit(lines: Sequence[str], path: Path) -> str:
    """Join a report's lines, print it and write it to `path` (parents created); returns the text."""
    text = "\n".join(lines) + "\n"
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text
