"""`hetpipe profile`: describe this machine as a cluster file, optionally with measured figures.

NVIDIA GPUs are found with NVML (``pynvml`` from nvidia-ml-py): name, memory, PCI bus
id, active NVLinks and the P2P read status between every pair.  Without a driver
(``nvmlInit`` raises `pynvml.NVMLError`) the machine's CPU is profiled instead, and the
summary says so in one line.  Each card resolves to a catalog row; a card the catalog
lacks is measured.

With ``calibrate=True`` the first device of each kind runs
`hetpipe.cost_models.calibrate.calibrate_device` (matmul FLOP/s and copy bandwidth)
and the written file records the measured peaks/efficiencies (`apply_calibration`);
local point-to-point transfers are measured too: GPU-to-GPU copies when there are two
or more cards; between CPU core groups, framed one-way messages between two processes pinned
on the first two groups, as a run sends them (`link_calibration.measure_message_link`); else
gloo ping-pong between two local processes (`measure_link`).  The
result is a normal cluster file that `load_cluster` reads back.

Example:
    >>> cluster, summary = run_profile(output=None, calibrate=False)  # doctest: +SKIP
    >>> cluster.devices[0].id  # doctest: +SKIP
    'vm:0'
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hetpipe.cost_models.calibrate import (
    CPU_KIND, Calibration, LinkMeasurement, apply_calibration, calibrate_device, fit_alpha_beta, measure_link,
    measure_memory_bandwidth_bytes_s,
)
from hetpipe.cost_models.catalog import load_catalog, normalize_name
from hetpipe.cost_models.cluster import cluster_from_dict, load_cluster
from hetpipe.cost_models.cpu_cores import format_cores, split_cores
from hetpipe.cost_models.group_calibration import group_kind, measure_core_groups
from hetpipe.cost_models.link_calibration import measure_message_link
from hetpipe.cost_models.outputs import atomic_write_text
from hetpipe.cost_models.devices import Cluster, DeviceProfile
from hetpipe.errors import ConfigError

logger = logging.getLogger(__name__)

#: Matmul edge and repeats for ``--calibrate``: 1024^3 (calibrate.DEFAULT_MATMUL_SIZE) with 3
#: repeats keeps one device near a second on the 2-core reference VM.
PROFILE_MATMUL_SIZE = 1024
PROFILE_REPEATS = 3
#: Link sizes for ``--calibrate``: 4 KiB fixes latency, 1-16 MiB the bandwidth (cost_formulas.md
#: §3.4), small enough that the gloo measurement (mostly 6-8 s of process start-up,
#: environment_facts.md) stays well under 20 s.
PROFILE_LINK_SIZES_BYTES = (4 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)
#: NVML's memory figure may differ from the catalog's (a 12GB RTX 3080 reports as "RTX 3080");
#: beyond this relative difference the file records NVML's memory.
MEMORY_MISMATCH_FRACTION = 0.05
#: NVLinks NVML is asked about per card (NVML_NVLINK_MAX_LINKS in nvml.h; 18 on H100).
NVLINK_MAX_LINKS = 18


@dataclass(frozen=True)
class DetectedGpu:
    """One card as NVML reports it."""

    index: int
    name: str
    memory_bytes: int
    pci_bus_id: str
    nvlink_active: bool


@dataclass(frozen=True)
class Detection:
    """What NVML saw: the cards, whether every pair can do P2P, and a one-line note."""

    gpus: tuple[DetectedGpu, ...]
    all_p2p: bool
    note: str


def _nvlink_active(pynvml: Any, handle: Any) -> bool:
    for link in range(NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                return True
        except pynvml.NVMLError:  # NotSupported / InvalidArgument past the last link
            break
    return False


def _p2p_ok(pynvml: Any, handles: list[Any]) -> bool:
    caps = getattr(pynvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    ok = getattr(pynvml, "NVML_P2P_STATUS_OK", 0)
    try:
        return all(pynvml.nvmlDeviceGetP2PStatus(a, b, caps) == ok
                   for i, a in enumerate(handles) for b in handles[i + 1:])
    except pynvml.NVMLError:
        return False


def detect_gpus() -> Detection:
    """Local NVIDIA GPUs via NVML; an empty `Detection` (with the reason) when there is no driver.

    Example:
        >>> isinstance(detect_gpus().note, str)
        True
    """
    try:
        import pynvml
    except ImportError:
        return Detection((), False, "nvidia-ml-py (pynvml) is not installed; profiling the CPU instead")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return Detection((), False, f"no NVIDIA driver found (NVML: {err}); profiling the CPU instead")
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        gpus = []
        for i, h in enumerate(handles):
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            bus = bus.decode() if isinstance(bus, bytes) else str(bus)
            gpus.append(DetectedGpu(i, name, int(pynvml.nvmlDeviceGetMemoryInfo(h).total), bus,
                                    _nvlink_active(pynvml, h)))
        all_p2p = _p2p_ok(pynvml, handles)
    except pynvml.NVMLError as err:
        return Detection((), False, f"NVML failed while listing GPUs ({err}); profiling the CPU instead")
    finally:
        pynvml.nvmlShutdown()
    if not gpus:
        return Detection((), False, "NVIDIA driver found but no GPUs; profiling the CPU instead")
    return Detection(tuple(gpus), all_p2p, f"{len(gpus)} NVIDIA GPU(s) found by NVML")


def _host_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _node_name() -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", socket.gethostname()).strip("-") or "local"
    return name


def _gpu_entry(gpu: DetectedGpu) -> tuple[dict[str, Any], DeviceProfile | None]:
    """Cluster-file entry for one card and its catalog profile (None: not in the catalog)."""
    catalog = load_catalog()
    key = catalog.index.get(normalize_name(gpu.name))
    if key is None:
        return {"name": normalize_name(gpu.name) or f"gpu{gpu.index}", "memory": gpu.memory_bytes}, None
    entry: dict[str, Any] = {"gpu": key}
    profile = catalog.entries[key].profile
    if abs(gpu.memory_bytes - profile.memory_bytes) > MEMORY_MISMATCH_FRACTION * profile.memory_bytes:
        entry["memory"] = gpu.memory_bytes
        entry["source"] = f"{profile.source}; memory as NVML reports it"
    return entry, profile


def _intra(detection: Detection) -> str:
    if len(detection.gpus) < 2 or not detection.all_p2p:
        return "pcie-host"
    return "nvlink" if all(g.nvlink_active for g in detection.gpus) else "pcie-p2p"


def _calibrated_fields(profile: DeviceProfile, cal: Calibration) -> dict[str, Any]:
    """Cluster-file fields that reproduce `apply_calibration(profile, cal)` on load."""
    tuned = apply_calibration(profile, cal)
    tera = 1e12
    return {"tensor_tflops": tuned.tensor_flops_s / tera, "fp32_tflops": tuned.fp32_flops_s / tera,
            "memory_bandwidth": f"{tuned.memory_bandwidth_bytes_s:.6g}B/s",
            "matmul_efficiency": round(min(1.0, tuned.matmul_efficiency or 1.0), 6),
            "bandwidth_efficiency": round(min(1.0, tuned.bandwidth_efficiency or 1.0), 6),
            **({"kernel_overhead": f"{tuned.kernel_overhead_s:.6g}s"} if cal.kernel_overhead_s is not None else {}),
            **({"op_rates": {k: float(f"{v:.6g}") for k, v in tuned.op_rates}} if cal.op_rates else {}),
            **({"optimizer_op": f"{tuned.step_op_s:.6g}s"} if cal.step_op_s is not None else {}),
            **({"optimizer_bandwidth": f"{tuned.step_bytes_s:.6g}B/s"} if cal.step_bytes_s is not None else {}),
            **({"backward_op_overhead": f"{tuned.backward_op_s:.6g}s"} if cal.backward_op_s is not None else {}),
            **({"view_overhead": f"{tuned.view_op_s:.6g}s"} if cal.view_op_s is not None else {}),
            "source": tuned.source}


def _torch_device(gpu: DetectedGpu) -> str:
    """The torch device of an NVML card, matched by PCI address (CUDA's default order may differ)."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"cannot measure {gpu.name}: this torch build has no CUDA; install a CUDA build of torch "
                          "(a card not in the catalog must be measured; a catalog card can be profiled without "
                          "--calibrate)")
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            address = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"
            if gpu.pci_bus_id.lower().startswith(address):
                return f"cuda:{i}"
    return f"cuda:{gpu.index}"


