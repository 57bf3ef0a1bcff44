"""Cluster files (YAML or JSON) -> `Cluster`: devices, and a link for every ordered pair.

The format is documented field by field in ``docs/cluster-file.md``::

    name: home-lab
    nodes:
      - name: desk
        intra: pcie-host                 # nvlink | pcie-p2p | pcie-host
        network: {bandwidth: 1Gbit/s, latency: 0.2ms}
        devices: [{gpu: rtx3090}, {gpu: rtx4090, reserve: 2GB}]
    links: [{between: [desk, shelf], bandwidth: 100Mbit/s, latency: 30ms}]

Device ids are ``"<node>:<index>"``.  Intra-node links follow the node's ``intra``
kind (`hetpipe.cost_models.links`), inter-node links the slower of the two nodes'
``network`` figures or an explicit ``links`` entry.  Every mistake is one
`ConfigError` line: ``<file>:<line>: <field>: <what is wrong>; <fix>``.

Example:
    >>> doc = {"nodes": [{"name": "a", "devices": [{"gpu": "rtx3090", "count": 2}]}]}
    >>> c = cluster_from_dict(doc, source="inline")
    >>> [d.id for d in c.devices], c.link("a:0", "a:1").kind
    (['a:0', 'a:1'], 'pcie-host')
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

import yaml

from hetpipe.cost_models.catalog import load_catalog, lookup_gpu
from hetpipe.cost_models.cluster_fields import (
    Where, check_keys, device_entry, entry_cores, host_figures, network_spec, text,
)
from hetpipe.cost_models.devices import Cluster, Device, Link
from hetpipe.cost_models.validate import MAX_CLUSTER_FILE_BYTES, MAX_YAML_ALIASES, check_device_count
from hetpipe.cost_models.links import (
    INTRA_KINDS, NETWORK_KIND, PCIE4_X16_BANDWIDTH_BYTES_S, LinkEnds, NetworkSpec, intra_figures, intra_kind, slower,
)
from hetpipe.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_RESERVE_BYTES", "cluster_from_dict", "load_catalog", "load_cluster", "lookup_gpu"]

#: Memory kept back per device when the file gives no ``reserve``: CUDA context, NCCL
#: buffers and allocator fragmentation cost 1-5 GB per GPU; Sailor uses 2-3 GB for
#: Megatron (cost_formulas.md §3.2, "Fixed overhead").  We take 2 GiB, the low end.
DEFAULT_RESERVE_BYTES = 2 * 2**30
#: Intra-node interconnect of a node that names none: the one every pair of cards has.
DEFAULT_INTRA = "pcie-host"
_TOP_KEYS = ("name", "nodes", "links", "notes", "calibration")
_NODE_KEYS = ("name", "intra", "intra_link", "network", "devices", "host_link", "host_memory_bandwidth")
_LINK_KEYS = ("between", "bandwidth", "latency")


class _LineLoader(yaml.SafeLoader):
    """SafeLoader whose mappings remember their 1-based line (for error messages).

    It counts aliases while composing (before anything is expanded) and refuses more than
    `MAX_YAML_ALIASES`: a few hundred bytes of nested aliases expand to gigabytes.
    """

    aliases_seen = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases_seen += 1
            if self.aliases_seen > MAX_YAML_ALIASES:
                mark = self.peek_event().start_mark
                raise ConfigError(f"{self.name}:{mark.line + 1}: more than {MAX_YAML_ALIASES} YAML aliases (*name); "
                                  "write the values out, or share fewer anchors")
        return super().compose_node(parent, index)


class _LineDict(dict):  # type: ignore[type-arg]
    """A mapping with the 1-based line where it starts and the line of each key (`Where.field`)."""

    line: int | None = None
    key_lines: dict[str, int] = {}


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> _LineDict:
    out = _LineDict(loader.construct_mapping(node, deep=True))
    out.line = node.start_mark.line + 1
    # after construct_mapping, whose merge (<<: *anchor) flattening leaves the merged keys in node.value
    out.key_lines = {str(loader.construct_object(k)): k.start_mark.line + 1
                     for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    return out


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_text(raw: str, source: str) -> Any:
    """The document in `raw` (JSON for ``*.json``, YAML otherwise)."""
    if source.endswith(".json"):
        try:
            return json.loads(raw)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{source}:{err.lineno}: malformed JSON: {err.msg} (column {err.colno}); "
                              "fix the syntax, or write the file as YAML") from None
    try:
        loader = _LineLoader(raw)
        loader.name = source
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(err.problem or err.context or "syntax error").split())
        raise ConfigError(f"{source}{line}: malformed YAML: {problem}; fix the indentation, colons and "
                          "brackets there (docs/cluster-file.md has an example)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: malformed YAML: {' '.join(str(err).split())}; fix the file") from None


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file (YAML, or JSON for ``*.json``) into a `Cluster`.

    Example:
        >>> c = load_cluster("examples/clusters/homelab.yaml")
        >>> [d.kind for d in c.devices]
        ['rtx3090', 'rtx4090', 'rtx3060-12gb']
    """
    path = Path(path)
    try:
        if path.is_file() and path.stat().st_size > MAX_CLUSTER_FILE_BYTES:
            raise ConfigError(f"cluster file {str(path)!r} is {path.stat().st_size} bytes, more than the "
                              f"{MAX_CLUSTER_FILE_BYTES} a cluster file may have; pass the cluster file, "
                              "not another file")
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"cluster file {str(path)!r} not found; pass an existing YAML/JSON file "
                          "(see examples/clusters/) or write one with `hetpipe profile -o cluster.yaml`") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read cluster file {str(path)!r}: {err}; check the path and permissions") from None
    doc = _parse_text(raw, str(path))
    if doc is None:
        raise ConfigError(f"{path}: the cluster file is empty; add nodes (see docs/cluster-file.md)")
    return cluster_from_dict(doc, source=str(path), default_name=path.stem)


