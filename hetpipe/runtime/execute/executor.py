"""Run one rank's action list over torch.distributed: forwards, backwards, P2P and the optimizer step.

`PipelineExecutor.step` walks the rank's `Action`s in order, each on the stage module its
virtual stage names (one per rank, or a rank's chunks of an interleaved plan:
`hetpipe.runtime.execute.chunks`; the compute actions are `hetpipe.runtime.execute.compute`'s):

* ``F``: run the stage on the micro-batch's inputs (the user's inputs on stage 0,
  the received activations elsewhere) and keep its autograd graph; the last stage
  also applies ``loss_fn(output, target)``, scaled by ``1 / num_microbatches``
  (``loss_reduction="mean"``) so that accumulated gradients are the mean over the
  global batch, or by 1 (``"sum"``).
* ``B``: ``torch.autograd.backward`` on the stage outputs with the received
  gradients (on the scaled loss on the last stage); gradients accumulate in the
  parameters over micro-batches; the gradients of the received inputs are kept
  for ``SEND_B``.  Units the plan recomputes re-run their forward here (checkpoint), and
  the memory ledger adds the largest one's activations on top of what is held.
* ``B`` and ``W`` when the list splits the backward (ZB-H1): B computes only the received
  inputs' gradients, keeping the graph; W the parameters' (`split_backward`); the
  micro-batch's activations are released at its W.
* ``SEND_*`` post ``isend``s; ``RECV_*`` wait for ``irecv``s posted up to
  ``prefetch_depth`` receives ahead, so transfers overlap compute; for the built-in
  GPipe/1F1B/ZB lists a RECV first waits for this rank's earlier sends (the defaults
  and why: `hetpipe.runtime.execute.prefetch`).
* ``STEP``: wait for outstanding sends, sum tied-parameter gradients between the
  stages holding a replica (one process group per tied parameter), clip by the
  global gradient norm across all stages (all-reduce of squared norms, torch's
  ``clip_grad_norm_`` formula, each tied parameter counted once), then
  ``optimizer.step()`` and ``lr_scheduler.step()``.

Gradients are zeroed at the start of each step, so after ``step`` they can be
inspected.  Before the first step, neighbours compare cut-spec fingerprints and
micro-batch counts.  Every wait is bounded by ``timeout_s``; a dead or hung peer
becomes a `RuntimeFailure` naming this rank, its stage, the action and the peer.
After a `RuntimeFailure` the process group is unusable: exit the process.

``StepStats.loss`` is the global-batch loss on the last stage and None elsewhere
(all ranks get it with ``broadcast_loss=True``, one broadcast per step).

Example (one stage: no process group needed):
    >>> import torch
    >>> from hetpipe.schedule.actions import Action, Op
    >>> from hetpipe.runtime.stage.build import build_stage, split_stages
    >>> net = torch.nn.Linear(3, 1)
    >>> prog = split_stages(torch.fx.symbolic_trace(net), {}, example_inputs=(torch.zeros(2, 3),))
    >>> stage = build_stage(prog, 0, state_dict=net.state_dict(), device="cpu")
    >>> opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    >>> acts = [Action(0, Op.F, 0), Action(0, Op.F, 1), Action(0, Op.B, 0), Action(0, Op.B, 1), Action(0, Op.STEP)]
    >>> ex = PipelineExecutor(stage, rank=0, num_stages=1, schedule_actions=acts, optimizer=opt, microbatches=2,
    ...                       loss_fn=torch.nn.functional.mse_loss, options=ExecutorOptions(timeout_s=5.0))
    >>> x, y = torch.ones(4, 3), torch.zeros(4, 1)
    >>> stats = ex.step([x[:2], x[2:]], [y[:2], y[2:]])
    >>> ref = torch.nn.functional.mse_loss(net(x), y).item()
    >>> abs(stats.loss - ref) < 1e-6, len(stats.forward_s)
    (True, 2)
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hetpipe.errors import RuntimeFailure
from hetpipe.runtime.execute import agreement, comm, heartbeat, prefetch
from hetpipe.runtime.execute.chunks import RankStages
from hetpipe.runtime.execute.compute import StageCompute
from hetpipe.runtime.execute.grad_clip import clip_grads
from hetpipe.runtime.execute.held import HeldBytes, grad_bytes, optimizer_bytes, storage_key
from hetpipe.runtime.execute.options import ExecutorOptions, ReplicaWiring
from hetpipe.runtime.execute.prefetch import PREFETCH_DEPTH
from hetpipe.runtime.execute.stats import ActionHooks, ActionTiming, MemoryStats, StepStats
from hetpipe.runtime.execute.step_state import StepState
from hetpipe.runtime.execute.tied import reduce_tied
from hetpipe.runtime.stage.build import StageModule
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.builders import check_actions

__all__ = ["ActionHooks", "ExecutorOptions", "PREFETCH_DEPTH", "PipelineExecutor", "StepStats"]


class PipelineExecutor:
    """Executes one rank's action list of a pipeline (see the module docstring).

    Args:
        stage_module: this rank's `StageModule`, or its chunks' (an interleaved plan: chunk c of
            rank r is virtual stage ``c p + r``); the first one's ``device`` is where compute runs.
        rank: this process's global rank (must be ``stage_ranks[s]`` for each of its stages s).
        num_stages: pipeline depth in (virtual) stages: the program's stage count.
        schedule_actions: this rank's actions, e.g. ``one_f_one_b(p, m)[rank]``.
        loss_fn: ``loss_fn(output, target) -> scalar`` per micro-batch (last stage only).
        optimizer: built over every parameter of ``stage_module``.
        microbatches: micro-batches per step.
        stage_ranks: global rank of each (virtual) stage (default: virtual stage k on rank k % p).
        options: `ExecutorOptions` (timeouts, loss reduction, clipping, prefetch, memory
            accounting; see its docstring).  Prefetch: on gloo 0 unless local ranks outnumber
            cores, else `PREFETCH_DEPTH` (`hetpipe.runtime.execute.prefetch`).  Saved-tensor
            accounting on every step is exact for data-dependent shapes; a stage's shapes are fixed
            by its cut specs, so the first step's bytes repeat and skipping the hooks afterwards
            saves about 0.8 ms per step on the 2-stage benchmark.
        hooks: `ActionHooks` for emulation / instrumentation.
        lr_scheduler: stepped after each optimizer step.
        wiring: `ReplicaWiring`: the process groups and callbacks of a replica plan.
    """

    def __init__(self, stage_module: StageModule | Sequence[StageModule], *, rank: int, num_stages: int,
                 schedule_actions: Sequence[Action], loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: torch.optim.Optimizer, microbatches: int, stage_ranks: Sequence[int] | None = None,
                 options: ExecutorOptions = ExecutorOptions(), hooks: ActionHooks | None = None,
                 lr_scheduler: Any = None, wiring: ReplicaWiring = ReplicaWiring()) -> None:
        self.stages = RankStages.of(stage_module)
        self.stage, self.options = self.stages.first, options
        self.rank, self.num_stages, self.microbatches = rank, num_stages, microbatches
        self.loss_fn, self.optimizer, self.lr_scheduler = loss_fn, optimizer, lr_scheduler
        self.timeout_s, self.grad_clip_norm = float(options.timeout_s), options.grad_clip_norm
        self.broadcast_loss = options.broadcast_loss
        self.hooks = hooks or ActionHooks()
        chunks = len(self.stages)
        self.stage_ranks = (tuple(stage_ranks) if stage_ranks is not None
                            else tuple(k % max(1, num_stages // chunks) for k in range(num_stages)))
        self._group, self._tied_group_fn, self._grad_sync = wiring.group, wiring.tied_group, wiring.grad_sync
        # a tensor-parallel member's replicated parameters (its lead counts them), tied ones held as vocabulary rows
        self._uncounted, self._tied_rows = wiring.uncounted, wiring.tied_rows
        self._where = f"rank {rank} (stage{'s' if chunks > 1 else ''} {', '.join(map(str, self.stages.stages))})"
        self._check_config(options.cut_specs)
        self.actions = tuple(schedule_actions)
        split = any(a.op is Op.W for a in self.actions)  # B and W: the gradients exist from the first W
        self._grad_op = Op.W if split else Op.B
        last_b = next((a for a in reversed(self.actions) if a.op is self._grad_op), None)
        ranks = max(1, num_stages // chunks)
        check_actions(self.actions, stage=self.stage.stage if chunks == 1 else self.stage.stage % ranks,
                      num_stages=num_stages if chunks == 1 else ranks, num_microbatches=microbatches, chunks=chunks)
        self._loss_scale = 1.0 / microbatches if options.loss_reduction == "mean" else 1.0
        self._distributed = dist.is_available() and dist.is_initialized()
        if num_stages > 1 and not self._distributed:
            raise RuntimeFailure(f"{self._where}: a {num_stages}-stage pipeline needs torch.distributed; call "
                                 "init_process_group first (hetpipe's launcher does)")
        self._sync_cuda = options.sync_cuda_timing and self.stage.device.type == "cuda"
        self._params = self.stages.parameters()
        statics = self.stages.statics()
        self._memory = HeldBytes({k[0] for k in map(storage_key, statics) if k})
        self._memory.totals["params"] = sum(t.numel() * t.element_size() for t in statics)
        self._memory.totals["optimizer"] = optimizer_bytes(optimizer)
        self.compute = StageCompute(self.stages, memory=self._memory, hooks=self.hooks, where=self._where,
                                    loss_fn=loss_fn, loss_scale=self._loss_scale, params=self._params,
                                    final_backward=wiring.final_backward, last_grad_action=last_b, split=split)
        self.comm = (wiring.make_comm or comm.StageComm)(
            self.stage, rank=rank, stage_ranks=self.stage_ranks, timeout_s=self.timeout_s,
            send_delay_s=self.hooks.send_delay_s, on_comm_bytes=self._memory.set_comm, on_arrived=self.hooks.arrived)
        self.comm.hold(self.stages.modules)
        self._tied, self._tied_stage = self._make_tied_groups()
        self._set_up_messages(options)
        self._names = tuple(str(a) for a in self.actions)
        if num_stages > 1:
            self.comm.handshake(microbatches)

    def _set_up_messages(self, options: ExecutorOptions) -> None:
        """Prefetch depth, the send-wait mode and the per-action receives to post (`prefetch`)."""
        depth = options.prefetch_depth
        self.prefetch_depth = max(0, int(prefetch.default_prefetch(self.comm.gloo) if depth is None else depth))
        wait = options.wait_sends_at_recv
        if wait is None:
            wait = self.comm.gloo and self.num_stages > 1 and self._agreed_builtin_schedule()
        self.comm.wait_sends_at_recv = bool(wait)
        self.comm.send_wait_lag = prefetch.INTERLEAVED_SEND_LAG if len(self.stages) > 1 else 0
        self._prefetch_at = prefetch.prefetch_plan(self.actions, depth=self.prefetch_depth, gloo=self.comm.gloo,
                                                   peer=self.comm.peer)

    def _check_config(self, cut_specs: Sequence[Any] | None) -> None:
        if self.microbatches < 1:
            raise RuntimeFailure(f"{self._where}: microbatches must be positive, got {self.microbatches}")
        for s in self.stages.modules:
            if s.num_stages != self.num_stages or len(self.stage_ranks) != self.num_stages:
                raise RuntimeFailure(f"{self._where}: the stage module is from a {s.num_stages}-stage program, the "
                                     f"executor was given num_stages={self.num_stages} and {len(self.stage_ranks)} "
                                     "stage ranks; use the same program everywhere")
            if self.stage_ranks[s.stage] != self.rank:
                raise RuntimeFailure(f"{self._where}: stage {s.stage} runs on rank {self.stage_ranks[s.stage]} per "
                                     "stage_ranks; build this rank's own stage")
            if cut_specs is not None and any(c is not None and c not in cut_specs for c in (s.in_cut, s.out_cut)):
                raise RuntimeFailure(f"{self._where}: the stage's cuts differ from the cut_specs given; build the "
                                     "stage from the same StagedProgram")

    def _make_tied_groups(self) -> tuple[list[tuple[Any, torch.nn.Parameter, str, tuple[int, ...]]], dict[int, int]]:
        """(process group, local param, name, ranks) per tied parameter this rank holds, and the
        stage holding each (by parameter id).

        ``new_group`` is collective over the world, so every rank creates every group in
        the same order, also the groups it is not part of; with a ``tied_group`` factory the
        caller made them up front (replicas of different layouts create different sets).
        """
        local, holder = [], {}
        for group in self.stage.tied_groups:  # the program-wide list, the same on every chunk
            ranks = sorted({self.stage_ranks[s] for s in group.stages})
            if len(ranks) < 2 or not self._distributed:
                continue
            handle = (self._tied_group_fn(ranks) if self._tied_group_fn is not None
                      else dist.new_group(ranks=ranks, timeout=timedelta(seconds=self.timeout_s)))
            mine = [s for s in self.stages.modules if group.local_name(s.stage) is not None]
            if len(mine) > 1:
                raise RuntimeFailure(f"{self._where}: tied parameter {group.canonical_name!r} is used by chunks "
                                     f"{[s.stage for s in mine]} of this one rank, which interleaved runs do not "
                                     "support yet; re-plan with --schedule 1f1b (or untie it)")
            for s in mine:
                param = dict(s.module.named_parameters(remove_duplicate=False))[group.local_name(s.stage)]
                local.append((handle, param, group.canonical_name, tuple(ranks)))
                holder[id(param)] = s.stage
        return local, holder

    def _collective(self, work: Any, what: str, ranks: Sequence[int]) -> None:
        self.comm.wait(work, what, f"is every rank of {list(ranks)} alive?")

    # ------------------------------------------------------------------ step

    def step(self, inputs_mb: Sequence[Any] | None = None, targets_mb: Sequence[Any] | None = None) -> StepStats:
        """Run the action list once; ``inputs_mb`` is read on the first stage, ``targets_mb`` on the last.

        Each element of ``inputs_mb`` is one micro-batch: a tensor or a tuple of the
        model's positional inputs, shaped like ``split_stages``' example inputs.
        """
        self._check_batch("inputs_mb", inputs_mb, self.stages.holds_first)
        self._check_batch("targets_mb", targets_mb, self.stages.holds_last)
        self.optimizer.zero_grad(set_to_none=True)
        self._memory.totals["grads"] = 0
        explicit = self.options.track_saved_every_step
        track = bool(self.hooks.exact_memory) if explicit is None else bool(explicit)
        self._state = self.compute.begin(inputs_mb, targets_mb, track_every=track)
        self.comm.reset()
        c = self.compute
        handlers = {Op.F: c.forward, Op.B: c.backward, Op.W: c.weight, Op.SEND_F: self._send, Op.SEND_B: self._send,
                    Op.RECV_F: self._recv, Op.RECV_B: self._recv, Op.STEP: self._optimizer_step}
        hooks, clock, memory = self.hooks, time.perf_counter, self._memory
        start, origin_s = clock(), time.monotonic()  # perf_counter is CLOCK_MONOTONIC on Linux: one origin
        timings = []
        for index, action in enumerate(self.actions):
            for ahead in self._prefetch_at[index]:  # posting is idempotent
                self.comm.post_recv(ahead)
            hooks.before(action)
            t0 = clock()
            handlers[action.op](action)
            if self._sync_cuda and action.op in (Op.F, Op.B, Op.W):  # not the NCCL streams: the sync runs on
                torch.cuda.current_stream(self.stage.device).synchronize()  # them during the last backward
            seconds = clock() - t0
            self._record(action, seconds)
            hooks.after(action, seconds)  # emulation stretches compute here
            heartbeat.beat()  # per-action progress for the launcher's watchdog
            timings.append(ActionTiming(self._names[index], t0 - start, clock() - t0))
            hooks.memory(action, memory.observe())
        return self._stats(timings, time.perf_counter() - start, origin_s)

    def _check_batch(self, name: str, batch: Sequence[Any] | None, needed: bool) -> None:
        if needed and (batch is None or len(batch) != self.microbatches):
            got = "None" if batch is None else f"{len(batch)} micro-batches"
            raise RuntimeFailure(f"{self._where}: step() needs {name} with {self.microbatches} micro-batches on "
                                 f"this stage, got {got}; split the global batch into equal micro-batches")

    def _record(self, action: Action, seconds: float) -> None:
        st: StepState = self._state
        if action.op is Op.F:
            st.forward_s[(action.stage, action.microbatch)] = seconds
        elif action.op is Op.B or action.op is Op.W:  # a split backward's seconds are B's + W's
            k = (action.stage, action.microbatch)
            st.backward_s[k] = st.backward_s.get(k, 0.0) + seconds
            if action.op is self._grad_op and not self._memory.totals["grads"]:  # allocated by the first
                self._memory.totals["grads"] = grad_bytes(self._params)
        elif action.op in prefetch.RECVS:
            st.comm_wait_s += seconds

    def _agreed_builtin_schedule(self) -> bool:
        """Are the ranks' lists together deadlock-free when each RECV first waits for the rank's earlier
        sends (`agreement`: every rank's list all-gathered once at start-up, the same answer on every
        rank)?  Interleaved lists are checked with the lag they run with (`prefetch.INTERLEAVED_SEND_LAG`:
        with m > p they deadlock without it)."""
        chunks = len(self.stages)
        ranks = max(1, self.num_stages // chunks)
        every = agreement.gathered_schedule(self.actions, num_stages=ranks, group=self._group,
                                            wait=lambda work: self._collective(
                                                work, "the start-up schedule agreement", self.stage_ranks))
        return agreement.sends_may_wait_at_recv(
            every, num_stages=ranks, microbatches=self.microbatches, chunks=chunks,
            send_wait_lag=prefetch.INTERLEAVED_SEND_LAG if chunks > 1 else 0)

    # ------------------------------------------------------------------ messages

    def _recv(self, action: Action) -> None:
        self.compute.received(action, self.comm.recv(action))

    def _send(self, action: Action) -> None:
        self.comm.send(action, self.compute.to_send(action))

    # ------------------------------------------------------------------ optimizer step

    def _optimizer_step(self, action: Action) -> None:
        t0 = time.perf_counter()
        self.comm.wait_sends()
        self._state.comm_wait_s += time.perf_counter() - t0
        if self._grad_sync is not None:
            self._grad_sync()
        reduce_tied(self._tied, rows=self._tied_rows, wait=self._collective)  # execute/tied.py
        if self.grad_clip_norm is not None:
            self._state.grad_norm = self._clip_grads(float(self.grad_clip_norm))
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._memory.totals["grads"] = grad_bytes(self._params)
        self._memory.totals["optimizer"] = optimizer_bytes(self.optimizer)

    def _clip_grads(self, max_norm: float) -> float:
        """Global L2 norm over every stage (tied replicas counted once); scale grads like clip_grad_norm_."""
        not_owned = {id(p) for _, p, name, _ in self._tied
                     if self._owner_stage(name) != self._tied_stage[id(p)]} | self._uncounted
        all_reduce = None
        if self._distributed and self.num_stages > 1:
            def all_reduce(squared: torch.Tensor) -> None:
                work = dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
                self._collective(work, "the gradient-norm all-reduce", self.stage_ranks)
        return clip_grads(self._params, max_norm=max_norm, not_owned=not_owned, device=self.stage.device,
                          all_reduce=all_reduce)

    def _owner_stage(self, canonical_name: str) -> int:
        return next(g.owner_stage for g in self.stage.tied_groups if g.canonical_name == canonical_name)

    def _stats(self, timings: list[ActionTiming], step_s: float, origin_s: float = 0.0) -> StepStats:
        st = self._state
        loss = None
        if self.stages.holds_last:
            loss = float(torch.stack(st.loss_values).sum() * self._loss_scale)
        if self.broadcast_loss and self._distributed and self.num_stages > 1:
            value = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64,
                                 device=self.comm.header_device)
            work = dist.broadcast(value, src=self.stage_ranks[-1], group=self._group, async_op=True)
            self._collective(work, "the loss broadcast", self.stage_ranks)
            loss = float(value.item())
        m = self._memory
        memory = MemoryStats(m.totals["params"], m.totals["grads"], m.totals["optimizer"], m.peaks["activations"],
                             m.peaks["comm"], m.peaks["total"])
        optimizer_s = next(t.duration_s for t in reversed(timings) if t.action.endswith("STEP"))
        return StepStats(
            rank=self.rank, stage=self.stage.stage, loss=loss,
            forward_s=st.per_microbatch(st.forward_s, self.microbatches),
            backward_s=st.per_microbatch(st.backward_s, self.microbatches),
            actions=tuple(timings), comm_wait_s=st.comm_wait_s, optimizer_s=optimizer_s, step_s=step_s,
            grad_norm=st.grad_norm, memory=memory, origin_s=origin_s)
