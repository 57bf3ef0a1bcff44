"""The per-rank entry point torchrun runs: ``python -m hetpipe.runtime.worker plan.json --model M --steps N ...``.

On one node (``torchrun --standalone``) rank r runs stage r.  Across nodes, each node's
ranks run that node's stages in pipeline order: pass ``--plan-node NAME`` (the plan's node
name; or set ``HETPIPE_NODE``) and local rank k runs the k-th stage placed on that
node, whatever global rank the c10d rendezvous gave it (`stage_for`).  In order,
with nothing distributed before step 5:

1. re-capture ``--model`` on the meta device and verify the plan's fingerprint;
2. map the plan units' fx node names to stage indices;
3. build the schedule (``training.schedule`` unless ``--schedule``) and validate it;
4. split the traced graph and build only this rank's stage (`hetpipe.runtime.stage.build`);
5. join the process group (gloo on CPU, NCCL when CUDA is available), build the
   optimizer named by ``training.optimizer`` and the `PipelineExecutor`;
6. with ``--emulate``: measure one serialised F+B of every stage, choose the time
   scale (`hetpipe.runtime.emulate.pipeline.choose_time_scale`) and install the emulation hooks;
7. run ``--steps`` steps (a monitored barrier, then the rank's action list) on seeded
   synthetic data or ``--data``, touching ``progress-rank<r>`` after each step and, through
   `hetpipe.runtime.execute.heartbeat`, at least every second while actions finish;
8. write ``result-rank<r>.json``; on any failure write ``error-rank<r>.json`` naming
   the rank, stage and action, and exit 1 (torchrun then tears the job down).

Example:
    $ torchrun --standalone --nproc-per-node=3 -m hetpipe.runtime.worker plan.json \\
        --model gpt-demo --steps 4 --run-dir run --emulate
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetpipe.errors import ConfigError, HetpipeError, PlanError, RuntimeFailure
from hetpipe.plan.schema import Plan, verify_model
from hetpipe.runtime.execute import heartbeat
from hetpipe.runtime.launch import RankError, write_error
from hetpipe.runtime.report import ActionRecord, RankResult, median
from hetpipe.runtime.run import _import, data_stream, split_microbatches
from hetpipe.runtime.stage.buffers import ModelBuffers, kept_buffers

log = logging.getLogger("hetpipe.worker")

# Default learning rates: Adam's paper default (Kingma & Ba 2015) and a common SGD one.
DEFAULT_LR = {"adam": 1e-3, "adamw": 1e-3, "sgd": 1e-2, "momentum": 1e-2}
MOMENTUM = 0.9  # "momentum" optimizer: SGD with the classic heavy-ball coefficient
# Calibration passes of one micro-batch through the pipeline; the first is warm-up
# (lazy allocations, first-call dispatch), the median of the rest is used.
CALIBRATION_PASSES = 4


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
    p.add_argument("--safety-factor", type=float, default=None)
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--no-sync-overlap", dest="sync_overlap", action="store_false")
    # Not "--node": torchrun's own parser would take it for an abbreviation of --node-rank.
    p.add_argument("--plan-node", dest="node", default=os.environ.get("HETPIPE_NODE"),
                   help="the plan node this torchrun agent runs (multi-node jobs; default: one node)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- model and plan


def resolve_for_plan(plan: Plan, *, model: str, seq: int | None) -> Any:
    """``model`` on meta (`hetpipe.models.ResolvedModel`); a fresh one per call (its buffers: `ModelBuffers`)."""
    from hetpipe import models

    sized = models.takes_size(model)  # built-in and Hugging Face models: sized like the plan's micro-batch
    return models.resolve(model, device="meta", batch=plan.training.micro_batch_size if sized else None,
                          seq=seq if sized else None)


def capture_for_plan(plan: Plan, *, model: str, seq: int | None) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """(UnitGraph, one meta micro-batch) of ``model``, verified against ``plan``'s fingerprint."""
    from hetpipe.partitioner.capture.capture import capture

    resolved = resolve_for_plan(plan, model=model, seq=seq)
    if resolved.example_inputs is None:
        raise ConfigError(f"model factory {model!r} returned no example inputs; return (module, example_inputs) "
                          "with one micro-batch so the plan's fingerprint can be checked")
    graph = capture(resolved.model, resolved.example_inputs, name=model, optimizer=plan.training.optimizer,
                    precision=plan.training.precision)
    verify_model(plan, graph)
    return graph, resolved.example_inputs


