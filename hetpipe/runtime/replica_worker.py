"""`hetpipe run` for a version-2 plan: one torchrun process per stage of every replica.

The worker (`hetpipe.runtime.worker.train`) hands a plan with ``replicas`` to
`train_replicas`, which checks it can run on this world size before joining the
process group, then drives a `ReplicaTrainer` over the same global batches on every
rank that reads data, and returns the rank's `RankResult` (stage = its index in
``plan.stages``; losses = the replicas' sample-weighted loss of the global batch).

With ``--emulate`` each rank pretends to be its plan device: its replica's links, one
time scale calibrated over every replica, the memory ledger, and the gradient sync (or
DiLoCo outer step) delayed to the plan's time (`hetpipe.runtime.emulate.replicas`).

Example:
    $ hetpipe run replicas.json --model gpt2-small --steps 100     # a plan from partition_replicas
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from hetpipe.errors import ConfigError
from hetpipe.plan.schema import Plan
from hetpipe.runtime.data import data_stream
from hetpipe.runtime.rank import (
    barrier,
    emulation_fields,
    gather_stage_ranks,
    join_process_group,
    loss_for,
    stage_for,
    touch,
)
from hetpipe.runtime.report import RankResult


def train_replicas(args: argparse.Namespace, state: Any) -> RankResult:
    """Run this rank's stage of its replica for ``args.steps`` steps (see the module docstring)."""
    from hetpipe.runtime.execute import heartbeat
    from hetpipe.runtime.emulate.pipeline import RecordingHooks
    from hetpipe.runtime.emulate.replicas import SwitchHooks, emulate_replicas
    from hetpipe.runtime.replicas.trainer import ReplicaTrainer, check_runnable

    plan = Plan.load(args.plan)
    check_runnable(plan, world_size=int(os.environ.get("WORLD_SIZE", "1")))  # refuse before joining
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    state.stage = stage_for(plan, node=args.node, rank=state.rank, local_rank=local_rank)
    state.phase = "joining the process group"
    backend = join_process_group(args.timeout)
    ranks = gather_stage_ranks(state.stage, len(plan.stages))
    heartbeat.install(args.run_dir / f"progress-rank{state.rank}")  # the executor beats per action from here
    hooks = SwitchHooks(RecordingHooks())
    state.hooks = hooks
    state.phase = "building the replica"
    trainer = ReplicaTrainer(plan, model=args.model, loss=loss_for(args.model, args.loss), lr=args.lr,
                             schedule=args.schedule, seq=args.seq, seed=args.seed, timeout_s=args.timeout,
                             stage_ranks=ranks, hooks=hooks,
                             overlap_sync=args.sync_overlap)
    reads = trainer.is_first or trainer.is_last
    stream = data_stream(args.data, model=args.model, global_batch=plan.training.global_batch, seed=args.seed,
                         example=trainer.example, meta_model=trainer.graph_module) if reads else None
    first = next(stream, None) if stream is not None else None
    if args.emulate:
        state.phase = "calibration"
        emulate_replicas(trainer, hooks, inputs=first[0] if first is not None else None,
                         targets=first[1] if first is not None else None, timeout_s=args.timeout,
                         safety_factor=args.safety_factor)
    step_s, losses, out = [], [], None
    for step in range(args.steps):
        state.phase = f"step {step}"
        batch = (first if step == 0 else next(stream, None)) if stream is not None else None
        if stream is not None and batch is None:
            raise ConfigError(f"--data ran out after {step} batches; the run needs {args.steps}")
        barrier(backend == "gloo", args.timeout)
        start = time.monotonic()
        out = trainer.step(*(batch if batch is not None else (None, None)))
        step_s.append(time.monotonic() - start)
        if trainer.is_last and out.loss is not None:
            losses.append(float(out.loss))
        touch(args.run_dir / f"progress-rank{state.rank}")
    state.phase = "finishing"
    trainer.finish()
    barrier(backend == "gloo", args.timeout)
    return _result(plan, trainer, hooks, out, step_s, losses, backend)


def _result(plan: Plan, trainer: Any, hooks: Any, out: Any, step_s: list[float], losses: list[float],
            backend: str) -> RankResult:
    stage = trainer.place.plan_stage
    dev = plan.devices[plan.device_index()[plan.stages[stage].device]]
    stats = out.stats if out is not None else None
    return RankResult(rank=trainer.place.rank, stage=stage, device=dev.id, kind=dev.kind, step_s=tuple(step_s),
                      losses=tuple(losses), backend=backend, **emulation_fields(hooks, stats, stage))
