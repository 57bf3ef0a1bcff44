"""Measured feedback: a run report's measured stage and link times -> a calibrated cluster file (issue 16, item 2).

`calibrate_from_report` reads the per-step measured / predicted ratios a run report holds
for every stage (forward, backward and, under ``--emulate``, every send; see
`hetpipe.runtime.faults.straggler`), takes their medians over the last ``window_steps``
steps (the cluster as it is now, after any slowdown began) and rewrites the cluster file
the plan was made from:

* **devices**: a card whose stage ran ``f`` times its predicted time (``f`` = the
  time-weighted ratio ``(r_F F + r_B B) / (F + B)`` over the plan's forward and backward
  times ``F``, ``B``; the cluster format has one speed per card, not one per direction)
  gets every term of the time model scaled by ``f``: peak tensor and fp32 FLOP/s and memory
  bandwidth divided by ``f``, the per-kernel overhead multiplied by it
  (`hetpipe.cost_models.timing`), so each unit's predicted time on it is ``f`` times the
  catalog's.  A card that shares its kind with other cards and is calibrated to other
  figures gets its own ``name:`` (``<kind>-calibrated-<node>-<n>``): cards of one kind share one profile.
* **links**: a link whose sends took ``r`` times the alpha-beta prediction for their bytes
  gets bandwidth / ``r`` and latency x ``r``: every message of the sizes the run sent then
  takes ``r`` times as long (one message size per link in a pipeline, so bandwidth and latency
  cannot be told apart).  The format has one figure per node (``intra_link``) and per node
  pair (``links``), both directions: the slowest measured direction is written.

Ratios within `CALIBRATION_TOLERANCE` of 1 leave the entry as it was.  Only cards and links
the run used are measured; the rest are copied unchanged.  Runs without per-step ratios (a
CPU run without ``--emulate``) are refused: their times are this machine's, not the plan's cards'.

Example:
    >>> device_factor(ratios={"fwd": 3.0, "bwd": 3.0}, fwd_s=1.0, bwd_s=2.0)
    3.0
    >>> scaled_link(bandwidth_bytes_s=1e9, latency_s=1e-4, factor=4.0)
    (250000000.0, 0.0004)
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Mapping

import yaml

from hetpipe.cost_models.cluster import cluster_from_dict, load_cluster
from hetpipe.cost_models.outputs import atomic_write_text, check_writable
from hetpipe.cost_models.timing import efficiencies
from hetpipe.errors import ConfigError
from hetpipe.runtime.faults.straggler import DEFAULT_STEPS
from hetpipe.runtime.report import RunReport

log = logging.getLogger(__name__)

#: Ratios within this of 1 are "as planned": the emulation stretches every action to its target
#: within 2% (`hetpipe.runtime.emulate.pipeline.OVERRUN_TOLERANCE`), so smaller deviations are its own precision.
CALIBRATION_TOLERANCE = 0.02
FLOPS_PER_TFLOP = 1e12


@dataclass(frozen=True)
class DeviceCalibration:
    """One card: measured / predicted (``factor``; forward and backward apart) and the kind it is written as."""

    device: str
    kind: str
    factor: float
    fwd_factor: float
    bwd_factor: float
    written_kind: str


@dataclass(frozen=True)
class LinkCalibration:
    """One measured link direction: measured / predicted and the figures written for it."""

    src: str
    dst: str
    factor: float
    bandwidth_bytes_s: float
    latency_s: float


@dataclass(frozen=True)
class ClusterCalibration:
    """What `calibrate_from_report` found and the cluster document it made (``document``, YAML-ready)."""

    devices: tuple[DeviceCalibration, ...]
    links: tuple[LinkCalibration, ...]
    steps: tuple[int, ...]  # the run's steps the medians are over
    document: Mapping[str, Any]

    def lines(self) -> list[str]:
        """One line per card and link, for the CLI."""
        out = [f"{d.device} ({d.kind}): measured/predicted {d.factor:.3f} (F {d.fwd_factor:.3f}, B "
               f"{d.bwd_factor:.3f}) -> " + ("unchanged" if d.factor == 1.0 else
                                             f"{1 / d.factor:.3f}x speed as {d.written_kind}")
               for d in self.devices]
        out += [f"link {l.src} -> {l.dst}: measured/predicted {l.factor:.3f} -> {l.bandwidth_bytes_s:.4g} B/s, "
                f"{l.latency_s:.3g} s" for l in self.links]
        return out


def device_factor(*, ratios: Mapping[str, float], fwd_s: float, bwd_s: float) -> float:
    """Time-weighted measured / predicted of a stage: ``(r_F F + r_B B) / (F + B)``."""
    return (ratios["fwd"] * fwd_s + ratios["bwd"] * bwd_s) / (fwd_s + bwd_s)


def scaled_link(*, bandwidth_bytes_s: float, latency_s: float, factor: float) -> tuple[float, float]:
    """(bandwidth, latency) under which every message takes ``factor`` times as long."""
    return bandwidth_bytes_s / factor, latency_s * factor


def _window(report: RunReport, window_steps: int, source: str) -> tuple[dict[int, dict[str, float]], tuple[int, ...]]:
    """Stage -> median ratio per measure over the last ``window_steps`` steps measured."""
    out, steps = {}, set()
    for st in report.stages:
        recent = st.step_ratios[-window_steps:]
        if not recent:
            raise ConfigError(f"{source}: stage {st.stage} has no per-step measured/predicted times (a run without "
                              "--emulate on CPUs, or a report from an older hetpipe); calibrate from a report of "
                              "`hetpipe run --emulate --report run.json` or of a run on the plan's GPUs")
        steps.update(r.step for r in recent)
        measures = sorted({m for r in recent for m in r.ratios})
        out[st.stage] = {m: median([r.ratios[m] for r in recent if m in r.ratios]) for m in measures}
    return out, tuple(sorted(steps))


def _expanded(doc: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Expand ``count:`` entries in place (ids stay ``node:n``); device id -> (node index, entry index)."""
    where = {}
    for i, node in enumerate(doc["nodes"]):
        entries = []
        for entry in node["devices"]:
            entries += [{k: v for k, v in entry.items() if k != "count"} for _ in range(int(entry.get("count", 1)))]
        node["devices"] = entries
        where.update({f"{node['name']}:{n}": (i, n) for n in range(len(entries))})
    return where


