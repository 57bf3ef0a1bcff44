"""Execute a replica plan (plan version 2): several pipelines side by side, kept consistent (issue #6).

`plan.stages` lists every replica's stages one replica after another; stage i runs on
global rank ``stage_ranks[i]`` (default i).  `place_rank` works out, from the plan
alone and before any collective, which replica and stage a rank runs, its replica's
global stage ranks, its m_r micro-batches and its slice of the global batch (replica r
takes samples [sum_{q<r} n_q, sum_{q<=r} n_q) of every global batch); anything the
runtime cannot run (a world of the wrong size, replicas that do not tile the stages,
micro-batches that do not add up, an unknown policy) is a `HetpipeError` naming the
replica or stage and the fix.

`ReplicaTrainer` then builds only this rank's stage of its replica's pipeline (seeded
weights, identical in every replica), creates every process group on every rank in one
global order (replica pipelines, their tied-parameter groups, the sync buckets of
`hetpipe.runtime.replicas.sync`), and a `PipelineExecutor` over the replica's ranks with
the replica's m_r micro-batches.  Each step runs the replica's schedule; the gradient
sync runs inside the optimizer step (``synchronous``), or every H steps an outer
DiLoCo step follows it (``diloco``).

Example (a refused plan never touches torch.distributed):
    >>> ReplicaTrainer("missing-plan.json", model="gpt-tiny", rank=0, world_size=2)
    Traceback (most recent call last):
    ...
    hetpipe.errors.PlanError: cannot read plan missing-plan.json: No such file or directory
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hetpipe.errors import ConfigError, PlanError
from hetpipe.plan.schema import Plan
from hetpipe.runtime.data import split_microbatches
from hetpipe.runtime.execute.executor import ActionHooks, PipelineExecutor, StepStats
from hetpipe.runtime.execute.options import ExecutorOptions, ReplicaWiring
from hetpipe.runtime.rank import capture_for_plan, device_backend, make_optimizer, recompute_nodes, resolve_for_plan
from hetpipe.runtime.replicas.shard import ShardedOptimizer, shard_groups
from hetpipe.runtime.stage.offload import HostOffloadOptimizer
from hetpipe.runtime.replicas.sync import (
    DILOCO_OUTER_LR,
    DILOCO_OUTER_MOMENTUM,
    SYNC_POLICIES,
    ReplicaSync,
    group_ranks,
    param_units,
    sync_buckets,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaPlace:
    """Where one rank sits in a replica plan."""

    rank: int
    replica: int
    stage: int  # position in its replica's pipeline
    plan_stage: int  # index into plan.stages
    stage_ranks: tuple[int, ...]  # global rank of each stage of its replica
    microbatches: int  # m_r
    first_sample: int  # its replica's first sample in every global batch
    samples: int  # n_r = m_r x micro-batch size
    grad_weight: float  # n_r / global batch

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)


def _layout(plan: Plan) -> str:
    return ", ".join(f"replica {r.index}: {r.num_stages} stage(s)" for r in plan.replicas)


def check_runnable(plan: Plan, *, world_size: int, stage_ranks: Sequence[int] | None = None) -> tuple[int, ...]:
    """Refuse a replica plan this runtime cannot run; return the global rank of every plan stage.

    Example:
        >>> check_runnable(type("P", (), {"replicas": ()})(), world_size=1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hetpipe.errors.PlanError: this plan has no replicas (a single pipeline); run it with `hetpipe run` ...
    """
    from hetpipe.plan.replica_check import replica_structure

    if not plan.replicas or plan.sync is None:
        raise PlanError("this plan has no replicas (a single pipeline); run it with `hetpipe run` or "
                        "hetpipe.Trainer, not the replica runtime")
    n = len(plan.stages)
    if world_size != n:
        raise ConfigError(f"the plan has {n} stages in {len(plan.replicas)} replicas ({_layout(plan)}), but the "
                          f"process group has {world_size} ranks; launch exactly {n} processes, one per stage "
                          f"(torchrun --nproc-per-node={n})")
    ranks = tuple(range(n)) if stage_ranks is None else tuple(int(r) for r in stage_ranks)
    if sorted(ranks) != list(range(n)):
        raise ConfigError(f"stage_ranks {list(ranks)} must give each of the {n} plan stages its own rank 0..{n - 1}")
    problems = replica_structure(plan)
    for rep in plan.replicas:
        own = plan.stages[rep.first_stage:rep.first_stage + rep.num_stages]
        if [st.index for st in own] != list(range(len(own))):
            problems.append(f"replica {rep.index}: its stages are numbered {[st.index for st in own]}, expected "
                            f"0..{len(own) - 1} (each replica's pipeline counts from 0)")
        if own and (own[0].first_unit != 0 or own[-1].last_unit != len(plan.units) - 1 or any(
                a.last_unit + 1 != b.first_unit for a, b in zip(own, own[1:]))):
            problems.append(f"replica {rep.index}: its stages do not cover units 0..{len(plan.units) - 1} in order")
    if plan.sync.policy not in SYNC_POLICIES or plan.sync.outer_steps < 1:
        problems.append(f"sync: policy {plan.sync.policy!r} with H = {plan.sync.outer_steps} (use synchronous, or "
                        "diloco with outer_steps >= 1)")
    if problems:
        raise PlanError(f"the replica plan cannot run: {'; '.join(problems[:3])}; re-plan it with `hetpipe plan` "
                        "(`hetpipe show` lists its replicas)")
    return ranks


def place_rank(plan: Plan, *, rank: int, world_size: int, stage_ranks: Sequence[int] | None = None) -> ReplicaPlace:
    """This rank's replica, stage and batch share (pure: no collective).

    Example:
        >>> # replicas (2 stages, m=3) and (1 stage, m=1), micro-batch 2: rank 2 runs
        >>> # replica 1's only stage on samples 6..7 with grad_weight 0.25
    """
    ranks = check_runnable(plan, world_size=world_size, stage_ranks=stage_ranks)
    if rank not in ranks:
        raise ConfigError(f"rank {rank} is outside the plan's {len(ranks)} stages; launch {len(ranks)} processes")
    plan_stage = ranks.index(rank)
    first = 0
    for rep in plan.replicas:
        if rep.first_stage <= plan_stage < rep.first_stage + rep.num_stages:
            return ReplicaPlace(rank, rep.index, plan_stage - rep.first_stage, plan_stage,
                                ranks[rep.first_stage:rep.first_stage + rep.num_stages], rep.microbatches, first,
                                rep.samples, rep.grad_weight)
        first += rep.samples
    raise AssertionError("check_runnable: the replicas tile the stages")


def replica_node_to_stage(plan: Plan, graph_module: Any, replica: int) -> dict[str, int]:
    """fx node name -> stage of ``replica``'s pipeline, from the plan's units and that replica's stages."""
    rep = plan.replicas[replica]
    known = {n.name for n in graph_module.graph.nodes}
    out: dict[str, int] = {}
    for k, st in enumerate(plan.stages[rep.first_stage:rep.first_stage + rep.num_stages]):
        for unit in plan.units[st.first_unit:st.last_unit + 1]:
            for name in unit.node_names:
                if name not in known:
                    raise PlanError(f"plan unit {unit.index} ({unit.name}) names fx node {name!r}, which the captured "
                                    "model does not have; re-plan it with `hetpipe plan`")
                out[name] = k
    return out


def replica_batch(batch: Any, place: ReplicaPlace, *, what: str) -> list[Any]:
    """This replica's micro-batches of a global batch (a tensor or a tuple of tensors).

    Example:
        >>> p = ReplicaPlace(2, 1, 0, 2, (2,), 1, 6, 2, 0.25)
        >>> [t.tolist() for t in replica_batch(torch.arange(8), p, what="x")]
        [[6, 7]]
    """
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    end = place.first_sample + place.samples
    if tensors[0].shape[0] < end:
        raise ConfigError(f"{what}: a global batch of {tensors[0].shape[0]} samples, but replica {place.replica} "
                          f"reads samples {place.first_sample}..{end - 1}; pass global batches of the plan's size")
    part = tuple(t[place.first_sample:end] for t in tensors)
    return split_microbatches(part[0] if isinstance(batch, torch.Tensor) else part, place.microbatches, what=what)


@dataclass(frozen=True)
class ReplicaStepStats:
    """One step on one rank: the executor's stats, the replicas' sample-weighted loss and the sync."""

    stats: StepStats
    loss: float | None  # sum_r grad_weight_r x loss_r (every rank; None with global_loss=False)
    synced: bool  # gradients (synchronous) or parameters (diloco outer step) were all-reduced
    bytes_reduced: int  # payload bytes this rank all-reduced so far (sync or outer steps)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class ReplicaTrainer:
    """One rank of a replica plan in this process (see the module docstring).

    Args:
        plan: a version-2 `Plan` (with replicas) or the path of plan.json.
        model: the model the plan was made for (built-in name or ``package.module:factory``).
        loss: ``loss(output, targets) -> scalar`` per micro-batch (default: the built-in model's).
        optimizer: ``factory(params) -> torch.optim.Optimizer``, the (inner) optimizer of every
            replica (default: the plan's ``training.optimizer`` with ``lr``).
        rank, world_size: default from the initialised process group (else ``$RANK`` /
            ``$WORLD_SIZE``); checked against the plan before any collective.
        stage_ranks: global rank of each plan stage (default: rank i runs ``plan.stages[i]``).
        global_loss: all-reduce the replicas' sample-weighted loss every step (one scalar).
        outer_lr, outer_momentum: DiLoCo's outer Nesterov SGD (defaults: the paper's).
        overlap_sync: launch the synchronous gradient all-reduces during the last backward
            (`hetpipe.runtime.replicas.buckets`), else all in the optimizer step.
        bucket_cap_bytes: largest gradient all-reduce part (default: the plan's ``sync.bucket_cap_bytes``).
        schedule, seq, seed, timeout_s, state_dict, grad_clip_norm, hooks, device: as for
            `hetpipe.runtime.trainer.Trainer` and `PipelineExecutor`.
    """

    def __init__(self, plan: Plan | str | Path, *, model: str, loss: Callable[..., Any] | None = None,
                 optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
                 lr: float | None = None, schedule: str | None = None, seq: int | None = None, seed: int = 0,
                 timeout_s: float = 60.0, rank: int | None = None, world_size: int | None = None,
                 stage_ranks: Sequence[int] | None = None, state_dict: Any = None,
                 grad_clip_norm: float | None = None, hooks: ActionHooks | None = None, global_loss: bool = True,
                 outer_lr: float = DILOCO_OUTER_LR, outer_momentum: float = DILOCO_OUTER_MOMENTUM,
                 device: torch.device | str | None = None, overlap_sync: bool = True,
                 bucket_cap_bytes: int | None = None) -> None:
        self.plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        here, world = _world()
        world = world if world_size is None else world_size
        self.place = place_rank(self.plan, rank=here if rank is None else rank, world_size=world,
                                stage_ranks=stage_ranks)
        self._ranks = check_runnable(self.plan, world_size=world, stage_ranks=stage_ranks)
        self.where = f"rank {self.place.rank} (replica {self.place.replica}, stage {self.place.stage})"
        schedule = schedule or self.plan.training.schedule
        actions = self._schedule(schedule)
        graph, example = capture_for_plan(self.plan, model=model, seq=seq)
        self.graph_module, self.example = graph.module, example  # meta: for data_stream(meta_model=, example=)
        programs = self._programs(graph.module, example)
        self.program = programs[self.place.replica]  # its replica's `StagedProgram` (checkpoints name tensors by it)
        dev = torch.device(device) if device is not None else device_backend(int(os.environ.get("LOCAL_RANK", "0")))[1]
        from hetpipe.runtime.stage.buffers import ModelBuffers
        from hetpipe.runtime.stage.build import build_stage

        buffers = ModelBuffers(resolve_for_plan(self.plan, model=model, seq=seq).model)
        self.stage = build_stage(programs[self.place.replica], self.place.stage, state_dict=state_dict, device=dev,
                                 seed=seed, buffers=buffers,
                                 recompute=recompute_nodes(self.plan, self.place.plan_stage))
        buckets = sync_buckets(self.plan, param_units(graph.module, self.plan), self._ranks)
        if world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(f"{self.where}: a {world}-rank replica plan needs torch.distributed; call "
                              "init_process_group first (torchrun and hetpipe's launcher do)")
        groups = self._make_groups(programs, group_ranks(buckets), timeout_s) if world > 1 else {}
        self.groups = groups  # rank set -> process group (`hetpipe.runtime.emulate.replicas` calibrates with them)
        sync = self.plan.sync
        assert sync is not None  # check_runnable
        self.sync = ReplicaSync(buckets, module=self.stage.module, rank=self.place.rank,
                                grad_weight=self.place.grad_weight, policy=sync.policy, outer_steps=sync.outer_steps,
                                groups=groups, timeout_s=timeout_s, where=self.where, outer_lr=outer_lr,
                                outer_momentum=outer_momentum, overlap=overlap_sync,
                                bucket_cap_bytes=bucket_cap_bytes or sync.bucket_cap_bytes)
        self.optimizer = self._optimizer(optimizer, lr)
        if loss is None and self.stage.is_last:
            from hetpipe.models import loss_fn

            loss = loss_fn(model)
        self.global_loss = global_loss
        self.executor = PipelineExecutor(
            self.stage, rank=self.place.rank, num_stages=self.place.num_stages, schedule_actions=actions,
            loss_fn=loss if loss is not None else _no_loss, optimizer=self.optimizer,
            microbatches=self.place.microbatches, stage_ranks=self.place.stage_ranks,
            options=ExecutorOptions(timeout_s=timeout_s, grad_clip_norm=grad_clip_norm), hooks=hooks,
            wiring=ReplicaWiring(group=groups.get(tuple(sorted(self.place.stage_ranks))),
                                 tied_group=lambda ranks: groups[tuple(sorted(ranks))], grad_sync=self.sync.sync_grads,
                                 final_backward=self.sync.arm if overlap_sync else None))

    def _optimizer(self, factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None,
                   lr: float | None) -> Any:
        """The stage's optimizer; a `ShardedOptimizer` over it where the plan shards a group this rank holds."""
        params = list(self.stage.parameters())

        def build(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            return factory(ps) if factory is not None else make_optimizer(self.plan.training.optimizer, ps, lr=lr)

        shards = shard_groups(self.plan, self.sync, replica=self.place.replica, stage_ranks=self._ranks)
        if self.plan.stages[self.place.plan_stage].offload:  # its state and step on the host
            if shards:
                raise PlanError(f"{self.where}: the stage offloads its optimizer state and also holds a sharded sync "
                                "group; a plan does one or the other per stage, re-plan it with `hetpipe plan`")
            return HostOffloadOptimizer(params, build)
        return ShardedOptimizer(params, shards, build) if shards else build(params)

    def _schedule(self, name: str) -> list[Any]:
        from hetpipe.schedule.builders import make_schedule, validate_schedule

        p, m = self.place.num_stages, self.place.microbatches
        schedule = make_schedule(name, p, m)
        validate_schedule(schedule, num_stages=p, num_microbatches=m)
        return schedule[self.place.stage]

    def _programs(self, graph_module: Any, example: tuple[torch.Tensor, ...]) -> list[Any]:
        """Every replica's staged program (meta only): each rank needs every replica's tied groups."""
        from hetpipe.runtime.stage.build import split_stages

        return [split_stages(graph_module, replica_node_to_stage(self.plan, graph_module, rep.index),
                             example_inputs=example, num_stages=rep.num_stages) for rep in self.plan.replicas]

    def _make_groups(self, programs: Sequence[Any], bucket_ranks: Sequence[tuple[int, ...]],
                     timeout_s: float) -> dict[tuple[int, ...], Any]:
        """Every process group of the run, created on every rank in one order (``new_group`` is collective)."""
        wanted: list[tuple[int, ...]] = []
        for rep, program in zip(self.plan.replicas, programs):
            ranks = self._ranks[rep.first_stage:rep.first_stage + rep.num_stages]
            wanted.append(tuple(sorted(ranks)))
            wanted += [tuple(sorted({ranks[s] for s in g.stages})) for g in program.tied]
        wanted += bucket_ranks
        return {ranks: dist.new_group(ranks=list(ranks), timeout=timedelta(seconds=timeout_s))
                for ranks in dict.fromkeys(w for w in wanted if len(w) > 1)}

    @property
    def is_first(self) -> bool:
        """Whether this rank reads the inputs (its replica's stage 0)."""
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        """Whether this rank reads the targets and computes its replica's loss."""
        return self.stage.is_last

    @property
    def bytes_reduced(self) -> int:
        """Payload bytes this rank has all-reduced for replica sync (gradients or DiLoCo deltas)."""
        return self.sync.bytes_reduced

    def step(self, inputs: Any = None, targets: Any = None) -> ReplicaStepStats:
        """One optimizer step on one *global* batch; this rank's replica reads its slice of it.

        Pass the same global batch on every rank that reads data (None elsewhere).
        """
        p = self.place
        if (self.is_first and inputs is None) or (self.is_last and targets is None):
            raise ConfigError(f"{self.where} needs the {'inputs' if self.is_first else 'targets'} of every step; "
                              "pass the global batch on every first and last stage of every replica")
        ins = replica_batch(inputs, p, what="inputs") if self.is_first else None
        tgs = replica_batch(targets, p, what="targets") if self.is_last else None
        stats = self.executor.step(ins, tgs)
        synced = self.sync.after_step()
        loss = self._weighted_loss(stats) if self.global_loss else stats.loss
        return ReplicaStepStats(stats, loss, synced, self.sync.bytes_reduced)

    def finish(self) -> bool:
        """After the last step (every rank): a DiLoCo run whose steps are no multiple of H takes a final outer
        step, so every replica ends with the same parameters.  True when it synced."""
        if self.sync.policy != "diloco" or self.sync.steps % self.sync.outer_steps == 0:
            return False
        self.sync.outer_step()
        return True

    def _weighted_loss(self, stats: StepStats) -> float:
        """sum_r grad_weight_r x loss_r: the mean loss of the global batch (one float64 all-reduce)."""
        mine = stats.loss if self.is_last and stats.loss is not None else 0.0
        value = torch.tensor([self.place.grad_weight * mine], dtype=torch.float64,
                             device=self.executor.comm.header_device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            work = dist.all_reduce(value, op=dist.ReduceOp.SUM, async_op=True)
            self.executor.comm.wait(work, "the replica loss all-reduce", "is every rank alive?")
        return float(value.item())


def _no_loss(output: Any, targets: Any) -> torch.Tensor:
    raise AssertionError("only the last stage computes a loss")  # internal invariant
