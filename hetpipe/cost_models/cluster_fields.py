"""Field-level parsing for cluster files: one device entry, one network spec, error locations.

Split from `hetpipe.cost_models.cluster` (which assembles nodes and links) so each
file stays small.  Every check raises `ConfigError` through `Where.error`, which
prefixes ``<file>:<line>: <field path>:``.

Example:
    >>> w = Where("lab.yaml", 3, "nodes[0]")
    >>> print(w.field("devices[1]").field("memory").error("must be positive; write e.g. memory: 24GB"))
    lab.yaml:3: nodes[0].devices[1].memory: must be positive; write e.g. memory: 24GB
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from hetpipe.cost_models.catalog import load_catalog
from hetpipe.cost_models.cpu_cores import parse_cores
from hetpipe.cost_models.devices import DeviceProfile
from hetpipe.cost_models.offload import HOST_MEMORY_BYTES_S
from hetpipe.cost_models.links import LinkEnds, NetworkSpec, PCIE4_X16_BANDWIDTH_BYTES_S
from hetpipe.cost_models.quantities import parse_bandwidth_bytes_s, parse_bytes, parse_latency_s
from hetpipe.cost_models.validate import (
    MAX_BANDWIDTH_BYTES_S, MAX_DEVICE_FLOPS_S, MAX_DEVICE_MEMORY_BYTES, MAX_DEVICES, MAX_LATENCY_S, MAX_SHOWN_CHARS, show,
)
from hetpipe.errors import ConfigError

#: FLOP/s per TFLOP/s (cluster files give compute in TFLOP/s).
FLOPS_PER_TFLOP = 1e12
#: Figures a card that is not in the catalog must give.
REQUIRED_FIGURES = ("memory", "tensor_tflops", "fp32_tflops", "memory_bandwidth")
DEVICE_KEYS = ("gpu", "name", "count", "reserve", *REQUIRED_FIGURES, "nvlink", "p2p", "pcie_bandwidth",
               "nvlink_bandwidth", "matmul_efficiency", "bandwidth_efficiency", "kernel_overhead", "source",
               "cores", "op_rates", "optimizer_op", "optimizer_bandwidth",
               "backward_op_overhead", "view_overhead")
NETWORK_KEYS = ("bandwidth", "latency")


@dataclass(frozen=True)
class Where:
    """Where a value sits: file, 1-based line (when known) and field path; `node` is the parsed
    value there (a mapping loaded from YAML knows the line of each of its keys).

    Example:
        >>> class Parsed(dict):  # what the YAML loader gives: the 1-based line of each key
        ...     key_lines = {"memory": 7}
        >>> Where("lab.yaml", 3, "nodes[0]", Parsed(memory="x")).field("memory")
        Where(source='lab.yaml', line=7, path='nodes[0].memory')
    """

    source: str
    line: int | None
    path: str
    node: object = dataclasses.field(default=None, repr=False, compare=False)

    def field(self, name: str, node: object = None) -> Where:
        """The location of `name` inside this one: a field's line is its key's, a list item's
        (``devices[1]``) that of its own mapping; `node` is the value there (found when omitted)."""
        if node is None and isinstance(self.node, Mapping):
            node = self.node.get(name)
        key, _, index = name.partition("[")
        key_line = getattr(self.node, "key_lines", {}).get(key)
        own_line = getattr(node, "line", None)
        # a mapping's own line is where its first key sits, not the key that holds it
        line = (own_line or key_line) if index else (key_line or own_line)
        return Where(self.source, line or self.line, f"{self.path}.{name}" if self.path else name, node)

    def error(self, message: str) -> ConfigError:
        at = f"{self.source}:{self.line}" if self.line else self.source
        return ConfigError(f"{at}: {self.path}: {message}" if self.path else f"{at}: {message}")


def check_keys(entry: object, allowed: tuple[str, ...], where: Where) -> None:
    """`entry` must be a mapping whose keys are all in `allowed` (typos get a suggestion)."""
    if not isinstance(entry, Mapping):
        raise where.error(f"expected a mapping with fields {', '.join(allowed)}, got {type(entry).__name__}")
    for key in entry:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise where.field(str(key)[:MAX_SHOWN_CHARS]).error(
                f"unknown field; {hint}allowed here: {', '.join(allowed)}")


def text(value: object, where: Where) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise where.error(f"must be a non-empty string, got {show(value)}; quote it if it is a number")
    return value.strip()


def quantity(value: object, parse: Callable[[object], float], where: Where, *, allow_zero: bool = False,
             maximum: float = math.inf) -> float:
    """`value` parsed by `parse`: finite, positive (or zero when `allow_zero`) and at most `maximum`."""
    if value is None:
        raise where.error("is missing a value; see docs/cluster-file.md for units")
    try:
        number = parse(value)
    except (ValueError, OverflowError) as err:
        raise where.error(str(err)) from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        raise where.error(f"must be {'non-negative' if allow_zero else 'positive'} and finite, got {show(value)}; "
                          "see docs/cluster-file.md for units")
    if number > maximum:
        raise where.error(f"{show(value)} is above the sanity bound {maximum:g} (base units); "
                          "check the unit (e.g. GB, not TB) and the exponent")
    return number


def _fraction(value: object, where: Where) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise where.error(f"must be a fraction in (0, 1], got {show(value)}; it is achieved / peak")
    return float(value)


def _flag(value: object, where: Where) -> bool:
    if not isinstance(value, bool):
        raise where.error(f"must be true or false, got {show(value)}")
    return value


def _tflops(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number of TFLOP/s (e.g. 71), got {show(value)}")
    return float(value) * FLOPS_PER_TFLOP


def network_spec(entry: object, where: Where, *, allowed: tuple[str, ...] = NETWORK_KEYS) -> NetworkSpec:
    """``{bandwidth: 1Gbit/s, latency: 0.2ms}`` -> `NetworkSpec` (both fields required).

    Example:
        >>> network_spec({"bandwidth": "1Gbit/s", "latency": "0.2ms"}, Where("f", None, "network"))
        NetworkSpec(bandwidth_bytes_s=125000000.0, latency_s=0.0002)
    """
    check_keys(entry, allowed, where)
    assert isinstance(entry, Mapping)
    for key in NETWORK_KEYS:
        if key not in entry:
            raise where.field(key).error("is missing; give both, e.g. {bandwidth: 1Gbit/s, latency: 0.2ms}")
    return NetworkSpec(quantity(entry["bandwidth"], parse_bandwidth_bytes_s, where.field("bandwidth"),
                                maximum=MAX_BANDWIDTH_BYTES_S),
                       quantity(entry["latency"], parse_latency_s, where.field("latency"), allow_zero=True,
                                maximum=MAX_LATENCY_S))


def op_rates(value: object, where: Where) -> tuple[tuple[str, float], ...]:
    """``op_rates: {attention: 3.9e10, gelu: 3.6e9}`` -> sorted pairs: measured work per second of each op
    kind (FLOP/s for attention, bytes/s for a memory-bound aten op; `hetpipe.cost_models.work`).

    Example:
        >>> op_rates({"gelu": 3.6e9, "attention": 4e10}, Where("f", None, "d.op_rates"))
        (('attention', 40000000000.0), ('gelu', 3600000000.0))
    """
    if not isinstance(value, Mapping) or not value:
        raise where.error(f"must map op kinds to rates, e.g. {{gelu: 3.6e9}}, got {show(value)}; "
                          "`hetpipe profile --calibrate` writes it")
    out = []
    for key, rate in value.items():
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
            raise where.field(str(key)[:MAX_SHOWN_CHARS]).error(
                f"must be a positive number (work per second), got {show(rate)}; re-run `hetpipe profile --calibrate`")
        out.append((str(key), float(rate)))
    return tuple(sorted(out))


def _figures(entry: Mapping[str, Any], where: Where) -> dict[str, Any]:
    """DeviceProfile fields the entry sets explicitly."""
    parsers: dict[str, tuple[str, Callable[[object, Where], Any]]] = {
        "memory": ("memory_bytes", lambda v, w: int(quantity(v, parse_bytes, w, maximum=MAX_DEVICE_MEMORY_BYTES))),
        "tensor_tflops": ("tensor_flops_s", lambda v, w: quantity(v, _tflops, w, maximum=MAX_DEVICE_FLOPS_S)),
        "fp32_tflops": ("fp32_flops_s", lambda v, w: quantity(v, _tflops, w, maximum=MAX_DEVICE_FLOPS_S)),
        "memory_bandwidth": ("memory_bandwidth_bytes_s",
                             lambda v, w: quantity(v, parse_bandwidth_bytes_s, w, maximum=MAX_BANDWIDTH_BYTES_S)),
        "nvlink": ("nvlink", _flag),
        "p2p": ("p2p", _flag),
        "matmul_efficiency": ("matmul_efficiency", _fraction),
        "bandwidth_efficiency": ("bandwidth_efficiency", _fraction),
        "kernel_overhead": ("kernel_overhead_s",
                            lambda v, w: quantity(v, parse_latency_s, w, allow_zero=True, maximum=MAX_LATENCY_S)),
        "op_rates": ("op_rates", op_rates),
        "optimizer_op": ("step_op_s", lambda v, w: quantity(v, parse_latency_s, w, maximum=MAX_LATENCY_S)),
        "backward_op_overhead": ("backward_op_s", lambda v, w: quantity(v, parse_latency_s, w, maximum=MAX_LATENCY_S)),
        "view_overhead": ("view_op_s", lambda v, w: quantity(v, parse_latency_s, w, maximum=MAX_LATENCY_S)),
        "optimizer_bandwidth": ("step_bytes_s",
                                lambda v, w: quantity(v, parse_bandwidth_bytes_s, w, maximum=MAX_BANDWIDTH_BYTES_S)),
    }
    return {attr: parse(entry[key], where.field(key)) for key, (attr, parse) in parsers.items() if key in entry}


def _base(entry: Mapping[str, Any], where: Where) -> tuple[DeviceProfile | None, LinkEnds, str]:
    """(catalog profile or None, its link figures, kind) for one entry."""
    if "gpu" in entry:
        at = where.field("gpu")
        try:
            row = load_catalog().entry(text(entry["gpu"], at))
        except ConfigError as err:
            raise at.error(str(err)) from None
        kind = text(entry["name"], where.field("name")) if "name" in entry else row.key
        return row.profile, LinkEnds(row.pcie_bandwidth_bytes_s, row.nvlink_bandwidth_bytes_s), kind
    if "name" not in entry:
        raise where.error("give gpu: <catalog name> (e.g. gpu: rtx3090), or name: plus "
                          f"{', '.join(REQUIRED_FIGURES)} for a card not in the catalog")
    kind = text(entry["name"], where.field("name"))
    missing = [f for f in REQUIRED_FIGURES if f not in entry]
    if missing:
        raise where.error(f"card {kind!r} is not from the catalog and lacks {', '.join(missing)}; give all of "
                          f"{', '.join(REQUIRED_FIGURES)} (e.g. memory: 16GiB, tensor_tflops: 50, fp32_tflops: 20, "
                          "memory_bandwidth: 500GB/s)")
    return None, LinkEnds(PCIE4_X16_BANDWIDTH_BYTES_S, None), kind


def _ends(entry: Mapping[str, Any], where: Where, ends: LinkEnds, profile: DeviceProfile) -> LinkEnds:
    pcie, nvlink = ends.pcie_bandwidth_bytes_s, ends.nvlink_bandwidth_bytes_s
    if "pcie_bandwidth" in entry:
        pcie = quantity(entry["pcie_bandwidth"], parse_bandwidth_bytes_s, where.field("pcie_bandwidth"),
                        maximum=MAX_BANDWIDTH_BYTES_S)
    if "nvlink_bandwidth" in entry:
        nvlink = quantity(entry["nvlink_bandwidth"], parse_bandwidth_bytes_s, where.field("nvlink_bandwidth"),
                          maximum=MAX_BANDWIDTH_BYTES_S)
    if profile.nvlink and nvlink is None:
        raise where.field("nvlink").error("a card with nvlink: true needs nvlink_bandwidth (NVIDIA's figure, "
                                          "both directions, e.g. 112.5GB/s)")
    return LinkEnds(pcie, nvlink)


def device_entry(entry: object, where: Where, *,
                 default_reserve_bytes: int) -> list[tuple[DeviceProfile, int, LinkEnds]]:
    """One ``devices`` entry -> ``count`` copies of (profile, reserve_bytes, link ends).

    Example:
        >>> [(p.kind, r) for p, r, _ in device_entry({"gpu": "3090", "count": 2, "reserve": "1GB"},
        ...                                          Where("f", None, "d"), default_reserve_bytes=0)]
        [('rtx3090', 1000000000), ('rtx3090', 1000000000)]
    """
    check_keys(entry, DEVICE_KEYS, where)
    assert isinstance(entry, Mapping)
    base, ends, kind = _base(entry, where)
    figures = _figures(entry, where)
    source = text(entry["source"], where.field("source")) if "source" in entry else None
    if base is None:
        profile = DeviceProfile(kind=kind, **figures, source=source or f"given in {where.source}")
    else:
        overridden = [k for k in REQUIRED_FIGURES if k in entry]
        note = f"{base.source}; {', '.join(overridden)} from {where.source}" if overridden else base.source
        profile = replace(base, kind=kind, **figures, source=source or note)
    count = entry.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DEVICES:
        raise where.field("count").error(f"must be a whole number of cards, at least 1 and at most {MAX_DEVICES}, "
                                         f"got {show(count)}; fix the count")
    reserve = default_reserve_bytes
    if "reserve" in entry:
        reserve = int(quantity(entry["reserve"], parse_bytes, where.field("reserve"), allow_zero=True,
                               maximum=MAX_DEVICE_MEMORY_BYTES))
    if reserve >= profile.memory_bytes:
        raise where.field("reserve").error(
            f"reserve of {reserve} bytes leaves nothing of the card's {profile.memory_bytes} bytes; "
            "set reserve: below memory (CUDA context + NCCL + fragmentation, 1-5 GB on a real GPU)")
    return [(profile, reserve, _ends(entry, where, ends, profile))] * count


def entry_cores(entry: Mapping[str, Any], where: Where) -> list[tuple[int, ...]]:
    """The ``cores`` of one ``devices`` entry (a CPU core group, `hetpipe.cost_models.cpu_cores`), one per
    copy: ``()`` (not pinned) when absent; a group names one device, so ``count`` must then be 1.

    Example:
        >>> entry_cores({"gpu": "cpu", "cores": "0-1"}, Where("f", None, "d"))
        [(0, 1)]
    """
    count = entry.get("count", 1)
    if "cores" not in entry:
        return [()] * count
    at = where.field("cores")
    try:
        cores = parse_cores(entry["cores"])
    except ValueError as err:
        raise at.error(f"{err}; write e.g. cores: 0 or cores: 0-3 (the CPU cores this device runs on)") from None
    if count != 1:
        raise where.field("count").error(f"must be 1 with cores: (one core group is one device), got {show(count)}; "
                                         "give each group its own devices entry")
    return [cores]


def host_figures(node: Mapping[str, Any], where: Where) -> tuple[float | None, float]:
    """A node's optional ``host_link`` (each card's link to host memory, per direction; None = the
    card's PCIe figure) and ``host_memory_bandwidth`` (default `offload.HOST_MEMORY_BYTES_S`): what
    optimizer-state offload pays (`hetpipe.cost_models.offload`).

    Example:
        >>> host_figures({"host_link": "12GB/s"}, Where("f", None, "nodes[0]"))
        (12000000000.0, 51200000000.0)
    """
    link = (quantity(node["host_link"], parse_bandwidth_bytes_s, where.field("host_link"), maximum=MAX_BANDWIDTH_BYTES_S)
            if "host_link" in node else None)
    memory = (quantity(node["host_memory_bandwidth"], parse_bandwidth_bytes_s, where.field("host_memory_bandwidth"),
                       maximum=MAX_BANDWIDTH_BYTES_S) if "host_memory_bandwidth" in node else HOST_MEMORY_BYTES_S)
    return link, memory