def _read_doc(path: Path) -> dict[str, Any]:
    """The cluster file's document (already validated by `load_cluster`), as plain data."""
    raw = path.read_text(encoding="utf-8")
    doc = json.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)
    return copy.deepcopy(dict(doc))


def _check_devices(report: RunReport, cluster: Any, *, report_src: str, cluster_src: str) -> None:
    kinds = {d.id: d.kind for d in cluster.devices}
    for st in report.stages:
        if kinds.get(st.device) != st.kind:
            has = f"has it as kind {kinds[st.device]!r}" if st.device in kinds else "has no such device"
            raise ConfigError(f"{report_src}: stage {st.stage} ran on {st.device} ({st.kind}), but {cluster_src} "
                              f"{has}; "
                              "pass the cluster file the run's plan was made from (--cluster)")


def _entry(entry: dict[str, Any], profile: Any, factor: float, *, name: str | None, note: str) -> dict[str, Any]:
    """A device entry whose every time-model term is ``factor`` times slower (see the module docstring)."""
    out = dict(entry)
    out["tensor_tflops"] = profile.tensor_flops_s / factor / FLOPS_PER_TFLOP
    out["fp32_tflops"] = profile.fp32_flops_s / factor / FLOPS_PER_TFLOP
    out["memory_bandwidth"] = profile.memory_bandwidth_bytes_s / factor  # bytes/s (a bare number)
    out["kernel_overhead"] = efficiencies(profile).kernel_overhead_s * factor  # seconds
    if profile.op_rates:  # a calibrated CPU's per-op rates are time-model terms too (`cost_models.timing`)
        out["op_rates"] = {kind: rate / factor for kind, rate in profile.op_rates}
    if profile.backward_op_s is not None:  # and so are its fixed costs per backward op and per view
        out["backward_op_overhead"] = profile.backward_op_s * factor
    if profile.view_op_s is not None:
        out["view_overhead"] = profile.view_op_s * factor
    if name is not None:
        out["name"] = name
    out["source"] = note
    return out


