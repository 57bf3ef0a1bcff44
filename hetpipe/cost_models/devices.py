"""Device profiles, links and clusters: the hardware half of every cost.

`DeviceProfile` is what one *kind* of device can do (a catalog row, possibly
overridden by calibration).  `Device` is one card in a cluster.  `Link` is a
directed connection between two devices.  `Cluster` bundles them and answers
``cluster.link(src_id, dst_id)``.

Example:
    >>> p = DeviceProfile(kind="rtx3090", memory_bytes=24 * 10**9,
    ...                   tensor_flops_s=71e12, fp32_flops_s=35.6e12,
    ...                   memory_bandwidth_bytes_s=936e9, source="gpu_specs.md")
    >>> d = Device(id="n0:0", node="n0", profile=p, reserve_bytes=2 * 10**9)
    >>> d.usable_bytes
    22000000000
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class DeviceProfile:
    """Capabilities of one kind of device.

    Attributes:
        kind: catalog key, lowercase (``rtx3090``, ``a100-80gb``, ``cpu``).
        memory_bytes: physical memory.
        tensor_flops_s: dense bf16/fp16 tensor-core FLOP/s with FP32 accumulate
            (the rate autocast training gets; GeForce cards run it at half their
            FP16-accumulate rate).  Peak, from the catalog.
        fp32_flops_s: dense fp32 (non-tensor-core) FLOP/s, peak.
        memory_bandwidth_bytes_s: DRAM bandwidth, peak.
        matmul_efficiency: achieved / peak matmul FLOP/s (calibrated, or the
            catalog default `cost_models.timing.DEFAULT_MATMUL_EFFICIENCY`).
        bandwidth_efficiency: achieved / peak memory bandwidth.
        kernel_overhead_s: fixed time per launched op.
        nvlink: whether the card has NVLink.
        p2p: whether PCIe peer-to-peer works between two such cards.
        source: where the figures come from (catalog citation, ``calibrated``...).
        op_rates: measured rate per op kind, ``(kind, work per second)`` sorted by kind: FLOP/s of
            fused attention (``attention``, ``attention_backward``), bytes/s of a memory-bound aten op
            (``gelu``, ...), `hetpipe.cost_models.work`; () = not measured (catalog cards): the
            roofline prices every op at the matmul rate and copy bandwidth (`cost_models.timing`).
        step_op_s: seconds per op of the optimizer's per-tensor loop, measured (a CPU); None = the
            multi-tensor ``foreach`` path (CUDA's default), `hetpipe.cost_models.optimizer_step`.  Which
            path the step takes is `steps_foreach` (its time and its transient, memory model 5).
        step_bytes_s: bytes per second that per-tensor loop streams, measured; None = its bytes are
            priced as one fused pass at the copy bandwidth (profiles calibrated before it was measured).
        backward_op_s: fixed seconds per backward kernel (autograd node and kernel), measured (a CPU);
            None = ``kernel_overhead_s``.
        view_op_s: fixed seconds per op without a kernel (view, detach, allocation), measured (a CPU);
            None = free (`hetpipe.cost_models.timing.pass_time_s`).
    """

    kind: str
    memory_bytes: int
    tensor_flops_s: float
    fp32_flops_s: float
    memory_bandwidth_bytes_s: float
    matmul_efficiency: float | None = None
    bandwidth_efficiency: float | None = None
    kernel_overhead_s: float | None = None
    nvlink: bool = False
    p2p: bool = False
    source: str = ""
    op_rates: tuple[tuple[str, float], ...] = ()
    step_op_s: float | None = None
    step_bytes_s: float | None = None
    backward_op_s: float | None = None
    view_op_s: float | None = None


#: The catalog's CPU row and the prefix of a CPU core group's kind (`group_calibration.group_kind`: ``cpu-c0``).
CPU_KIND, CPU_GROUP_PREFIX = "cpu", "cpu-"


def steps_foreach(profile: DeviceProfile) -> bool:
    """Does a device of `profile` run the optimizer's multi-tensor (``foreach``) step?

    PyTorch picks it only where every parameter is on a CUDA-like device
    (``torch.optim.optimizer._default_to_fused_or_foreach``); CPU tensors run the per-tensor loop.
    So: CUDA cards yes; the CPU (its catalog row, a core group, or any profile with a measured
    per-tensor loop ``step_op_s``, which only a CPU calibration records) no.

    Example:
        >>> gpu = DeviceProfile("rtx3090", 24 * 10**9, 71e12, 35.6e12, 936e9)
        >>> steps_foreach(gpu), steps_foreach(DeviceProfile("cpu-c0-1", 8 * 10**9, 5e10, 5e10, 1e10))
        (True, False)
    """
    kind = profile.kind
    return profile.step_op_s is None and kind != CPU_KIND and not kind.startswith(CPU_GROUP_PREFIX)


@dataclass(frozen=True)
class Device:
    """One device of a cluster.

    Attributes:
        id: unique id, ``"<node>:<index>"`` by convention.
        node: the host it sits in; devices on one node share intra-node links.
        profile: what it can do.
        reserve_bytes: memory kept back (CUDA context, NCCL, allocator
            fragmentation); see `cost_models.cluster.DEFAULT_RESERVE_BYTES`.
        host_link_bytes_s: the card's link to its host's memory, per direction (its PCIe
            figure, or the node's ``host_link``); 0 = unknown.
        host_memory_bytes_s: its host's memory bandwidth (`cost_models.offload`); 0 = unknown.
        cores: a CPU core group this device is (`cost_models.cpu_cores`): the rank that runs it
            pins itself there in a non-emulated run; () = not pinned.
    """

    id: str
    node: str
    profile: DeviceProfile
    reserve_bytes: int = 0
    host_link_bytes_s: float = 0.0
    host_memory_bytes_s: float = 0.0
    cores: tuple[int, ...] = ()

    @property
    def kind(self) -> str:
        return self.profile.kind

    @property
    def memory_bytes(self) -> int:
        return self.profile.memory_bytes

    @property
    def usable_bytes(self) -> int:
        """Memory a plan may fill: physical memory minus the reserve."""
        return self.profile.memory_bytes - self.reserve_bytes


@dataclass(frozen=True)
class Link:
    """A directed link; transfer time of n bytes is ``latency_s + n / bandwidth_bytes_s``."""

    src: str
    dst: str
    bandwidth_bytes_s: float
    latency_s: float
    kind: str = ""  # nvlink | pcie-p2p | pcie-host | network | loopback

    def transfer_s(self, num_bytes: int) -> float:
        """Alpha-beta model of one message (cost_formulas.md §3.4); an empty message still pays the latency."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_s


@dataclass(frozen=True)
class Cluster:
    """Devices plus the links between every ordered pair of them."""

    name: str
    devices: tuple[Device, ...]
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)

    def device(self, device_id: str) -> Device:
        for dev in self.devices:
            if dev.id == device_id:
                return dev
        raise KeyError(device_id)

    def link(self, src: str, dst: str) -> Link:
        """The link from `src` to `dst` (both device ids)."""
        return self.links[(src, dst)]

    @property
    def kinds(self) -> tuple[str, ...]:
        """Distinct device kinds, in first-appearance order."""
        seen: dict[str, None] = {}
        for dev in self.devices:
            seen.setdefault(dev.kind, None)
        return tuple(seen)

    def profile(self, kind: str) -> DeviceProfile:
        for dev in self.devices:
            if dev.kind == kind:
                return dev.profile
        raise KeyError(kind)
