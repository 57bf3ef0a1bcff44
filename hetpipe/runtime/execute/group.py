"""A tensor-parallel group's stage inside the pipeline executor (issue 15).

Every member of a group stage runs its lead's action list (the simulator, validator and
executor share one list); only the messages differ, and `GroupComm` swaps them:

* ``RECV_F`` / ``RECV_B``: the lead receives the neighbour's frame as any stage does, then
  broadcasts it (header and tensors, one uint8 frame) to its members; a member takes its copy
  from that broadcast.  This is the broadcast the contract prices: "one broadcast of each received
  activation or gradient from the lead" (`hetpipe.partitioner.tp_tables.group_stage`).
* ``SEND_F`` / ``SEND_B``: only the lead sends.  A member's output is the lead's (every block
  ends in `reduce_from_group`'s all-reduce) and so is its input gradient (`copy_to_group`'s).
* The start-up handshake is the lead's.

`group_wiring` plugs it into `PipelineExecutor` (``ReplicaWiring.make_comm``) with the two
optimizer-step rules of a member: a tied parameter's gradient is summed over the leads and every
member of the stages holding it, members adding zeros (theirs equals their lead's), or, split by
vocabulary, each its own rows of a whole-size buffer (`ReplicaWiring.tied_rows`); and the
global gradient norm counts each replicated parameter once, on the lead (``uncounted``), every
member's own shards always.

Example (a group of one: the lead's own messages, nothing broadcast):
    >>> from hetpipe.runtime.tp_shard import ColumnParallelLinear, BlockInput
    >>> import torch
    >>> net = torch.nn.Sequential(ColumnParallelLinear(torch.ones(2, 3), None, BlockInput(None)),
    ...                           torch.nn.LayerNorm(2))
    >>> sorted(n for n, p in net.named_parameters() if id(p) in replicated_ids(net))
    ['1.bias', '1.weight']
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hetpipe.runtime.execute.comm import Pending, StageComm, encode_header, frame_layout, pack_frame, unpack_frame
from hetpipe.runtime.execute.options import ReplicaWiring
from hetpipe.runtime.stage.types import StageModule
from hetpipe.runtime.tp_shard import ColumnParallelLinear, RowParallelLinear
from hetpipe.runtime.tp_vocab import VocabShard, tied_rows
from hetpipe.schedule.actions import Action, Op


class GroupComm(StageComm):
    """`StageComm` of one member of a group stage (module docstring).

    ``group``: the group's process group; ``lead_rank``: its lead's global rank;
    ``is_lead``: this rank is the lead.  Everything else as `StageComm`.
    """

    def __init__(self, stage: StageModule, *, group: Any, lead_rank: int, is_lead: bool, **kwargs: Any) -> None:
        super().__init__(stage, **kwargs)
        self.group, self.lead_rank, self.is_lead = group, lead_rank, is_lead
        self.where += "" if is_lead else f" (member of the group led by rank {lead_rank})"

    def handshake(self, microbatches: int) -> None:
        if self.is_lead:
            super().handshake(microbatches)

    def post_recv(self, action: Action) -> None:
        if self.is_lead:
            super().post_recv(action)

    def recv(self, action: Action) -> list[torch.Tensor]:
        """The lead's received message, broadcast to the group (module docstring)."""
        kind, specs, _ = self.message_specs(action)
        if self.is_lead:
            tensors = super().recv(action)
            peer_stage = self.stage.stage + (-1 if action.op is Op.RECV_F else 1)
            header = encode_header(stage=peer_stage, kind=kind, microbatch=action.microbatch, arrive_ns=0,
                                   tensors=tensors)
            frame = pack_frame(header, tensors, specs, device=self.stage.device)
        else:
            frame = torch.empty(frame_layout(specs)[1], dtype=torch.uint8, device=self.stage.device)
            self._on_bytes(action, sum(t.num_bytes for t in specs))
        work = dist.broadcast(frame, src=self.lead_rank, group=self.group, async_op=True)
        self.wait(work, f"the group broadcast of {action} from its lead rank {self.lead_rank}",
                  f"is every member of rank {self.lead_rank}'s group alive?")
        if self.is_lead:
            return tensors
        header, tensors = unpack_frame(frame, specs)
        self._check_header(header, Pending(action, self.lead_rank, specs, frame, []))
        self._on_bytes(action, None)
        return tensors

    def send(self, action: Action, tensors: Sequence[torch.Tensor]) -> None:
        if self.is_lead:
            super().send(action, tensors)


def replicated_ids(module: torch.nn.Module) -> set[int]:
    """ids of ``module``'s parameters every member holds whole: all but the column layers' weights and
    biases and the row layers' weights (a row layer's bias is added once, after the all-reduce)."""
    shards = set()
    for m in module.modules():
        if isinstance(m, VocabShard):  # an embedding's or a head's vocabulary rows
            shards.add(id(m.weight))
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            shards.add(id(m.weight))
            if isinstance(m, ColumnParallelLinear) and m.bias is not None:
                shards.add(id(m.bias))
    return {id(p) for p in module.parameters() if id(p) not in shards}


def group_wiring(stage: StageModule, *, group: Any, lead_rank: int, is_lead: bool,
                 tied_group: Callable[[Sequence[int]], Any]) -> ReplicaWiring:
    """The executor wiring of one member of a group stage (module docstring)."""
    rows = tied_rows(stage.module)  # a tied parameter split by vocabulary: every member adds its own rows
    tied = [p for name, p in stage.named_parameters() if name in stage.tied_parameters() and id(p) not in rows]

    def zero_tied() -> None:  # before the tied all-reduce: the lead's gradient stands for the group's
        for p in tied:
            if p.grad is not None:
                p.grad.zero_()

    def make_comm(stage_module: StageModule, **kwargs: Any) -> GroupComm:
        return GroupComm(stage_module, group=group, lead_rank=lead_rank, is_lead=is_lead, **kwargs)

    return ReplicaWiring(tied_group=tied_group, grad_sync=None if is_lead else zero_tied, make_comm=make_comm,
                         uncounted=frozenset() if is_lead else frozenset(replicated_ids(stage.module)),
                         tied_rows=rows)
