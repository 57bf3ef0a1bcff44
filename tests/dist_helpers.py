"""Helpers for multi-process runtime tests: spawn a small gloo world with a hard timeout, tiny models.

`run_world` starts ``world_size`` processes from a fork server (torch.multiprocessing's
``forkserver`` context: fresh processes like ``spawn``, forked from one server that imported
`RANK_PRELOAD` once per session instead of every rank importing torch again), each
joining a gloo group on 127.0.0.1 at a free port with one OpenMP thread, runs
``fn(rank, world_size, *args)`` and saves what it returns (or the error it raised:
type, message, seconds since the call) to a file the parent reads.  Workers leave
with ``os._exit`` so a broken process group can never hang the interpreter's
shutdown; the parent kills whatever is still alive at the deadline (or as soon as
the ranks it waits for have finished).

The models are small and deterministic (no dropout, no BatchNorm) so a pipelined
run can be compared with a single-process reference to fp32 rounding:

* `SkipNet`: an MLP U-Net whose encoder outputs and the raw input skip over whole
  stages, plus an ``x.size(0)`` that crosses cuts as a baked constant.
* `TinyGPT`: token + position embeddings, causal attention blocks, and an LM head tied to the token embedding (GPT-2 style).
"""

from __future__ import annotations

import datetime
import os
import resource
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

PG_TIMEOUT_S = 60.0
#: What every rank imports before its first step, imported once by the fork server: torch (2.3-2.6 s of CPU
#: per process on this machine) and what the first capture and stage build load lazily (torch._dynamo,
#: torch.export, sympy: 1.7 s of the first capture's 2.0 s; the second takes 0.35 s).  Measured with
#: ``time.process_time`` around the imports and two captures of gpt-tiny in one process.  On
#: tests/test_executor.py's worlds: 14 ranks took 64.9 s of CPU spawned, 13.1 s forked from the server (load 15-20).
#: Since session 14 also the worker (`tests.forked_launch` runs ``hetpipe run``'s ranks here) and the zoo's Hugging
#: Face model classes: importing transformers and them took 2.4 s of CPU in a process that had torch (process_time,
#: load 9), paid once by the server instead of by every rank of a Hugging Face run.
RANK_PRELOAD = ("torch", "torch.distributed", "torch.fx", "torch._dynamo", "torch.export", "sympy",
                "hetpipe.partitioner.capture.capture", "hetpipe.runtime.execute.executor", "hetpipe.runtime.trainer",
                "hetpipe.runtime.replicas.trainer", "hetpipe.runtime.worker", "hetpipe.models.hf", "transformers",
                "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                "transformers.models.bert.modeling_bert", "transformers.models.gpt2.modeling_gpt2",
                "transformers.models.t5.modeling_t5", "safetensors.torch", "tests.dist_helpers")
#: CPU seconds of every rank `run_world` collected in this process (the ranks are the fork server's children,
#: not this process's, so ``RUSAGE_CHILDREN`` and ``time`` miss them): tests/cpu_profile.py reads it.
RANKS_CPU_S = [0.0]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankOutcome:
    """What one rank left behind: its return value, or the error it raised (None if it left nothing)."""

    rank: int
    exitcode: int | None
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    error_at_s: float | None = None  # seconds after the worker function started
    cpu_s: float | None = None  # the rank's CPU seconds (user + system), fork server's imports excluded


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    path = Path(out_dir) / f"rank{rank}.pt"
    record: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        start = time.monotonic()
        try:
            record["value"] = fn(rank, world_size, *args)
        except BaseException as err:  # noqa: BLE001 - the parent asserts on it
            record.update(error_type=type(err).__name__, error=str(err), error_at_s=time.monotonic() - start,
                          traceback=traceback.format_exc())
    except BaseException as err:  # noqa: BLE001
        record.update(error_type=type(err).__name__, error=str(err), traceback=traceback.format_exc())
    usage = resource.getrusage(resource.RUSAGE_SELF)  # a forked child starts at 0: the rank's own work
    record["cpu_s"] = usage.ru_utime + usage.ru_stime
    torch.save(record, path)
    os._exit(0)  # never tear down a possibly broken group


def _failed(proc: Any, path: Path) -> bool:
    """Whether an exited rank failed: a non-zero exit, or an error in its record."""
    if proc.exitcode != 0:
        return True
    return path.exists() and torch.load(path, weights_only=False).get("error_type") is not None


def _join(procs: list[Any], waited: list[int], deadline: float, out_dir: Path, fail_fast: bool) -> None:
    """Wait for the ``waited`` ranks until ``deadline``; with ``fail_fast``, only until one of them failed
    (as torchrun tears a job down at its first failed rank: the others would wait on it until their timeout)."""
    if not fail_fast:
        for r in waited:
            procs[r].join(max(0.0, deadline - time.monotonic()))
        return
    pending = set(waited)
    while pending and time.monotonic() < deadline:
        for r in sorted(pending):
            if not procs[r].is_alive():
                pending.discard(r)
                if _failed(procs[r], out_dir / f"rank{r}.pt"):
                    return
        if pending:
            procs[min(pending)].join(0.1)