def node_to_stage(plan: Plan, graph_module: Any) -> dict[str, int]:
    """fx node name -> stage index, from the plan's units and stage ranges.

    Example:
        >>> # plan stage 0 holds units 0-1, stage 1 unit 2: every node of units 0-1 maps to 0
    """
    known = {n.name for n in graph_module.graph.nodes}
    unit_stage = {u: st.index for st in plan.stages for u in range(st.first_unit, st.last_unit + 1)}
    out: dict[str, int] = {}
    for unit in plan.units:
        for name in unit.node_names:
            if name not in known:
                raise PlanError(f"plan unit {unit.index} ({unit.name}) names fx node {name!r}, which the captured "
                                "model does not have; re-plan it with `hetpipe plan`")
            out[name] = unit_stage[unit.index]
    return out


def make_optimizer(name: str, params: Sequence[nn.Parameter], *, lr: float | None) -> torch.optim.Optimizer:
    """The optimizer ``training.optimizer`` names: adam, adamw, sgd or momentum.

    Example:
        >>> type(make_optimizer("momentum", [nn.Parameter(torch.zeros(1))], lr=None)).__name__
        'SGD'
    """
    key = name.lower()
    if key not in DEFAULT_LR:
        raise ConfigError(f"unknown optimizer {name!r} in the plan; use one of {', '.join(DEFAULT_LR)}")
    rate = DEFAULT_LR[key] if lr is None else lr
    if key == "adam":
        return torch.optim.Adam(params, lr=rate)
    if key == "adamw":
        return torch.optim.AdamW(params, lr=rate)
    return torch.optim.SGD(params, lr=rate, momentum=MOMENTUM if key == "momentum" else 0.0)


def stage_for(plan: Plan, *, node: str | None, rank: int, local_rank: int) -> int:
    """The stage this process runs: ``rank`` on one node, else the ``local_rank``-th stage on ``node``.

    Example:
        >>> # plan stages on nodes (desk, desk, shelf): node "shelf", local rank 0 -> stage 2
    """
    if node is None:
        return rank
    here = [st.index for st in plan.stages if plan.devices[plan.device_index()[st.device]].node == node]
    if not here:
        nodes = sorted({d.node for d in plan.devices})
        raise ConfigError(f"--plan-node {node!r} runs no stage of this plan; the plan's nodes are {nodes}")
    if local_rank >= len(here):
        raise ConfigError(f"node {node!r} has {len(here)} stages in the plan but torchrun started local rank "
                          f"{local_rank}; use --nproc-per-node={len(here)} on that node")
    return here[local_rank]


def stage_ranks(stage_of_rank: Sequence[int], num_stages: int) -> list[int]:
    """Global rank of each stage from every rank's stage (all-gathered); refuses gaps and duplicates.

    Example:
        >>> stage_ranks([2, 0, 1], 3)
        [1, 2, 0]
    """
    if sorted(stage_of_rank) != list(range(num_stages)):
        raise ConfigError(f"the ranks run stages {list(stage_of_rank)}, but each of the {num_stages} stages needs "
                          "exactly one rank; give each node --plan-node with its plan name and --nproc-per-node equal "
                          "to its stage count")
    return [list(stage_of_rank).index(s) for s in range(num_stages)]


# ----------------------------------------------------------------------------- emulation inputs


def device_label(plan: Plan, stage: int) -> str:
    """``"n1:0 (rtx3060-12gb)"``: the plan device of ``stage``, for messages."""
    dev = plan.devices[plan.device_index()[plan.stages[stage].device]]
    return f"{dev.id} ({dev.kind})"


def stage_links(plan: Plan, stage: int, *, stages: Sequence[Any] | None = None) -> dict[int, tuple[float, float]]:
    """Cut -> (bandwidth_bytes_s, latency_s) of the plan link ``stage`` sends over on that cut.

    ``stages`` is the pipeline ``stage`` indexes (default ``plan.stages``; a replica plan
    passes one replica's own stages, so its neighbours are that replica's).
    """
    links = {(l.src, l.dst): l for l in plan.links}
    pipe = plan.stages if stages is None else stages
    here, out = pipe[stage].device, {}
    for cut, peer in ((stage, stage + 1), (stage - 1, stage - 1)):
        if 0 <= peer < len(pipe):
            link = links.get((here, pipe[peer].device))
            if link is None:
                raise PlanError(f"the plan has no link {here} -> {pipe[peer].device} (stage {stage} -> "
                                f"{peer}); add it to `links` or re-plan")
            out[cut] = (link.bandwidth_bytes_s, link.latency_s)
    return out


