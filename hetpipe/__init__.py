"""hetpipe: partition PyTorch training across mixed GPU clusters.

Public API (see README.md):
    capture(model, example_inputs, ...) -> UnitGraph
    load_cluster(path) -> Cluster
    partition(model, cluster, *, example_inputs, ...) -> Plan
    Plan.save(path) / Plan.load(path), check_plan(plan)
    run(plan, model=..., steps=..., emulate=...) -> RunReport   (launches torchrun, one process per stage)
    calibrate_from_report(run_json, cluster_yaml, output=...)   (measured times -> a calibrated cluster file)
    Trainer(plan, model=..., loss=...).step(inputs, targets)    (one rank inside your own torchrun script)
    ReplicaTrainer(plan, model=...).step(inputs, targets)       (one rank of a replica plan, plan version 2)

Heavy submodules (torch, OR-Tools) load on first use, so ``hetpipe --help`` is fast.

Example:
    >>> import hetpipe
    >>> hetpipe.Plan.__name__
    'Plan'
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from hetpipe.errors import (
    CaptureError,
    ConfigError,
    HetpipeError,
    InfeasibleError,
    PlanError,
    RuntimeFailure,
    ScheduleError,
)

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "capture": "hetpipe.partitioner.capture.capture",
    "UnitGraph": "hetpipe.partitioner.capture.graph",
    "Unit": "hetpipe.partitioner.capture.graph",
    "partition": "hetpipe.plan.build",
    "partition_graph": "hetpipe.plan.build",
    "Plan": "hetpipe.plan.schema",
    "check_plan": "hetpipe.plan.check",
    "load_cluster": "hetpipe.cost_models.cluster",
    "Cluster": "hetpipe.cost_models.devices",
    "Problem": "hetpipe.partitioner.problem",
    "evaluate": "hetpipe.partitioner.problem",
    "Action": "hetpipe.schedule.actions",
    "run": "hetpipe.runtime.run",
    "Trainer": "hetpipe.runtime.trainer",
    "ReplicaTrainer": "hetpipe.runtime.replicas.trainer",
    "RunReport": "hetpipe.runtime.report",
    "calibrate_from_report": "hetpipe.runtime.faults.feedback",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hetpipe' has no attribute {name!r}")


__all__ = [
    "CaptureError",
    "ConfigError",
    "HetpipeError",
    "InfeasibleError",
    "PlanError",
    "RuntimeFailure",
    "ScheduleError",
    "__version__",
    *_LAZY,
]
