"""What is live at the allocator's peak of one executor step on CUDA, by allocation site (`benchmarks/gpu_check.py`).

Split from gpu_check.py (the 500-line limit); gpu_check imports it where its step runs on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

PEAK_GROUPS = 10  # allocation sites listed at the allocator's peak


def peak_sites(trace: list[dict[str, Any]], start_bytes: int) -> tuple[int, list[tuple[str, int]]]:
    """Replay one device's allocator trace (`torch.cuda.memory._snapshot()['device_traces'][d]`): the peak
    bytes (``start_bytes`` held before recording plus the live recorded blocks) and, at that peak, the live
    bytes by allocation site (the innermost frame in hetpipe or this script, else the innermost frame).

    Example:
        >>> ev = [{"action": "alloc", "addr": 1, "size": 8, "frames": [{"filename": "x.py", "line": 3, "name": "f"}]},
        ...       {"action": "free_completed", "addr": 1, "size": 8, "frames": []}]
        >>> peak_sites(ev, 100)
        (108, [('x.py:3 f', 8)])
    """
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in trace:
        if ev["action"] == "alloc":
            frames = ev.get("frames") or []
            mine = [f for f in frames if "hetpipe" in f["filename"] or "gpu_check" in f["filename"]]
            f = (mine or frames or [{"filename": "autograd engine (C++)", "line": 0, "name": ""}])[0]
            live[ev["addr"]] = (ev["size"], f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}")
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    sites: dict[str, int] = {}
    for size, site in at_peak.values():
        sites[site] = sites.get(site, 0) + size
    return start_bytes + peak, sorted(sites.items(), key=lambda kv: -kv[1])[:PEAK_GROUPS]


def executor_peak(ex: Any, xs: list[Any], ys: list[Any]) -> list[str]:
    """One more executor step with the allocator's history on: what is live at its peak, by site."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    try:
        ex.step(xs, ys)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, sites = peak_sites(trace, start)
    return ["", f"Executor step under the allocator's history: {start / 2**20:.1f} MiB allocated before it (parameters, Adam state, the last step's gradients, freed at its start), "
                f"peak {peak / 2**20:.1f} MiB; live at the peak, allocated during the step, by site:", "",
            "| site | MiB |", "|---|---|", *(f"| `{site}` | {b / 2**20:.1f} |" for site, b in sites)]