# ----------------------------------------------------------------------------- the run


class _State:
    """Where this rank is, for the error file."""

    def __init__(self, rank: int) -> None:
        self.rank, self.stage, self.phase, self.hooks = rank, rank, "start-up", None


def _touch(path: Path) -> None:
    path.write_text(str(time.time()))


def _backend(local_rank: int) -> tuple[str, torch.device]:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def _loss_fn(args: argparse.Namespace) -> Any:
    if args.loss:
        return _import(args.loss, "--loss")
    from hetpipe.models import loss_fn

    try:
        return loss_fn(args.model)
    except ConfigError:
        raise ConfigError(f"model {args.model!r} is not built in, so hetpipe has no loss for it; pass --loss "
                          "package.module:function") from None


def _barrier(gloo: bool, timeout_s: float) -> None:
    if gloo:  # names the rank that did not arrive
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
    else:
        dist.barrier()


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

    def executor(self, *, actions: Sequence[Any], optimizer: Any, microbatches: int, hooks: Any,
                 loss_fn: Any) -> Any:
        from hetpipe.runtime.execute.executor import PipelineExecutor

        return PipelineExecutor(self.stage, rank=self.rank, num_stages=self.num_stages, schedule_actions=actions,
                                loss_fn=loss_fn, optimizer=optimizer, microbatches=microbatches,
                                timeout_s=self.args.timeout, hooks=hooks, stage_ranks=self.stage_ranks)

    def data(self) -> Any:
        a = self.args
        return data_stream(a.data, model=a.model, global_batch=self.plan.training.global_batch, seed=a.seed,
                           example=self.example, meta_model=self.meta_model)


def prepare(args: argparse.Namespace, state: _State, *, plan: Plan | None = None,
            state_dict: Any = None) -> _Run:
    """Steps 1-4, before any process group work: capture, verify, schedule, this rank's stage.

    ``plan`` (default: loaded from ``args.plan``) and ``state_dict`` (default: seeded
    weights) come from `hetpipe.runtime.trainer.Trainer`.
    """
    from hetpipe.schedule.builders import make_schedule, validate_schedule
    from hetpipe.runtime.stage.build import build_stage, split_stages
    from hetpipe.runtime.stage.weights import check_stage, open_weights, saved_names

    state.phase = "loading the plan"
    plan = plan if plan is not None else Plan.load(args.plan)
    p, m = len(plan.stages), plan.training.microbatches
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != p:
        raise ConfigError(f"the plan has {p} stages but torchrun started {world} processes; launch with "
                          f"--nproc-per-node={p} (or one process per stage on each node)")
    if args.emulate and int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        raise ConfigError("--emulate runs every stage on one host (emulated links time messages with the host's "
                          "CLOCK_MONOTONIC); launch it with `hetpipe run --emulate`, not across nodes")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    state.stage = stage_for(plan, node=args.node, rank=state.rank, local_rank=local_rank)
    state.phase = "capture"
    graph, example = capture_for_plan(plan, model=args.model, seq=args.seq)
    mapping = node_to_stage(plan, graph.module)
    state.phase = "schedule validation"
    schedule = make_schedule(args.schedule or plan.training.schedule, p, m)
    validate_schedule(schedule, num_stages=p, num_microbatches=m)
    state.phase = "building the stage"
    program = split_stages(graph.module, mapping, example_inputs=example, num_stages=p)
    if state_dict is None and getattr(args, "weights", None):
        state.phase = "checking --weights"
        state_dict = open_weights(args.weights)
        check_stage(program, state.stage, state_dict)  # names and shapes from the headers, before any read
        state.phase = "building the stage"
    stage = build_stage(program, state.stage, state_dict=state_dict, device=_backend(local_rank)[1], seed=args.seed,
                        buffers=ModelBuffers(resolve_for_plan(plan, model=args.model, seq=args.seq).model))
    run = _Run(args, plan, stage, state.stage, schedule[state.stage], graph.module, example)
    run.saved_names = saved_names(program, state.stage)
    return run


