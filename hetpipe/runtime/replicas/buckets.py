"""Gradient all-reduce *parts*: buckets cut to a size cap, launched during backward, awaited in the step.

A `hetpipe.runtime.replicas.sync.SyncBucket` (one sync group's parameters, or one tied
parameter) can be as large as a whole stage.  `split_parts` cuts it into parts of at
most ``cap_bytes`` (whole units while they fit, else whole parameters, from the last unit
back, because backward produces the last gradients first); every holder of the bucket cuts
it identically, since they hold the same parameters.  `OverlappedReducer` runs the parts of one rank:

* `OverlappedReducer.arm` (called by the executor right before the rank's last backward
  of the step) lets a post-accumulate-grad hook mark each parameter whose gradient is
  now final; a part is launched -- its gradients copied into one flat buffer, scaled by
  the replica's weight, an async all-reduce (SUM) posted -- as soon as all its
  parameters are final *and* every part before it in the launch order was launched, so
  every process group sees the same sequence of collectives on every member.  The
  part's gradients then become views of the flat buffer, so no second copy is held.
* `OverlappedReducer.finish` (inside the optimizer step) launches what is left (a
  parameter that got no gradient, or everything when overlap is off), then waits for
  every part in order, bounded by ``timeout_s``, zeroing the parts a rank holds without
  owning (tied copies: the owner copy carries the sum).

Example (one rank, no process group: a part with a single holder is only scaled):
    >>> lin = nn.Linear(2, 1)
    >>> b = SyncBucket("units 0-0", ranks=(0,), names=("weight", "bias"), owners=(0,))
    >>> parts = split_parts(b, [lin.weight, lin.bias], group=None, owner=True, cap_bytes=8)
    >>> [p.label for p in parts], [len(p.params) for p in parts]
    (['units 0-0 part 1/2', 'units 0-0 part 2/2'], [1, 1])
    >>> red = OverlappedReducer(parts, weight=0.5, timeout_s=5.0, where="rank 0", overlap=True)
    >>> red.arm(); lin(torch.ones(1, 2)).sum().backward()
    >>> red.finish(); [p.in_backward for p in parts], lin.bias.grad
    ([True, True], tensor([0.5000]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetpipe.runtime.execute import comm


@dataclass(frozen=True)
class SyncBucket:
    """One all-reduce: parameters ``names`` (graph order) held by ``ranks``; ``owners`` contribute in full."""

    label: str  # "units 0-2" or "tied transformer.wte.weight", for messages
    ranks: tuple[int, ...]  # every holder's global rank, ascending (the process group)
    names: tuple[str, ...]  # qualified names; a tied bucket lists every alias
    owners: tuple[int, ...]  # the first holder per replica (all holders for a unit bucket)
    tied: bool = False  # one parameter under several names; a holder has some of them
    first_unit: int = 0  # where the bucket sits in the global order (and which sync group it is charged to)
    units: tuple[int, ...] = ()  # plan unit of each name (empty: all ``first_unit``)

    def unit_of(self, name: str) -> int:
        return self.units[self.names.index(name)] if self.units else self.first_unit

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def is_owner(self, rank: int) -> bool:
        return rank in self.owners


@dataclass(eq=False)
class Part:
    """One all-reduce of one rank: some parameters of one bucket, and the state of this step's exchange."""

    bucket: SyncBucket
    label: str
    params: list[nn.Parameter]
    group: Any  # process group of ``bucket.ranks``; None: a single holder, nothing to exchange
    owner: bool
    num_bytes: int
    first_unit: int  # lowest plan unit among ``params``: its gradients are final last in a backward
    flat: torch.Tensor | None = None
    work: Any = None
    in_backward: bool = False  # launched by a gradient hook, i.e. overlapped with backward


