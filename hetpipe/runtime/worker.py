"""The per-rank entry point torchrun runs: ``python -m hetpipe.runtime.worker plan.json --model M --steps N ...``.

On one node (``torchrun --standalone``) rank r runs stage r.  Across nodes, each node's
ranks run that node's stages in pipeline order: pass ``--plan-node NAME`` (the plan's node
name; or set ``HETPIPE_NODE``) and local rank k runs the k-th stage placed on that
node, whatever global rank the c10d rendezvous gave it (`stage_for`).  A plan with
tensor-parallel groups runs one rank per card instead (`hetpipe.plan.group_run.rank_slots`:
each group's lead first); after the join its members cut their shards and every rank learns the
layout (`hetpipe.runtime.tp_run.setup_groups`).  In order, with nothing distributed before step 5:

1. re-capture ``--model`` on the meta device and verify the plan's fingerprint;
2. map the plan units' fx node names to stage indices;
3. build the schedule (``training.schedule`` unless ``--schedule``) and validate it;
4. split the traced graph and build only this rank's stage, or chunks (`hetpipe.runtime.stage.build`);
5. join the process group, once, whatever the plan version (gloo on CPU, NCCL when CUDA is available),
   build the optimizer named by ``training.optimizer`` and the `PipelineExecutor`;
6. with ``--emulate``: measure one serialised F+B of every stage (chunk: `hetpipe.runtime.interleaved_run`), choose
   the time scale (`hetpipe.runtime.emulate.pipeline.choose_time_scale`) and install the emulation hooks;
7. run ``--steps`` steps (a monitored barrier, then the rank's action list) on seeded synthetic data or
   ``--data``, touching ``progress-rank<r>`` after each step and, through `hetpipe.runtime.execute.heartbeat`,
   at least every second while actions finish; with ``--resume`` the stage, its optimizer state and the data
   position are restored first and the steps continue after the checkpoint's; with ``--checkpoint-dir`` every
   ``--checkpoint-every`` steps and at the end every rank saves its stage (`hetpipe.runtime.checkpoint.state`);
8. write ``result-rank<r>.json``; on any failure write ``error-rank<r>.json`` naming
   the rank, stage and action, and exit 1 (torchrun then tears the job down).

A replica plan (version 2) runs the same loop: it is checked against the world size before step 5
(`hetpipe.runtime.replicas.trainer.check_runnable`), steps 1-4 happen in a `ReplicaTrainer` after the join
(it makes the replicas' process groups), and with ``--emulate`` `hetpipe.runtime.emulate.replicas` calibrates
every replica and delays the sync to the plan's time.  Each step is one global batch; the last stage of each
replica reports the replicas' sample-weighted loss.  ``--checkpoint-dir`` / ``--resume`` work as for a pipeline,
in the same files (`hetpipe.runtime.checkpoint.replicas`: replica 0 writes each tensor).

Example:
    $ torchrun --standalone --nproc-per-node=3 -m hetpipe.runtime.worker plan.json --model gpt-demo --steps 4 --emulate
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hetpipe.errors import ConfigError, HetpipeError
from hetpipe.plan.group_run import has_groups, rank_slots
from hetpipe.plan.schema import Plan
from hetpipe.runtime.execute import heartbeat
from hetpipe.runtime.execute.comm import peer_lost
from hetpipe.runtime.execute.options import ReplicaWiring
from hetpipe.runtime.tp_ranks import slot_for
from hetpipe.runtime.tp_run import member_predicted, save_grouped, setup_groups
from hetpipe.runtime.faults.watch import step_watch
from hetpipe.runtime.launch import RankError, write_error
from hetpipe.cost_models.cpu_cores import available_cores
from hetpipe.runtime.pinning import pin_stage
from hetpipe.runtime.update_timer import UpdateTimer
from hetpipe.runtime.report import RankResult, median
from hetpipe.runtime.steps_done import record_step
from hetpipe.runtime.switch import SwitchPoint, add_switch_args, at_boundaries
from hetpipe.runtime.stage.buffers import ModelBuffers, kept_buffers
from hetpipe.runtime.data import data_stream, split_microbatches
from hetpipe.runtime.emulate.pipeline import RecordingHooks
from hetpipe.runtime.emulate.replicas import SwitchHooks, emulate_replicas
from hetpipe.runtime.rank import (
    error_message,
    CALIBRATION_PASSES,
    RankState,
    barrier,
    capture_for_plan,
    resolve_for_plan,
    device_backend,
    emulation_fields,
    gather_stage_ranks,
    join_process_group,
    loss_for,
    make_optimizer,
    stage_optimizer,
    node_to_stage,
    recompute_nodes, selective_nodes,
    stage_for,
    stage_links,
    touch,
)
from hetpipe.runtime.replicas.shard import ShardedOptimizer
from hetpipe.runtime.replicas.trainer import ReplicaTrainer, check_runnable
from hetpipe.runtime.checkpoint.replicas import replica_checkpoints

log = logging.getLogger("hetpipe.worker")

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hetpipe.runtime.worker", description="one pipeline stage (run by torchrun)")
    p.add_argument("plan", type=Path)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--loss", default=None)
    p.add_argument("--weights", default=None)
    p.add_argument("--save-weights", default=None)
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--resume", type=Path, default=None, help="a complete checkpoint folder (or a folder of them)")
    p.add_argument("--safety-factor", type=float, default=None)
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--no-sync-overlap", dest="sync_overlap", action="store_false")
    p.add_argument("--inject", action="append", default=[], help="a fault (hetpipe.runtime.faults.inject)")
    p.add_argument("--straggler-margin", type=float, default=None)
    p.add_argument("--straggler-steps", type=int, default=None)
    add_switch_args(p)  # --switch-at, --switch-listen (runtime/switch.py)
    # Not "--node": torchrun's own parser would take it for an abbreviation of --node-rank.
    p.add_argument("--plan-node", dest="node", default=os.environ.get("HETPIPE_NODE"),
                   help="the plan node this torchrun agent runs (multi-node jobs; default: one node)")
    return p.parse_args(argv)


def _microbatches(batch: tuple[Any, Any] | None, plan: Plan, stage: int) -> tuple[list[Any] | None, list[Any] | None]:
    """This stage's share of a global batch: inputs on the first stage, targets on the last."""
    if batch is None:
        return None, None
    m, last = plan.training.microbatches, len(plan.stages) - 1
    inputs = split_microbatches(batch[0], m, what="inputs") if stage == 0 else None
    targets = split_microbatches(batch[1], m, what="targets") if stage == last else None
    return inputs, targets


