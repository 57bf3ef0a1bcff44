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


def one_way_spans(stamps: dict[str, list[float]], out: str) -> None:
    """Gather both ranks' send / arrival stamps (CLOCK_MONOTONIC s, one host) per way and, on rank 1, write each
    way's one-way spans (arrival - send, the first message of each way left out as a warm-up) to `out` as JSON."""
    import json

    import torch.distributed as dist

    both: list = [None, None]
    dist.all_gather_object(both, stamps)
    if dist.get_rank() == 1:
        spans = {w: [end - start for start, end in zip(both[0][w][1:], both[1][w][1:])] for w in stamps}
        Path(out).write_text(json.dumps(spans))
    dist.destroy_process_group()


def spawn_spans(worker, messages: int) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    """Run ``worker(rank, port, messages, out)`` on two spawned ranks (which end with `one_way_spans`) and return
    the spans per way it wrote."""
    import json
    import tempfile

    import torch

    from hetpipe.cost_models.calibrate import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "spans.json")
        torch.multiprocessing.spawn(worker, args=(free_port(), messages, out), nprocs=2)
        return json.loads(Path(out).read_text())
