"""The cluster entrance of the Python API: a path, a dict or a `Cluster`, always checked.

`as_cluster` accepts what users pass to `hetpipe.partition` (a cluster file path, a parsed
cluster document as a dict, or a `Cluster` built in code) and returns a `Cluster` whose
figures passed the same bounds as a cluster file (`hetpipe.cost_models.validate`):
finite positive compute, memory and bandwidth, a link for every ordered pair of devices.

Example:
    >>> c = as_cluster({"nodes": [{"name": "a", "devices": [{"gpu": "rtx3090", "count": 2}]}]})
    >>> [d.id for d in c.devices]
    ['a:0', 'a:1']
    >>> try:
    ...     as_cluster(None)
    ... except ConfigError as err:
    ...     print(err)
    cluster: expected a cluster file path, a dict or a Cluster, got NoneType; pass e.g. "examples/clusters/homelab.yaml"
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hetpipe.cost_models.cluster import cluster_from_dict, load_cluster
from hetpipe.cost_models.devices import Cluster, Device
from hetpipe.cost_models.validate import (
    MAX_BANDWIDTH_BYTES_S, MAX_DEVICE_FLOPS_S, MAX_DEVICE_MEMORY_BYTES, MAX_LATENCY_S, check_device_count,
    finite_number, whole_number,
)
from hetpipe.errors import ConfigError

_FIX = "fix the figure where the Cluster is built (or use a cluster file: docs/cluster-file.md)"


def as_cluster(cluster: object) -> Cluster:
    """A checked `Cluster` from a path, a cluster document (dict) or a `Cluster`."""
    if isinstance(cluster, Cluster):
        check_cluster(cluster)
        return cluster
    if isinstance(cluster, Mapping):
        return cluster_from_dict(cluster, source="<dict>")
    if isinstance(cluster, (str, Path)):
        return load_cluster(cluster)
    raise ConfigError(f"cluster: expected a cluster file path, a dict or a Cluster, got {type(cluster).__name__}; "
                      'pass e.g. "examples/clusters/homelab.yaml"')


def _check_device(i: int, dev: Device) -> None:
    if not isinstance(dev, Device):
        raise ConfigError(f"cluster.devices[{i}]: expected a Device, got {type(dev).__name__}; {_FIX}")
    at = f"cluster.devices[{i}] ({dev.id})"
    p = dev.profile
    whole_number(p.memory_bytes, f"{at}.memory_bytes", minimum=1, maximum=MAX_DEVICE_MEMORY_BYTES, fix=_FIX)
    whole_number(dev.reserve_bytes, f"{at}.reserve_bytes", minimum=0, maximum=p.memory_bytes - 1, fix=_FIX)
    for name in ("tensor_flops_s", "fp32_flops_s"):
        finite_number(getattr(p, name), f"{at}.{name}", strict=True, maximum=MAX_DEVICE_FLOPS_S, fix=_FIX)
    finite_number(p.memory_bandwidth_bytes_s, f"{at}.memory_bandwidth_bytes_s", strict=True,
                  maximum=MAX_BANDWIDTH_BYTES_S, fix=_FIX)
    for name in ("matmul_efficiency", "bandwidth_efficiency"):
        if getattr(p, name) is not None:
            finite_number(getattr(p, name), f"{at}.{name}", strict=True, maximum=1.0, fix=_FIX)
    if p.kernel_overhead_s is not None:
        finite_number(p.kernel_overhead_s, f"{at}.kernel_overhead_s", maximum=MAX_LATENCY_S, fix=_FIX)


def check_cluster(cluster: Cluster) -> None:
    """Raise `ConfigError` unless every figure of `cluster` is finite and in range and every
    ordered pair of distinct devices has a link (a missing link would be priced as free)."""
    check_device_count(len(cluster.devices), "cluster.devices")
    if not cluster.devices:
        raise ConfigError(f"cluster {cluster.name!r} has no devices; add at least one device")
    ids = [d.id for d in cluster.devices]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"cluster.devices: device id {dup!r} appears twice; give every device its own id")
    for i, dev in enumerate(cluster.devices):
        _check_device(i, dev)
    wanted = len(ids) * (len(ids) - 1)
    known = set(ids)
    pairs = {k for k in cluster.links if k[0] != k[1] and k[0] in known and k[1] in known}
    if len(pairs) != wanted:  # name the first missing pair (a missing link would be priced as free)
        a, b = next((a, b) for a in ids for b in ids if a != b and (a, b) not in pairs)
        raise ConfigError(f"cluster.links: no link {a} -> {b}; every ordered pair of devices needs one "
                          "(a missing link would be priced as infinitely fast); add it")
    for (a, b), link in cluster.links.items():
        bw, lat = link.bandwidth_bytes_s, link.latency_s
        # the plain comparison first: a 1,024-card cluster has a million links
        if not (isinstance(bw, (int, float)) and isinstance(lat, (int, float))
                and 0 < bw <= MAX_BANDWIDTH_BYTES_S and 0 <= lat <= MAX_LATENCY_S):
            finite_number(bw, f"cluster.links[{a} -> {b}].bandwidth_bytes_s", strict=True,
                          maximum=MAX_BANDWIDTH_BYTES_S, fix=_FIX)
            finite_number(lat, f"cluster.links[{a} -> {b}].latency_s", maximum=MAX_LATENCY_S, fix=_FIX)