def calibrate(run: _Run, *, loss_fn: Any, batch: tuple[Any, Any] | None) -> list[Any]:
    """One micro-batch through the whole pipeline, `CALIBRATION_PASSES` times: uncontended real F/B per stage.

    With a single micro-batch the pipeline is serial (each rank computes while the
    others wait in a receive), which is the single-process measurement
    `hetpipe.runtime.emulate.pipeline.choose_time_scale` wants.  The optimizer is SGD with
    learning rate 0, so the weights are untouched.  Returns every stage's `StageTiming`.
    """
    from hetpipe.runtime.emulate.pipeline import RecordingHooks, StageTiming
    from hetpipe.schedule.builders import make_schedule

    hooks = RecordingHooks()
    executor = run.executor(actions=make_schedule("gpipe", run.num_stages, 1)[run.index],
                            optimizer=torch.optim.SGD(run.stage.parameters(), lr=0.0), microbatches=1,
                            hooks=hooks, loss_fn=loss_fn)
    inputs, targets = _microbatches(batch, run.plan, run.index)
    with kept_buffers(run.stage.module):  # calibration is not training: BatchNorm statistics are restored
        for _ in range(CALIBRATION_PASSES):
            executor.step(inputs[:1] if inputs else None, targets[:1] if targets else None)
    every: list[Any] = [None] * run.num_stages
    dist.all_gather_object(every, (run.index, median(hooks.fwd_compute_s[1:]), median(hooks.bwd_compute_s[1:])))
    by_stage = {s: StageTiming(f, b) for s, f, b in every}
    return [by_stage[s] for s in range(run.num_stages)]


def _emulation_hooks(run: _Run, loss_fn: Any, batch: tuple[Any, Any] | None) -> Any:
    from hetpipe.runtime.emulate.pipeline import DEFAULT_SAFETY_FACTOR, EmulationHooks, StageTiming, choose_time_scale

    plan, s = run.plan, run.index
    measured = calibrate(run, loss_fn=loss_fn, batch=batch)
    predicted = [StageTiming(st.fwd_s, st.bwd_s) for st in plan.stages]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", run.num_stages))
    scale = choose_time_scale(measured, predicted, num_ranks=local_ranks, num_cores=cores,
                              safety_factor=run.args.safety_factor or DEFAULT_SAFETY_FACTOR)
    dev = plan.devices[plan.device_index()[plan.stages[s].device]]
    log.info("stage %d: time scale %.4g real s per emulated s (limited by %s)", s, scale.real_s_per_emulated_s,
             scale.limiting)
    return EmulationHooks(rank=run.rank, stage=s, device_label=device_label(plan, s), usable_bytes=dev.usable_bytes,
                          predicted=predicted[s], links=stage_links(plan, s),
                          time_scale=scale.real_s_per_emulated_s, origin=scale)


def _peak(hooks: Any, stats: Any) -> tuple[int, dict[str, int], str]:
    """(peak bytes, breakdown at the peak, action) from the emulation ledger or the executor's stats."""
    ledger = getattr(hooks, "ledger", None)
    if ledger is not None:
        return ledger.peak_bytes, dict(ledger.peak_breakdown), ledger.peak_action
    if stats is None:
        return 0, {}, ""
    mem = stats.memory
    return mem.peak_bytes, {"params": mem.param_bytes, "grads": mem.grad_bytes,
                            "optimizer": mem.optimizer_state_bytes, "activations": mem.peak_activation_bytes,
                            "comm": mem.peak_comm_bytes}, ""


def emulation_fields(hooks: Any, stats: Any, plan_stage: int) -> dict[str, Any]:
    """The `RankResult` fields that come from the hooks: recorded F/B, time scale, ledger, links."""
    scale, compute = getattr(hooks, "origin", None), getattr(hooks, "compute", None)
    peak, breakdown, peak_action = _peak(hooks, stats)
    return dict(
        fwd_s=tuple(hooks.fwd_s), bwd_s=tuple(hooks.bwd_s), fwd_compute_s=tuple(hooks.fwd_compute_s),
        bwd_compute_s=tuple(hooks.bwd_compute_s),
        calibration_fwd_s=scale.measured[plan_stage].fwd_s if scale else None,
        calibration_bwd_s=scale.measured[plan_stage].bwd_s if scale else None,
        time_scale=scale.real_s_per_emulated_s if scale else 1.0, time_scale_limiting=scale.limiting if scale else "",
        safety_factor=scale.safety_factor if scale else 1.0, contention_factor=scale.contention_factor if scale else 1.0,
        peak_bytes=peak, peak_breakdown=breakdown, peak_action=peak_action,
        overruns_fwd=compute.overruns["F"] if compute else 0, overruns_bwd=compute.overruns["B"] if compute else 0,
        worst_overrun_ratio=compute.worst_overrun_ratio if compute else 0.0,
        messages=getattr(hooks, "messages", 0), late_messages=getattr(hooks, "late_messages", 0),
        worst_late_s=getattr(hooks, "worst_late_s", 0.0),
        last_step_actions=tuple(ActionRecord(a.action, a.start_s, a.duration_s) for a in stats.actions)
        if stats is not None else ())


