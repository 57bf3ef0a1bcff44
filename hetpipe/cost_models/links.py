"""The link model: bandwidth and latency between two devices of a cluster.

Every transfer follows the alpha-beta model ``t = latency_s + bytes / bandwidth_bytes_s``
(cost_formulas.md §3.4).  Inside a node the figures depend on the interconnect:

* ``nvlink``: half of the smaller NVIDIA NVLink figure of the two cards (NVIDIA quotes
  NVLink as the total over all links in *both* directions: A100 600 GB/s = 12 links x
  25 GB/s x 2; one direction carries half).  Assumes the pair is fully connected (an
  NVSwitch or a 2-way bridge); a partial mesh such as DGX-1 V100 is slower [measure].
* ``pcie-p2p``: the smaller PCIe x16 rate per direction of the two cards (gen4
  32 GB/s, gpu_specs.md A100 row "PCIe 4.0 32+32 GB/s").
* ``pcie-host``: GPU -> host memory -> GPU, `PCIE_HOST_BANDWIDTH_BYTES_S` or the
  cards' PCIe rate if lower.

A kind the cards cannot do falls back (nvlink -> pcie-p2p -> pcie-host) with a
warning: gpu_specs.md, "the RTX 40 series has no P2P/IB path ... intra-node 4090
traffic goes GPU -> host -> GPU".  Between nodes the link is the slower of the two
nodes' network figures (lower bandwidth, higher latency) unless the cluster file
gives the pair explicitly.  Measured figures (``hetpipe profile --calibrate``)
replace these defaults through a node's ``intra_link``.

Example:
    >>> from hetpipe.cost_models.catalog import load_catalog
    >>> a, b = load_catalog().entry("rtx3090"), load_catalog().entry("rtx4090")
    >>> intra_kind("pcie-p2p", a.profile, b.profile)
    'pcie-host'
    >>> intra_figures("pcie-host", LinkEnds(a.pcie_bandwidth_bytes_s, a.nvlink_bandwidth_bytes_s),
    ...               LinkEnds(b.pcie_bandwidth_bytes_s, b.nvlink_bandwidth_bytes_s))
    NetworkSpec(bandwidth_bytes_s=10000000000.0, latency_s=2e-05)
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpipe.cost_models.devices import DeviceProfile

#: Intra-node interconnects a cluster file may name, fastest first.
INTRA_KINDS = ("nvlink", "pcie-p2p", "pcie-host")
#: Kind of every link between two nodes.
NETWORK_KIND = "network"

#: NVIDIA's NVLink bandwidth counts both directions (A100: 12 links x 25 GB/s x 2 = 600 GB/s,
#: NVIDIA A100 datasheet; RTX 3090 bridge: 4 x 14.0625 x 2 = 112.5 GB/s, gpu_specs.md).
NVLINK_DIRECTIONS = 2
#: PCIe 4.0 x16 per direction (gpu_specs.md, A100 row: "PCIe 4.0 32+32 GB/s"); used for a
#: card described by its figures when it gives no ``pcie_bandwidth``.
PCIE4_X16_BANDWIDTH_BYTES_S = 32e9
#: GPU -> host -> GPU copies: gpu_specs.md, "roughly 10-25 GB/s effective [typical; measure]";
#: we take the low end (two PCIe hops through a pinned bounce buffer).
PCIE_HOST_BANDWIDTH_BYTES_S = 10e9
#: Small-message latency of one GPU-to-GPU copy over NVLink.  Typical CUDA peer-copy /
#: NCCL point-to-point latency on one node is a few microseconds [typical; calibrate].
NVLINK_LATENCY_S = 5e-6
#: The same over PCIe peer-to-peer: about twice NVLink's (PCIe round trips through the
#: root complex or a switch) [typical; calibrate].
PCIE_P2P_LATENCY_S = 10e-6
#: Via host memory: two copies (device -> host, host -> device) plus a synchronisation,
#: so twice the PCIe P2P latency [typical; calibrate].
PCIE_HOST_LATENCY_S = 20e-6


@dataclass(frozen=True)
class NetworkSpec:
    """Bandwidth and latency of one direction of a link (a node's network, an override)."""

    bandwidth_bytes_s: float
    latency_s: float


@dataclass(frozen=True)
class LinkEnds:
    """What one card brings to an intra-node link (catalog figures or the cluster file's)."""

    pcie_bandwidth_bytes_s: float | None
    nvlink_bandwidth_bytes_s: float | None


def intra_kind(requested: str, a: DeviceProfile, b: DeviceProfile) -> str:
    """The interconnect two cards on one node really use when the node asks for `requested`.

    Example:
        >>> p = DeviceProfile("x", 1, 1.0, 1.0, 1.0, nvlink=True, p2p=True)
        >>> q = DeviceProfile("y", 1, 1.0, 1.0, 1.0, p2p=True)
        >>> intra_kind("nvlink", p, q)
        'pcie-p2p'
    """
    if requested not in INTRA_KINDS:
        raise ValueError(f"unknown intra-node link {requested!r}; use one of {', '.join(INTRA_KINDS)}")
    if requested == "nvlink" and a.nvlink and b.nvlink:
        return "nvlink"
    if requested in ("nvlink", "pcie-p2p") and a.p2p and b.p2p:
        return "pcie-p2p"
    return "pcie-host"


def intra_figures(kind: str, a: LinkEnds, b: LinkEnds) -> NetworkSpec:
    """Default bandwidth and latency of an intra-node link of `kind` between cards `a` and `b`.

    Example:
        >>> intra_figures("pcie-p2p", LinkEnds(16e9, None), LinkEnds(32e9, None))
        NetworkSpec(bandwidth_bytes_s=16000000000.0, latency_s=1e-05)
    """
    pcie = min(x.pcie_bandwidth_bytes_s or PCIE4_X16_BANDWIDTH_BYTES_S for x in (a, b))
    if kind == "nvlink":
        if a.nvlink_bandwidth_bytes_s is None or b.nvlink_bandwidth_bytes_s is None:
            raise ValueError("an NVLink card needs nvlink_bandwidth")
        nvlink = min(a.nvlink_bandwidth_bytes_s, b.nvlink_bandwidth_bytes_s) / NVLINK_DIRECTIONS
        return NetworkSpec(nvlink, NVLINK_LATENCY_S)
    if kind == "pcie-p2p":
        return NetworkSpec(pcie, PCIE_P2P_LATENCY_S)
    if kind == "pcie-host":
        return NetworkSpec(min(pcie, PCIE_HOST_BANDWIDTH_BYTES_S), PCIE_HOST_LATENCY_S)
    raise ValueError(f"unknown intra-node link {kind!r}; use one of {', '.join(INTRA_KINDS)}")


def slower(a: NetworkSpec, b: NetworkSpec) -> NetworkSpec:
    """The link two nodes' networks allow: the lower bandwidth and the higher latency.

    Example:
        >>> slower(NetworkSpec(125e6, 2e-4), NetworkSpec(12.5e6, 1e-4))
        NetworkSpec(bandwidth_bytes_s=12500000.0, latency_s=0.0002)
    """
    return NetworkSpec(min(a.bandwidth_bytes_s, b.bandwidth_bytes_s), max(a.latency_s, b.latency_s))