class _Run:
    """One rank's run: the plan, its stage, and what it needs to execute (built in `prepare`)."""

    def __init__(self, args: argparse.Namespace, plan: Plan, stage: Any, stage_index: int, actions: list[Any],
                 meta_model: Any, example: tuple[torch.Tensor, ...]) -> None:
        self.args, self.plan, self.stage, self.index, self.actions = args, plan, stage, stage_index, actions
        self.meta_model, self.example = meta_model, example
        self.rank = int(os.environ.get("RANK", "0"))
        self.num_stages = len(plan.stages)
        self.stage_ranks: list[int] = list(range(self.num_stages))
        self.saved_names: dict[str, str] = {}  # local -> saved name (`hetpipe.runtime.stage.weights.saved_names`)
        self.program: Any = None  # the `StagedProgram` (checkpoints name every stage's tensors from it)
        self.slot: Any = None  # `RankSlot`: (stage, member of its tensor-parallel group, device)
        self.units: Any = ()  # the captured units (a group member shards its stage's blocks)
        self.wiring = ReplicaWiring()  # a tensor-parallel plan's (`hetpipe.runtime.tp_run.setup_groups`)
        self.groups: Any = None  # its `GroupSetup`

    def executor(self, *, actions: Sequence[Any], optimizer: Any, microbatches: int, hooks: Any,
                 loss_fn: Any) -> Any:
        from hetpipe.runtime.execute.executor import PipelineExecutor
        from hetpipe.runtime.execute.options import ExecutorOptions

        v = len(getattr(self.stage, "modules", (self.stage,)))  # interleaved: chunk c p + r on stage r's rank
        return PipelineExecutor(self.stage, rank=self.rank, num_stages=self.num_stages * v, schedule_actions=actions,
                                loss_fn=loss_fn, optimizer=optimizer, microbatches=microbatches,
                                stage_ranks=list(self.stage_ranks) * v, options=ExecutorOptions(timeout_s=self.args.timeout),
                                hooks=hooks, wiring=self.wiring)

    def data(self, start: int = 0) -> Any:
        a = self.args
        return data_stream(a.data, model=a.model, global_batch=self.plan.training.global_batch, seed=a.seed,
                           example=self.example, meta_model=self.meta_model, start=start)


