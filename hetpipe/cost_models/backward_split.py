"""How a unit's backward splits into the input gradient (B) and the weight gradient (W).

Zero-bubble schedules (`hetpipe.schedule.builders.zb_h1`) run the two halves of a backward as
separate actions, so the simulator needs each one's seconds.  The rule (Qi et al. 2023, "Zero
Bubble Pipeline Parallelism", arXiv 2311.11015, §2): for a linear layer ``Y = X W`` the
input gradient ``dX = dY W^T`` and the weight gradient ``dW = X^T dY`` are one matmul each,
with the forward's FLOPs, so each is half of the backward.  A unit with trainable parameters is
priced at `WEIGHT_GRAD_SHARE` of its backward for W; a unit without any (activations, the
loss, parameter-free attention glue) has no W.

Where this is not exact, and in which direction: a transformer block's parameter-free
attention matmuls (``Q K^T``, ``P V``: ``4 b s^2 h`` forward FLOPs beside the linear layers'
``24 b s h^2``) have only input gradients, so its true W share is ``24 h / (48 h + 8 s)``:
0.41 for GPT-2 small at s = 1024, 0.49 at s = 128.  Unit captures record a unit's whole
backward FLOPs, not which of them multiply a parameter, so the share is not derived per unit.

Example:
    >>> stage_bwd_weight_s(bwd_s=(2.0, 1.0, 4.0), trainable=(True, False, True))
    3.0
"""

from __future__ import annotations

from typing import Sequence

#: W's share of a unit's backward when the unit has trainable parameters (module docstring).
WEIGHT_GRAD_SHARE = 0.5


def unit_bwd_weight_s(bwd_s: float, *, trainable: bool) -> float:
    """W seconds of one unit whose whole backward takes `bwd_s`.

    Example:
        >>> unit_bwd_weight_s(3.0, trainable=True), unit_bwd_weight_s(3.0, trainable=False)
        (1.5, 0.0)
    """
    return WEIGHT_GRAD_SHARE * bwd_s if trainable else 0.0


def stage_bwd_weight_s(*, bwd_s: Sequence[float], trainable: Sequence[bool]) -> float:
    """W seconds of a stage: the sum over its units (a recompute's extra forward stays in B)."""
    return sum(unit_bwd_weight_s(b, trainable=t) for b, t in zip(bwd_s, trainable, strict=True))