def _node_links(node: Mapping[str, Any], where: Where, devices: list[Device],
                ends: list[LinkEnds]) -> dict[tuple[str, str], Link]:
    """Links between every ordered pair of `devices` on one node."""
    requested = node.get("intra", DEFAULT_INTRA)
    if requested not in INTRA_KINDS:
        raise where.field("intra").error(f"unknown interconnect {requested!r}; use one of {', '.join(INTRA_KINDS)}")
    override = network_spec(node["intra_link"], where.field("intra_link")) if "intra_link" in node else None
    links: dict[tuple[str, str], Link] = {}
    downgraded: set[str] = set()
    for i, (a, ea) in enumerate(zip(devices, ends)):
        for j, (b, eb) in enumerate(zip(devices, ends)):
            if i == j:
                continue
            kind = intra_kind(requested, a.profile, b.profile)
            if kind != requested:
                downgraded.add(f"{a.kind}/{b.kind} -> {kind}")
            try:
                spec = override or intra_figures(kind, ea, eb)
            except ValueError as err:
                raise where.field("devices").error(f"{err}; add nvlink_bandwidth to the card") from None
            links[(a.id, b.id)] = Link(a.id, b.id, spec.bandwidth_bytes_s, spec.latency_s, kind)
    if downgraded:
        logger.warning("%s: node %r asks for intra: %s, but not every card supports it (gpu_specs.md: RTX 40 "
                       "cards have no P2P); modelling %s", where.source, node["name"], requested,
                       ", ".join(sorted(downgraded)))
    return links


def _overrides(doc: Mapping[str, Any], where: Where, nodes: list[str]) -> dict[frozenset[str], NetworkSpec]:
    """The ``links`` section: explicit figures per unordered node pair."""
    raw = doc.get("links") or []
    if not isinstance(raw, list):
        raise where.field("links").error("must be a list of {between: [a, b], bandwidth, latency}")
    out: dict[frozenset[str], NetworkSpec] = {}
    for k, entry in enumerate(raw):
        at = where.field(f"links[{k}]", entry)
        check_keys(entry, _LINK_KEYS, at)
        pair = entry.get("between")
        if not isinstance(pair, list) or len(pair) != 2 or pair[0] == pair[1]:
            raise at.field("between").error("must name two different nodes, e.g. between: [desk, shelf]")
        for name in pair:
            if name not in nodes:
                raise at.field("between").error(f"no node named {name!r}; nodes are {', '.join(nodes)}")
        key = frozenset(pair)
        if key in out:
            raise at.field("between").error(f"{pair[0]!r}-{pair[1]!r} is given twice; keep one entry")
        out[key] = network_spec(entry, at, allowed=_LINK_KEYS)
    return out


def _network_links(nodes: list[Mapping[str, Any]], where: Where, by_node: dict[str, list[Device]],
                   overrides: dict[frozenset[str], NetworkSpec]) -> dict[tuple[str, str], Link]:
    """Links between every ordered pair of devices on different nodes."""
    specs: dict[str, NetworkSpec | None] = {}
    for i, node in enumerate(nodes):
        net = node.get("network")
        at = where.field(f"nodes[{i}]", node).field("network")
        specs[node["name"]] = None if net is None else network_spec(net, at)
    links: dict[tuple[str, str], Link] = {}
    for i, na in enumerate(nodes):
        for nb in nodes[i + 1:]:
            a, b = na["name"], nb["name"]
            spec = overrides.get(frozenset((a, b)))
            if spec is None:
                missing = [n for n in (na, nb) if specs[n["name"]] is None]
                if missing:
                    node = missing[0]
                    raise where.field(f"nodes[{nodes.index(node)}]", node).field("network").error(
                        f"node {node['name']!r} has no network figures and no links entry joins {a!r} and {b!r}; "
                        "add network: {bandwidth: 1Gbit/s, latency: 0.2ms} to the node")
                spec = slower(specs[a], specs[b])  # type: ignore[arg-type]
            for da in by_node[a]:
                for db in by_node[b]:
                    links[(da.id, db.id)] = Link(da.id, db.id, spec.bandwidth_bytes_s, spec.latency_s, NETWORK_KIND)
                    links[(db.id, da.id)] = Link(db.id, da.id, spec.bandwidth_bytes_s, spec.latency_s, NETWORK_KIND)
    return links


