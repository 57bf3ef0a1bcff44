"""Tensor-parallel groups in a plan (issue 15): validation, and the refusals until they are wired.

A `PlanStage` with ``group_devices`` runs on a group of cards of one node or of two
(`tp_tables.MAX_GROUP_NODES`; its ring then priced on the nodes' link), member i holding
``group_shares[i]`` of every tensor-parallel block (version 4).  `validate_groups` runs when
a plan is loaded (`plan.validate`): the members are plan devices of at most two nodes, ``device``
first, each once and in no other stage; the shares are one per member, positive, and sum to 1
(integer heads / columns follow by largest remainder, so their sum is every block's total).

The solver writes groups under ``--tensor-parallel auto`` and `check_plan` prices them
(`plan/tp_plan.py`); `hetpipe run` runs them (`plan/group_run.py`: the rank layout, each member's
predicted times, and the refusals of what groups do not run yet).

Example:
    >>> from types import SimpleNamespace as NS
    >>> dev = lambda i, node: NS(id=i, node=node, usable_bytes=1)
    >>> plan = NS(devices=[dev("a", "n"), dev("b", "n")],
    ...           stages=[NS(device="a", group_devices=("a", "b"), group_shares=(0.75, 0.25))])
    >>> validate_groups(plan)
    >>> plan.devices.append(dev("c", "m"))
    >>> plan.stages[0] = NS(device="a", group_devices=("a", "c"), group_shares=(0.5, 0.5))   # across two nodes
    >>> validate_groups(plan)
"""

from __future__ import annotations

import math
from typing import Any

from hetpipe.errors import PlanError
from hetpipe.partitioner.tp_tables import MAX_GROUP_NODES

_FIX = "the plan was edited or corrupted; re-create it with `hetpipe plan`"
#: Slack on the shares' sum: JSON round-trips floats exactly, so only their own rounding.
SHARE_SUM_TOL = 1e-9


def _group(st: Any, at: str, nodes: dict[str, str]) -> None:
    members, shares = tuple(st.group_devices), tuple(st.group_shares)
    if len(members) < 2 or members[0] != st.device or len(set(members)) != len(members):
        raise PlanError(f"{at}.group_devices: {list(members)} must list 2 or more distinct devices, the stage's "
                        f"device {st.device!r} first; {_FIX}")
    unknown = [m for m in members if m not in nodes]
    if unknown:
        raise PlanError(f"{at}.group_devices: {unknown} not in plan.devices; {_FIX}")
    if len({nodes[m] for m in members}) > MAX_GROUP_NODES:
        raise PlanError(f"{at}.group_devices: {list(members)} span nodes {sorted({nodes[m] for m in members})}; "
                        f"a tensor-parallel group is on at most {MAX_GROUP_NODES} nodes; {_FIX}")
    if len(shares) != len(members) or not all(isinstance(w, (int, float)) and math.isfinite(w) and w > 0
                                              for w in shares):
        raise PlanError(f"{at}.group_shares: {list(shares)} must be one positive share per member of "
                        f"{list(members)}; {_FIX}")
    if abs(sum(shares) - 1.0) > SHARE_SUM_TOL:
        raise PlanError(f"{at}.group_shares: {list(shares)} sum to {sum(shares)!r}, not 1; {_FIX}")


def validate_groups(plan: Any) -> None:
    """Raise `PlanError` unless every stage's group is well formed (module docstring)."""
    nodes = {d.id: d.node for d in plan.devices}
    holders: dict[str, int] = {}
    for i, st in enumerate(plan.stages):
        at = f"plan.stages[{i}]"
        if st.group_devices or st.group_shares:
            _group(st, at, nodes)
        for m in st.group_devices or (st.device,):
            if m in holders and holders[m] != i:
                raise PlanError(f"{at}.group_devices: {m!r} also runs stage {holders[m]}; {_FIX}")
            holders[m] = i