def prepare(args: argparse.Namespace, state: RankState, *, plan: Plan | None = None,
            state_dict: Any = None) -> _Run:
    """Steps 1-4, before any process group work: capture, verify, schedule, this rank's stage.

    ``plan`` (default: loaded from ``args.plan``) and ``state_dict`` (default: seeded
    weights) come from `hetpipe.runtime.trainer.Trainer`.
    """
    from hetpipe.schedule.builders import make_schedule, validate_schedule
    from hetpipe.runtime.execute.chunks import RankStages
    from hetpipe.runtime.stage.build import build_chunks, split_stages
    from hetpipe.runtime.stage.weights import check_stage, open_weights, saved_names

    state.phase = "loading the plan"
    plan = plan if plan is not None else Plan.load(args.plan)
    p, m, cards = len(plan.stages), plan.training.microbatches, len(rank_slots(plan))
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != cards:
        raise ConfigError(f"the plan has {p} stages on {cards} cards but torchrun started {world} processes; launch "
                          f"with --nproc-per-node={cards} (or one process per card on each node)")
    if args.emulate and int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        raise ConfigError("--emulate runs every stage on one host (emulated links time messages with the host's "
                          "CLOCK_MONOTONIC); launch it with `hetpipe run --emulate`, not across nodes")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    slot = slot_for(plan, node=args.node, rank=state.rank, local_rank=local_rank) if has_groups(plan) else None
    state.stage = slot.stage if slot else stage_for(plan, node=args.node, rank=state.rank, local_rank=local_rank)
    state.phase = "capture"
    graph, example = capture_for_plan(plan, model=args.model, seq=args.seq)
    mapping = node_to_stage(plan, graph.module)
    state.phase = "schedule validation"
    schedule = make_schedule(args.schedule or plan.training.schedule, p, m)
    validate_schedule(schedule, num_stages=p, num_microbatches=m)
    state.phase, built_from = "building the stage", time.monotonic()
    program = split_stages(graph.module, mapping, example_inputs=example, num_stages=p * max(1, len(plan.stages[0].chunks)))
    if state_dict is None and getattr(args, "weights", None):
        state.phase = "checking --weights"
        state_dict = open_weights(args.weights)
        check_stage(program, state.stage, state_dict)  # names and shapes from the headers, before any read
        state.phase = "building the stage"
    built = build_chunks(program, state.stage, ranks=p, state_dict=state_dict, device=device_backend(local_rank)[1],
                         seed=args.seed, buffers=ModelBuffers(resolve_for_plan(plan, model=args.model, seq=args.seq).model),
                         recompute=recompute_nodes(plan, state.stage), selective=selective_nodes(plan, state.stage))
    stage = built[0] if len(built) == 1 else RankStages.of(built)  # interleaved: the rank's chunks
    run = _Run(args, plan, stage, state.stage, schedule[state.stage], graph.module, example)
    run.saved_names, state.build_s = saved_names(program, state.stage), time.monotonic() - built_from  # prices a switch
    run.program, run.slot, run.units, run.graph = program, slot, graph.units, graph  # graph: re-cut by a switch
    return run


