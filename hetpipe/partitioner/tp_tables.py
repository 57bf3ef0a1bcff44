"""A pipeline stage run by a tensor-parallel group, priced from the solver's tables (issue 15).

`Problem.tensor_parallel` holds, per unit, what a group can split (`UnitSplit`: the share of
its FLOPs and parameters inside tensor-parallel blocks, and each block's parts, forward FLOPs,
all-reduced bytes and per-part activations), the same figures `tp_groups.price_group` reads
from the captured `Unit`s.  `group_stage` prices a stage on units [first, last] run by the
group ``members`` (device indices of at most `MAX_GROUP_NODES` nodes, the lead first) at a pipeline position:

* **shares** -- `tp_groups.price_group`'s ``uneven`` rule (or ``even``): each member's speed on
  the run is the run's FLOPs over its own F + B on its kind; equal finish with the replicated
  fraction, capped by memory (``w_i · shardable + replicated <= usable``, shardable = split
  state + in-flight blocks' activations) -- `cost_models.tensor_parallel.proportional_shares`;
* **member time** -- each block's *integer* parts (largest remainder, what the runtime runs):
  member i runs ``(f_u · mine_u + 1 - f_u)`` of unit u's forward and backward on its kind
  (`tp_groups.rounded_member_s`, the same formula per unit); F_s / B_s = the slowest member's
  forward / backward + each block's ring all-reduces (a Megatron pair: the row output forward, the
  column input's gradient backward; split by vocabulary: `tensor_parallel.block_allreduce_bytes`;
  over the group's slowest link, largest latency) + one broadcast of
  the received activation (F_s, not on the first stage) / gradient (B_s, not on the last)
  from the lead to the group (latency + bytes / bandwidth on the same link);
* **memory** -- every member under M_s (`stage_memory.pipeline_stage_bytes`, the stage's
  in-flight count) with its *integer* parts of every block (what runs): each block's activations
  ``ceil(parts_i / parts · x)``, each unit's split state and gradients at the largest part fraction
  of its blocks (an upper bound: the tables hold no per-block parameter bytes), everything else
  whole, and at the step (memory model 5) its kind's U over its share of the stepped parameters; the
  stage fits when every member does;
* **step** -- each member steps its share of the split parameters and all replicated ones on
  its kind; S_s = the slowest member's.

A group stage neither recomputes nor offloads (not priced for groups: stated in the README).

Example (two cards of one kind: the run splits in half, plus its all-reduces):
    >>> from types import SimpleNamespace as NS
    >>> blk = BlockSplit(parts=4, fwd_flops=10, allreduce_bytes=1000, activation_bytes=8)
    >>> p = NS(fwd_s={"a": (1.0,)}, bwd_s={"a": (2.0,)}, tensor_parallel=(UnitSplit(30, 1.0, 1.0, (blk,)),),
    ...        devices=(NS(kind="a", usable_bytes=10**6), NS(kind="a", usable_bytes=10**6)),
    ...        bandwidth_bytes_s=((0.0, 1e6), (1e6, 0.0)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...        state_bytes=(400,), activation_bytes=(8,), grad_bytes=(100,), step_s={}, step_launch_s={})
    >>> g = group_stage(p, first=0, last=0, members=(0, 1), position=StagePosition(0, True, 4, 0, 0, 0, 0, 8))
    >>> g.shares, g.fwd_s, g.bwd_s   # 0.5 + 1 ms all-reduce; 1.0 + 1 ms
    ((0.5, 0.5), 0.501, 1.001)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Mapping, Protocol

from hetpipe.cost_models.stage_memory import pipeline_stage_bytes
from hetpipe.cost_models.step_transient import NO_STEP_TRANSIENT
from hetpipe.cost_models.sync import ring_allreduce_s
from hetpipe.cost_models.tensor_parallel import (
    TensorShares, block_allreduce_bytes, even_shares, memory_caps, proportional_shares)
from hetpipe.errors import InfeasibleError
from hetpipe.schedule.held import position_held_terms

#: `--tensor-parallel`: ``off`` (pipeline only) or ``auto`` (the solver may run a stage on a group).
TENSOR_PARALLEL_MODES = ("off", "auto")
#: The most cards a group holds under ``auto`` (issue 15: k <= 4).
DEFAULT_GROUP_MAX = 4
#: The most nodes one group's cards may come from under ``auto`` (`Problem.group_nodes`): a ring ordered by node
#: then crosses one node pair's link, once in each direction (full duplex: the two hops do not share a direction),
#: so pricing every ring step on that link is the alpha-beta ring exactly; with more nodes the ring would cross
#: several pairs' links.  It also bounds the candidate groups the exact group DP enumerates (`candidate_groups`).
MAX_GROUP_NODES = 2
#: Block kinds split by vocabulary (their all-reduces differ from a Megatron pair's).
VOCAB_KINDS = ("embedding", "head")
#: Share rules: ``uneven`` (equal finish, capped by memory: what the solver uses), ``even`` (1/k).
GROUP_RULES = ("uneven", "even")


@dataclass(frozen=True)
class BlockSplit:
    """One tensor-parallel block of a unit (`capture.tensor_blocks.TensorParallelBlock`'s numbers)."""

    parts: int  # heads / key-value groups / hidden columns the shares are rounded to
    fwd_flops: int  # forward FLOPs inside the block: what splits with the parts
    allreduce_bytes: int  # the row output (forward) and the column input's gradient (backward)
    activation_bytes: int  # per micro-batch, held for backward, split with the parts
    kind: str = ""  # "embedding" / "head" (split by vocabulary) change the all-reduces; "" a Megatron pair
    loss_allreduce_bytes: int = 0  # a vocabulary head: one (b, s) fp32 vector of the vocab-parallel loss

    def allreduces(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(forward, backward) bytes of each all-reduce (`tensor_parallel.block_allreduce_bytes`)."""
        return block_allreduce_bytes(self.kind, allreduce_bytes=self.allreduce_bytes,
                                     loss_allreduce_bytes=self.loss_allreduce_bytes)


@dataclass(frozen=True)
class UnitSplit:
    """What a tensor-parallel group can split of one unit (all zero: the unit runs replicated)."""

    flops: int  # forward + backward FLOPs of the unit
    flops_fraction: float  # of them inside blocks (`Unit.tp_flops_fraction`)
    param_fraction: float  # of its parameters that split (`Unit.tp_param_fraction`)
    blocks: tuple[BlockSplit, ...] = ()


def unit_splits(units: Sequence[Any]) -> tuple[UnitSplit, ...]:
    """`UnitSplit` per captured `Unit` (its ``tensor_parallel`` blocks and fractions)."""
    return tuple(UnitSplit(flops=u.fwd_flops + u.bwd_flops, flops_fraction=u.tp_flops_fraction,
                           param_fraction=u.tp_param_fraction,
                           blocks=tuple(block_split(b) for b in u.tensor_parallel)) for u in units)


def block_split(b: Any) -> BlockSplit:
    """`BlockSplit` of a captured `TensorParallelBlock` (or a plan's `PlanBlock`)."""
    kind = getattr(b, "kind", "")
    return BlockSplit(b.parts, b.fwd_flops, b.allreduce_bytes, b.activation_bytes,
                      kind=kind if kind in VOCAB_KINDS else "", loss_allreduce_bytes=b.loss_allreduce_bytes)


class GroupTables(Protocol):
    """The `Problem` fields a group's price reads (a Protocol: `problem.py` imports this module)."""

    fwd_s: Mapping[str, tuple[float, ...]]
    bwd_s: Mapping[str, tuple[float, ...]]
    tensor_parallel: tuple[UnitSplit, ...]
    devices: Sequence[Any]
    bandwidth_bytes_s: Sequence[Sequence[float]]
    latency_s: Sequence[Sequence[float]]
    state_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    step_s: Mapping[str, tuple[float, ...]]
    step_launch_s: Mapping[str, float]


@dataclass(frozen=True)
class StagePosition:
    """What the stage's position and neighbours add: stages after it, first or not, micro-batches,
    and its whole-stage memory terms as `problem.stage_memory_bytes` computes them for one card."""

    stages_after: int
    first: bool
    microbatches: int
    in_bytes: int
    out_bytes: int
    in_grad_bytes: int
    out_grad_bytes: int
    activation_bytes: int  # A_s of the whole stage (`problem.stage_activation_bytes`)
    tied_bytes: int = 0  # tied replicas: replicated on every member, but a tied head's rows (`tied_vocab_bytes`)
    # T_s (memory model 4, `problem.stage_transient_bytes`): on every member whole (a bound for a vocab-split loss)
    transient_bwd_bytes: int = 0
    # (P_s, the largest stepped tensor) of the whole stage (memory model 5, `problem.stage_step_bytes`): each
    # member steps its share of the split parameters and all the others; its largest tensor whole (a bound)
    step_bytes: tuple[int, int] = (0, 0)

    @property
    def in_flight(self) -> int:
        return min(self.stages_after + 1, self.microbatches)


@dataclass(frozen=True)
class GroupStage:
    """A group stage's figures (seconds per micro-batch; bytes; `shares` in member order)."""

    shares: tuple[float, ...]
    fwd_s: float
    bwd_s: float
    step_s: float
    memory_bytes: tuple[int, ...]  # M_s of each member
    usable_bytes: tuple[int, ...]
    allreduce_s: float  # all the blocks' all-reduces, forward + backward
    # each member's own F and B (its integer parts + the all-reduces + the lead's broadcast; F_s, B_s: the
    # largest) and step, in member order: what the emulator stretches each member to
    member_fwd_s: tuple[float, ...] = ()
    member_bwd_s: tuple[float, ...] = ()
    member_step_s: tuple[float, ...] = ()

    @property
    def fits(self) -> bool:
        return all(m <= u for m, u in zip(self.memory_bytes, self.usable_bytes))


def tied_vocab_bytes(tables: Any, first: int, last: int) -> int:
    """Of the tied replicas a stage on units [first, last] holds (`problem.tied_bytes`), the state bytes
    held through a unit with a block split by vocabulary: a tied LM head on a group, of which each member
    holds only its rows.  ``tables``: a `Problem` (its ``tied`` and ``tensor_parallel``)."""
    held = range(first, last + 1)
    splits = tables.tensor_parallel

    def vocab(u: int) -> bool:
        return bool(splits) and any(b.kind in VOCAB_KINDS for b in splits[u].blocks)

    return sum(t.state_bytes for t in getattr(tables, "tied", ()) if t.owner_unit not in held
               and any(u in held and vocab(u) for u in t.user_units if u != t.owner_unit))


def ring_of(tables: GroupTables, members: Sequence[int]) -> tuple[float, float]:
    """(bandwidth, latency) of the group's ring: its slowest link, its largest latency.

    A ring all-reduce of S bytes over k ranks runs 2(k-1) steps, each moving S/k bytes over every hop at once, so
    a step lasts as long as its slowest hop: 2(k-1)·α + 2(k-1)/k · S/β with β the slowest hop's bandwidth and α the
    largest latency (`sync.ring_allreduce_s`; cost_formulas.md §3.4; Patarasuk & Yuan 2009).  A group across two
    nodes is a ring ordered by node: two hops cross the nodes' link (one each way), the rest stay inside a node,
    so β is the slower of that link and the slowest intra-node pair.  Taking every pair (not only the ring's hops)
    prices a node whose pairs differ by its slowest, the ring order the runtime's library picks being unknown.

    Example (cards 0, 1 on one node at 100 B/s, card 2 on another at 10 B/s: the ring runs at 10 B/s):
        >>> from types import SimpleNamespace as NS
        >>> bw = ((0, 100.0, 10.0), (100.0, 0, 10.0), (10.0, 10.0, 0))
        >>> ring_of(NS(bandwidth_bytes_s=bw, latency_s=((0, 1e-6, 5e-6),) * 3), (0, 1, 2))
        (10.0, 5e-06)
    """
    pairs = [(a, b) for a in members for b in members if a != b]
    if not pairs:
        return math.inf, 0.0
    return (min(tables.bandwidth_bytes_s[a][b] for a, b in pairs), max(tables.latency_s[a][b] for a, b in pairs))


def _run_s(tables: GroupTables, kind: str, units: range) -> float:
    return sum(tables.fwd_s[kind][u] + tables.bwd_s[kind][u] for u in units)


def group_shares(tables: GroupTables, units: range, members: Sequence[int], *, in_flight: int,
                 rule: str = "uneven") -> TensorShares:
    """The shares `tp_groups.price_group` gives the run (raises `InfeasibleError` if no split fits)."""
    splits = [tables.tensor_parallel[u] for u in units]
    flops = sum(s.flops for s in splits)
    split_flops = sum(s.flops_fraction * s.flops for s in splits)
    if split_flops <= 0:  # a group would only run the same work on every member
        raise InfeasibleError("nothing in the run splits over a tensor-parallel group")
    if rule == "even":
        return even_shares(len(members))
    split_state = sum(round(s.param_fraction * tables.state_bytes[u]) for s, u in zip(splits, units))
    split_act = in_flight * sum(b.activation_bytes for s in splits for b in s.blocks)
    total = sum(tables.state_bytes[u] for u in units) + in_flight * sum(tables.activation_bytes[u] for u in units)
    speeds = [flops / _run_s(tables, tables.devices[d].kind, units) for d in members]
    caps = memory_caps([tables.devices[d].usable_bytes for d in members], shardable_bytes=split_state + split_act,
                       replicated_bytes=total - split_state - split_act)
    return proportional_shares(speeds, caps, replicated_fraction=1.0 - split_flops / flops)


def member_fractions(tables: GroupTables, units: range, shares: TensorShares, member: int) -> list[float]:
    """Per unit, the fraction of its work member ``member`` runs: ``f · mine + 1 - f`` with its
    integer parts of every block (`tp_groups.rounded_member_s`)."""
    out, parts = [], {}  # parts: one largest-remainder split per block size (blocks of a model repeat them)
    for u in units:
        s = tables.tensor_parallel[u]
        block_flops = sum(b.fwd_flops for b in s.blocks) or 1
        for b in s.blocks:
            if b.parts not in parts:
                parts[b.parts] = shares.parts(b.parts)
        mine = sum(parts[b.parts][member] / b.parts * b.fwd_flops / block_flops for b in s.blocks if b.parts)
        out.append(s.flops_fraction * mine + 1.0 - s.flops_fraction)
    return out


def _member_bytes(tables: GroupTables, units: range, shares: TensorShares, member: int, pos: StagePosition,
                  kind: str) -> int:
    """Member ``member``'s M_s with its *integer* parts of every block (largest remainder, what runs):
    each block's activations exactly; each unit's split state and gradients at the largest part
    fraction of its blocks (the tables record no per-block parameter bytes: an upper bound; with
    continuous shares, 4 heads at 0.64 priced 0.64 of the attention where the member holds 3 of 4)."""
    splits = [tables.tensor_parallel[u] for u in units]
    state = sum(tables.state_bytes[u] for u in units) + pos.tied_bytes
    grads = sum(tables.grad_bytes[u] for u in units) if tables.grad_bytes else 0
    parts: dict[int, tuple[int, ...]] = {}
    left_state = left_grad = left_act = left_step = 0  # split bytes that leave this member's card
    stepped = getattr(tables, "step_param_bytes", ())
    for s, u in zip(splits, units):
        for b in s.blocks:
            if b.parts and b.parts not in parts:
                parts[b.parts] = shares.parts(b.parts)
        mine = max((parts[b.parts][member] / b.parts for b in s.blocks if b.parts), default=1.0)
        split_state = round(s.param_fraction * tables.state_bytes[u])
        left_state += split_state - int(math.ceil(mine * split_state))
        split_step = round(s.param_fraction * stepped[u]) if stepped else 0
        left_step += split_step - int(math.ceil(mine * split_step))
        if grads:
            split_grad = round(s.param_fraction * tables.grad_bytes[u])
            left_grad += split_grad - int(math.ceil(mine * split_grad))
        left_act += sum(b.activation_bytes - -(-b.activation_bytes * parts[b.parts][member] // b.parts)
                        for b in s.blocks if b.parts)
    vocab = [parts[b.parts][member] / b.parts for s in splits for b in s.blocks if b.kind in VOCAB_KINDS]
    tied_vocab = tied_vocab_bytes(tables, units.start, units.stop - 1) if vocab else 0
    left_state += tied_vocab - int(math.ceil(max(vocab, default=1.0) * tied_vocab))  # a tied head: its rows
    rule = getattr(tables, "step_transient", {}).get(kind, NO_STEP_TRANSIENT)
    return pipeline_stage_bytes(
        state_bytes=state - left_state, grad_bytes=grads - left_grad, activation_bytes=pos.activation_bytes - left_act,
        held=position_held_terms(pos.stages_after, first=pos.first, microbatches=pos.microbatches),
        in_bytes=pos.in_bytes, out_bytes=pos.out_bytes, in_grad_bytes=pos.in_grad_bytes,
        out_grad_bytes=pos.out_grad_bytes, transient_bwd_bytes=pos.transient_bwd_bytes,
        step_list_bytes=rule.list_multiple * (pos.step_bytes[0] - left_step),
        step_tensor_bytes=rule.tensor_multiple * pos.step_bytes[1])


def group_stage(tables: GroupTables, *, first: int, last: int, members: Sequence[int], position: StagePosition,
                rule: str = "uneven", shares: Sequence[float] | None = None) -> GroupStage:
    """Price units [first, last] on the group ``members`` at ``position`` (module docstring).

    Shares and integer parts are worked out with the members in device-index order (largest
    remainder's ties go to the lower index), so the price does not depend on which member leads;
    `GroupStage` lists everything in ``members`` order.  Raises `InfeasibleError` when the members
    cannot hold the split at any shares.  ``shares`` (in ``members`` order) prices given shares instead
    of deriving them (the runtime's predictions for the shares a plan records).
    """
    order = sorted(members)
    if list(members) != order:
        given = None if shares is None else [shares[list(members).index(d)] for d in order]
        g = group_stage(tables, first=first, last=last, members=order, position=position, rule=rule, shares=given)
        back = [order.index(d) for d in members]
        return replace(g, shares=tuple(g.shares[i] for i in back), memory_bytes=tuple(g.memory_bytes[i] for i in back),
                       usable_bytes=tuple(g.usable_bytes[i] for i in back),
                       member_fwd_s=tuple(g.member_fwd_s[i] for i in back),
                       member_bwd_s=tuple(g.member_bwd_s[i] for i in back),
                       member_step_s=tuple(g.member_step_s[i] for i in back))
    units = range(first, last + 1)
    shares = (group_shares(tables, units, members, in_flight=position.in_flight, rule=rule) if shares is None
              else TensorShares(tuple(shares), (False,) * len(shares)))
    bandwidth, latency = ring_of(tables, members)
    blocks = [b for u in units for b in tables.tensor_parallel[u].blocks]

    def ring(sizes: Sequence[int]) -> float:
        return sum(ring_allreduce_s(num_bytes=n, ranks=len(members), bandwidth_bytes_s=bandwidth, latency_s=latency)
                   for n in sizes)

    fwd_allreduce = sum(ring(b.allreduces()[0]) for b in blocks)
    bwd_allreduce = sum(ring(b.allreduces()[1]) for b in blocks)

    def bcast(nbytes: int) -> float:  # the lead hands a received message to the group
        return latency + nbytes / bandwidth if nbytes > 0 else 0.0

    fwd, bwd, step = [], [], []
    for i, d in enumerate(members):
        kind = tables.devices[d].kind
        frac = member_fractions(tables, units, shares, i)
        fwd.append(sum(tables.fwd_s[kind][u] * f for u, f in zip(units, frac)))
        bwd.append(sum(tables.bwd_s[kind][u] * f for u, f in zip(units, frac)))
        step.append(_member_step_s(tables, kind, units, shares.weights[i]))
    fwd_extra = fwd_allreduce + (0.0 if position.first else bcast(position.in_bytes))
    bwd_extra = bwd_allreduce + (bcast(position.out_grad_bytes) if position.stages_after else 0.0)
    return GroupStage(
        shares=shares.weights, fwd_s=max(fwd) + fwd_extra, bwd_s=max(bwd) + bwd_extra,
        step_s=max(step), allreduce_s=fwd_allreduce + bwd_allreduce,
        member_fwd_s=tuple(f + fwd_extra for f in fwd), member_bwd_s=tuple(b + bwd_extra for b in bwd),
        member_step_s=tuple(step),
        memory_bytes=tuple(_member_bytes(tables, units, shares, i, position, tables.devices[d].kind)
                           for i, d in enumerate(members)),
        usable_bytes=tuple(tables.devices[d].usable_bytes for d in members))


def _member_step_s(tables: GroupTables, kind: str, units: range, w: float) -> float:
    """The member's optimizer step: its share of the split parameters, every replicated one."""
    if kind not in tables.step_s:
        return 0.0
    table = tables.step_s[kind]
    own = sum(table[u] * (tables.tensor_parallel[u].param_fraction * w + 1.0 - tables.tensor_parallel[u].param_fraction)
              for u in units)
    return own + tables.step_launch_s.get(kind, 0.0)

