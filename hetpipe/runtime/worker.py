"""The per-rank entry point torchrun runs: ``python -m hetpipe.runtime.worker plan.json --model M --steps N ...``.

Rank r runs stage r of the plan.  In order, with nothing distributed before step 5:

1. re-capture ``--model`` on the meta device and verify the plan's fingerprint;
2. map the plan units' fx node names to stage indices;
3. build the schedule (``training.schedule`` unless ``--schedule``) and validate it;
4. split the traced graph and build only this rank's stage (`hetpipe.runtime.stage`);
5. join the process group (gloo on CPU, NCCL when CUDA is available), build the
   optimizer named by ``training.optimizer`` and the `PipelineExecutor`;
6. with ``--emulate``: measure one serialised F+B of every stage, choose the time
   scale (`hetpipe.runtime.emulate.choose_time_scale`) and install the emulation hooks;
7. run ``--steps`` steps (a monitored barrier, then the rank's action list) on seeded
   synthetic data or ``--data``, touching ``progress-rank<r>`` after each one;
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
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetpipe.errors import ConfigError, HetpipeError, PlanError, RuntimeFailure
from hetpipe.partitioner.plan import Plan, verify_model
from hetpipe.runtime.launch import RankError, write_error
from hetpipe.runtime.report import RankResult, median

log = logging.getLogger("hetpipe.worker")

# Default learning rates: Adam's paper default (Kingma & Ba 2015) and a common SGD one.
DEFAULT_LR = {"adam": 1e-3, "adamw": 1e-3, "sgd": 1e-2, "momentum": 1e-2}
MOMENTUM = 0.9  # "momentum" optimizer: SGD with the classic heavy-ball coefficient
# Calibration passes of one micro-batch through the pipeline; the first is warm-up
# (lazy allocations, first-call dispatch), the median of the rest is used.
CALIBRATION_PASSES = 4
_DATA_SEED_STRIDE = 1_000_003  # seed * stride + step: one independent stream per step


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
    p.add_argument("--safety-factor", type=float, default=None)
    p.add_argument("--emulate", action="store_true")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- model and plan


def capture_for_plan(plan: Plan, *, model: str, seq: int | None) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """(UnitGraph, one meta micro-batch) of ``model``, verified against ``plan``'s fingerprint."""
    from hetpipe import models
    from hetpipe.partitioner.capture import capture

    builtin = ":" not in model
    resolved = models.resolve(model, device="meta", batch=plan.training.micro_batch_size if builtin else None,
                              seq=seq if builtin else None)
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


# ----------------------------------------------------------------------------- data


def _vocab_size(meta_model: nn.Module) -> int:
    for mod in meta_model.modules():
        if isinstance(mod, nn.Embedding):
            return int(mod.num_embeddings)
    raise ConfigError("the model takes integer inputs but has no nn.Embedding to size synthetic token ids; "
                      "pass --data")