def _sync_both(src: str, dst: str) -> None:
    import torch

    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)


def measure_gpu_copy(src: str, dst: str, *, sizes_bytes: tuple[int, ...] = PROFILE_LINK_SIZES_BYTES,
                     repeats: int = PROFILE_REPEATS) -> tuple[float, float]:
    """Alpha-beta fit ``(latency_s, bandwidth_bytes_s)`` of copies from torch device `src` to `dst`.

    Example:
        >>> latency_s, bandwidth_bytes_s = measure_gpu_copy("cuda:0", "cuda:1")  # doctest: +SKIP
    """
    import statistics
    import time

    import torch

    medians = []
    for size in sizes_bytes:
        a = torch.empty(size, dtype=torch.uint8, device=src)
        b = torch.empty(size, dtype=torch.uint8, device=dst)
        b.copy_(a)  # warm-up: peer mapping, allocator
        times = []
        for _ in range(repeats):
            _sync_both(src, dst)
            start = time.perf_counter()
            b.copy_(a)
            _sync_both(src, dst)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return fit_alpha_beta(sizes_bytes, medians)


def _measure_intra(detection: Detection, groups: tuple[tuple[int, ...], ...] = (),
                   message_path: Any = None) -> tuple[dict[str, str], dict[str, Any]]:
    """Measured ``intra_link`` and its record: GPU copies with 2+ cards, else gloo loopback (between
    the first two core groups, each end pinned to its group, when the devices are core groups)."""
    if len(detection.gpus) < 2 and len(groups) >= 2:
        # measured as a run uses it: framed one-way messages, sender busy, receiver waiting (link_calibration)
        m = measure_message_link(core_groups=groups[:2], path=message_path)
        latency, bandwidth = m.latency_s, m.bandwidth_bytes_s
        how = (f"gloo {m.method} on 127.0.0.1 between processes pinned to cores {format_cores(groups[0])} "
               f"and {format_cores(groups[1])}")
        return _link_fields(latency, bandwidth), {
            "method": how, "latency_s": latency, "bandwidth_bytes_s": bandwidth,
            "sizes_bytes": list(m.sizes_bytes), "median_times_s": list(m.median_times_s)}
    elif len(detection.gpus) >= 2:
        src, dst = _torch_device(detection.gpus[0]), _torch_device(detection.gpus[1])
        latency, bandwidth = measure_gpu_copy(src, dst)
        how = f"torch copy {src} -> {dst}"
    else:
        m: LinkMeasurement = measure_link(2, sizes_bytes=PROFILE_LINK_SIZES_BYTES, repeats=PROFILE_REPEATS)
        latency, bandwidth = m.latency_s, m.bandwidth_bytes_s
        how = "gloo ping-pong between 2 local processes on 127.0.0.1"
    return _link_fields(latency, bandwidth), {"method": how, "latency_s": latency, "bandwidth_bytes_s": bandwidth}


