"""What `hetpipe run` does with an interleaved plan (plan version 6 chunks; issue 17 item 2).

Each rank builds one stage module per chunk (`hetpipe.runtime.stage.build.build_chunks`: chunk c of
plan stage r is virtual stage ``c p + r``) and its executor runs the rank's interleaved 1F1B list
over them (`hetpipe.runtime.execute.chunks`).  Not run yet, each refused before launch with its
fix: weights files and checkpoints (they name one stage per rank), fault injection and supervision,
replicas and tensor-parallel groups.

Under ``--emulate`` each chunk's F and B are stretched to its own predicted seconds (the plan's
`PlanChunk`s) and each message is timed on the link of its cut, the wrap-around p-1 -> 0 included;
the time scale comes from one micro-batch through every chunk in model order, serially
(`serial_actions`), like a plain pipeline's calibration.

Example:
    >>> refuse_unrunnable_interleaved(1, {"resume": "ckpt"})      # a plain plan: nothing refused
    >>> refuse_unrunnable_interleaved(2, {"emulate": True, "weights": None})
    >>> refuse_unrunnable_interleaved(2, {"resume": "ckpt"})
    Traceback (most recent call last):
    ...
    hetpipe.errors.ConfigError: --resume: an interleaved plan (2 chunks per card) runs without it so far; drop --resume, or re-plan with --schedule 1f1b, zb-1f1b or zb-h1 (auto may choose interleaving)
    >>> [str(a) for a in serial_actions(1, ranks=2, chunks=2)]
    ['1RECV_F0', '1F0', '1SEND_F0', '3RECV_F0', '3F0', '3B0', '3SEND_B0', '1RECV_B0', '1B0', '1SEND_B0', '1STEP']
"""

from __future__ import annotations

import logging
import os
from statistics import median
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from hetpipe.errors import ConfigError
from hetpipe.plan.schema import Plan
from hetpipe.runtime.emulate.pipeline import (DEFAULT_SAFETY_FACTOR, EmulationHooks, RecordingHooks, StageTiming,
                                              choose_time_scale)
from hetpipe.runtime.rank import CALIBRATION_PASSES, stage_links
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.interleaved import chunks_of

log = logging.getLogger(__name__)

#: run() options an interleaved plan does not take yet -> the flag users know them by
UNSUPPORTED = {"weights": "--weights", "save_weights": "--save-weights",
               "checkpoint_dir": "--checkpoint-dir", "resume": "--resume", "inject": "--inject",
               "max_restarts": "--max-restarts", "adapt": "--adapt", "wait_for_return": "--wait-for-return"}


def plan_chunks(plan: Plan) -> int:
    """Chunks per card of ``plan``: its stages' recorded chunks, 1 for a plain plan."""
    return max(1, len(plan.stages[0].chunks)) if plan.stages else 1


def refuse_unrunnable_interleaved(chunks: int, options: Mapping[str, Any]) -> None:
    """Raise `ConfigError` for the first of ``options`` (run()'s keyword arguments) an interleaved run
    does not take yet (module docstring); nothing for a plain plan (``chunks`` 1)."""
    if chunks < 2:
        return
    for name, flag in UNSUPPORTED.items():
        if options.get(name):
            raise ConfigError(f"{flag}: an interleaved plan ({chunks} chunks per card) runs without it so far; "
                              f"drop {flag}, or re-plan with --schedule 1f1b, zb-1f1b or zb-h1 (auto may "
                              "choose interleaving)")


def check_schedule(plan: Plan, schedule: str) -> None:
    """Refuse running ``plan`` under a schedule of another chunk count (its chunks are its cut)."""
    have, want = plan_chunks(plan), chunks_of(schedule)
    if have != want:
        raise ConfigError(f"--schedule {schedule} runs {want} chunk{'s' if want > 1 else ''} per card, the plan was "
                          f"cut into {have}; drop --schedule (the plan's is {plan.training.schedule}) or re-plan with "
                          f"--schedule {schedule}")
    if have > 1 and (plan.replicas or any(st.group_devices for st in plan.stages)):
        raise ConfigError("an interleaved plan with replicas or tensor-parallel groups does not run yet; re-plan "
                          "with --schedule 1f1b")


def serial_actions(rank: int, *, ranks: int, chunks: int) -> list[Action]:
    """Rank ``rank``'s list for one micro-batch through every virtual stage in model order: the forwards
    of its chunks, then their backwards in reverse (serial: one rank computes at a time)."""
    last, out = ranks * chunks - 1, []
    for c in range(chunks):
        k = c * ranks + rank
        out += ([Action(k, Op.RECV_F, 0)] if k > 0 else []) + [Action(k, Op.F, 0)]
        out += [Action(k, Op.SEND_F, 0)] if k < last else []
    for c in reversed(range(chunks)):
        k = c * ranks + rank
        out += ([Action(k, Op.RECV_B, 0)] if k < last else []) + [Action(k, Op.B, 0)]
        out += [Action(k, Op.SEND_B, 0)] if k > 0 else []
    return out + [Action(rank, Op.STEP)]


def chunk_timings(plan: Plan) -> dict[int, StageTiming]:
    """Virtual stage -> the plan's F/B seconds per micro-batch of that chunk."""
    p = len(plan.stages)
    return {c * p + st.index: StageTiming(ch.fwd_s, ch.bwd_s) for st in plan.stages for c, ch in enumerate(st.chunks)}


def emulation_hooks(run: Any, *, loss_fn: Any, inputs: Sequence[Any] | None, targets: Sequence[Any] | None,
                    safety_factor: float | None) -> EmulationHooks:
    """Calibrate (`serial_actions`, `CALIBRATION_PASSES` times, SGD at lr 0) and return this rank's
    `EmulationHooks` with every chunk's predicted seconds and every cut's link (module docstring)."""
    plan, r, p = run.plan, run.index, run.num_stages
    v = len(run.stage.modules)
    hooks = RecordingHooks()
    executor = run.executor(actions=serial_actions(r, ranks=p, chunks=v), microbatches=1, hooks=hooks,
                            optimizer=torch.optim.SGD(run.stage.parameters(), lr=0.0), loss_fn=loss_fn)
    for _ in range(CALIBRATION_PASSES):
        executor.step(inputs[:1] if inputs else None, targets[:1] if targets else None)
    mine = {c * p + r: StageTiming(median(hooks.fwd_compute_s[c::v][1:]),
                                   median(hooks.bwd_compute_s[v - 1 - c::v][1:])) for c in range(v)}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    measured = {k: t for got in every for k, t in got.items()}
    predicted = chunk_timings(plan)
    order = sorted(predicted)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    scale = choose_time_scale([measured[k] for k in order], [predicted[k] for k in order],
                              num_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", p)), num_cores=cores,
                              safety_factor=safety_factor or DEFAULT_SAFETY_FACTOR)
    virtual = [plan.stages[k % p] for k in range(p * v)]  # the card of each virtual stage
    links = {cut: link for c in range(v) for cut, link in stage_links(plan, c * p + r, stages=virtual).items()}
    dev = plan.devices[plan.device_index()[plan.stages[r].device]]
    log.info("stage %d (%d chunks): time scale %.4g real s per emulated s (limited by virtual %s)", r, v,
             scale.real_s_per_emulated_s, scale.limiting)
    return EmulationHooks(rank=run.rank, stage=r, device_label=f"{dev.id} ({dev.kind})", usable_bytes=dev.usable_bytes,
                          predicted=predicted[r], links=links, time_scale=scale.real_s_per_emulated_s, origin=scale,
                          chunk_predicted={k: predicted[k] for k in range(r, p * v, p)})
