"""What the executor's memory ledger is compared with: M_s less memory model 4's backward transients and
memory model 5's optimizer step transient.

The ledger (`hetpipe.runtime.execute.held`) counts held storages (parameters, gradients, optimizer
state, saved activations, messages); a backward's transients (T_s: the loss's 2 x logits) and the
step's (U_s: Adam's foreach list) are not held storages, so a run's measured held peak is within its
tolerance of M_s without them, never above M_s.  The transients themselves are checked against live
storages (tests/test_backward_transient.py, tests/test_step_transient.py) and the allocator on a GPU
(benchmarks/gpu_check.py).
"""

from __future__ import annotations

import dataclasses

from hetpipe.partitioner.problem import stage_memory_bytes
from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan


def ledger_bytes(plan: Plan) -> tuple[int, ...]:
    """Per stage of `plan` (no groups): its M_s priced without backward or step transients."""
    problem = dataclasses.replace(problem_from_plan(plan), transient_bwd_bytes=(), step_transient={})
    stages = stages_from_plan(plan)
    return tuple(stage_memory_bytes(problem, stages, s) for s in range(len(stages)))
