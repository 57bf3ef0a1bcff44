"""Per device kind, per unit forward/backward seconds of a capture: the tables every plan records.

Moved out of `plan.build` (which re-exports both names) so that `plan.selective_plan` prices the
selective level's dropped nodes without importing the planner's glue.

Example:
    >>> from hetpipe.cost_models.cluster import load_cluster
    >>> from hetpipe.plan.build import capture_builtin
    >>> cluster = load_cluster("examples/clusters/homelab.yaml")
    >>> graph = capture_builtin("mlp-tiny", batch=2)
    >>> times = unit_times(graph, cluster)
    >>> sorted(times) == sorted(cluster.kinds), {len(v) for v in times.values()} == {graph.num_units}
    (True, True)
"""

from __future__ import annotations

from hetpipe.cost_models.devices import Cluster, DeviceProfile
from hetpipe.cost_models.timing import unit_time_s
from hetpipe.partitioner.capture.graph import UnitGraph
from hetpipe.plan.schema import UnitTimes


def unit_times(graph: UnitGraph, cluster: Cluster) -> dict[str, tuple[UnitTimes, ...]]:
    """Per device kind, per unit forward/backward seconds for one micro-batch."""
    return {kind: profile_unit_times(graph, cluster.profile(kind)) for kind in cluster.kinds}


def profile_unit_times(graph: UnitGraph, prof: DeviceProfile) -> tuple[UnitTimes, ...]:
    """Per unit forward/backward seconds for one micro-batch on a device of profile `prof`."""
    times = []
    for u in graph.units:
        t = unit_time_s(fwd_flops=u.fwd_flops, bwd_flops=u.bwd_flops, memory_traffic_bytes=u.memory_traffic_bytes,
                        op_count=u.op_count, profile=prof, precision=graph.precision, fwd_work=u.fwd_work,
                        bwd_work=u.bwd_work, held_bytes=u.activation_bytes)
        times.append(UnitTimes(fwd=t.fwd_s, bwd=t.bwd_s))
    return tuple(times)
