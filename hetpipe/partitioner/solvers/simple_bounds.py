"""Lower bounds on the H-1F1B estimate T_est = S + (m - 1) b that need no search.

S (every stage's F + B and every cut's round trip) is at least every unit on its fastest kind;
the bottleneck b is at least the largest such unit and at least S_lb spread over every device.
"""

from __future__ import annotations

from hetpipe.partitioner.problem import Problem


def simple_lower_bound(problem: Problem) -> float:
    """A valid lower bound on T for any placement: S >= every unit on its fastest kind (S_lb),
    and the bottleneck >= the largest such unit and >= S_lb / #devices.

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> p = Problem({"a": (1.0, 3.0)}, {"a": (0.0, 0.0)}, (0, 0), (0, 0), (0, 0),
        ...             (DeviceSlot("x", "a", "n", 1),), ((1.0,),), ((0.0,),), 3)
        >>> simple_lower_bound(p)  # 4 + 2 * max(3, 4 / 1)
        12.0
    """
    kinds = list(problem.fwd_s)
    fastest = [min(problem.fwd_s[k][u] + problem.bwd_s[k][u] for k in kinds) for u in range(problem.num_units)]
    s_lb = sum(fastest)
    b_lb = max(max(fastest, default=0.0), s_lb / max(1, len(problem.devices)))
    return s_lb + (problem.microbatches - 1) * b_lb


def sum_lower_bound(problem: Problem) -> float:
    """S >= every unit on its fastest kind (comm and memory only add)."""
    kinds = list(problem.fwd_s)
    return sum(min(problem.fwd_s[k][u] + problem.bwd_s[k][u] for k in kinds) for u in range(problem.num_units))