def _link_fields(latency_s: float, bandwidth_bytes_s: float) -> dict[str, str]:
    """A cluster file's ``intra_link`` entry."""
    return {"bandwidth": f"{bandwidth_bytes_s:.6g}B/s", "latency": f"{max(latency_s, 0.0):.6g}s"}


def _device_entries(detection: Detection, *, calibrate: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One cluster-file entry per device (calibrated per kind when asked) and the calibration record."""
    targets: list[tuple[dict[str, Any], DeviceProfile | None, DetectedGpu | None]] = []
    if not detection.gpus:
        cpu = load_catalog().entries[CPU_KIND].profile
        targets.append(({"gpu": CPU_KIND, "memory": _host_memory_bytes(),
                         "source": f"{cpu.source}; memory: this host's RAM (sysconf)"}, cpu, None))
    for gpu in detection.gpus:
        entry, profile = _gpu_entry(gpu)
        targets.append((entry, profile, gpu))
    measured: dict[str, dict[str, Any]] = {}
    record: dict[str, Any] = {}
    for entry, profile, gpu in targets:
        kind = str(entry.get("gpu") or entry["name"])
        if not calibrate and profile is not None:
            continue
        if profile is None:
            logger.warning("%s is not in the catalog; measuring it", gpu.name if gpu else kind)
        if kind not in measured:
            device = "cpu" if gpu is None else _torch_device(gpu)
            cal = calibrate_device(device, size=PROFILE_MATMUL_SIZE, repeats=PROFILE_REPEATS)
            base = profile or DeviceProfile(kind, int(entry["memory"]), cal.tensor_matmul_flops_s,
                                            cal.fp32_matmul_flops_s, cal.memory_bandwidth_bytes_s,
                                            source="measured (not in the catalog)")
            measured[kind] = _calibrated_fields(base, cal)
            record[kind] = {"device": device, "tensor_matmul_flops_s": cal.tensor_matmul_flops_s,
                            "fp32_matmul_flops_s": cal.fp32_matmul_flops_s,
                            "memory_bandwidth_bytes_s": cal.memory_bandwidth_bytes_s, "matmul_size": cal.matmul_size}
        entry.update(measured[kind])
    return [e for e, _, _ in targets], record


def _group_entries(groups: tuple[tuple[int, ...], ...],
                   cpu_clock: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One calibrated device per CPU core group, measured at once (`measure_core_groups`, on the threads' CPU
    clock with `cpu_clock`); each gets an equal share of the host's RAM (the groups share it)."""
    cpu = load_catalog().entries[CPU_KIND].profile
    cals = measure_core_groups(groups, size=PROFILE_MATMUL_SIZE, repeats=PROFILE_REPEATS, cpu_clock=cpu_clock)
    share = _host_memory_bytes() // len(groups)
    entries, record = [], {}
    for cores, cal in zip(groups, cals):
        kind = group_kind(cores)
        fields = _calibrated_fields(cpu, cal)
        fields["source"] += f"; memory: 1/{len(groups)} of this host's RAM (sysconf)" + (
            "; timed in thread CPU time (--clock cpu)" if cpu_clock else "")
        entries.append({"gpu": CPU_KIND, "name": kind, "cores": format_cores(cores), "memory": share, **fields})
        record[kind] = {"device": f"cpu, cores {format_cores(cores)}", "tensor_matmul_flops_s": cal.tensor_matmul_flops_s,
                        "fp32_matmul_flops_s": cal.fp32_matmul_flops_s, "kernel_overhead_s": cal.kernel_overhead_s,
                        "memory_bandwidth_bytes_s": cal.memory_bandwidth_bytes_s, "matmul_size": cal.matmul_size}
    return entries, record


def profile_document(detection: Detection, *, calibrate: bool, cpu_devices: int | None = None,
                     message_path: Any = None, cpu_clock: bool = False) -> dict[str, Any]:
    """The cluster document describing this machine (one node); `message_path`: the runtime's own
    send and receive for the core groups' link (`link_calibration.MessagePath`; None: its imitation);
    `cpu_clock`: the core groups timed in thread CPU time (`group_calibration`; the link stays wall time).

    Example:
        >>> doc = profile_document(Detection((), False, "no GPUs"), calibrate=False)
        >>> doc["nodes"][0]["devices"][0]["gpu"]
        'cpu'
    """
    import torch

    groups: tuple[tuple[int, ...], ...] = ()
    if cpu_clock and cpu_devices is None:
        raise ConfigError("--clock cpu times CPU core groups' calibration in CPU time: it needs --cpu-devices N "
                          "and --calibrate; drop --clock cpu or add --cpu-devices")
    if cpu_devices is not None:
        if detection.gpus or not calibrate:
            raise ConfigError(f"--cpu-devices {cpu_devices} measures CPU core groups as devices: it needs --calibrate "
                              "and a machine profiled without GPUs; drop --cpu-devices or add --calibrate")
        groups = split_cores(cpu_devices)
        entries, record = _group_entries(groups, cpu_clock)
    else:
        entries, record = _device_entries(detection, calibrate=calibrate)
    node: dict[str, Any] = {"name": _node_name(), "intra": _intra(detection), "devices": entries}
    doc: dict[str, Any] = {"name": f"{_node_name()}-profile", "nodes": [node]}
    if calibrate:
        link, link_record = _measure_intra(detection, groups, message_path)
        node["intra_link"] = link
        # the host step of optimizer-state offload runs at the host's copy bandwidth (`cost_models.offload`)
        host = measure_memory_bandwidth_bytes_s("cpu", repeats=PROFILE_REPEATS)
        node["host_memory_bandwidth"] = f"{host / 1e9:.4g}GB/s"
        doc["calibration"] = {"host": socket.gethostname(), "torch": str(torch.__version__),
                              "date": datetime.date.today().isoformat(), "devices": record, "link": link_record}
    return doc


def _summary(cluster: Cluster, detection: Detection, doc: dict[str, Any], output: Path | None) -> str:
    lines = [detection.note]
    for dev in cluster.devices:
        p = dev.profile
        eff = f", measured matmul efficiency {p.matmul_efficiency:.2f}" if p.matmul_efficiency is not None else ""
        lines.append(f"{dev.id}: {dev.kind}, {dev.memory_bytes / 2**30:.1f} GiB "
                     f"({dev.usable_bytes / 2**30:.1f} usable), "
                     f"{p.tensor_flops_s / 1e12:.4g} TFLOP/s tensor, {p.fp32_flops_s / 1e12:.4g} TFLOP/s fp32, "
                     f"{p.memory_bandwidth_bytes_s / 1e9:.4g} GB/s{eff}")
    link = doc.get("calibration", {}).get("link")
    if link:
        lines.append(f"local link ({link['method']}): {link['bandwidth_bytes_s'] / 1e9:.3g} GB/s, "
                     f"{link['latency_s'] * 1e6:.3g} us latency")
    lines.append(f"wrote {output}" if output else "not written (pass -o cluster.yaml to save it)")
    return "\n".join(lines)


def run_profile(*, output: Path | None, calibrate: bool, cpu_devices: int | None = None,
                message_path: Any = None, cpu_clock: bool = False) -> tuple[Cluster, str]:
    """Profile this machine; write the cluster file to `output` when given; return it and a summary.

    Example:
        >>> cluster, summary = run_profile(output=None, calibrate=False)
        >>> len(cluster.devices) >= 1 and "not written" in summary
        True
    """
    detection = detect_gpus()
    logger.info("%s", detection.note)
    doc = profile_document(detection, calibrate=calibrate, cpu_devices=cpu_devices, message_path=message_path,
                           cpu_clock=cpu_clock)
    if output is None:
        cluster = cluster_from_dict(doc, source="<hetpipe profile>")
    else:
        output = Path(output)
        flags = (" --calibrate" if calibrate else "") + (f" --cpu-devices {cpu_devices}" if cpu_devices else "") + (
            " --clock cpu" if cpu_clock else "")
        header = (f"# written by `hetpipe profile{flags}` "
                  f"on {socket.gethostname()}; {detection.note}\n# see docs/cluster-file.md\n")
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(output, header + yaml.safe_dump(doc, sort_keys=False), option="-o")
        except OSError as err:
            raise ConfigError(f"cannot write {output}: {err.strerror}; choose a writable path with -o") from None
        cluster = load_cluster(output)
    return cluster, _summary(cluster, detection, doc, output)