def synthetic_batch(model: str, example: Sequence[torch.Tensor], *, global_batch: int, vocab: int | None,
                    seed: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Seeded (inputs, targets) of one global batch shaped like ``example`` (one meta micro-batch).

    Integer inputs are token ids in ``[0, vocab)``, float inputs standard normal; targets
    come from `hetpipe.models.example_targets`.  Every rank calling it with the same
    arguments gets the same tensors.

    Example:
        >>> ex = (torch.empty(2, 8, dtype=torch.int64, device="meta"),)
        >>> a, _ = synthetic_batch("gpt-tiny", ex, global_batch=4, vocab=256, seed=0, step=1)
        >>> b, t = synthetic_batch("gpt-tiny", ex, global_batch=4, vocab=256, seed=0, step=1)
        >>> a[0].shape, torch.equal(a[0], b[0]), torch.equal(t, torch.roll(a[0], -1, 1))
        (torch.Size([4, 8]), True, True)
    """
    from hetpipe.models import example_targets

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * _DATA_SEED_STRIDE + step)
        inputs = []
        for t in example:
            shape = (global_batch, *t.shape[1:])
            if t.dtype.is_floating_point:
                inputs.append(torch.randn(shape, dtype=t.dtype))
            else:
                if vocab is None:
                    raise ConfigError(f"model {model!r} takes integer inputs; pass --data")
                inputs.append(torch.randint(0, vocab, shape, dtype=t.dtype))
        targets = example_targets(model, tuple(inputs))
    return tuple(inputs), targets


def _import(spec: str, what: str) -> Any:
    from hetpipe.models import _load_factory  # same import rules as model factories

    try:
        return _load_factory(spec)
    except ConfigError as err:
        raise ConfigError(f"{what}: {err}") from None


def data_stream(args: argparse.Namespace, plan: Plan, example: Sequence[torch.Tensor],
                meta_model: nn.Module) -> Iterator[tuple[Any, Any]]:
    """Global batches (inputs, targets): synthetic, a saved file, or a user factory's iterable."""
    if args.data is None:
        ints = any(not t.dtype.is_floating_point for t in example)
        vocab = _vocab_size(meta_model) if ints else None
        step = 0
        while True:
            yield synthetic_batch(args.model, example, global_batch=plan.training.global_batch, vocab=vocab,
                                  seed=args.seed, step=step)
            step += 1
    elif ":" not in args.data and Path(args.data).is_file():
        yield from torch.load(args.data, weights_only=False)
    else:
        yield from _import(args.data, "--data")()


def split_microbatches(batch: Any, microbatches: int, *, what: str) -> list[Any]:
    """Cut a global batch (a tensor or tuple of tensors) into ``microbatches`` along dim 0.

    Example:
        >>> [t.shape[0] for t in split_microbatches(torch.zeros(6, 2), 3, what="x")]
        [2, 2, 2]
    """
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    n = tensors[0].shape[0]
    if n % microbatches:
        raise ConfigError(f"{what}: batch of {n} is not divisible into {microbatches} micro-batches; "
                          f"yield global batches of {microbatches} x micro-batch size")
    parts = [t.chunk(microbatches) for t in tensors]
    mbs = [tuple(p[i] for p in parts) for i in range(microbatches)]
    return [m[0] for m in mbs] if isinstance(batch, torch.Tensor) else mbs


# ----------------------------------------------------------------------------- emulation inputs


def device_label(plan: Plan, stage: int) -> str:
    """``"n1:0 (rtx3060-12gb)"``: the plan device of ``stage``, for messages."""
    dev = plan.devices[plan.device_index()[plan.stages[stage].device]]
    return f"{dev.id} ({dev.kind})"


def stage_links(plan: Plan, stage: int) -> dict[int, tuple[float, float]]:
    """Cut -> (bandwidth_bytes_s, latency_s) of the plan link ``stage`` sends over on that cut."""
    links = {(l.src, l.dst): l for l in plan.links}
    here, out = plan.stages[stage].device, {}
    for cut, peer in ((stage, stage + 1), (stage - 1, stage - 1)):
        if 0 <= peer < len(plan.stages):
            link = links.get((here, plan.stages[peer].device))
            if link is None:
                raise PlanError(f"the plan has no link {here} -> {plan.stages[peer].device} (stage {stage} -> "
                                f"{peer}); add it to `links` or re-plan")
            out[cut] = (link.bandwidth_bytes_s, link.latency_s)
    return out


# ----------------------------------------------------------------------------- the run


class _State:
    """Where this rank is, for the error file."""

    def __init__(self, rank: int) -> None:
        self.rank, self.stage, self.phase, self.hooks = rank, rank, "start-up", None

    def action(self) -> str:
        current = getattr(self.hooks, "current", "")
        return f"step {self.phase}: {current}" if self.phase.isdigit() and current else self.phase


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


def calibrate(stage: Any, *, plan: Plan, rank: int, loss_fn: Any, batch: tuple[Any, Any] | None,
              timeout_s: float) -> Any:
    """One micro-batch through the whole pipeline, `CALIBRATION_PASSES` times: uncontended real F/B per stage.

    With a single micro-batch the pipeline is serial (each rank computes while the
    others wait in a receive), which is the single-process measurement
    `hetpipe.runtime.emulate.choose_time_scale` wants.  The optimizer is SGD with
    learning rate 0, so the weights are untouched.  Returns every stage's `StageTiming`.
    """
    from hetpipe.runtime.emulate import RecordingHooks, StageTiming
    from hetpipe.runtime.executor import PipelineExecutor
    from hetpipe.runtime.schedule import make_schedule

    p = len(plan.stages)
    hooks = RecordingHooks()
    executor = PipelineExecutor(stage, rank=rank, num_stages=p, schedule_actions=make_schedule("gpipe", p, 1)[rank],
                                loss_fn=loss_fn, optimizer=torch.optim.SGD(stage.parameters(), lr=0.0),
                                microbatches=1, timeout_s=timeout_s, hooks=hooks)
    inputs, targets = _microbatches(batch, plan, rank)
    for _ in range(CALIBRATION_PASSES):
        executor.step(inputs[:1] if inputs else None, targets[:1] if targets else None)
    mine = (median(hooks.fwd_compute_s[1:]), median(hooks.bwd_compute_s[1:]))
    every: list[Any] = [None] * p
    dist.all_gather_object(every, mine)
    return [StageTiming(f, b) for f, b in every]


def _emulation_hooks(args: argparse.Namespace, plan: Plan, stage: Any, rank: int, loss_fn: Any,
                     batch: tuple[Any, Any] | None) -> Any:
    from hetpipe.runtime.emulate import DEFAULT_SAFETY_FACTOR, EmulationHooks, StageTiming, choose_time_scale

    measured = calibrate(stage, plan=plan, rank=rank, loss_fn=loss_fn, batch=batch, timeout_s=args.timeout)
    predicted = [StageTiming(s.fwd_s, s.bwd_s) for s in plan.stages]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", len(plan.stages)))
    scale = choose_time_scale(measured, predicted, num_ranks=local_ranks, num_cores=cores,
                              safety_factor=args.safety_factor or DEFAULT_SAFETY_FACTOR)
    dev = plan.devices[plan.device_index()[plan.stages[rank].device]]
    hooks = EmulationHooks(rank=rank, stage=rank, device_label=device_label(plan, rank), usable_bytes=dev.usable_bytes,
                           predicted=predicted[rank], links=stage_links(plan, rank),
                           time_scale=scale.real_s_per_emulated_s, origin=scale)
    log.info("rank %d: time scale %.4g real s per emulated s (limited by %s)", rank, scale.real_s_per_emulated_s,
             scale.limiting)
    return hooks


def _result(plan: Plan, rank: int, hooks: Any, last_stats: Any, step_s: list[float], losses: list[float],
            backend: str) -> RankResult:
    scale = getattr(hooks, "origin", None)
    ledger, compute = getattr(hooks, "ledger", None), getattr(hooks, "compute", None)
    mem = last_stats.memory if last_stats is not None else None
    breakdown = dict(ledger.peak_breakdown) if ledger else ({
        "params": mem.param_bytes, "grads": mem.grad_bytes, "optimizer": mem.optimizer_state_bytes,
        "activations": mem.peak_activation_bytes, "comm": mem.peak_comm_bytes} if mem else {})
    return RankResult(
        rank=rank, stage=rank, device=plan.stages[rank].device,
        kind=plan.devices[plan.device_index()[plan.stages[rank].device]].kind,
        step_s=tuple(step_s), losses=tuple(losses), fwd_s=tuple(hooks.fwd_s), bwd_s=tuple(hooks.bwd_s),
        fwd_compute_s=tuple(hooks.fwd_compute_s), bwd_compute_s=tuple(hooks.bwd_compute_s),
        calibration_fwd_s=scale.measured[rank].fwd_s if scale else None,
        calibration_bwd_s=scale.measured[rank].bwd_s if scale else None,
        time_scale=scale.real_s_per_emulated_s if scale else 1.0, time_scale_limiting=scale.limiting if scale else "",
        safety_factor=scale.safety_factor if scale else 1.0, contention_factor=scale.contention_factor if scale else 1.0,
        peak_bytes=ledger.peak_bytes if ledger else (mem.peak_bytes if mem else 0), peak_breakdown=breakdown,
        peak_action=ledger.peak_action if ledger else "",
        overruns_fwd=compute.overruns["F"] if compute else 0, overruns_bwd=compute.overruns["B"] if compute else 0,
        worst_overrun_ratio=compute.worst_overrun_ratio if compute else 0.0,
        messages=getattr(hooks, "messages", 0), late_messages=getattr(hooks, "late_messages", 0), backend=backend)


def prepare(args: argparse.Namespace, state: _State) -> tuple[Plan, Any, list[Any], Any]:
    """Steps 1-4 (no process group yet): (plan, this rank's stage module, its actions, meta model)."""
    from hetpipe.runtime.schedule import make_schedule, validate_schedule
    from hetpipe.runtime.stage import build_stage, split_stages

    world = int(os.environ.get("WORLD_SIZE", "1"))
    state.phase = "loading the plan"
    plan = Plan.load(args.plan)
    p, m = len(plan.stages), plan.training.microbatches
    if world != p:
        raise ConfigError(f"the plan has {p} stages but torchrun started {world} processes; launch with "
                          f"--nproc-per-node={p} (or nodes x processes = {p})")
    state.phase = "capture"
    graph, example = capture_for_plan(plan, model=args.model, seq=args.seq)
    mapping = node_to_stage(plan, graph.module)
    state.phase = "schedule validation"
    name = args.schedule or plan.training.schedule
    schedule = make_schedule(name, p, m)
    validate_schedule(schedule, num_stages=p, num_microbatches=m)
    state.phase = "building the stage"
    program = split_stages(graph.module, mapping, example_inputs=example, num_stages=p)
    _, device = _backend(int(os.environ.get("LOCAL_RANK", "0")))
    stage = build_stage(program, state.rank, state_dict=None, device=device, seed=args.seed)
    return plan, stage, schedule[state.rank], graph.module


def train(args: argparse.Namespace, state: _State) -> RankResult:
    """The whole rank: prepare, join the group, (calibrate), run the steps, return the result."""
    from hetpipe.runtime.emulate import RecordingHooks
    from hetpipe.runtime.executor import PipelineExecutor

    plan, stage, actions, meta_model = prepare(args, state)
    rank, p = state.rank, len(plan.stages)
    backend, _ = _backend(int(os.environ.get("LOCAL_RANK", "0")))
    state.phase = "joining the process group"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    progress = args.run_dir / f"progress-rank{rank}"
    _touch(progress)
    loss_fn = _loss_fn(args) if rank == p - 1 else None
    reads_data = rank in (0, p - 1)
    stream = data_stream(args, plan, _example_inputs(plan, args), meta_model) if reads_data else None
    first = next(stream) if stream is not None else None
    state.phase = "calibration"
    hooks = _emulation_hooks(args, plan, stage, rank, loss_fn, first) if args.emulate else RecordingHooks()
    state.hooks = hooks
    optimizer = make_optimizer(plan.training.optimizer, list(stage.parameters()), lr=args.lr)
    executor = PipelineExecutor(stage, rank=rank, num_stages=p, schedule_actions=actions, loss_fn=loss_fn,
                                optimizer=optimizer, microbatches=plan.training.microbatches,
                                timeout_s=args.timeout, hooks=hooks)
    step_s, losses, stats = [], [], None
    for step in range(args.steps):
        state.phase = str(step)
        batch = (first if step == 0 else next(stream, None)) if stream is not None else None
        if reads_data and batch is None:
            raise ConfigError(f"--data ran out after {step} batches; the run needs {args.steps}")
        inputs, targets = _microbatches(batch, plan, rank)
        _barrier(backend == "gloo", args.timeout)
        start = time.monotonic()
        stats = executor.step(inputs, targets)
        step_s.append(time.monotonic() - start)
        if stats.loss is not None:
            losses.append(float(stats.loss))
        _touch(progress)
    state.phase = "finishing"
    _barrier(backend == "gloo", args.timeout)
    return _result(plan, rank, hooks, stats, step_s, losses, backend)


def _example_inputs(plan: Plan, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    from hetpipe import models

    builtin = ":" not in args.model
    resolved = models.resolve(args.model, device="meta", batch=plan.training.micro_batch_size if builtin else None,
                              seq=args.seq if builtin else None)
    return resolved.example_inputs or ()


def _error_message(err: BaseException, state: _State) -> str:
    if isinstance(err, HetpipeError):
        return str(err)
    return (f"rank {state.rank} (stage {state.stage}) failed during {state.action()}: {type(err).__name__}: {err}; "
            "this is a bug unless the model itself raised it -- see the traceback in the log")


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
        action = str(getattr(state.hooks, "current", "") or state.phase)
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
