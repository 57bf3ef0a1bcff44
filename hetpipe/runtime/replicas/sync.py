"""Keep pipeline replicas consistent: weighted gradient sync every step, or DiLoCo outer steps (issue #6).

A replica plan (plan version 2) records *sync groups*: units [first_unit, last_unit] held
by one device in every replica.  `sync_buckets` turns them into buckets of parameter
names (from the captured fx graph: a ``call_module`` node's submodule parameters and the
targets of ``get_attr`` nodes belong to that node's unit) and the global ranks holding
them; a parameter tied across units (GPT-2's ``wte`` / ``lm_head``) gets a bucket of its
own over every rank holding a copy, because replicas may hold it on different stages.
Buckets are in one global order (by first unit; a tied parameter just before the group of
its lowest unit), so every rank issues its all-reduces in an order consistent with every
other rank's (no deadlock, and matching collectives on each process group).

`ReplicaSync` splits each bucket into *parts* of at most ``bucket_cap_bytes`` (the plan's
``sync.bucket_cap_bytes``; whole units while they fit, last unit first, see
`hetpipe.runtime.replicas.buckets.split_parts`) and runs each part as one flat all-reduce (SUM) over a process group of its holders, each
rank's contribution scaled by its replica's ``grad_weight`` = samples_r / global_batch.
With each replica's loss the mean over its own samples, the sum is the mean-loss
gradient of the concatenated global batch:

    g = sum_r (n_r / N) * g_r         (n_r samples of replica r, N = sum_r n_r)

* ``synchronous``: overlapped with backward.  The executor calls `ReplicaSync.arm` right
  before the rank's last backward; from then on a post-accumulate-grad hook marks each
  parameter whose gradient is final, and a part is launched (async all-reduce) as soon
  as its parameters are all final and every part before it in the rank's *launch
  order* was launched.  The launch order is the reverse of the one global bucket order
  (parts of later units first: backward produces them first), so every process group
  sees its collectives in the same order on every member.  A launched part's gradients
  become views of its flat buffer (no second copy of the gradients is held).
  `ReplicaSync.sync_grads`, inside the optimizer step, launches what is left (a
  parameter that got no gradient, or everything with ``overlap=False``) and waits for
  all parts, before the executor sums tied-parameter copies within a replica; a tied
  copy holds a partial gradient then, so every copy contributes and afterwards only the
  replica's first copy (its *owner*) keeps the sum and the others are zeroed: the
  executor's tied all-reduce then gives every copy exactly the sum.
* ``diloco`` (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
  Language Models", arXiv 2311.08105, Algorithm 1): every replica steps its own inner
  optimizer with no sync; every H steps `ReplicaSync.outer_step` all-reduces the weighted
  pseudo-gradient ``anchor - params`` (owner copies only; they are equal within a
  replica), applies SGD with Nesterov momentum to the anchor and copies it back into the
  parameters.  The exchange has the bytes of one gradient sync, so volume falls by H.

``bytes_reduced`` counts the payload bytes this rank handed to all-reduces.

Example:
    >>> b = SyncBucket("units 0-2", ranks=(0, 2), names=("w",), owners=(0, 2))
    >>> b.num_ranks, b.is_owner(2)
    (2, True)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetpipe.cost_models.sync import BUCKET_CAP_BYTES
from hetpipe.errors import PlanError
from hetpipe.plan.schema import Plan
from hetpipe.runtime.replicas.buckets import OverlappedReducer, Part, SyncBucket, split_parts, wait_all_reduce

log = logging.getLogger(__name__)

#: DiLoCo's outer optimizer, Nesterov SGD with learning rate 0.7 and momentum 0.9: the
#: settings Douillard et al. (arXiv 2311.08105, §3 and Table 1) found best and use
#: throughout ("outer learning rate of 0.7 and momentum 0.9").
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9
SYNC_POLICIES = ("synchronous", "diloco")


def param_units(graph_module: Any, plan: Plan) -> dict[str, int]:
    """Qualified parameter name -> the plan unit of the fx node that uses it (first use wins).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> gm = torch.fx.symbolic_trace(net)
        >>> class P: units = (type("U", (), {"index": 0, "node_names": ("_0",)}),
        ...                   type("U", (), {"index": 1, "node_names": ("_1",)}))
        >>> param_units(gm, P())
        {'0.weight': 0, '0.bias': 0, '1.weight': 1, '1.bias': 1}
    """
    nodes = {n.name: n for n in graph_module.graph.nodes}
    params = dict(graph_module.named_parameters(remove_duplicate=False))
    out: dict[str, int] = {}
    for unit in plan.units:
        for name in unit.node_names:
            node = nodes.get(name)
            if node is None:
                raise PlanError(f"plan unit {unit.index} names fx node {name!r}, which the captured model does not "
                                "have; re-plan it with `hetpipe plan`")
            if node.op == "call_module":
                sub = graph_module.get_submodule(str(node.target))
                names = [f"{node.target}.{p}" for p, _ in sub.named_parameters(remove_duplicate=False)]
            elif node.op == "get_attr" and str(node.target) in params:
                names = [str(node.target)]
            else:
                continue
            for qualified in names:
                out.setdefault(qualified, unit.index)
    return out


def holder_stage(plan: Plan, replica: int, unit: int) -> int:
    """Plan stage index holding ``unit`` in ``replica``."""
    rep = plan.replicas[replica]
    for i in range(rep.first_stage, rep.first_stage + rep.num_stages):
        if plan.stages[i].first_unit <= unit <= plan.stages[i].last_unit:
            return i
    raise PlanError(f"replica {replica} holds no stage with unit {unit}; its stages must cover every unit "
                    "(re-plan it with `hetpipe plan`)")


def _check_groups(plan: Plan) -> None:
    assert plan.sync is not None
    covered = [u for g in plan.sync.groups for u in range(g.first_unit, g.last_unit + 1)]
    if len(plan.replicas) > 1 and covered != list(range(len(plan.units))):
        raise PlanError(f"plan sync.groups cover units {covered}, not every unit 0..{len(plan.units) - 1} once in "
                        "order; re-plan it with `hetpipe plan` (check_plan lists the mismatch)")


def _unit_bucket(plan: Plan, group: Any, names: tuple[str, ...], stage_ranks: Sequence[int],
                 units: tuple[int, ...] = ()) -> SyncBucket:
    holders = []
    for r in range(len(plan.replicas)):
        stage = holder_stage(plan, r, group.first_unit)
        st = plan.stages[stage]
        if st.last_unit < group.last_unit or r >= len(group.devices) or st.device != group.devices[r]:
            raise PlanError(f"sync group of units {group.first_unit}-{group.last_unit} lists devices "
                            f"{list(group.devices)}, but replica {r} holds them on stage {st.index} ({st.device}, "
                            f"units {st.first_unit}-{st.last_unit}); re-plan it with `hetpipe plan`")
        holders.append(stage_ranks[stage])
    ranks = tuple(sorted(holders))
    return SyncBucket(f"units {group.first_unit}-{group.last_unit}", ranks, names, ranks,
                      first_unit=group.first_unit, units=units)


def sync_buckets(plan: Plan, units_of: Mapping[str, int], stage_ranks: Sequence[int]) -> tuple[SyncBucket, ...]:
    """Every rank's buckets in the one global order (module docstring); empty for a single replica.

    ``units_of`` is `param_units`; ``stage_ranks[i]`` the global rank running ``plan.stages[i]``.
    """
    assert plan.sync is not None, "a replica plan records its sync"
    if len(plan.replicas) < 2:
        return ()
    _check_groups(plan)
    tied = {n for t in plan.model.tied for n in t.names}
    out = []
    for group in plan.sync.groups:
        names = tuple(n for n, u in units_of.items() if group.first_unit <= u <= group.last_unit and n not in tied)
        if names:
            out.append(_unit_bucket(plan, group, names, stage_ranks, tuple(units_of[n] for n in names)))
    for t in plan.model.tied:
        holders, owners = set(), []
        for r in range(len(plan.replicas)):
            stages = sorted({holder_stage(plan, r, u) for u in t.units})
            holders.update(stage_ranks[s] for s in stages)
            owners.append(stage_ranks[stages[0]])
        low = min(t.units)  # its gradient is final when this unit's backward is done: charge it to that group
        group_first = next(g.first_unit for g in plan.sync.groups if g.first_unit <= low <= g.last_unit)
        out.append(SyncBucket(f"tied {t.names[0]}", tuple(sorted(holders)), tuple(t.names), tuple(sorted(owners)),
                              tied=True, first_unit=group_first))
    # A tied parameter's gradient is final only when its lowest unit's backward is done: it goes before that
    # unit's group here, i.e. after the whole group in the (reversed) launch order.  Stable sort.
    return tuple(sorted(out, key=lambda b: (b.first_unit, not b.tied)))


def group_ranks(buckets: Sequence[SyncBucket]) -> list[tuple[int, ...]]:
    """The distinct process groups the buckets need, in bucket order (one group per rank set)."""
    return list(dict.fromkeys(b.ranks for b in buckets if b.num_ranks > 1))


@dataclass
class _Local:
    """A bucket as this rank runs it: its parameters (one per tied alias set) and process group."""

    bucket: SyncBucket
    params: list[nn.Parameter]
    group: Any
    owner: bool
    units: list[int]  # plan unit of each parameter


class ReplicaSync:
    """This rank's part of the replica sync (module docstring); `groups` maps a rank set to its group.

    Args:
        buckets: `sync_buckets` (every rank's; this rank keeps the ones it holds).
        module: this rank's stage module (``nn.Module``), parameters under qualified names.
        rank: global rank.  grad_weight: samples of this replica / global batch.
        policy: "synchronous" or "diloco".  outer_steps: H (diloco).
        groups: rank set -> process group (made on every rank in `group_ranks` order).
        overlap: synchronous sync launched from gradient hooks during the last backward (else
            all in the optimizer step).  bucket_cap_bytes: largest all-reduce part.
    """

    def __init__(self, buckets: Sequence[SyncBucket], *, module: nn.Module, rank: int, grad_weight: float,
                 policy: str, outer_steps: int, groups: Mapping[tuple[int, ...], Any], timeout_s: float,
                 where: str, outer_lr: float = DILOCO_OUTER_LR, outer_momentum: float = DILOCO_OUTER_MOMENTUM,
                 overlap: bool = True, bucket_cap_bytes: int = BUCKET_CAP_BYTES) -> None:
        if policy not in SYNC_POLICIES or outer_steps < 1:
            raise PlanError(f"{where}: sync policy {policy!r} with H = {outer_steps} cannot run; use "
                            f"{' or '.join(SYNC_POLICIES)} with outer_steps >= 1")
        self.rank, self.weight, self.policy, self.outer_steps = rank, float(grad_weight), policy, int(outer_steps)
        self.timeout_s, self.where = float(timeout_s), where
        self.bytes_reduced = 0
        self.steps = 0
        # `hetpipe.runtime.emulate.replicas.SyncEmulation` under --emulate: delays each exchange to the plan's time.
        self.emulation: Any = None
        self.gloo = dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
        named = dict(module.named_parameters(remove_duplicate=False))
        self._local = [lb for lb in (self._bind(b, named, groups) for b in buckets if rank in b.ranks) if lb.params]
        self._anchors: dict[int, torch.Tensor] = {}
        self._outer: torch.optim.Optimizer | None = None
        if policy == "diloco":
            anchors = [self._anchor(p) for lb in self._local for p in lb.params]
            if anchors:
                self._outer = torch.optim.SGD(anchors, lr=outer_lr, momentum=outer_momentum, nesterov=True)
        # Launch order: the reverse of the global bucket order (later units first), parts last parameter first.
        parts = [part for lb in reversed(self._local) for part in
                 split_parts(lb.bucket, lb.params, group=lb.group, owner=lb.owner, cap_bytes=bucket_cap_bytes,
                             units=lb.units)]
        self.reducer = OverlappedReducer(parts, weight=self.weight, timeout_s=self.timeout_s, where=where,
                                         overlap=overlap and policy == "synchronous", on_bytes=self._count)

    def held(self, label: str, *, tied: bool = False) -> tuple[list[nn.Parameter], Any] | None:
        """The parameters (bucket order) and process group of this rank's bucket `label` (a tied
        parameter's bucket with `tied`), or None."""
        for lb in self._local:
            if lb.bucket.label == label and lb.bucket.tied == tied:
                return lb.params, lb.group
        return None

    def _count(self, num_bytes: int) -> None:
        self.bytes_reduced += num_bytes

    @property
    def parts(self) -> list[Part]:
        """This rank's gradient all-reduce parts, in launch order (with the last step's state)."""
        return self.reducer.parts

    def arm(self) -> None:
        """The executor's last backward of the step is next: launch parts as their gradients become final."""
        if self.policy == "synchronous":
            if self.emulation is not None:
                self.emulation.armed()
            self.reducer.arm()

    def _bind(self, bucket: SyncBucket, named: Mapping[str, nn.Parameter],
              groups: Mapping[tuple[int, ...], Any]) -> _Local:
        present = [n for n in bucket.names if n in named]
        if not present or (len(present) != len(bucket.names) and not bucket.tied):
            missing = [n for n in bucket.names if n not in named][:3]
            raise PlanError(f"{self.where}: the plan makes this rank a holder of {bucket.label}, but its stage lacks "
                            f"{missing}; the plan does not match the model, re-plan it with `hetpipe plan`")
        first = {}  # a tied alias set is one parameter: the first name of each; frozen ones get no gradient
        for n in present:
            if named[n].requires_grad:
                first.setdefault(id(named[n]), n)
        params = [named[n] for n in first.values()]
        group = groups.get(bucket.ranks) if bucket.num_ranks > 1 else None
        return _Local(bucket, params, group, bucket.is_owner(self.rank), [bucket.unit_of(n) for n in first.values()])

    def _anchor(self, p: nn.Parameter) -> torch.Tensor:
        a = p.detach().clone()
        self._anchors[id(p)] = a
        return a

    # ------------------------------------------------------------------ collectives

    def _all_reduce(self, lb: _Local, flat: torch.Tensor, what: str) -> None:
        if lb.group is None:
            return
        self.bytes_reduced += flat.numel() * flat.element_size()
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=lb.group, async_op=True)
        wait_all_reduce(work, what=f"{what} all-reduce of {lb.bucket.label}", ranks=lb.bucket.ranks,
                        where=self.where, timeout_s=self.timeout_s, gloo=self.gloo)

    def sync_grads(self) -> None:
        """Synchronous policy: finish the weighted gradient sum over the replicas, before the tied all-reduce."""
        if self.policy != "synchronous":
            return
        emu = self.emulation
        if emu is None:
            self.reducer.finish()
        elif self.reducer.overlap:  # each part from when its holders' gradients were final (emulated)
            emu.begin_overlapped()
            self.reducer.finish(on_part=emu.after_part)
            emu.end_overlapped()
        else:  # serially after the slowest replica, as T charges it
            emu.begin()  # every rank, also one holding no bucket: it is a collective
            self.reducer.finish()
            emu.end()

    def after_step(self) -> bool:
        """Count an inner step; on diloco every H-th one runs `outer_step`.  True when it synced."""
        self.steps += 1
        if self.policy == "diloco" and self.steps % self.outer_steps == 0:
            self.outer_step()
            return True
        return self.policy == "synchronous"

    @torch.no_grad()
    def outer_step(self) -> None:
        """DiLoCo outer step: averaged pseudo-gradient, Nesterov SGD on the anchor, params <- anchor."""
        emu = self.emulation
        if emu is not None:
            emu.begin()  # every rank: a collective
        self._outer_exchange()
        if emu is not None:
            emu.end()

    def _outer_exchange(self) -> None:
        if self._outer is None:
            return
        for lb in self._local:
            deltas = [self._anchors[id(p)] - p for p in lb.params]
            flat = torch.cat([d.reshape(-1) for d in deltas])
            flat.mul_(self.weight if lb.owner else 0.0)  # copies within a replica are equal: owners only
            self._all_reduce(lb, flat, "DiLoCo outer")
            anchors = [self._anchors[id(p)] for p in lb.params]
            _scatter(flat, anchors)
            if self.emulation is not None:
                self.emulation.after_bucket(lb.bucket.label)
        self._outer.step()
        for lb in self._local:
            for p in lb.params:
                p.copy_(self._anchors[id(p)])


def _scatter(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into each tensor's ``.grad`` (allocated when missing)."""
    offset = 0
    for t in tensors:
        piece = flat[offset:offset + t.numel()].view_as(t)
        if t.grad is None:
            t.grad = piece.clone()
        else:
            t.grad.copy_(piece)
        offset += t.numel()
    assert offset == flat.numel(), (offset, flat.numel())  # the buffer was built from these tensors
