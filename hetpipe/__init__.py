"""hetpipe: partition PyTorch training across mixed GPU clusters.

Public API (see README.md):
    capture(model, example_inputs, ...) -> UnitGraph
    load_cluster(path) -> Cluster
    partition(model, cluster, *, example_inputs, ...) -> Plan
    Plan.save(path) / Plan.load(path)
"""

from __future__ import annotations

import logging

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

__all__ = [
    "CaptureError",
    "ConfigError",
    "HetpipeError",
    "InfeasibleError",
    "PlanError",
    "RuntimeFailure",
    "ScheduleError",
    "__version__",
]