def calibrate(run: _Run, *, loss_fn: Any, batch: tuple[Any, Any] | None) -> list[Any]:
    """One micro-batch through the whole pipeline, `CALIBRATION_PASSES` times: uncontended real F/B per stage.

    With a single micro-batch the pipeline is serial (each rank computes while the
    others wait in a receive), which is the single-process measurement
    `hetpipe.runtime.emulate.pipeline.choose_time_scale` wants.  The optimizer is SGD with
    learning rate 0, so the weights are untouched.  Returns every stage's `StageTiming`.
    """
    from hetpipe.runtime.emulate.pipeline import StageTiming
    from hetpipe.schedule.builders import make_schedule

    hooks = RecordingHooks()
    executor = run.executor(actions=make_schedule("gpipe", run.num_stages, 1)[run.index],
                            optimizer=torch.optim.SGD(run.stage.parameters(), lr=0.0), microbatches=1,
                            hooks=hooks, loss_fn=loss_fn)
    inputs, targets = _microbatches(batch, run.plan, run.index)
    with kept_buffers(run.stage.module):  # calibration is not training: BatchNorm statistics are restored
        for _ in range(CALIBRATION_PASSES):
            executor.step(inputs[:1] if inputs else None, targets[:1] if targets else None)
    every: list[Any] = [None] * dist.get_world_size()  # per rank: per stage, or per card of a grouped plan
    dist.all_gather_object(every, (run.index, median(hooks.fwd_compute_s[1:]), median(hooks.bwd_compute_s[1:])))
    if run.slot is not None:
        return [StageTiming(f, b) for _, f, b in every]
    by_stage = {s: StageTiming(f, b) for s, f, b in every}
    return [by_stage[s] for s in range(run.num_stages)]


