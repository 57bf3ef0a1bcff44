"""Pipeline schedules as data: one list of `Action`s per rank.

The runtime executor and the simulator execute the same lists.  An action is
printed like torch.distributed.pipelining's IR: ``1F3`` is stage 1's forward
of micro-batch 3, ``2RECV_B0`` stage 2 receiving the gradient of micro-batch 0,
``0STEP`` the optimizer step of stage 0.

Example:
    >>> str(Action(1, Op.F, 3))
    '1F3'
    >>> Action.parse("2RECV_B0")
    Action(stage=2, op=<Op.RECV_B: 'RECV_B'>, microbatch=0)
    >>> str(Action(0, Op.STEP))
    '0STEP'
    >>> Action.parse("1W2")
    Action(stage=1, op=<Op.W: 'W'>, microbatch=2)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Op(str, Enum):
    """What an action does."""

    F = "F"  # forward of one micro-batch
    B = "B"  # backward of one micro-batch: input and weight gradients, or only the input gradient
    # when the rank's list also has a W for that micro-batch (zero-bubble schedules)
    W = "W"  # weight gradient of one micro-batch, after its B (Qi et al. 2023, arXiv 2311.11015)
    SEND_F = "SEND_F"  # send forward activations to stage + 1
    RECV_F = "RECV_F"  # receive forward activations from stage - 1
    SEND_B = "SEND_B"  # send input gradients to stage - 1
    RECV_B = "RECV_B"  # receive output gradients from stage + 1
    STEP = "STEP"  # optimizer step (after all micro-batches)


_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|STEP|F|B|W)(\d*)$")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule; `microbatch` is None only for STEP."""

    stage: int
    op: Op
    microbatch: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.op.value}{mb}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``Action.parse("1F3") == Action(1, Op.F, 3)``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F3', '0SEND_F2', '1STEP'")
        stage, op, mb = match.groups()
        return cls(int(stage), Op(op), int(mb) if mb else None)


#: A schedule: rank r's actions in execution order (rank r runs stage r).
Schedule = dict[int, list[Action]]
