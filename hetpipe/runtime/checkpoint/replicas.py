"""Checkpoints of replica plans (plan version 2): the same files as a single pipeline's, so a
checkpoint moves between one pipeline and replicas, other replica counts and batch shares, and
sharded and unsharded optimizer state.

Synchronous replicas hold the same parameters and the same optimizer state after every step
(their gradients are all-reduced before it), so exactly one holder writes each tensor: the ranks
of replica 0 (its stages cover the model), with `hetpipe.runtime.stage.weights.saved_names` of
its own cut (a tied parameter once, by its owner stage).  Where the plan shards a group's
optimizer state (ZeRO-1), every holder first takes part in `gather_full_state` and replica 0's
holder writes the whole state by parameter name (what it costs: see
`hetpipe.runtime.replicas.shard_state`).  Every rank writes its own random generators under
``rng/stage-<plan stage>/`` (restored only on the same plan).  The data position is the number
of global batches consumed, one per step whatever the replicas' shares, so it is plan-independent.

A resumed rank reads exactly the keys of its replica's stage (`restore_checkpoint`), then a
sharded optimizer keeps its slices (`load_full_state`).

DiLoCo plans are refused: between outer steps each replica's parameters and inner optimizer
state differ, and the outer anchors and Nesterov momentum would need saving per replica;
`refuse_diloco` says so and names the fix.

Example:
    >>> from types import SimpleNamespace as NS
    >>> refuse_diloco(NS(replicas=(1, 2), sync=NS(policy="diloco", outer_steps=4)), "--resume")
    Traceback (most recent call last):
    ...
    hetpipe.errors.ConfigError: --resume: the replica plan syncs with DiLoCo (H = 4), whose replicas differ between outer steps; checkpoints of replica plans need synchronous sync: re-plan with hetpipe.plan.replicas.partition_replicas(..., policy="synchronous"), or run without --checkpoint-dir/--resume
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

from hetpipe.errors import ConfigError
from hetpipe.runtime.checkpoint.files import CheckpointInfo, check_names, plan_digest
from hetpipe.runtime.checkpoint.state import (
    Checkpointing,
    StageState,
    canonical_names,
    check_optimizer,
    model_shapes,
    program_fingerprint,
    restore_checkpoint,
    save_checkpoint,
)
from hetpipe.runtime.replicas.shard import ShardedOptimizer
from hetpipe.runtime.replicas.shard_state import gather_full_state, load_full_state

log = logging.getLogger(__name__)


class _StateOnly:
    """What `stage_state_dict` and `restore_checkpoint` touch of an optimizer: its ``state`` by parameter."""

    def __init__(self, state: dict[Any, Any] | None = None) -> None:
        self.state: dict[Any, Any] = {} if state is None else state


def refuse_diloco(plan: Any, flag: str) -> None:
    """One `ConfigError` for checkpointing or resuming a DiLoCo replica plan (see the module docstring)."""
    sync = getattr(plan, "sync", None)
    if plan.replicas and sync is not None and sync.policy == "diloco":
        raise ConfigError(f"{flag}: the replica plan syncs with DiLoCo (H = {sync.outer_steps}), whose replicas differ "
                          "between outer steps; checkpoints of replica plans need synchronous sync: re-plan with "
                          "hetpipe.plan.replicas.partition_replicas(..., policy=\"synchronous\"), or run without "
                          "--checkpoint-dir/--resume")


def replica_state(trainer: Any, *, root: str | Path | None, every: int | None, model: str,
                  seed: int) -> tuple[StageState, Checkpointing]:
    """(what this rank saves and restores, when and as what) for a `ReplicaTrainer`."""
    from hetpipe.runtime.stage.weights import saved_names

    place, program = trainer.place, trainer.program
    owned = saved_names(program, place.stage) if place.replica == 0 else {}  # replica 0 writes every tensor once
    optimizer = _StateOnly() if isinstance(trainer.optimizer, ShardedOptimizer) else trainer.optimizer
    st = StageState(trainer.stage.module, canonical_names(program, place.stage), owned, optimizer, place.plan_stage)
    ckpt = Checkpointing(root=Path(root) if root is not None else None, every=every, model=model,
                         fingerprint=program_fingerprint(program), plan=trainer.plan, seed=seed)
    return st, ckpt


def save_replica(trainer: Any, st: StageState, ckpt: Checkpointing, steps_done: int) -> Path:
    """Collective over the world: every rank of the replica plan saves (module docstring)."""
    assert ckpt.root is not None  # `Checkpointing.due` is False without a folder
    if isinstance(trainer.optimizer, ShardedOptimizer):
        full = gather_full_state(trainer.optimizer)  # every holder takes part; only replica 0's saves it
        st = dataclasses.replace(st, optimizer=_StateOnly(full if st.owned else {}))
    return save_checkpoint(ckpt.root, step=steps_done, state=st, info=ckpt.info(steps_done))


def resume_replica(folder: Path, info: CheckpointInfo, trainer: Any, st: StageState, ckpt: Checkpointing) -> int:
    """Check ``folder`` against this rank's stage and restore it (collective); returns the steps already taken."""
    check_optimizer(folder, info, ckpt.plan)
    check_names(folder, info, model=ckpt.model, fingerprint=ckpt.fingerprint,
                needed=model_shapes(trainer.program, parameters_only=True, stages=[trainer.place.stage]),
                stage=trainer.place.plan_stage)
    same = info.plan_digest == plan_digest(ckpt.plan)
    if isinstance(trainer.optimizer, ShardedOptimizer):
        loaded = _StateOnly()
        restore_checkpoint(folder, dataclasses.replace(st, optimizer=loaded), same_plan=same)
        load_full_state(trainer.optimizer, loaded.state)
    else:
        restore_checkpoint(folder, st, same_plan=same)
    log.info("%s resumed from %s at step %d (%s plan)", trainer.where, folder, info.step, "same" if same else "another")
    return info.step


def replica_checkpoints(args: Any, trainer: Any, resume: Any,
                        set_phase: Callable[[str], None]) -> tuple[int, Callable[[int, bool], None]]:
    """The worker's hook: restore ``--resume`` (``(folder, info)`` or None) and return (steps already
    taken, the per-step saver) for a replica plan."""
    root, every = getattr(args, "checkpoint_dir", None), getattr(args, "checkpoint_every", None)
    if root is not None or resume is not None:
        refuse_diloco(trainer.plan, "--checkpoint-dir" if resume is None else "--resume")
    st, ckpt = replica_state(trainer, root=root, every=every, model=args.model, seed=args.seed)
    start = 0
    if resume is not None:
        set_phase("resuming from the checkpoint")
        start = resume_replica(resume[0], resume[1], trainer, st, ckpt)

    def after_step(steps_done: int, last: bool) -> None:
        if ckpt.due(steps_done, last=last):
            set_phase(f"saving the checkpoint of step {steps_done}")
            save_replica(trainer, st, ckpt, steps_done)

    return start, after_step
