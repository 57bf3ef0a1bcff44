"""Pin a rank to its plan device's CPU core group (a non-emulated run on core-group devices).

A plan made on a cluster file from `hetpipe profile --calibrate --cpu-devices N` names, for
each device, the cores it was measured on (`PlanDevice.cores`).  The rank running a stage
on such a device pins itself there (affinity and one intra-op thread per core), so the run
measures the devices the plan was costed for.  Under ``--emulate`` nothing is pinned: the
emulation shares every core among the ranks and chooses its time scale for that
(`hetpipe.runtime.emulate.pipeline.choose_time_scale`).

Example:
    >>> from hetpipe.plan.schema import PlanDevice
    >>> stage_cores([PlanDevice("vm:0", "cpu-c0", "vm", 1, 1, cores=(0,))], "vm:0")
    (0,)
"""

from __future__ import annotations

import logging
from typing import Sequence

from hetpipe.cost_models.cpu_cores import format_cores, pin_cores
from hetpipe.plan.schema import Plan, PlanDevice

log = logging.getLogger(__name__)


def stage_cores(devices: Sequence[PlanDevice], device_id: str) -> tuple[int, ...]:
    """The core group of device `device_id` (() when it is not a core group)."""
    for dev in devices:
        if dev.id == device_id:
            return tuple(dev.cores)
    return ()


def pin_stage(plan: Plan, stage: int, *, emulate: bool) -> tuple[int, ...]:
    """Pin this process to the cores of ``plan.stages[stage]``'s device unless emulating; returns them."""
    cores = stage_cores(plan.devices, plan.stages[stage].device)
    if emulate or not cores:
        return ()
    pin_cores(cores)
    log.info("stage %d pinned to cores %s (%d thread(s))", stage, format_cores(cores), len(cores))
    return cores
