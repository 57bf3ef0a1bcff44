"""The HetpipeError hierarchy: every user-facing failure is one of these.

Each error carries a message that says *what* is wrong and *how to fix it*.
The CLI catches `HetpipeError`, prints ``error: <message>`` on one line and
exits with status 2; library callers catch the specific subclass.

Example:
    >>> try:
    ...     raise ConfigError("cluster.yaml:3: unknown GPU 'RTX 3095'; did you mean 'rtx3090'?")
    ... except HetpipeError as err:
    ...     print(err)
    cluster.yaml:3: unknown GPU 'RTX 3095'; did you mean 'rtx3090'?
"""

from __future__ import annotations


class HetpipeError(Exception):
    """Base class of every error hetpipe raises for bad input or impossible requests."""


class ConfigError(HetpipeError):
    """A cluster file, catalog entry or option is malformed or inconsistent."""


class CaptureError(HetpipeError):
    """A model could not be traced or grouped into partitionable units."""


class InfeasibleError(HetpipeError):
    """No plan fits the cluster's memory (the message says by how much and how to fix it)."""


class PlanError(HetpipeError):
    """A plan file is corrupted, of an unknown version, or made for another model."""


class ScheduleError(HetpipeError):
    """A pipeline schedule is invalid (the message names rank, step and micro-batch)."""


class RuntimeFailure(HetpipeError):
    """A distributed run failed: a peer died, timed out, or an emulated device ran out of memory."""
