"""The compute actions of a rank: F, B and W on the stage module an action names (issue 4, 17).

* ``F``: run the action's stage (chunk) on the micro-batch's inputs (the user's inputs on virtual
  stage 0, the received activations elsewhere) and keep its autograd graph; the last virtual stage
  also applies ``loss_fn(output, target)``, scaled by ``loss_scale``.
* ``B``: ``torch.autograd.backward`` on the outputs with the received gradients (on the scaled loss
  on the last stage); gradients accumulate in the parameters; the received inputs' gradients are
  kept for ``SEND_B``.  Units the stage recomputes re-run their forward here, and the ledger adds
  the largest one's activations on top of what is held.
* ``B`` and ``W`` when the list splits the backward (ZB-H1): B computes only the inputs' gradients,
  keeping the graph; W the parameters' (`split_backward`); activations are released at W.

Every tensor is keyed by (virtual stage, micro-batch) (`step_state`), so a rank holding several
chunks keeps one micro-batch in flight on each.  The ledger (`HeldBytes`) is the rank's: it sums
every chunk's held activations.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from hetpipe.errors import RuntimeFailure
from hetpipe.runtime.execute import comm, split_backward
from hetpipe.runtime.execute.chunks import RankStages
from hetpipe.runtime.execute.held import HeldBytes, grad_bytes
from hetpipe.runtime.execute.stats import ActionHooks
from hetpipe.runtime.execute.step_state import StepState, key
from hetpipe.schedule.actions import Action, Op


class StageCompute:
    """F/B/W of one rank's stage modules (module docstring); `begin` starts each step."""

    def __init__(self, stages: RankStages, *, memory: HeldBytes, hooks: ActionHooks, where: str,
                 loss_fn: Callable[[Any, Any], torch.Tensor], loss_scale: float, params: Sequence[torch.nn.Parameter],
                 final_backward: Callable[[], None] | None, last_grad_action: Action | None, split: bool) -> None:
        self.stages, self.memory, self.hooks, self.where = stages, memory, hooks, where
        self.loss_fn, self.loss_scale, self.params = loss_fn, loss_scale, params
        self.final_backward, self.last_grad_action, self.split = final_backward, last_grad_action, split
        self.saved_bytes: dict[Any, int] = {}  # (stage, mb) -> activation bytes its forward added (first step)
        self.state = StepState()
        self.track_every = False
        self.inputs: Sequence[Any] | None = None
        self.targets: Sequence[Any] | None = None

    def begin(self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None, *, track_every: bool) -> StepState:
        """A fresh step: its micro-batches and an empty `StepState`."""
        self.inputs, self.targets, self.track_every = inputs, targets, track_every
        self.state = StepState()
        return self.state

    def forward_args(self, action: Action) -> tuple[torch.Tensor, ...]:
        stage, mb = self.stages[action.stage], action.microbatch
        if not stage.is_first:
            return tuple(self.state.received.pop(key(action)))
        assert self.inputs is not None  # checked by the executor's step()
        raw = self.inputs[mb]
        args = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
        specs = stage.input_specs
        if len(args) != len(specs):
            raise RuntimeFailure(f"{self.where}: micro-batch {mb} has {len(args)} inputs, the model takes "
                                 f"{len(specs)} ({', '.join(s.name for s in specs)}); pass them as a tuple")
        problem = comm.mismatch(args, specs)
        if problem:
            raise RuntimeFailure(f"{self.where}: micro-batch {mb} input {problem.removeprefix('tensor ')}; split the "
                                 "global batch into equal micro-batches shaped like split_stages' example inputs")
        return tuple(a.to(stage.device) for a in args)

    def forward(self, action: Action) -> None:
        stage, st, k, mb = self.stages[action.stage], self.state, key(action), action.microbatch
        args = self.forward_args(action)
        track = self.track_every or k not in self.saved_bytes
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, _identity) if track else contextlib.nullcontext():
            out = stage(*args)
            if stage.is_last:
                assert self.targets is not None  # checked by the executor's step()
                loss = self.loss_fn(out, self.targets[mb])
        if stage.is_last:
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise RuntimeFailure(f"{self.where}: loss_fn returned {type(loss).__name__} "
                                     f"{getattr(loss, 'shape', '')} for micro-batch {mb}; it must return a scalar")
            st.losses[k] = loss * self.loss_scale
            st.loss_values.append(loss.detach())
            outs: tuple[torch.Tensor, ...] = ()
        else:
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            st.outputs[k] = outs
        st.inputs[k] = args
        if track:
            received = () if stage.is_first else args  # views of one received frame
            self.saved_bytes[k] = self.memory.add(k, [*saved, *args, *outs], received=received)
        else:  # same shapes as when it was measured (checked against the cut specs): same bytes
            self.memory.add_known(k, self.saved_bytes[k])

    def backward(self, action: Action) -> None:
        stage, st, k = self.stages[action.stage], self.state, key(action)
        if self.final_backward is not None and action == self.last_grad_action and not self.split:
            self.final_backward()
        if stage.is_last:
            loss = st.losses.pop(k)
            roots, grads = ([loss], None) if loss.requires_grad else ([], None)
        else:
            outs = [o for o, s in zip(st.outputs.pop(k), stage.out_cut.tensors) if s.requires_grad]
            pairs = [(o, g) for o, g in zip(outs, st.grads_in.pop(k)) if o.requires_grad]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
            self.memory.set_comm(("grad_in", k), None)
        inputs = st.inputs.pop(k)
        if self.split:  # B: the inputs' gradients now, the parameters' at this micro-batch's W
            got, st.pending_w[k] = split_backward.backward_input(roots, grads if grads else None, inputs,
                                                                 list(stage.parameters()))
            self.memory.add_retained(k, st.pending_w[k].held_tensors(), frames=grads or ())  # freed at W
            for x, g in zip(inputs, got):
                x.grad = g
        elif roots:
            torch.autograd.backward(roots, grads)
        if not stage.is_first:
            st.grads_out[k] = [x.grad if x.grad is not None else torch.zeros_like(x)
                               for x, s in zip(inputs, stage.in_cut.tensors) if s.requires_grad]
        if stage.recomputed or stage.selective:
            self.observe_recompute(action)
        if not self.split:
            self.memory.release(k)

    def weight(self, action: Action) -> None:
        """W of a split backward: the parameters' gradients, then the micro-batch's activations go."""
        if self.final_backward is not None and action == self.last_grad_action:
            self.final_backward()
        params = list(self.stages[action.stage].parameters())
        split_backward.backward_weight(self.state.pending_w.pop(key(action)), params)
        self.memory.release(key(action))

    def observe_recompute(self, action: Action) -> None:
        """Account the backward's recompute: one unit's saved tensors again, on top of what is held.

        The recompute ran while this micro-batch's activations were still held, with the
        gradients allocated; the largest recomputed unit is the cost model's transient term, and the
        selective level's largest unit of re-made outputs its peak (`cost_models.selective`), added once.
        """
        stage = self.stages[action.stage]
        memory, extra = self.memory, stage.recompute_bytes + stage.selective_bytes
        memory.totals["grads"] = grad_bytes(self.params)
        memory.totals["activations"] += extra
        self.hooks.memory(action, memory.observe())
        memory.totals["activations"] -= extra

    # ------------------------------------------------------------------ messages (routed per virtual stage)

    def received(self, action: Action, tensors: list[torch.Tensor]) -> None:
        """Keep a RECV's tensors under its (virtual stage, micro-batch)."""
        k = key(action)
        if action.op is Op.RECV_F:
            for t, spec in zip(tensors, self.stages[action.stage].in_cut.tensors):
                t.requires_grad_(spec.requires_grad)
            self.state.received[k] = tensors
        else:
            self.state.grads_in[k] = tensors
            self.memory.set_comm(("grad_in", k), sum(t.numel() * t.element_size() for t in tensors))

    def to_send(self, action: Action) -> Sequence[torch.Tensor]:
        """The tensors a SEND action posts: the stage's outputs, or its inputs' gradients."""
        k = key(action)
        return self.state.outputs[k] if action.op is Op.SEND_F else self.state.grads_out.pop(k)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