def _result(run: _Run, hooks: Any, stats: Any, step_s: list[float], losses: list[float], backend: str) -> RankResult:
    dev = run.plan.devices[run.plan.device_index()[run.plan.stages[run.index].device]]
    return RankResult(rank=run.rank, stage=run.index, device=dev.id, kind=dev.kind, step_s=tuple(step_s),
                      losses=tuple(losses), backend=backend, **emulation_fields(hooks, stats, run.index))


def _join(run: _Run, state: _State) -> str:
    """Step 5: join the process group and learn every stage's global rank."""
    backend, _ = _backend(int(os.environ.get("LOCAL_RANK", "0")))
    state.phase = "joining the process group"
    dist.init_process_group(backend, timeout=timedelta(seconds=run.args.timeout))
    every: list[Any] = [None] * run.num_stages
    dist.all_gather_object(every, run.index)
    run.stage_ranks = stage_ranks(every, run.num_stages)
    return backend


def train(args: argparse.Namespace, state: _State) -> RankResult:
    """The whole rank: prepare, join the group, (calibrate), run the steps, return the result."""
    from hetpipe.runtime.emulate.pipeline import RecordingHooks

    if Plan.load(args.plan).replicas:
        from hetpipe.runtime.replica_worker import train_replicas

        return train_replicas(args, state)
    run = prepare(args, state)
    backend = _join(run, state)
    progress = args.run_dir / f"progress-rank{run.rank}"
    heartbeat.install(progress)  # from here on the executor beats per action (calibration included)
    last = run.index == run.num_stages - 1
    loss_fn = _loss_fn(args) if last else None
    stream = run.data() if run.index == 0 or last else None
    first = next(stream, None) if stream is not None else None
    state.phase = "calibration"
    hooks = _emulation_hooks(run, loss_fn, first) if args.emulate else RecordingHooks()
    state.hooks = hooks
    optimizer = make_optimizer(run.plan.training.optimizer, list(run.stage.parameters()), lr=args.lr)
    executor = run.executor(actions=run.actions, optimizer=optimizer, microbatches=run.plan.training.microbatches,
                            hooks=hooks, loss_fn=loss_fn)
    step_s, losses, stats = [], [], None
    for step in range(args.steps):
        state.phase = f"step {step}"
        batch = (first if step == 0 else next(stream, None)) if stream is not None else None
        if stream is not None and batch is None:
            raise ConfigError(f"--data ran out after {step} batches; the run needs {args.steps}")
        inputs, targets = _microbatches(batch, run.plan, run.index)
        _barrier(backend == "gloo", args.timeout)
        start = time.monotonic()
        stats = executor.step(inputs, targets)
        step_s.append(time.monotonic() - start)
        if stats.loss is not None:
            losses.append(float(stats.loss))
        _touch(progress)
    state.phase = "finishing"
    _barrier(backend == "gloo", args.timeout)
    if args.save_weights:
        from hetpipe.runtime.stage.weights import save_pipeline

        state.phase = "saving the weights"
        save_pipeline(run.stage.module, run.saved_names, args.save_weights, stage=run.index, num_stages=run.num_stages)
    return _result(run, hooks, stats, step_s, losses, backend)


def _error_message(err: BaseException, state: _State) -> str:
    if isinstance(err, HetpipeError):
        return str(err)
    at = getattr(state.hooks, "current", "") if state.phase.startswith("step") else ""
    return (f"rank {state.rank} (stage {state.stage}) failed during {state.phase}{f' at {at}' if at else ''}: "
            f"{type(err).__name__}: {err}; this is a bug unless the model itself raised it -- see the traceback "
            "in the log")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank; exit 0 on success, 1 after writing ``error-rank<r>.json``."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = parse_args(argv)
    state = _State(rank)
    try:
        result = train(args, state)
    except BaseException as err:  # noqa: BLE001 - every failure must reach the error file
        message = _error_message(err, state)
        if not isinstance(err, HetpipeError):
            traceback.print_exc()
        action = str(getattr(state.hooks, "current", "")) if state.phase.startswith("step") else state.phase
        write_error(args.run_dir, RankError(rank, state.stage, action, message, type(err).__name__, time.time()))
        log.error("%s", message)
        sys.stderr.flush()
        # The process group may be wedged (a dead peer): exit without tearing it down.
        os._exit(1)
    result.save(args.run_dir / f"result-rank{rank}.json")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
