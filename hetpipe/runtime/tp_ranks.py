"""Which rank runs which member of which stage, and the process groups a plan with
tensor-parallel groups needs (issue 15).

One rank per card: `hetpipe.plan.group_run.rank_slots` lays the ranks out (stages in order, each
group's lead first).  On one node rank r takes slot r; across nodes (``--plan-node``) local rank
k takes the k-th slot on that node (`slot_for`).  After the join every rank all-gathers its slot
(`gather_layout`): ``stage_ranks`` are the leads (they exchange the cuts), ``group_ranks`` every
stage's ranks in member order.  `GroupHandles` then creates, on every rank and in the same order
(``new_group`` is collective over the world), one process group per tensor-parallel group and one
per tied parameter whose stages include a group (the tied gradient is summed over the leads and
every member of those groups: members add zeros, `hetpipe.runtime.execute.group`).

Example:
    >>> layout = Layout(slot=RankSlot(0, 1, "b"), stage_ranks=(0, 2), group_ranks=((0, 1), (2,)))
    >>> layout.is_lead, layout.executor_ranks, layout.stages_of((0, 1, 2))
    (False, (1, 2), {0, 1})
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from hetpipe.errors import ConfigError
from hetpipe.plan.group_run import RankSlot, rank_slots
from hetpipe.plan.schema import Plan


@dataclass(frozen=True)
class Layout:
    """This rank's slot and every stage's ranks (leads: ``stage_ranks``; all members: ``group_ranks``)."""

    slot: RankSlot
    stage_ranks: tuple[int, ...]
    group_ranks: tuple[tuple[int, ...], ...]

    @property
    def is_lead(self) -> bool:
        return self.slot.member == 0

    @property
    def executor_ranks(self) -> tuple[int, ...]:
        """The stage ranks this rank's executor uses: the leads, with this rank at its own stage
        (a member runs its lead's action list; its p2p is the group's broadcast)."""
        ranks = list(self.stage_ranks)
        ranks[self.slot.stage] = self.group_ranks[self.slot.stage][self.slot.member]
        return tuple(ranks)

    def stages_of(self, ranks: Sequence[int]) -> set[int]:
        """The stages the global ``ranks`` run."""
        return {s for s, group in enumerate(self.group_ranks) for r in group if r in ranks}


def slot_for(plan: Plan, *, node: str | None, rank: int, local_rank: int) -> RankSlot:
    """The slot this process runs: slot ``rank`` on one node, else the ``local_rank``-th slot on ``node``."""
    slots = rank_slots(plan)
    if node is None:
        if rank >= len(slots):
            raise ConfigError(f"the plan runs on {len(slots)} cards but this is rank {rank}; launch with "
                              f"--nproc-per-node={len(slots)} (one process per card of every stage and group)")
        return slots[rank]
    node_of = {d.id: d.node for d in plan.devices}
    here = [s for s in slots if node_of[s.device] == node]
    if not here:
        raise ConfigError(f"--plan-node {node!r} runs no stage of this plan; the plan's nodes are "
                          f"{sorted(set(node_of.values()))}")
    if local_rank >= len(here):
        raise ConfigError(f"node {node!r} has {len(here)} cards in the plan but torchrun started local rank "
                          f"{local_rank}; use --nproc-per-node={len(here)} on that node")
    return here[local_rank]


def gather_layout(plan: Plan, slot: RankSlot) -> Layout:
    """Every rank's slot (one all-gather), checked: each slot of `rank_slots` exactly once."""
    slots = rank_slots(plan)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (slot.stage, slot.member))
    want = sorted((s.stage, s.member) for s in slots)
    if sorted(every) != want:
        raise ConfigError(f"the ranks run (stage, member) {every}, but the plan needs each of {want} exactly once; "
                          "give each node --plan-node with its plan name and --nproc-per-node equal to its cards")
    rank_of = {tuple(v): r for r, v in enumerate(every)}
    group_ranks = tuple(tuple(rank_of[(s.stage, m)] for m in range(sum(x.stage == s.stage for x in slots)))
                        for s in slots if s.member == 0)
    return Layout(slot, tuple(g[0] for g in group_ranks), group_ranks)


class GroupHandles:
    """The process groups of a grouped plan, created in the same order on every rank (module docstring)."""

    def __init__(self, layout: Layout, tied_stages: Sequence[Sequence[int]], *, timeout_s: float) -> None:
        self.layout, timeout = layout, timedelta(seconds=timeout_s)
        self.tensor: dict[int, Any] = {}
        for s, ranks in enumerate(layout.group_ranks):
            if len(ranks) > 1:
                self.tensor[s] = dist.new_group(ranks=list(ranks), timeout=timeout)
        self.leads = dist.new_group(ranks=list(layout.stage_ranks), timeout=timeout)  # --save-weights' writers
        self.tied: dict[frozenset[int], Any] = {}
        for stages in tied_stages:
            key = frozenset(stages)
            ranks = sorted(r for s in key for r in layout.group_ranks[s])
            if key not in self.tied and len(ranks) > 1:
                self.tied[key] = dist.new_group(ranks=ranks, timeout=timeout)

    def my_group(self) -> Any:
        """This rank's tensor-parallel process group (None on a width-1 stage)."""
        return self.tensor.get(self.layout.slot.stage)

    def tied_group(self, ranks: Sequence[int]) -> Any:
        """The executor's ``tied_group`` factory: the group of the stages ``ranks`` (its view) run."""
        return self.tied[frozenset(self.layout.stages_of(ranks))]
