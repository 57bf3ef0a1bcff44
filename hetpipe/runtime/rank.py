"""What every rank of a run shares, whatever its plan version: where it is, which stage it runs,
its device and process group, its optimizer and loss, and what it reports.

`hetpipe.runtime.worker` (the torchrun entry point), `hetpipe.runtime.trainer.Trainer`,
`hetpipe.runtime.replicas.trainer.ReplicaTrainer` and the replica emulation all build on
these; none of them imports another's private helpers.

Example:
    >>> stage_ranks([2, 0, 1], 3)     # rank 0 runs stage 2, rank 1 stage 0, rank 2 stage 1
    [1, 2, 0]
    >>> device_backend(0)[0] in ("gloo", "nccl")
    True
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetpipe.runtime.stage.offload import HostOffloadOptimizer
from hetpipe.errors import ConfigError, HetpipeError, PlanError
from hetpipe.models import loss_fn, resolve, takes_size
from hetpipe.partitioner.capture.capture import capture
from hetpipe.plan.schema import Plan, verify_model
from hetpipe.plan.selective_schema import dropped_nodes
from hetpipe.runtime.data import import_object
from hetpipe.runtime.execute.comm import peer_lost
from hetpipe.runtime.report import ActionRecord, RankTimeline

# Default learning rates: Adam's paper default (Kingma & Ba 2015) and a common SGD one.
DEFAULT_LR = {"adam": 1e-3, "adamw": 1e-3, "sgd": 1e-2, "momentum": 1e-2}
MOMENTUM = 0.9  # "momentum" optimizer: SGD with the classic heavy-ball coefficient
# Calibration passes of one micro-batch through the pipeline; the first is warm-up
# (lazy allocations, first-call dispatch), the median of the rest is used.
CALIBRATION_PASSES = 4


class RankState:
    """Where this rank is (rank, stage, phase, hooks with the current action), for the error file."""

    def __init__(self, rank: int) -> None:
        self.rank, self.stage, self.phase, self.hooks = rank, rank, "start-up", None


def touch(path: Path) -> None:
    """Write the time into ``path``: the launcher's watchdog reads it as this rank's heartbeat."""
    path.write_text(str(time.time()))


def device_backend(local_rank: int) -> tuple[str, torch.device]:
    """(process-group backend, device) of this rank: NCCL on its CUDA device, else gloo on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def loss_for(model: str, loss: str | None) -> Any:
    """The loss ``--loss`` names (``package.module:function``), else the built-in model's.

    Example:
        >>> loss_for("my.pkg:factory", None)
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: model 'my.pkg:factory' is not built in, so hetpipe has no loss for it; pass --loss package.module:function
    """
    if loss:
        return import_object(loss, "--loss")
    try:
        return loss_fn(model)
    except ConfigError:
        raise ConfigError(f"model {model!r} is not built in, so hetpipe has no loss for it; pass --loss "
                          "package.module:function") from None


def barrier(gloo: bool, timeout_s: float) -> None:
    """Wait for every rank; on gloo a monitored barrier names the rank that did not arrive."""
    if gloo:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
    else:
        dist.barrier()

