"""The plan record of a unit's tensor-parallel block (issue 15; `PlanUnit.tp_blocks`, version 4).

Written only in plans solved with ``--tensor-parallel auto``, so that `hetpipe check` re-derives
every group's shares, times and memory from the plan alone (`plan/tp_plan.py`).

Example:
    >>> PlanBlock(parts=4, fwd_flops=1024, allreduce_bytes=512, activation_bytes=64).parts
    4
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlanBlock:
    """`partitioner.tp_tables.BlockSplit` as recorded: parts, forward FLOPs, all-reduced and held bytes."""

    parts: int
    fwd_flops: int
    allreduce_bytes: int
    activation_bytes: int
    # a block split by vocabulary ("embedding" / "head"; "" a Megatron pair) and its loss all-reduce
    kind: str = field(default="", metadata={"since": 4})
    loss_allreduce_bytes: int = field(default=0, metadata={"since": 4})
