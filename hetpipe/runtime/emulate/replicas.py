"""Emulate a replica plan (plan version 2) on one CPU box: `hetpipe run replicas.json --emulate`.

Each rank pretends to be its plan device exactly as in a single pipeline
(`hetpipe.runtime.emulate.pipeline`), with three replica-specific pieces:

* **Links** are its own replica's neighbours (`hetpipe.runtime.rank.stage_links` over
  that replica's stages; cut k sits between the replica's stages k and k + 1).
* **Calibration and time scale.**  Every replica pushes one micro-batch through its own
  pipeline `CALIBRATION_PASSES` times, one replica after the other (a world barrier
  between them), so each stage's real F/B is measured uncontended.  The per-stage
  medians are all-gathered and every rank runs `choose_time_scale` on the same
  numbers, over every plan stage, so all ranks agree on one global time scale.
* **Gradient sync** lasts the plan's time.  Synchronous sync is overlapped as the
  runtime overlaps it (`hetpipe.runtime.replicas.buckets`): each all-reduce part is charged
  its sync group's ``time_s`` times its share of the group's bytes, and starts, in the
  launch order, once every holder finished its last (stretched) backward and its
  previous part -- one MAX all-reduce of those times over the part's holders
  (`SyncEmulation.after_part`); the rank leaves the sync when its last part ends.  This is
  the simulator's model (`hetpipe.cost_models.sync.overlapped_sync_end_s`, at the
  granularity of whole stages: a part is ready when its stage's backward ends).  A DiLoCo
  outer step (every H steps, after the inner optimizer step) is charged serially:
  `SyncEmulation.begin` all-reduces (MAX) the time every rank entered it, bucket k ends
  ``time_scale * sum_{j<=k} groups[j].time_s`` after that and every rank leaves at
  ``time_scale * sync_s`` after it, as T charges it (T = max_r T_r + T_sync / H).

The memory ledger checks each stage against its card's ``usable_bytes``; an emulated
out-of-memory names the rank, its replica, the stage within that replica and the card.

Example:
    >>> emu = SyncEmulation(time_scale=0.5, bucket_end_s={"units 0-3": 0.2}, total_s=0.3, timeout_s=5.0)
    >>> emu.real_offset_s("units 0-3"), emu.real_offset_s("tied wte.weight")
    (0.1, 0.15)
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist

from hetpipe.errors import ConfigError
from hetpipe.plan.schema import Plan
from hetpipe.runtime.execute import comm
from hetpipe.runtime.emulate.pipeline import DEFAULT_SAFETY_FACTOR, EmulationHooks, RecordingHooks, StageTiming
from hetpipe.runtime.execute.executor import ActionHooks
from hetpipe.runtime.execute.options import ExecutorOptions, ReplicaWiring
from hetpipe.runtime.stage.buffers import kept_buffers

log = logging.getLogger(__name__)


class SwitchHooks(ActionHooks):
    """Executor hooks whose target can change after the executor is built (calibration first, then emulation).

    The executor binds ``send_delay_s`` / ``arrived`` when it is constructed, so the
    replica trainer gets this object and `inner` is swapped once the time scale is known.

    Example:
        >>> h = SwitchHooks(RecordingHooks()); h.inner = ActionHooks(); h.send_delay_s(0, 10)
        0.0
    """

    def __init__(self, inner: ActionHooks) -> None:
        self.inner = inner

    @property  # type: ignore[override]
    def exact_memory(self) -> bool:
        return bool(self.inner.exact_memory)

    def before(self, action: Any) -> None:
        self.inner.before(action)

    def after(self, action: Any, seconds: float) -> None:
        self.inner.after(action, seconds)

    def send_delay_s(self, cut: int, num_bytes: int) -> float:
        return self.inner.send_delay_s(cut, num_bytes)

    def memory(self, action: Any, held_bytes: Mapping[str, int]) -> None:
        self.inner.memory(action, held_bytes)

    def arrived(self, action: Any, late_s: float) -> None:
        self.inner.arrived(action, late_s)

    def __getattr__(self, name: str) -> Any:  # fwd_s, ledger, origin, current, ... of the inner hooks
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclass
class SyncEmulation:
    """Delays one rank's part of every replica sync to the plan's time (module docstring).

    ``bucket_end_s``: emulated seconds from the start of the sync to the end of the bucket
    with that label; a bucket not listed (a tied parameter) ends with the whole exchange,
    ``total_s`` (the plan's ``sync.sync_s``).
    """

    time_scale: float
    bucket_end_s: Mapping[str, float]
    total_s: float
    timeout_s: float
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    syncs: int = 0
    overrun_s: float = 0.0  # worst real seconds an exchange lasted beyond its emulated end
    _start_s: float = 0.0
    # Plan sync groups as (first unit, last unit, emulated seconds, bytes): what a part is charged.
    groups: tuple[tuple[int, int, float, int], ...] = ()
    bwd_s: float = 0.0  # this rank's stage's emulated backward per micro-batch
    # plan unit -> share of this stage's backward after which that unit's gradients are final
    bwd_fraction: Mapping[int, float] = field(default_factory=dict)
    _armed_s: float = 0.0  # real time the last backward of the step began
    _free_s: float = 0.0  # when this rank's previous overlapped part ends (real monotonic seconds)

    def armed(self) -> None:
        """The step's last backward starts now (`hetpipe.runtime.replicas.sync.ReplicaSync.arm`)."""
        self._armed_s = time.monotonic()

    def ready_s(self, part: Any) -> float:
        """Real time a part's gradients are final in the emulated world (a tied part: the backward's end)."""
        share = 1.0 if part.bucket.tied else self.bwd_fraction.get(part.first_unit, 1.0)
        return self._armed_s + self.time_scale * self.bwd_s * share

    def part_s(self, first_unit: int, num_bytes: int) -> float:
        """Emulated seconds of an all-reduce part of ``num_bytes`` charged to the group holding ``first_unit``."""
        for first, last, seconds, group_bytes in self.groups:
            if first <= first_unit <= last:
                return seconds * num_bytes / group_bytes if group_bytes > 0 else 0.0
        return 0.0

    def begin_overlapped(self) -> None:
        """The optimizer step has started: wait for the parts launched since `armed`."""
        self.syncs += 1
        self._free_s = self._armed_s

    def after_part(self, part: Any) -> None:
        """A part's real all-reduce is done: agree on its emulated start with its holders, charge its time."""
        if part.group is None:
            return
        start = torch.tensor([max(self._free_s, self.ready_s(part))], dtype=torch.float64, device=self.device)
        work = dist.all_reduce(start, op=dist.ReduceOp.MAX, group=part.group, async_op=True)
        comm.wait_work(work, timeout_s=self.timeout_s, gloo=dist.get_backend() == "gloo",
                       describe=lambda timed_out, detail: (
                           f"rank {dist.get_rank()}: the emulated start of {part.label} "
                           f"{'timed out' if timed_out else 'failed'} ({detail}); is every holder alive?"))
        self._free_s = float(start.item()) + self.time_scale * self.part_s(part.bucket.first_unit, part.num_bytes)
        self.overrun_s = max(self.overrun_s, time.monotonic() - self._free_s)

    def end_overlapped(self) -> None:
        """Leave the sync when this rank's last part ends (emulated)."""
        late = time.monotonic() - self._free_s
        if late < 0:
            time.sleep(-late)

    def real_offset_s(self, label: str) -> float:
        return self.time_scale * self.bucket_end_s.get(label, self.total_s)

    def begin(self) -> None:
        """Collective over the world: the sync starts when the last rank arrives."""
        self.syncs += 1
        here = torch.tensor([time.monotonic()], dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            work = dist.all_reduce(here, op=dist.ReduceOp.MAX, async_op=True)
            comm.wait_work(work, timeout_s=self.timeout_s, gloo=dist.get_backend() == "gloo",
                           describe=lambda timed_out, detail: (
                               f"rank {dist.get_rank()}: the emulated replica sync's start "
                               f"{'timed out' if timed_out else 'failed'} ({detail}); is every rank alive?"))
        self._start_s = float(here.item())

    def _sleep_until(self, offset_s: float) -> None:
        late = time.monotonic() - (self._start_s + offset_s)
        if late < 0:
            time.sleep(-late)
        else:
            self.overrun_s = max(self.overrun_s, late)

    def after_bucket(self, label: str) -> None:
        self._sleep_until(self.real_offset_s(label))

    def end(self) -> None:
        self._sleep_until(self.time_scale * self.total_s)


def sync_emulation(plan: Plan, *, time_scale: float, timeout_s: float, device: torch.device,
                   plan_stage: int | None = None) -> SyncEmulation:
    """The plan's sync groups as bucket end offsets (the runtime labels unit buckets ``units a-b``) and
    part charges; with ``plan_stage``, when that stage's last backward makes each group's gradients final."""
    from hetpipe.plan.run_sim import stage_bwd_fraction

    assert plan.sync is not None  # check_runnable
    ends, total = {}, 0.0
    for g in plan.sync.groups:
        total += g.time_s
        ends[f"units {g.first_unit}-{g.last_unit}"] = total
    groups = tuple((g.first_unit, g.last_unit, g.time_s, g.num_bytes) for g in plan.sync.groups)
    emu = SyncEmulation(time_scale, ends, plan.sync.sync_s, timeout_s, device, groups=groups)
    if plan_stage is not None:
        st = plan.stages[plan_stage]
        emu.bwd_s = st.bwd_s
        emu.bwd_fraction = {u: stage_bwd_fraction(plan, st, u) for u in range(st.first_unit, st.last_unit + 1)}
    return emu


def replica_label(plan: Plan, trainer: Any) -> str:
    """``"replica 1 on n1:0 (rtx3060-12gb)"``: for the memory ledger's messages."""
    dev = plan.devices[plan.device_index()[plan.stages[trainer.place.plan_stage].device]]
    return f"replica {trainer.place.replica} on {dev.id} ({dev.kind})"


def calibrate_replicas(trainer: Any, *, inputs: Any, targets: Any, timeout_s: float,
                       passes: int) -> list[StageTiming]:
    """Every plan stage's uncontended real F/B of one micro-batch, replica after replica (module docstring)."""
    from hetpipe.runtime.execute.executor import PipelineExecutor
    from hetpipe.runtime.replicas.trainer import replica_batch
    from hetpipe.runtime.report import median
    from hetpipe.schedule.builders import make_schedule
    from hetpipe.runtime.rank import barrier

    p = trainer.place
    gloo = dist.get_backend() == "gloo"
    hooks = RecordingHooks()
    groups = trainer.groups  # the replica's pipeline and tied-parameter groups, made by the trainer
    executor = PipelineExecutor(
        trainer.stage, rank=p.rank, num_stages=p.num_stages,
        schedule_actions=make_schedule("gpipe", p.num_stages, 1)[p.stage], loss_fn=trainer.executor.loss_fn,
        optimizer=torch.optim.SGD(trainer.stage.parameters(), lr=0.0), microbatches=1, stage_ranks=p.stage_ranks,
        options=ExecutorOptions(timeout_s=timeout_s), hooks=hooks,
        wiring=ReplicaWiring(group=groups.get(tuple(sorted(p.stage_ranks))),
                             tied_group=lambda ranks: groups[tuple(sorted(ranks))]))
    ins = replica_batch(inputs, p, what="inputs")[:1] if trainer.is_first else None
    tgs = replica_batch(targets, p, what="targets")[:1] if trainer.is_last else None
    for rep in trainer.plan.replicas:  # one replica at a time: the others wait at the barrier
        if rep.index == p.replica:
            with kept_buffers(trainer.stage.module):  # calibration is not training: BatchNorm statistics kept
                for _ in range(passes):
                    executor.step(ins, tgs)
        barrier(gloo, timeout_s)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (p.plan_stage, median(hooks.fwd_compute_s[1:]), median(hooks.bwd_compute_s[1:])))
    by_stage = {s: StageTiming(f, b) for s, f, b in every}
    return [by_stage[s] for s in range(len(trainer.plan.stages))]


def emulate_replicas(trainer: Any, hooks: SwitchHooks, *, inputs: Any, targets: Any, timeout_s: float,
                     safety_factor: float | None) -> EmulationHooks:
    """Calibrate, choose the one time scale, and make ``trainer`` emulate its plan device (module docstring).

    Installs the `EmulationHooks` into ``hooks`` (the trainer's executor hooks) and a
    `SyncEmulation` into ``trainer.sync``; returns the emulation hooks.
    """
    from hetpipe.runtime.emulate.pipeline import choose_time_scale
    from hetpipe.runtime.rank import CALIBRATION_PASSES, stage_links

    plan, p = trainer.plan, trainer.place
    world = dist.get_world_size()
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        raise ConfigError("--emulate runs every stage on one host (emulated links time messages with the host's "
                          "CLOCK_MONOTONIC); launch it with `hetpipe run --emulate`, not across nodes")
    measured = calibrate_replicas(trainer, inputs=inputs, targets=targets, timeout_s=timeout_s,
                                  passes=CALIBRATION_PASSES)
    predicted = [StageTiming(st.fwd_s, st.bwd_s) for st in plan.stages]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    scale = choose_time_scale(measured, predicted, num_ranks=world, num_cores=cores,
                              safety_factor=safety_factor or DEFAULT_SAFETY_FACTOR)
    log.info("rank %d: time scale %.4g real s per emulated s (limited by %s)", p.rank, scale.real_s_per_emulated_s,
             scale.limiting)
    rep = plan.replicas[p.replica]
    own = plan.stages[rep.first_stage:rep.first_stage + rep.num_stages]
    dev = plan.devices[plan.device_index()[own[p.stage].device]]
    emu = EmulationHooks(rank=p.rank, stage=p.stage, device_label=replica_label(plan, trainer),
                         usable_bytes=dev.usable_bytes, predicted=predicted[p.plan_stage],
                         links=stage_links(plan, p.stage, stages=own), time_scale=scale.real_s_per_emulated_s,
                         origin=scale)
    hooks.inner = emu
    trainer.sync.emulation = sync_emulation(plan, time_scale=scale.real_s_per_emulated_s, timeout_s=timeout_s,
                                            device=trainer.executor.comm.header_device,
                                            plan_stage=trainer.place.plan_stage)
    return emu