def run_world(fn: Callable[..., Any], *, world_size: int, args: Sequence[Any] = (), timeout_s: float,
              out_dir: Path, wait_for: Sequence[int] | None = None, fail_fast: bool = False) -> list[RankOutcome]:
    """Run ``fn`` on every rank; return each rank's outcome once ``wait_for`` ranks (default all) have exited
    (``fail_fast``: or one of them failed; the others are then killed, their outcomes without a value).

    Raises ``TimeoutError`` if those ranks are not done within ``timeout_s`` (the
    processes are killed first, so nothing outlives the test).
    """
    ctx = mp.get_context("forkserver")  # like spawn (no state of this process), torch already imported
    ctx.set_forkserver_preload(list(RANK_PRELOAD))  # read when the server starts: the first run_world
    port = free_port()
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, str(out_dir), tuple(args)), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    waited = list(range(world_size)) if wait_for is None else list(wait_for)
    deadline = time.monotonic() + timeout_s
    try:
        _join(procs, waited, deadline, out_dir, fail_fast)
        late = [r for r in waited if procs[r].is_alive()]
        if late and not (fail_fast and any(_failed(procs[r], out_dir / f"rank{r}.pt") for r in waited
                                           if not procs[r].is_alive())):
            raise TimeoutError(f"ranks {late} still running after {timeout_s:.0f} s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [_outcome(r, procs[r].exitcode, out_dir / f"rank{r}.pt") for r in range(world_size)]


def _outcome(rank: int, exitcode: int | None, path: Path) -> RankOutcome:
    if not path.exists():
        return RankOutcome(rank, exitcode)
    rec = torch.load(path, weights_only=False)
    if "traceback" in rec and rec.get("error_type") not in ("RuntimeFailure", "ScheduleError"):
        rec["error"] = f"{rec['error']}\n{rec['traceback']}"
    RANKS_CPU_S[0] += rec.get("cpu_s", 0.0)
    return RankOutcome(rank, exitcode, rec.get("value"), rec.get("error_type"), rec.get("error"),
                       rec.get("error_at_s"), rec.get("cpu_s"))


# ----------------------------------------------------------------------------- models


def _mlp(d_in: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, d_out), nn.Tanh())


class SkipNet(nn.Module):
    """An MLP U-Net: encoder outputs are concatenated back in the decoder; the input is added at the end."""

    UNITS = ("inp", "down1", "down2", "mid", "up2", "up1", "out")

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, 16)
        self.down1, self.down2, self.mid = _mlp(16, 16), _mlp(16, 12), _mlp(12, 12)
        self.up2, self.up1 = _mlp(24, 16), _mlp(32, 16)
        self.out = nn.Linear(16, d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)  # an int that crosses every cut: baked into later stages
        h0 = self.inp(x)
        d1 = self.down1(h0)
        d2 = self.down2(d1)
        m = self.mid(d2)
        u2 = self.up2(torch.cat([m, d2], dim=-1))
        u1 = self.up1(torch.cat([u2, d1], dim=-1))
        y = self.out(u1 + h0) * self.scale
        return (y + x).reshape(n, -1)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
        causal = x.new_ones(t, t).tril()
        att = att.masked_fill(causal == 0, float("-inf")).softmax(dim=-1)
        x = x + self.c_proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """GPT-2-shaped toy: ``lm_head.weight is wte.weight``."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 5, ctx: int = 8) -> None:
        super().__init__()
        self.vocab = vocab
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(_Block(d, heads, ctx) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    @property
    def units(self) -> tuple[str, ...]:
        return ("wte", "wpe", *(f"h.{i}" for i in range(len(self.h))), "ln_f", "lm_head")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def node_units(gm: fx.GraphModule, units: Sequence[str]) -> dict[str, str]:
    """fx node name -> the unit (module path prefix) it belongs to; top-level glue nodes are left out."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            path = str(node.target)
        else:
            stack = node.meta.get("nn_module_stack") or {}
            path = next(iter(stack.values()))[0] if stack else ""
        unit = next((u for u in units if path == u or path.startswith(u + ".")), None)
        if unit is not None:
            out[node.name] = unit
    return out


def stage_mapping(gm: fx.GraphModule, units: Sequence[str], units_per_stage: Sequence[int]) -> dict[str, int]:
    """Give the first ``units_per_stage[0]`` units to stage 0, the next ones to stage 1, ..."""
    assert sum(units_per_stage) == len(units), (units_per_stage, units)
    unit_stage, k = {}, 0
    for stage, count in enumerate(units_per_stage):
        for u in units[k:k + count]:
            unit_stage[u] = stage
        k += count
    return {name: unit_stage[u] for name, u in node_units(gm, units).items()}