def split_parts(bucket: SyncBucket, params: Sequence[nn.Parameter], *, group: Any, owner: bool, cap_bytes: int,
                units: Sequence[int] | None = None) -> list[Part]:
    """``params`` (graph order; ``units``: their plan units) in parts of at most ``cap_bytes``, last first.

    Whole units go together while they fit (a part then never waits for a unit it barely
    touches, and the simulator's unit-grained parts match); a unit over the cap is cut at
    parameters.  A single parameter over the cap is a part of its own.
    """
    unit_of = list(units) if units is not None else [bucket.first_unit] * len(params)
    nbytes = [p.numel() * p.element_size() for p in params]
    by_unit: dict[int, list[int]] = {}
    for i in reversed(range(len(params))):
        by_unit.setdefault(unit_of[i], []).append(i)
    chunks: list[list[int]] = []
    size = 0
    for unit in sorted(by_unit, reverse=True):
        idx = by_unit[unit]
        whole = sum(nbytes[i] for i in idx)
        if chunks and chunks[-1] and size + whole <= cap_bytes:
            chunks[-1] += idx
            size += whole
            continue
        chunks.append([])
        size = 0
        for i in idx:
            if chunks[-1] and size + nbytes[i] > cap_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += nbytes[i]
    n = len(chunks)
    return [Part(bucket, bucket.label if n == 1 else f"{bucket.label} part {k + 1}/{n}", [params[i] for i in chunk],
                 group, owner, sum(params[i].numel() * params[i].element_size() for i in chunk),
                 min(unit_of[i] for i in chunk)) for k, chunk in enumerate(chunks)]


class OverlappedReducer:
    """This rank's parts, in launch order (module docstring).

    Args:
        parts: in the order every holder launches them.
        weight: this replica's sample share; gradients are scaled by it before the sum.
        overlap: launch parts from gradient hooks during the last backward (else all in `finish`).
        on_bytes: called with the payload bytes of each launched exchange.
    """

    def __init__(self, parts: Sequence[Part], *, weight: float, timeout_s: float, where: str, overlap: bool,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.parts, self.weight, self.timeout_s, self.where = list(parts), float(weight), timeout_s, where
        self.overlap, self._on_bytes = overlap, on_bytes
        self.gloo = dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
        self._armed = False
        self._ready: set[int] = set()
        self._next = 0
        if overlap:
            for part in self.parts:
                for p in part.params:
                    p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        """The next backward is this step's last on this rank: gradients that accumulate now are final."""
        self._armed, self._ready, self._next = True, set(), 0
        for part in self.parts:
            part.flat, part.work, part.in_backward = None, None, False

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        self._ready.add(id(param))
        while self._next < len(self.parts) and all(id(p) in self._ready for p in self.parts[self._next].params):
            self._launch(self.parts[self._next], in_backward=True)
            self._next += 1

    @torch.no_grad()
    def _launch(self, part: Part, *, in_backward: bool) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in part.params]
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(self.weight)
        offset = 0
        for p in part.params:  # the gradient is now a view of the buffer the all-reduce fills in place
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        part.flat, part.in_backward = flat, in_backward
        if part.group is not None:
            part.work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=part.group, async_op=True)
            if self._on_bytes is not None:
                self._on_bytes(flat.numel() * flat.element_size())

    def finish(self, on_part: Callable[[Part], None] | None = None) -> None:
        """Launch the parts not yet launched, then wait for each in order; ``on_part`` after each one."""
        if not self._armed:
            self.arm()
        while self._next < len(self.parts):
            self._launch(self.parts[self._next], in_backward=False)
            self._next += 1
        self._armed = False
        for part in self.parts:
            if part.work is not None:
                self._wait(part)
            if not part.owner:
                assert part.flat is not None  # launched above
                part.flat.zero_()  # the owner copy carries the sum; the executor's tied all-reduce adds zeros
            if on_part is not None:
                on_part(part)
            part.work, part.flat = None, None  # the gradients (views) keep the buffer until zero_grad

    def _wait(self, part: Part) -> None:
        wait_all_reduce(part.work, what=f"gradient all-reduce of {part.label}", ranks=part.bucket.ranks,
                        where=self.where, timeout_s=self.timeout_s, gloo=self.gloo)


def wait_all_reduce(work: Any, *, what: str, ranks: Sequence[int], where: str, timeout_s: float, gloo: bool) -> None:
    """Bounded wait for a bucket's all-reduce; a timeout or a lost peer names ``what`` and the ranks."""
    def describe(timed_out: bool, detail: str) -> str:
        if timed_out:
            return (f"{where} timed out after {timeout_s:.1f} s in the {what} with ranks {list(ranks)}; is every "
                    "one alive? (if only slow, raise timeout_s)")
        return f"{where} failed in the {what} with ranks {list(ranks)} ({detail}); check their logs for the first error"
    comm.wait_work(work, timeout_s=timeout_s, gloo=gloo, describe=describe)