def _node_names(nodes: Any, where: Where) -> list[str]:
    if not isinstance(nodes, list) or not nodes:
        raise where.field("nodes").error("the cluster has no devices (nodes is missing or empty); add "
                                         "nodes: [{name: n0, devices: [{gpu: rtx3090}]}]")
    names: list[str] = []
    for i, node in enumerate(nodes):
        at = where.field(f"nodes[{i}]", node)
        check_keys(node, _NODE_KEYS, at)
        name = text(node.get("name"), at.field("name"))
        if ":" in name:
            raise at.field("name").error(f"{name!r} contains ':', which separates node and index in device ids; "
                                         "rename the node")
        if name in names:
            raise at.field("name").error(f"duplicate node name {name!r}; give every node a distinct name")
        names.append(name)
    return names


def _check_kinds(devices: list[Device], where: Where) -> None:
    """Devices of one kind must share one profile (per-kind unit times are computed once)."""
    first: dict[str, Device] = {}
    for dev in devices:
        other = first.setdefault(dev.kind, dev)
        if other.profile != dev.profile:
            raise where.error(f"devices {other.id} and {dev.id} are both kind {dev.kind!r} with different figures; "
                              "give the modified card its own name: (e.g. name: rtx3090-oc)")


def cluster_from_dict(doc: Any, *, source: str = "<dict>", default_name: str = "cluster") -> Cluster:
    """Build a `Cluster` from a parsed cluster document; `source` names it in errors.

    Example:
        >>> doc = {"nodes": [{"name": "x", "network": {"bandwidth": "1Gbit/s", "latency": "1ms"},
        ...                   "devices": [{"gpu": "rtx3090"}]},
        ...                  {"name": "y", "network": {"bandwidth": "10Gbit/s", "latency": "0.1ms"},
        ...                   "devices": [{"gpu": "rtx3060-12gb"}]}]}
        >>> link = cluster_from_dict(doc).link("y:0", "x:0")
        >>> link.bandwidth_bytes_s, link.latency_s, link.kind
        (125000000.0, 0.001, 'network')
    """
    where = Where(source, getattr(doc, "line", None), "", doc)
    if not isinstance(doc, Mapping):
        raise where.error("the top level must be a mapping with name and nodes; see docs/cluster-file.md")
    check_keys(doc, _TOP_KEYS, where)
    nodes = doc.get("nodes")
    names = _node_names(nodes, where)
    devices: list[Device] = []
    by_node: dict[str, list[Device]] = {}
    links: dict[tuple[str, str], Link] = {}
    for i, (name, node) in enumerate(zip(names, nodes)):
        at = where.field(f"nodes[{i}]", node)
        entries = node.get("devices")
        if not isinstance(entries, list) or not entries:
            raise at.field("devices").error(f"node {name!r} has no devices; add devices: [{{gpu: rtx3090}}] "
                                            "or remove the node")
        built = [device_entry(e, at.field(f"devices[{k}]", e), default_reserve_bytes=DEFAULT_RESERVE_BYTES)
                 for k, e in enumerate(entries)]
        check_device_count(len(devices) + sum(len(g) for g in built), f"{source}: nodes[{i}].devices")
        link, memory = host_figures(node, at)
        cores = [c for k, e in enumerate(entries) for c in entry_cores(e, at.field(f"devices[{k}]", e))]
        node_devices = [Device(f"{name}:{n}", name, profile, reserve,
                               host_link_bytes_s=link or ends.pcie_bandwidth_bytes_s or PCIE4_X16_BANDWIDTH_BYTES_S,
                               host_memory_bytes_s=memory, cores=cores[n])
                        for n, (profile, reserve, ends) in enumerate(x for group in built for x in group)]
        ends = [e for group in built for (_, _, e) in group]
        by_node[name] = node_devices
        devices.extend(node_devices)
        links.update(_node_links(node, at, node_devices, ends))
    _check_kinds(devices, where)
    links.update(_network_links(nodes, where, by_node, _overrides(doc, where, names)))
    name = text(doc.get("name", default_name), where.field("name"))
    return Cluster(name=name, devices=tuple(devices), links=links)