def join_process_group(timeout_s: float) -> str:
    """Join torchrun's process group once (an already initialised one is reused); returns the backend."""
    backend, _ = device_backend(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return str(dist.get_backend())


def gather_stage_ranks(stage: int, num_stages: int) -> list[int]:
    """Global rank of each stage, from every rank's own stage (one all-gather; see `stage_ranks`)."""
    every: list[Any] = [None] * num_stages
    dist.all_gather_object(every, stage)
    return stage_ranks(every, num_stages)


# ----------------------------------------------------------------------------- model and plan


def resolve_for_plan(plan: Plan, *, model: str, seq: int | None) -> Any:
    """``model`` on meta (`hetpipe.models.ResolvedModel`); a fresh one per call (its buffers: `ModelBuffers`)."""
    sized = takes_size(model)  # built-in and Hugging Face models: sized like the plan's micro-batch
    return resolve(model, device="meta", batch=plan.training.micro_batch_size if sized else None,
                   seq=seq if sized else None)


def capture_for_plan(plan: Plan, *, model: str, seq: int | None) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """(UnitGraph, one meta micro-batch) of ``model``, verified against ``plan``'s fingerprint."""
    resolved = resolve_for_plan(plan, model=model, seq=seq)
    if resolved.example_inputs is None:
        raise ConfigError(f"model factory {model!r} returned no example inputs; return (module, example_inputs) "
                          "with one micro-batch so the plan's fingerprint can be checked")
    graph = capture(resolved.model, resolved.example_inputs, name=model, optimizer=plan.training.optimizer,
                    precision=plan.training.precision)
    verify_model(plan, graph, resolved.example_inputs)
    return graph, resolved.example_inputs


def node_to_stage(plan: Plan, graph_module: Any) -> dict[str, int]:
    """fx node name -> stage index, from the plan's units and stage ranges; for an interleaved plan,
    its virtual stage (chunk c of plan stage r is ``c p + r``, `hetpipe.plan.chunk_schema`).

    Example:
        >>> # plan stage 0 holds units 0-1, stage 1 unit 2: every node of units 0-1 maps to 0
    """
    known = {n.name for n in graph_module.graph.nodes}
    p = len(plan.stages)
    ranges = [(c * p + st.index, ch.first_unit, ch.last_unit) for st in plan.stages for c, ch in enumerate(st.chunks)]
    ranges = ranges or [(st.index, st.first_unit, st.last_unit) for st in plan.stages]
    unit_stage = {u: k for k, first, last in ranges for u in range(first, last + 1)}
    out: dict[str, int] = {}
    for unit in plan.units:
        for name in unit.node_names:
            if name not in known:
                raise PlanError(f"plan unit {unit.index} ({unit.name}) names fx node {name!r}, which the captured "
                                "model does not have; re-plan it with `hetpipe plan`")
            out[name] = unit_stage[unit.index]
    return out


def recompute_nodes(plan: Plan, stage: int) -> dict[int, tuple[str, ...]]:
    """Unit index -> fx node names of the units plan stage ``stage`` recomputes (``recompute_units``).

    Example:
        >>> # a stage with recompute_units (2, 3): {2: unit 2's node names, 3: unit 3's}
    """
    st = plan.stages[stage]
    outside = [u for u in st.recompute_units if not st.first_unit <= u <= st.last_unit]
    if outside:
        raise PlanError(f"plan stage {stage}: recompute_units lists unit {outside[0]}, outside the stage's units "
                        f"{st.first_unit}-{st.last_unit}; list only its own units or re-plan with `hetpipe plan`")
    return {u: tuple(plan.units[u].node_names) for u in st.recompute_units}


def selective_nodes(plan: Plan, stage: int) -> dict[int, tuple[str, ...]]:
    """Unit index -> the fx nodes whose outputs plan stage ``stage`` drops (the selective level, version 7);
    {} when the stage does not run it.

    Example:
        >>> # a stage with selective=True on units 1-2: {1: ('ln_1', 'ln_2', 'gelu'), 2: (...)}
    """
    st = plan.stages[stage]
    return dropped_nodes(plan.selective, st.first_unit, st.last_unit) if st.selective else {}


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


def stage_optimizer(plan: Plan, stage: int, params: Sequence[nn.Parameter], *, lr: float | None) -> Any:
    """`make_optimizer` for plan stage `stage`; in host memory (`HostOffloadOptimizer`) when it offloads."""
    name = plan.training.optimizer
    if plan.stages[stage].offload:
        return HostOffloadOptimizer(params, lambda host: make_optimizer(name, host, lr=lr))
    return make_optimizer(name, params, lr=lr)


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


def peak_memory(hooks: Any, stats: Any) -> tuple[int, dict[str, int], str]:
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
    peak, breakdown, peak_action = peak_memory(hooks, stats)
    return dict(
        fwd_s=tuple(hooks.fwd_s), bwd_s=tuple(hooks.bwd_s), fwd_compute_s=tuple(hooks.fwd_compute_s),
        bwd_compute_s=tuple(hooks.bwd_compute_s), fwd_cpu_s=tuple(getattr(hooks, "fwd_cpu_s", ())),
        bwd_cpu_s=tuple(getattr(hooks, "bwd_cpu_s", ())),
        calibration_fwd_s=scale.measured[plan_stage].fwd_s if scale else None,
        calibration_bwd_s=scale.measured[plan_stage].bwd_s if scale else None,
        time_scale=scale.real_s_per_emulated_s if scale else 1.0, time_scale_limiting=scale.limiting if scale else "",
        safety_factor=scale.safety_factor if scale else 1.0, contention_factor=scale.contention_factor if scale else 1.0,
        peak_bytes=peak, peak_breakdown=breakdown, peak_action=peak_action,
        overruns_fwd=compute.overruns["F"] if compute else 0, overruns_bwd=compute.overruns["B"] if compute else 0,
        worst_overrun_ratio=compute.worst_overrun_ratio if compute else 0.0,
        messages=getattr(hooks, "messages", 0), late_messages=getattr(hooks, "late_messages", 0),
        worst_late_s=getattr(hooks, "worst_late_s", 0.0), late_total_s=getattr(hooks, "late_total_s", 0.0),
        last_step_actions=tuple(ActionRecord(a.action, a.start_s, a.duration_s) for a in stats.actions)
        if stats is not None else (), **message_fields(hooks, plan_stage))


def message_fields(hooks: Any, plan_stage: int) -> dict[str, Any]:
    """The `RankResult` fields of the hooks' `MessageLog` (none without one): each kept step's SENDs and RECVs."""
    log = getattr(hooks, "message_log", None)
    if log is None:
        return {}
    kept = log.steps()
    steps = tuple(RankTimeline(plan_stage, plan_stage, tuple(ActionRecord(a.action, a.start_s - step[0].start_s,
                                                                  a.end_s - a.start_s) for a in step),
                               origin_s=step[0].start_s) for step in kept if step)
    return dict(message_steps=steps, message_steps_from=log.steps_seen - len(kept))


def error_message(err: BaseException, state: RankState) -> str:
    """The ``error:`` line of a rank's failure: a `HetpipeError` as it is, a dead peer's broken socket by name
    (`hetpipe.runtime.execute.comm.peer_lost`), anything else as a bug with the rank, phase and action.

    Example:
        >>> from types import SimpleNamespace
        >>> state = SimpleNamespace(rank=1, stage=1, phase="step 1", hooks=SimpleNamespace(current="1RECV_F2"))
        >>> error_message(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:6581"), state)[:76]
        'rank 1 (stage 1) failed waiting on a peer during step 1 at 1RECV_F2 (Connect'
    """
    if isinstance(err, HetpipeError):
        return str(err)
    at = getattr(state.hooks, "current", "") if state.phase.startswith("step") else ""
    where = f"rank {state.rank} (stage {state.stage})"
    if (lost := peer_lost(err)) is not None:  # a collective or message a dead peer's socket broke (comm.PEER_LOST)
        return (f"{where} failed waiting on a peer during {state.phase}{f' at {at}' if at else ''} ({lost}); a peer "
                "process ended: check the other ranks' logs for the first error")
    return (f"{where} failed during {state.phase}{f' at {at}' if at else ''}: {type(err).__name__}: {err}; this is "
            "a bug unless the model itself raised it -- see the traceback in the log")
