"""Run one rank's action list over torch.distributed: forwards, backwards, P2P and the optimizer step.

`PipelineExecutor.step` walks the rank's `Action`s in order:

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
  ``prefetch_depth`` receives ahead, so transfers overlap compute (on NCCL, which
  matches P2P in issue order per pair, never ahead of a send to the same peer).
  On gloo the stages' compute and gloo's I/O threads share the CPU cores, and
  two defaults follow measurements (benchmarks/runtime_vs_torch.py, 2-core VM):
  receives are posted at their own action while every local rank has a core of
  its own (posting early cost 15-40% there: the I/O thread that completes an
  early receive must preempt a busy stage), and `PREFETCH_DEPTH` ahead when ranks
  outnumber cores (ranks then block often and data should flow meanwhile); and,
  for the built-in GPipe/1F1B lists, a RECV first waits for this rank's earlier
  sends (``wait_sends_at_recv``; 3-8% faster, and deadlock-free for those lists:
  `validate_schedule` ``sends_wait_at_recv=True``).
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

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hetpipe.cost_models.stage_memory import RECV_PREFETCH
from hetpipe.errors import RuntimeFailure
from hetpipe.runtime.execute import agreement, comm, heartbeat, split_backward
from hetpipe.schedule.actions import Action, Op
from hetpipe.runtime.execute.held import HeldBytes, grad_bytes, optimizer_bytes, storage_key
from hetpipe.runtime.execute.options import ExecutorOptions, ReplicaWiring
from hetpipe.schedule.builders import check_actions
from hetpipe.runtime.stage.build import StageModule
from hetpipe.runtime.execute.stats import ActionHooks, ActionTiming, MemoryStats, StepStats
from hetpipe.runtime.execute.tied import reduce_tied

log = logging.getLogger(__name__)

_RECVS = (Op.RECV_F, Op.RECV_B)
_SENDS = (Op.SEND_F, Op.SEND_B)
_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon, so clipping matches it
# Receives posted ahead off gloo (the next one and two more: covers a 1F1B F-B-F window); the
# memory model counts a buffer for each (`hetpipe.cost_models.stage_memory.RECV_PREFETCH`).
PREFETCH_DEPTH = RECV_PREFETCH


@dataclass
class _StepState:
    inputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    outputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    loss_values: list[torch.Tensor] = field(default_factory=list)
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    grads_in: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    grads_out: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    pending_w: dict[int, split_backward.PendingWeight] = field(default_factory=dict)
    forward_s: dict[int, float] = field(default_factory=dict)
    backward_s: dict[int, float] = field(default_factory=dict)
    comm_wait_s: float = 0.0
    grad_norm: float | None = None


class PipelineExecutor:
    """Executes one rank's action list of a pipeline (see the module docstring).

    Args:
        stage_module: this rank's `StageModule`; its ``device`` is where compute runs.
        rank: this process's global rank (must be ``stage_ranks[stage_module.stage]``).
        num_stages: pipeline depth.
        schedule_actions: this rank's actions, e.g. ``one_f_one_b(p, m)[rank]``.
        loss_fn: ``loss_fn(output, target) -> scalar`` per micro-batch (last stage only).
        optimizer: built over ``stage_module.parameters()``.
        microbatches: micro-batches per step.
        stage_ranks: global rank of each stage (default: rank r runs stage r).
        options: `ExecutorOptions` (timeouts, loss reduction, clipping, prefetch, memory
            accounting; see its docstring).  Prefetch: on gloo 0 unless local ranks outnumber
            cores, else `PREFETCH_DEPTH` (module docstring).  Saved-tensor accounting on every
            step is exact for data-dependent shapes; a stage's shapes are fixed by its cut
            specs, so the first step's bytes repeat and skipping the hooks afterwards saves
            about 0.8 ms per step on the 2-stage benchmark.
        hooks: `ActionHooks` for emulation / instrumentation.
        lr_scheduler: stepped after each optimizer step.
        wiring: `ReplicaWiring`: the process groups and callbacks of a replica plan.
    """

    def __init__(self, stage_module: StageModule, *, rank: int, num_stages: int,
                 schedule_actions: Sequence[Action], loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: torch.optim.Optimizer, microbatches: int, stage_ranks: Sequence[int] | None = None,
                 options: ExecutorOptions = ExecutorOptions(), hooks: ActionHooks | None = None,
                 lr_scheduler: Any = None, wiring: ReplicaWiring = ReplicaWiring()) -> None:
        self.stage, self.options = stage_module, options
        self.rank, self.num_stages, self.microbatches = rank, num_stages, microbatches
        self.loss_fn, self.optimizer, self.lr_scheduler = loss_fn, optimizer, lr_scheduler
        self.timeout_s, self.grad_clip_norm = float(options.timeout_s), options.grad_clip_norm
        self.broadcast_loss = options.broadcast_loss
        self.hooks = hooks or ActionHooks()
        self._track_every_arg = options.track_saved_every_step
        self._saved_bytes: dict[int, int] = {}  # micro-batch -> activation bytes its forward added (first step)
        self.stage_ranks = tuple(stage_ranks) if stage_ranks is not None else tuple(range(num_stages))
        self._group, self._tied_group_fn, self._grad_sync = wiring.group, wiring.tied_group, wiring.grad_sync
        # a tensor-parallel member's replicated parameters (its lead counts them), tied ones held as vocabulary rows
        self._uncounted, self._tied_rows = wiring.uncounted, wiring.tied_rows
        self._where = f"rank {rank} (stage {stage_module.stage})"
        self._check_config(options.cut_specs)
        self.actions = tuple(schedule_actions)
        self._final_backward = wiring.final_backward
        self._split = any(a.op is Op.W for a in self.actions)  # B and W: the gradients exist from the first W
        self._grad_op = Op.W if self._split else Op.B
        self._last_b = next((a for a in reversed(self.actions) if a.op is self._grad_op), None)
        check_actions(self.actions, stage=stage_module.stage, num_stages=num_stages, num_microbatches=microbatches)
        self._loss_scale = 1.0 / microbatches if options.loss_reduction == "mean" else 1.0
        self._distributed = dist.is_available() and dist.is_initialized()
        if num_stages > 1 and not self._distributed:
            raise RuntimeFailure(f"{self._where}: a {num_stages}-stage pipeline needs torch.distributed; call "
                                 "init_process_group first (hetpipe's launcher does)")
        self._sync_cuda = options.sync_cuda_timing and stage_module.device.type == "cuda"
        self._params = list(dict.fromkeys(stage_module.parameters()))
        statics = list(dict.fromkeys(self._params + list(stage_module.module.buffers())))
        self._memory = HeldBytes({k[0] for k in map(storage_key, statics) if k})
        self._memory.totals["params"] = sum(t.numel() * t.element_size() for t in statics)
        self._memory.totals["optimizer"] = optimizer_bytes(optimizer)
        self.comm = (wiring.make_comm or comm.StageComm)(
            stage_module, rank=rank, stage_ranks=self.stage_ranks, timeout_s=self.timeout_s,
            send_delay_s=self.hooks.send_delay_s, on_comm_bytes=self._memory.set_comm, on_arrived=self.hooks.arrived)
        self._tied = self._make_tied_groups()
        depth = options.prefetch_depth
        self.prefetch_depth = max(0, int(self._default_prefetch() if depth is None else depth))
        wait = options.wait_sends_at_recv
        self.comm.wait_sends_at_recv = (self.comm.gloo and num_stages > 1 and self._agreed_builtin_schedule()
                                        if wait is None else bool(wait))
        self._prefetch_at = self._prefetch_plan()
        self._names = tuple(str(a) for a in self.actions)
        if num_stages > 1:
            self.comm.handshake(microbatches)

    def _check_config(self, cut_specs: Sequence[Any] | None) -> None:
        s = self.stage
        if self.microbatches < 1:
            raise RuntimeFailure(f"{self._where}: microbatches must be positive, got {self.microbatches}")
        if s.num_stages != self.num_stages or len(self.stage_ranks) != self.num_stages:
            raise RuntimeFailure(f"{self._where}: the stage module is from a {s.num_stages}-stage program, the "
                                 f"executor was given num_stages={self.num_stages} and {len(self.stage_ranks)} "
                                 "stage ranks; use the same program everywhere")
        if self.stage_ranks[s.stage] != self.rank:
            raise RuntimeFailure(f"{self._where}: stage {s.stage} runs on rank {self.stage_ranks[s.stage]} per "
                                 "stage_ranks; build this rank's own stage")
        if cut_specs is not None:
            if any(c is not None and c not in cut_specs for c in (s.in_cut, s.out_cut)):
                raise RuntimeFailure(f"{self._where}: the stage's cuts differ from the cut_specs given; build the "
                                     "stage from the same StagedProgram")

    def _make_tied_groups(self) -> list[tuple[Any, torch.nn.Parameter, str, tuple[int, ...]]]:
        """(process group, local param, name, ranks) per tied parameter this stage holds.

        ``new_group`` is collective over the world, so every rank creates every group in
        the same order, also the groups it is not part of; with a ``tied_group`` factory the
        caller made them up front (replicas of different layouts create different sets).
        """
        local = []
        params = dict(self.stage.module.named_parameters(remove_duplicate=False))
        for group in self.stage.tied_groups:
            ranks = sorted(self.stage_ranks[s] for s in set(group.stages))
            if len(ranks) < 2 or not self._distributed:
                continue
            handle = (self._tied_group_fn(ranks) if self._tied_group_fn is not None
                      else dist.new_group(ranks=ranks, timeout=timedelta(seconds=self.timeout_s)))
            name = group.local_name(self.stage.stage)
            if name is not None:
                local.append((handle, params[name], group.canonical_name, tuple(ranks)))
        return local

    def _collective(self, work: Any, what: str, ranks: Sequence[int]) -> None:
        self.comm.wait(work, what, f"is every rank of {list(ranks)} alive?")

    # ------------------------------------------------------------------ step

    def step(self, inputs_mb: Sequence[Any] | None = None, targets_mb: Sequence[Any] | None = None) -> StepStats:
        """Run the action list once; ``inputs_mb`` is read on the first stage, ``targets_mb`` on the last.

        Each element of ``inputs_mb`` is one micro-batch: a tensor or a tuple of the
        model's positional inputs, shaped like ``split_stages``' example inputs.
        """
        self._check_batch("inputs_mb", inputs_mb, self.stage.is_first)
        self._check_batch("targets_mb", targets_mb, self.stage.is_last)
        self._inputs, self._targets = inputs_mb, targets_mb
        self.optimizer.zero_grad(set_to_none=True)
        self._memory.totals["grads"] = 0
        self._state = _StepState()
        self.comm.reset()
        explicit = self._track_every_arg
        self._track_every = bool(self.hooks.exact_memory) if explicit is None else bool(explicit)
        handlers = {Op.F: self._forward, Op.B: self._backward, Op.W: self._weight, Op.SEND_F: self._send, Op.SEND_B: self._send,
                    Op.RECV_F: self._recv, Op.RECV_B: self._recv, Op.STEP: self._optimizer_step}
        hooks, clock, memory = self.hooks, time.perf_counter, self._memory
        start = clock()
        timings = []
        for index, action in enumerate(self.actions):
            self._prefetch(index)
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
        return self._stats(timings, time.perf_counter() - start)

    def _check_batch(self, name: str, batch: Sequence[Any] | None, needed: bool) -> None:
        if needed and (batch is None or len(batch) != self.microbatches):
            got = "None" if batch is None else f"{len(batch)} micro-batches"
            raise RuntimeFailure(f"{self._where}: step() needs {name} with {self.microbatches} micro-batches on "
                                 f"this stage, got {got}; split the global batch into equal micro-batches")

    def _record(self, action: Action, seconds: float) -> None:
        st = self._state
        if action.op is Op.F:
            st.forward_s[action.microbatch] = seconds
        elif action.op is Op.B or action.op is Op.W:  # a split backward's seconds are B's + W's
            st.backward_s[action.microbatch] = st.backward_s.get(action.microbatch, 0.0) + seconds
            if action.op is self._grad_op and not self._memory.totals["grads"]:  # allocated by the first
                self._memory.totals["grads"] = grad_bytes(self._params)
        elif action.op in _RECVS:
            st.comm_wait_s += seconds

    def _prefetch(self, index: int) -> None:
        """Post the receives `_prefetch_plan` lists for action ``index`` (posting is idempotent)."""
        for action in self._prefetch_at[index]:
            self.comm.post_recv(action)

    def _default_prefetch(self) -> int:
        """`PREFETCH_DEPTH`, or 0 on gloo while every local rank has a CPU core (module docstring)."""
        if not self.comm.gloo:
            return PREFETCH_DEPTH
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return PREFETCH_DEPTH if local_ranks > cores else 0

    def _agreed_builtin_schedule(self) -> bool:
        """Are the ranks' lists together deadlock-free when each RECV first waits for the rank's earlier
        sends (`agreement`: one all-gather of every list at start-up, the same answer on every rank)?"""
        every = agreement.gathered_schedule(self.actions, num_stages=self.num_stages, group=self._group,
                                            wait=lambda w: self._collective(w, "the start-up schedule agreement",
                                                                            self.stage_ranks))
        return agreement.sends_may_wait_at_recv(every, num_stages=self.num_stages, microbatches=self.microbatches)

    def _prefetch_plan(self) -> tuple[tuple[Action, ...], ...]:
        """Per action index: the next ``prefetch_depth`` receives, in order (none: each posts itself).

        Off gloo (NCCL matches point-to-point operations in issue order per peer), a
        receive is never posted ahead of a send to the same peer.  The list depends only
        on the action list, so it is computed once.
        """
        plan = []
        for index in range(len(self.actions)):
            found, blocked, post = 0, set(), []
            for a in self.actions[index:]:
                if a.op in _SENDS:
                    blocked.add(self.comm.peer(a))
                elif a.op in _RECVS:
                    if found >= self.prefetch_depth:
                        break
                    found += 1
                    if self.comm.gloo or self.comm.peer(a) not in blocked:
                        post.append(a)
            plan.append(tuple(post))
        return tuple(plan)

    # ------------------------------------------------------------------ actions

    def _recv(self, action: Action) -> None:
        tensors = self.comm.recv(action)
        mb = action.microbatch
        if action.op is Op.RECV_F:
            for t, spec in zip(tensors, self.stage.in_cut.tensors):
                t.requires_grad_(spec.requires_grad)
            self._state.received[mb] = tensors
        else:
            self._state.grads_in[mb] = tensors
            self._memory.set_comm(("grad_in", mb), sum(t.numel() * t.element_size() for t in tensors))

    def _send(self, action: Action) -> None:
        mb = action.microbatch
        tensors = self._state.outputs[mb] if action.op is Op.SEND_F else self._state.grads_out.pop(mb)
        self.comm.send(action, tensors)

    def _forward_args(self, mb: int) -> tuple[torch.Tensor, ...]:
        if not self.stage.is_first:
            return tuple(self._state.received.pop(mb))
        raw = self._inputs[mb]
        args = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
        specs = self.stage.input_specs
        if len(args) != len(specs):
            raise RuntimeFailure(f"{self._where}: micro-batch {mb} has {len(args)} inputs, the model takes "
                                 f"{len(specs)} ({', '.join(s.name for s in specs)}); pass them as a tuple")
        problem = comm.mismatch(args, specs)
        if problem:
            raise RuntimeFailure(f"{self._where}: micro-batch {mb} input {problem.removeprefix('tensor ')}; split the "
                                 "global batch into equal micro-batches shaped like split_stages' example inputs")
        return tuple(a.to(self.stage.device) for a in args)

    def _forward(self, action: Action) -> None:
        mb, st = action.microbatch, self._state
        args = self._forward_args(mb)
        track = self._track_every or mb not in self._saved_bytes
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, _identity) if track else contextlib.nullcontext():
            out = self.stage(*args)
            if self.stage.is_last:
                loss = self.loss_fn(out, self._targets[mb])
        if self.stage.is_last:
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise RuntimeFailure(f"{self._where}: loss_fn returned {type(loss).__name__} "
                                     f"{getattr(loss, 'shape', '')} for micro-batch {mb}; it must return a scalar")
            st.losses[mb] = loss * self._loss_scale
            st.loss_values.append(loss.detach())
            outs: tuple[torch.Tensor, ...] = ()
        else:
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            st.outputs[mb] = outs
        st.inputs[mb] = args
        if track:
            received = () if self.stage.is_first else args  # views of one received frame
            self._saved_bytes[mb] = self._memory.add(mb, [*saved, *args, *outs], received=received)
        else:  # same shapes as when it was measured (checked against the cut specs): same bytes
            self._memory.add_known(mb, self._saved_bytes[mb])

    def _backward(self, action: Action) -> None:
        mb, st = action.microbatch, self._state
        if self._final_backward is not None and action == self._last_b and not self._split:
            self._final_backward()
        if self.stage.is_last:
            loss = st.losses.pop(mb)
            roots, grads = ([loss], None) if loss.requires_grad else ([], None)
        else:
            outs = [o for o, s in zip(st.outputs.pop(mb), self.stage.out_cut.tensors) if s.requires_grad]
            pairs = [(o, g) for o, g in zip(outs, st.grads_in.pop(mb)) if o.requires_grad]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
            self._memory.set_comm(("grad_in", mb), None)
        inputs = st.inputs.pop(mb)
        if self._split:  # B: the inputs' gradients now, the parameters' at this micro-batch's W
            got, st.pending_w[mb] = split_backward.backward_input(roots, grads if grads else None, inputs,
                                                                  self._params)
            self._memory.add_retained(mb, st.pending_w[mb].held_tensors(), frames=grads or ())  # freed at W
            for x, g in zip(inputs, got):
                x.grad = g
        elif roots:
            torch.autograd.backward(roots, grads)
        if not self.stage.is_first:
            st.grads_out[mb] = [x.grad if x.grad is not None else torch.zeros_like(x)
                                for x, s in zip(inputs, self.stage.in_cut.tensors) if s.requires_grad]
        if self.stage.recomputed:
            self._observe_recompute(action)
        if not self._split:
            self._memory.release(mb)

    def _weight(self, action: Action) -> None:
        """W of a split backward: the parameters' gradients, then the micro-batch's activations go."""
        if self._final_backward is not None and action == self._last_b:
            self._final_backward()
        split_backward.backward_weight(self._state.pending_w.pop(action.microbatch), self._params)
        self._memory.release(action.microbatch)

    def _observe_recompute(self, action: Action) -> None:
        """Account the backward's recompute: one unit's saved tensors again, on top of what is held.

        The recompute ran while this micro-batch's activations were still held, with the
        gradients allocated; the largest recomputed unit is the cost model's transient term.
        """
        memory, extra = self._memory, self.stage.recompute_bytes
        memory.totals["grads"] = grad_bytes(self._params)
        memory.totals["activations"] += extra
        self.hooks.memory(action, memory.observe())
        memory.totals["activations"] -= extra

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
                     if self._owner_stage(name) != self.stage.stage} | self._uncounted
        pairs = [(p, p.grad) for p in self._params if p.grad is not None]  # a parameter without grad: skipped whole
        norms = [torch.linalg.vector_norm(g, 2.0) for p, g in pairs if id(p) not in not_owned]
        squared = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), device=self.stage.device)
        if self._distributed and self.num_stages > 1:
            work = dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
            self._collective(work, "the gradient-norm all-reduce", self.stage_ranks)
        total = squared.sqrt()
        coef = torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0)
        for _, g in pairs:
            g.mul_(coef.to(g.dtype))
        return float(total)

    def _owner_stage(self, canonical_name: str) -> int:
        return next(g.owner_stage for g in self.stage.tied_groups if g.canonical_name == canonical_name)

    def _stats(self, timings: list[ActionTiming], step_s: float) -> StepStats:
        st = self._state
        loss = None
        if self.stage.is_last:
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
            forward_s=tuple(st.forward_s[i] for i in range(self.microbatches)),
            backward_s=tuple(st.backward_s[i] for i in range(self.microbatches)),
            actions=tuple(timings), comm_wait_s=st.comm_wait_s, optimizer_s=optimizer_s, step_s=step_s,
            grad_norm=st.grad_norm, memory=memory)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