def _devices(report: RunReport, cluster: Any, doc: dict[str, Any], ratios: Mapping[int, Mapping[str, float]],
             source: str) -> tuple[DeviceCalibration, ...]:
    where = _expanded(doc)
    per_kind: dict[str, int] = {}
    for d in cluster.devices:
        per_kind[d.kind] = per_kind.get(d.kind, 0) + 1
    out = []
    for st in report.stages:
        r = ratios[st.stage]
        f = device_factor(ratios=r, fwd_s=st.predicted_fwd_s, bwd_s=st.predicted_bwd_s)
        written = st.kind
        if abs(f - 1.0) > CALIBRATION_TOLERANCE:
            node, n = where[st.device]
            name = f"{st.kind}-calibrated-{doc['nodes'][node]['name']}-{n}" if per_kind[st.kind] > 1 else None
            dev = cluster.device(st.device)
            note = (f"calibrated by `hetpipe calibrate` from {source}: measured/predicted {f:.4g} (F {r['fwd']:.4g}, "
                    f"B {r['bwd']:.4g}); was: {dev.profile.source}")
            doc["nodes"][node]["devices"][n] = _entry(doc["nodes"][node]["devices"][n], dev.profile, f, name=name,
                                                      note=note)
            written = name or st.kind
        else:
            f = 1.0
        out.append(DeviceCalibration(st.device, st.kind, f, r["fwd"], r["bwd"], written))
    return tuple(out)


def _links(report: RunReport, cluster: Any, doc: dict[str, Any],
           ratios: Mapping[int, Mapping[str, float]]) -> tuple[LinkCalibration, ...]:
    device_of = {st.stage: st.device for st in report.stages}
    node_of = {d.id: d.node for d in cluster.devices}
    out: list[LinkCalibration] = []
    for st in report.stages:
        for measure, r in ratios[st.stage].items():
            if not measure.startswith("send->") or abs(r - 1.0) <= CALIBRATION_TOLERANCE:
                continue
            src, dst = st.device, device_of[int(measure.removeprefix("send->"))]
            link = cluster.link(src, dst)
            bw, lat = scaled_link(bandwidth_bytes_s=link.bandwidth_bytes_s, latency_s=link.latency_s, factor=r)
            out.append(LinkCalibration(src, dst, r, bw, lat))
    slowest: dict[frozenset[str], LinkCalibration] = {}
    for cal in out:  # one figure per node / node pair: the slowest measured direction
        key = frozenset((node_of[cal.src], node_of[cal.dst]))
        if key not in slowest or cal.factor > slowest[key].factor:
            slowest[key] = cal
    for key, cal in slowest.items():
        figures = {"bandwidth": cal.bandwidth_bytes_s, "latency": cal.latency_s}
        if len(key) == 1:
            node = next(n for n in doc["nodes"] if n["name"] == node_of[cal.src])
            node["intra_link"] = figures
        else:
            entries = [e for e in doc.get("links") or [] if frozenset(e.get("between", ())) != key]
            doc["links"] = [*entries, {"between": [node_of[cal.src], node_of[cal.dst]], **figures}]
    return tuple(out)


def calibrate_from_report(report: RunReport | str | Path, cluster: str | Path, *, output: str | Path | None = None,
                          window_steps: int = DEFAULT_STEPS) -> ClusterCalibration:
    """A calibrated copy of the cluster file ``cluster`` from the run report ``report`` (module docstring).

    ``output`` (checked writable first) receives the YAML; ``window_steps``: the last steps the medians use.

    Example:
        >>> cal = calibrate_from_report("run.json", "lab.yaml", output="lab-calibrated.yaml")  # doctest: +SKIP
        >>> [(d.device, round(d.factor, 2)) for d in cal.devices]                              # doctest: +SKIP
        [('n0:0', 1.0), ('n0:1', 3.01), ('n1:0', 1.0)]
    """
    if output is not None:
        check_writable(output, "-o/--output")
    if isinstance(window_steps, bool) or not isinstance(window_steps, int) or window_steps < 1:
        raise ConfigError(f"--window must be a whole number of steps >= 1, got {window_steps!r}; write e.g. --window 3")
    source = str(report) if not isinstance(report, RunReport) else "the run report"
    run = report if isinstance(report, RunReport) else RunReport.load(report)
    cluster_path = Path(cluster)
    parsed = load_cluster(cluster_path)
    _check_devices(run, parsed, report_src=source, cluster_src=str(cluster_path))
    ratios, steps = _window(run, window_steps, source)
    doc = _read_doc(cluster_path)
    devices = _devices(run, parsed, doc, ratios, source)
    links = _links(run, parsed, doc, ratios)
    doc["name"] = f"{doc.get('name', cluster_path.stem)}-calibrated"
    doc.pop("calibration", None)
    cluster_from_dict(doc, source=f"calibrated {cluster_path}")  # what is written loads back
    if output is not None:
        atomic_write_text(output, f"# written by `hetpipe calibrate` from {source} and {cluster_path} (steps "
                                  f"{steps[0]}-{steps[-1]})\n" + yaml.safe_dump(doc, sort_keys=False),
                          option="-o/--output")
    return ClusterCalibration(devices, links, steps, doc)
