"""`Trainer`: one rank of a plan inside the user's own training script (launched by torchrun).

`hetpipe.run` launches torchrun for you and feeds seeded synthetic data or a saved
list of batches.  A user with a data loader that cannot be saved up front (streams,
shuffling workers, a custom collate) writes the loop instead; every rank runs the
same script, and hetpipe decides which stage it holds::

    # train.py -- torchrun --standalone --nproc-per-node=3 train.py
    import hetpipe
    trainer = hetpipe.Trainer("plan.json", model="gpt2-small", loss=my_loss, lr=3e-4)
    for step, (inputs, targets) in zip(range(1000), loader):
        stats = trainer.step(inputs, targets)    # global batches; only stages 0 and -1 read them
        if trainer.is_last:
            log.info("step %d loss %.4f", step, stats.loss)
    trainer.close()

What the constructor does, in order, before the first step: load the plan, re-capture
``model`` on the meta device and check the plan's fingerprint, validate the schedule,
build only this rank's stage (weights seeded per tensor, the same on any partition,
or loaded from ``state_dict``), join the process group (gloo on CPU, NCCL with CUDA;
an already initialised group is reused) and learn every stage's rank, then the
optimizer and the `PipelineExecutor`.  Every wait is bounded by ``timeout_s``; a dead
peer becomes a `RuntimeFailure` naming rank, stage and action (then exit the process:
the group is unusable).  Emulation is `hetpipe.run`'s (``emulate=True``), not this class's.

Example (nothing joins a process group before the plan and the model check out):
    >>> Trainer("missing-plan.json", model="gpt-demo")
    Traceback (most recent call last):
    ...
    hetpipe.errors.PlanError: cannot read plan missing-plan.json: No such file or directory
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetpipe.errors import ConfigError
from hetpipe.plan.schema import Plan
from hetpipe.runtime.data import split_microbatches
from hetpipe.runtime.execute.executor import PipelineExecutor, StepStats
from hetpipe.runtime.execute.options import ExecutorOptions
from hetpipe.runtime.stage.offload import HostOffloadOptimizer
from hetpipe.runtime.rank import RankState, gather_stage_ranks, join_process_group, loss_for, make_optimizer
from hetpipe.runtime.tp_run import save_grouped, setup_groups
from hetpipe.runtime.worker import prepare

log = logging.getLogger(__name__)


class Trainer:
    """One pipeline rank of ``plan`` in this process (see the module docstring).

    Args:
        plan: a `Plan` or the path of plan.json.
        model: the model the plan was made for (built-in name or ``package.module:factory``).
        loss: ``loss(output, targets) -> scalar`` per micro-batch, used on the last stage
            (default: the built-in model's loss).
        optimizer: ``factory(params) -> torch.optim.Optimizer`` (default: the plan's
            ``training.optimizer`` with ``lr``).
        lr: learning rate of the default optimizer.
        schedule: "1f1b" or "gpipe" (default: the plan's).
        lr_scheduler: ``factory(optimizer) -> scheduler``, stepped after each optimizer step.
        grad_clip_norm: clip the global gradient norm (across all stages) to this.
        state_dict: full-model weights; each rank copies only its stage's tensors.
        weights: a checkpoint file or folder instead (state-dict file, ``.safetensors``,
            ``save_pretrained`` folder); each rank reads only its stage's tensors.
        node: the plan node this process runs on (multi-node jobs; default ``$HETPIPE_NODE``).
        resume: a checkpoint folder (`save_checkpoint`'s, or ``hetpipe run --checkpoint-dir``'s) to
            continue from, on this plan or another; `steps_done` then says how many global
            batches the data loader must skip.
    """

    def __init__(self, plan: Plan | str | Path, *, model: str, loss: Callable[..., Any] | None = None,
                 optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
                 lr: float | None = None, schedule: str | None = None, seq: int | None = None, seed: int = 0,
                 timeout_s: float = 60.0, lr_scheduler: Callable[[Any], Any] | None = None,
                 grad_clip_norm: float | None = None, state_dict: Mapping[str, torch.Tensor] | None = None,
                 node: str | None = None, weights: str | Path | None = None,
                 resume: str | Path | None = None) -> None:
        from hetpipe.runtime.checkpoint.options import refuse_weights_with_resume

        refuse_weights_with_resume(weights, resume)  # before any process group or stage is built
        loaded = plan if isinstance(plan, Plan) else Plan.load(plan)
        if loaded.replicas:
            raise ConfigError(f"{plan if not isinstance(plan, Plan) else 'the plan'} has {len(loaded.replicas)} "
                              "replicas; use hetpipe.runtime.replicas.trainer.ReplicaTrainer for replica plans")
        plan_path = plan if not isinstance(plan, Plan) else None
        args = argparse.Namespace(plan=plan_path, model=model, seq=seq, seed=seed, schedule=schedule,
                                  timeout=float(timeout_s), emulate=False, lr=lr, loss=None,
                                  weights=str(weights) if weights is not None else None,
                                  node=node if node is not None else os.environ.get("HETPIPE_NODE"))
        state = RankState(dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0")))
        run = prepare(args, state, plan=plan if isinstance(plan, Plan) else None, state_dict=state_dict)
        self.backend = _join(run)
        self.plan, self.stage, self.rank = run.plan, run.stage, run.rank
        self._saved_names = run.saved_names
        self._run, self._model, self._seed = run, model, seed
        self.steps_done = 0  # optimizer steps taken (= global batches consumed), counting a resumed checkpoint's
        if self.is_last and loss is None:
            loss = loss_for(model, None)
        if run.groups is not None:  # a head split by vocabulary runs the vocab-parallel loss (runtime/tp_vocab.py)
            loss = run.groups.loss(loss)
        params = list(run.stage.parameters())
        make = optimizer if optimizer is not None else (
            lambda ps: make_optimizer(run.plan.training.optimizer, ps, lr=lr))
        # a stage the plan offloads steps `make`'s optimizer on host copies (`runtime/stage/offload.py`)
        opt = HostOffloadOptimizer(params, make) if run.plan.stages[run.index].offload else make(params)
        self.optimizer = opt
        self.executor = PipelineExecutor(
            run.stage, rank=run.rank, num_stages=run.num_stages, schedule_actions=run.actions,
            loss_fn=loss if loss is not None else _no_loss, optimizer=opt,
            microbatches=run.plan.training.microbatches, stage_ranks=run.stage_ranks,
            options=ExecutorOptions(timeout_s=float(timeout_s), grad_clip_norm=grad_clip_norm), wiring=run.wiring,
            lr_scheduler=lr_scheduler(opt.inner if isinstance(opt, HostOffloadOptimizer) else opt)
            if lr_scheduler is not None else None)
        if resume is not None:
            self._resume(resume)

    @property
    def is_first(self) -> bool:
        """Whether this rank reads the inputs (stage 0)."""
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        """Whether this rank reads the targets and computes the loss."""
        return self.stage.is_last

    def step(self, inputs: Any = None, targets: Any = None) -> StepStats:
        """One optimizer step on one global batch; ``inputs`` are read on stage 0, ``targets`` on the last.

        Pass the same global batch on every rank that reads data (or None on the others);
        it is cut into the plan's micro-batches along dim 0.
        """
        m = self.plan.training.microbatches
        if self.is_first and inputs is None:
            raise ConfigError(f"rank {self.rank} (stage 0) needs the inputs of every step; pass trainer.step(inputs, "
                              "targets) with the same global batch on the first and last stages")
        if self.is_last and targets is None:
            raise ConfigError(f"rank {self.rank} (stage {self.stage.stage}, the last) needs the targets of every step")
        # split (and so checked) on every rank given a batch, not only where read: a middle stage refuses a bad one
        # itself instead of waiting for a message its neighbour never sends (the review: a "connection closed")
        split_in = split_microbatches(inputs, m, what="inputs") if inputs is not None else None
        split_t = split_microbatches(targets, m, what="targets") if targets is not None else None
        stats = self.executor.step(split_in if self.is_first else None, split_t if self.is_last else None)
        self.steps_done += 1
        return stats

    def save_checkpoint(self, root: str | Path) -> Path:
        """Save this step's parameters, optimizer state (by parameter name) and random state into
        ``root/step-NNNNNN`` (collective; `hetpipe.runtime.checkpoint.state`); returns that folder.
        An lr scheduler's state is not saved."""
        from hetpipe.runtime.checkpoint.state import for_run, save_checkpoint

        st, ckpt = for_run(self._run, self.optimizer, root=root, every=None, model=self._model, seed=self._seed)
        return save_checkpoint(Path(root), step=self.steps_done, state=st, info=ckpt.info(self.steps_done))

    def _resume(self, resume: str | Path) -> None:
        from hetpipe.runtime.checkpoint.state import for_run, resume_stage
        from hetpipe.runtime.checkpoint.files import check_run_settings, find_checkpoint

        folder, info = find_checkpoint(resume)
        check_run_settings(folder, info, seed=self._seed, global_batch=self.plan.training.global_batch)
        st, ckpt = for_run(self._run, self.optimizer, root=None, every=None, model=self._model, seed=self._seed)
        self.steps_done = resume_stage(folder, info, st, program=self._run.program, ckpt=ckpt)

    def save_weights(self, out_dir: str | Path) -> None:
        """Write the current weights to ``out_dir`` as safetensors shards + ``model.safetensors.index.json``.

        Collective: every rank calls it (after the same step); ``out_dir`` is loadable
        with ``weights=`` and, for a Hugging Face model, with ``from_pretrained``.
        """
        from hetpipe.runtime.stage.weights import save_pipeline

        if self._run.groups is not None:  # a group's members gather their shards, the leads write
            save_grouped(self._run.groups, self.plan, self.stage, self._run.units, names=self._saved_names,
                         out_dir=str(out_dir))
            return
        save_pipeline(self.stage.module, self._saved_names, out_dir, stage=self.stage.stage,
                      num_stages=self.stage.num_stages)

    def close(self) -> None:
        """Leave the process group (after the last step, on every rank)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _no_loss(output: Any, targets: Any) -> torch.Tensor:
    raise AssertionError("only the last stage computes a loss")  # internal invariant


def _join(run: Any) -> str:
    """Join torchrun's process group (or reuse one) and learn every stage's global rank."""
    backend = join_process_group(run.args.timeout)
    run.rank = dist.get_rank()
    if run.slot is not None:  # tensor-parallel groups: layout, process groups, this member's shard (tp_run.py)
        run.groups = setup_groups(run.plan, run.slot, run.stage, run.units, timeout_s=run.args.timeout,
                                  source=run)
        run.stage_ranks, run.wiring = list(run.groups.layout.executor_ranks), run.groups.wiring
    else:
        run.stage_ranks = gather_stage_ranks(run.index, run.num_stages)
    return backend