def _emulation_hooks(run: _Run, loss_fn: Any, batch: tuple[Any, Any] | None) -> Any:
    from hetpipe.runtime.emulate.pipeline import DEFAULT_SAFETY_FACTOR, EmulationHooks, StageTiming, choose_time_scale
    from hetpipe.schedule.builders import is_split

    if hasattr(run.stage, "modules"):  # an interleaved plan's chunks, each emulated on its own (interleaved_run.py)
        from hetpipe.runtime.interleaved_run import emulation_hooks
        return emulation_hooks(run, loss_fn=loss_fn, safety_factor=run.args.safety_factor,
                               inputs=(mb := _microbatches(batch, run.plan, run.index))[0], targets=mb[1])
    plan, s = run.plan, run.index
    measured = calibrate(run, loss_fn=loss_fn, batch=batch)
    split = is_split(run.args.schedule or plan.training.schedule)  # B and W emulated apart
    predicted = [StageTiming(st.fwd_s, st.bwd_s, st.offload_s, st.bwd_weight_s if split else 0.0) for st in plan.stages]
    if run.slot is not None:  # one timing per card: a group member at its own share (tp_run.member_predicted)
        predicted = [member_predicted(plan, slot, predicted[slot.stage]) for slot in rank_slots(plan)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", run.num_stages))
    scale = choose_time_scale(measured, predicted, num_ranks=local_ranks, num_cores=cores,
                              safety_factor=run.args.safety_factor or DEFAULT_SAFETY_FACTOR)
    dev = plan.devices[plan.device_index()[run.slot.device if run.slot else plan.stages[s].device]]
    log.info("stage %d: time scale %.4g real s per emulated s (limited by %s)", s, scale.real_s_per_emulated_s,
             scale.limiting)
    return EmulationHooks(rank=run.rank, stage=s, device_label=f"{dev.id} ({dev.kind})", usable_bytes=dev.usable_bytes,
                          predicted=predicted[run.rank if run.slot else s], links=stage_links(plan, s),
                          time_scale=scale.real_s_per_emulated_s, origin=scale)


@dataclass(frozen=True)
class _RankLoop:
    """What the step loop drives, for either plan version: one step on a global batch, the hooks
    whose records go into the result, this rank's plan stage, and its data."""

    step: Callable[[Any], tuple[Any, float | None]]  # global batch (or None) -> (executor stats, loss or None)
    hooks: Any
    plan_stage: int
    stream: Iterator[Any] | None
    first: Any
    finish: Callable[[], Any] = lambda: None
    start: int = 0  # steps already taken (a resumed run continues with step `start`)
    after_step: Callable[[int, bool], None] = lambda steps_done, last: None  # checkpoints
    update_s: Callable[[], list[float]] = list  # seconds of each optimizer.step() (runtime/update_timer.py)
    slot: Any = None  # `RankSlot` of a plan with tensor-parallel groups (its member and card)
    switch: Callable[[int], Any] = lambda steps_done: None  # steps done -> `Switched` or None (runtime/switch.py)


def _pipeline_rank(args: argparse.Namespace, state: RankState, run: _Run, ranks: list[int], hooks: Any = None) -> Any:
    """A single pipeline (plan version 1): (calibration,) the optimizer and executor (``hooks``: a switch's)."""
    run.stage_ranks = ranks
    last = run.index == run.num_stages - 1
    loss_fn = loss_for(args.model, args.loss) if last else None
    if run.groups is not None:  # a head split by vocabulary runs the vocab-parallel loss (runtime/tp_vocab.py)
        loss_fn = run.groups.loss(loss_fn)
    resume = _resume_point(args)
    stream = run.data(resume[1].batches_consumed if resume else 0) if run.index == 0 or last else None
    first = next(stream, None) if stream is not None else None
    state.phase = "calibration"
    hooks = hooks if hooks is not None else _emulation_hooks(run, loss_fn, first) if args.emulate else RecordingHooks()
    state.hooks = hooks
    optimizer = stage_optimizer(run.plan, run.index, list(run.stage.parameters()), lr=args.lr)
    timer = UpdateTimer.attach(optimizer)
    executor = run.executor(actions=run.actions, optimizer=optimizer, microbatches=run.plan.training.microbatches,
                            hooks=hooks, loss_fn=loss_fn)
    start, after_step, saved = _checkpoints(args, state, run, optimizer, resume)

    def step(batch: Any) -> tuple[Any, float | None]:
        stats = executor.step(*_microbatches(batch, run.plan, run.index))
        return stats, stats.loss

    def finish() -> None:  # collective: every stage writes its shard, stage 0 the index
        if args.save_weights:
            from hetpipe.runtime.stage.weights import save_pipeline

            state.phase = "saving the weights"
            if run.groups is not None:  # members gather their shards back, the leads write
                save_grouped(run.groups, run.plan, run.stage, run.units, names=run.saved_names,
                             out_dir=args.save_weights)
            else:
                save_pipeline(run.stage.module, run.saved_names, args.save_weights, stage=run.index,
                              num_stages=run.num_stages)

    return _RankLoop(step, hooks, run.index, stream, first, finish=finish, start=start, after_step=after_step,
                     update_s=lambda: timer.durations_s, slot=run.slot, switch=at_boundaries(  # runtime/switch.py
                         state, args=args, run=run, saved=saved, hooks=hooks,
                         make_loop=lambda a, r, h, rk: _pipeline_rank(a, state, r, rk, h)))


def _resume_point(args: argparse.Namespace) -> Any:
    """(folder, `CheckpointInfo`) of ``--resume``, or None."""
    if getattr(args, "resume", None) is None:
        return None
    from hetpipe.runtime.checkpoint.files import find_checkpoint

    return find_checkpoint(args.resume)


def _checkpoints(args: argparse.Namespace, state: RankState, run: _Run, optimizer: Any,
                 resume: Any) -> tuple[int, Callable[[int, bool], None], Any]:
    """Restore ``--resume`` (collective) and return (steps already taken, the per-step saver, what it saves)."""
    from hetpipe.runtime.checkpoint.state import for_run, resume_stage, save_checkpoint

    st, ckpt = for_run(run, optimizer, root=getattr(args, "checkpoint_dir", None),
                       every=getattr(args, "checkpoint_every", None), model=args.model, seed=args.seed)
    start = 0
    if resume is not None:
        state.phase = "resuming from the checkpoint"
        start = resume_stage(resume[0], resume[1], st, program=run.program, ckpt=ckpt)

    def after_step(steps_done: int, last: bool) -> None:
        if ckpt.due(steps_done, last=last):
            state.phase = f"saving the checkpoint of step {steps_done}"
            save_checkpoint(ckpt.root, step=steps_done, state=st, info=ckpt.info(steps_done))

    return start, after_step, (st, ckpt)


def _replica_rank(args: argparse.Namespace, state: RankState, plan: Plan, ranks: list[int]) -> _RankLoop:
    """This rank's stage of its replica (plan version 2), (calibrated and) emulated with ``--emulate``."""
    from hetpipe.runtime.stage.weights import open_weights

    hooks = SwitchHooks(RecordingHooks())
    state.hooks = hooks
    state.phase = "building the replica"
    trainer = ReplicaTrainer(plan, model=args.model, loss=loss_for(args.model, args.loss), lr=args.lr,
                             schedule=args.schedule, seq=args.seq, seed=args.seed, timeout_s=args.timeout,
                             stage_ranks=ranks, hooks=hooks, overlap_sync=args.sync_overlap,
                             state_dict=open_weights(args.weights))
    reads = trainer.is_first or trainer.is_last
    resume = _resume_point(args)  # one global batch per step: the data position is the checkpoint's step count
    stream = data_stream(args.data, model=args.model, global_batch=plan.training.global_batch, seed=args.seed,
                         example=trainer.example, meta_model=trainer.graph_module,
                         start=resume[1].batches_consumed if resume else 0) if reads else None
    first = next(stream, None) if stream is not None else None
    if args.emulate:
        state.phase = "calibration"
        emulate_replicas(trainer, hooks, inputs=first[0] if first is not None else None,
                         targets=first[1] if first is not None else None, timeout_s=args.timeout,
                         safety_factor=args.safety_factor)
    start, after_step = replica_checkpoints(args, trainer, resume, lambda phase: setattr(state, "phase", phase))
    # S_s prices the stage's own update: a sharded group's inner step over its slice, not the all-gather after it
    opt = trainer.optimizer
    timer = UpdateTimer.attach(opt.inner if isinstance(opt, ShardedOptimizer) else opt)

    def step(batch: Any) -> tuple[Any, float | None]:
        out = trainer.step(*(batch if batch is not None else (None, None)))
        return out.stats, out.loss if trainer.is_last else None  # every rank has the loss; the last reports it

    return _RankLoop(step, hooks, trainer.place.plan_stage, stream, first, finish=trainer.finish, start=start,
                     after_step=after_step, update_s=lambda: timer.durations_s)


def _run_steps(args: argparse.Namespace, state: RankState, loop: _RankLoop, *, plan: Plan,
               backend: str, watch: Any) -> RankResult:
    """Step 7: the same loop for every plan version: barrier, one step, heartbeat; then the result.

    ``watch`` (`hetpipe.runtime.faults.watch.StepWatch`) injects ``--inject`` faults before each
    step and checks the step's times against the plan after it (stragglers)."""
    progress = args.run_dir / f"progress-rank{state.rank}"
    step_s, losses, stats, optimizer_s, origin_s = [], [], None, [], 0.0
    for step in range(loop.start, args.steps):
        state.phase = f"step {step}"
        watch.before_step(step)
        batch = (loop.first if step == loop.start else next(loop.stream, None)) if loop.stream is not None else None
        if loop.stream is not None and batch is None:
            raise ConfigError(f"--data ran out after {step} batches; the run needs {args.steps}")
        barrier(backend == "gloo", args.timeout)
        start = origin_s = time.monotonic()  # else StepStats.origin_s: the executor's own (measured_links.py)
        stats, loss = loop.step(batch)
        step_s.append(time.monotonic() - start)
        watch.after_step(step)
        optimizer_s.append(getattr(stats, "optimizer_s", 0.0))  # the STEP action (issue 17: S_s measured)
        if loss is not None:
            losses.append(float(loss))
        loop.after_step(step + 1, step + 1 == args.steps)
        touch(progress)
        record_step(args.run_dir, rank=state.rank, stage=loop.plan_stage, steps_done=step + 1, step_s=step_s,
                    hooks=loop.hooks, build_s=getattr(state, "build_s", 0.0))  # for a supervisor (steps_done.py)
        moved = loop.switch(step + 1) if step + 1 < args.steps else None
        if moved:  # in place onto a new plan (runtime/switch.py): the loop goes on with the next step
            loop, watch, plan, state.watch = moved.loop, moved.watch, moved.plan, moved.watch
    state.phase = "finishing"
    loop.finish()
    barrier(backend == "gloo", args.timeout)
    slot = loop.slot  # a card of a grouped plan: its own device, and its timings at its rank (calibrate)
    dev = plan.devices[plan.device_index()[slot.device if slot else plan.stages[loop.plan_stage].device]]
    return RankResult(rank=state.rank, stage=loop.plan_stage, member=slot.member if slot else 0, device=dev.id,
                      kind=dev.kind, step_s=tuple(step_s), update_s=tuple(loop.update_s()),
                      losses=tuple(losses), backend=backend, optimizer_s=tuple(optimizer_s),
                      step_origin_s=getattr(stats, "origin_s", 0.0) or origin_s, cores=available_cores(),
                      **emulation_fields(loop.hooks, stats, state.rank if slot else loop.plan_stage),
                      **watch.result_fields())


def train(args: argparse.Namespace, state: RankState) -> RankResult:
    """The whole rank, for every plan version: check and build what needs no peers, join the
    process group once, (calibrate), run the steps, return the result."""
    plan = Plan.load(args.plan)
    run = None
    if plan.replicas:
        check_runnable(plan, world_size=int(os.environ.get("WORLD_SIZE", "1")))  # refuse before joining
        state.stage = stage_for(plan, node=args.node, rank=state.rank,
                                local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    else:
        run = prepare(args, state, plan=plan)  # steps 1-4
    pin_stage(plan, state.stage, emulate=args.emulate)  # a core-group device: run where it was measured
    state.phase = "joining the process group"
    backend = join_process_group(args.timeout)  # step 5, the one join
    if run is not None and run.slot is not None:  # tensor-parallel groups: layout, groups, shards (tp_run.py)
        state.phase = "setting up the tensor-parallel groups"
        setup = setup_groups(plan, run.slot, run.stage, run.units, timeout_s=args.timeout, source=run)
        ranks, run.wiring, run.groups = list(setup.layout.executor_ranks), setup.wiring, setup
    else:
        ranks = gather_stage_ranks(state.stage, len(plan.stages))
    heartbeat.install(args.run_dir / f"progress-rank{state.rank}")  # the executor beats per action from here
    state.switch = SwitchPoint.from_args(args, state.rank) if run is not None else None
    loop = _replica_rank(args, state, plan, ranks) if run is None else _pipeline_rank(args, state, run, ranks)
    state.watch = step_watch(args, plan=plan, stage=loop.plan_stage, rank=state.rank, stage_ranks=ranks,
                             hooks=loop.hooks, first_step=loop.start)
    return _run_steps(args, state, loop, plan=plan, backend=backend, watch=state.watch)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank; exit 0 on success, 1 after writing ``error-rank<r>.json``."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = parse_args(argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)  # multi-node: each node's torchrun names its own, new folder
    state = RankState(rank)
    try:
        result = train(args, state)
    except BaseException as err:  # noqa: BLE001 - every failure must reach the error file
        message = error_message(err, state)
        if getattr(state, "watch", None) is not None:  # a timeout under an injected link cut names the link
            message = state.watch.explain(message)
        if not isinstance(err, HetpipeError):
            traceback.print_exc()
        action = str(getattr(state.hooks, "current", "")) if state.phase.startswith("step") else state.phase
        kind = "RuntimeFailure" if peer_lost(err) is not None else type(err).__name__
        write_error(args.run_dir, RankError(rank, state.stage, action, message, kind, time.time()))
        log.error("%s", message)
        sys.stderr.flush()
        # The process group may be wedged (a dead peer): exit without tearing it down.
        os._exit(1)
    result.save(args.run_dir / f"result-rank{rank}.json")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
