"""Two plan nodes as Linux network namespaces joined by a ``tc``-shaped veth pair (issue 16, item 5).

Where the machine allows it (root, ``ip netns``, ``tc``; `netns_support` says why not), a plan
over exactly two nodes can run with each node's ranks in their own network namespace: one
torchrun per node (``--plan-node``, c10d rendezvous on node 0's address), gloo bound to the
veth (``GLOO_SOCKET_IFNAME``), and the plan's inter-node link shaped on both ends by a token
bucket ``tbf`` (its bandwidth) under ``netem`` (its latency; where the kernel lacks the netem
module, as on the machine this was written on, the latency is not added and the report says
so).  gloo's traffic between the nodes then crosses a real, rate-limited link instead of the
in-process delays of ``--emulate``; traffic inside a node stays on the namespace's own stack,
unshaped.  Compute is not stretched
(the emulation's clock-based links need every rank on one network stack), so such a run
measures this CPU's compute and the shaped link; the report says which links were shaped.

Example:
    >>> tc_commands("hpv", bandwidth_bytes_s=125e6, latency_s=2e-4)[0]
    ['qdisc', 'add', 'dev', 'hpv', 'root', 'handle', '1:', 'netem', 'delay', '200.0us']
    >>> tc_commands("hpv", bandwidth_bytes_s=125e6, latency_s=None)[0][7:10]
    ['tbf', 'rate', '1000000000bit']
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hetpipe.errors import ConfigError, RuntimeFailure

log = logging.getLogger(__name__)

#: The veth's name inside each namespace (names are per namespace, so both ends share it).
VETH = "hpv"
#: Private /24 for the pair (RFC 1918); node i gets .1 + i.
SUBNET = "10.231.77"
#: Token bucket depth: at least one GSO super-packet (64 KiB: veth hands tbf unsegmented
#: packets, and a bucket smaller than a packet drops it forever), else 4 ms at the link's rate.
MIN_BURST_BYTES = 128 * 1024
BURST_S = 4e-3
#: Longest a packet may queue in the bucket before tbf drops it: long enough that a stage's
#: message (MBs at the slowest rates planned) queues rather than being dropped and retransmitted.
QUEUE_LATENCY_S = 10.0
COMMAND_TIMEOUT_S = 10.0


def netns_support() -> str:
    """"" when network namespaces and tc can be used here, else why not (one phrase)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2)"
    probe = f"hpprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except RuntimeFailure as err:
        return f"ip netns add failed: {err}"
    _ip("netns", "del", probe, check=False)
    return ""


def _ip(*args: str, check: bool = True) -> None:
    _sh(["ip", *args], check=check)


def _sh(cmd: Sequence[str], *, check: bool = True) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeFailure(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")


def tc_commands(dev: str, *, bandwidth_bytes_s: float, latency_s: float | None) -> list[list[str]]:
    """``tc`` arguments shaping ``dev``'s egress: a tbf (bandwidth), under a netem (one-way latency) unless
    ``latency_s`` is None (kernels without the netem module: bandwidth only)."""
    rate_bit_s = int(bandwidth_bytes_s * 8)
    burst = max(MIN_BURST_BYTES, int(bandwidth_bytes_s * BURST_S))
    tbf = ["tbf", "rate", f"{rate_bit_s}bit", "burst", str(burst), "latency", f"{QUEUE_LATENCY_S:g}s"]
    if latency_s is None:
        return [["qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf]]
    return [["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{latency_s * 1e6:.1f}us"],
            ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf]]


@dataclass(frozen=True)
class ShapedLink:
    """The plan's link between its two nodes, as shaped (both directions)."""

    nodes: tuple[str, str]
    bandwidth_bytes_s: float
    latency_s: float
    latency_shaped: bool = True  # False: no netem in this kernel, the latency was not added

    def line(self) -> str:
        lat = (f"netem {self.latency_s * 1e3:.4g} ms" if self.latency_shaped else
               f"latency {self.latency_s * 1e3:.4g} ms NOT added: no netem in this kernel")
        return (f"links {self.nodes[0]} <-> {self.nodes[1]} ran over a veth pair between network namespaces shaped "
                f"by tc (tbf {self.bandwidth_bytes_s * 8 / 1e6:.4g} Mbit/s, {lat}); compute was not emulated")


def shaped_link(plan: Any) -> ShapedLink:
    """The two nodes of ``plan`` (in rank order: stages, groups' members) and the slowest plan link between them."""
    from hetpipe.plan.group_run import rank_slots

    dev = {d.id: d for d in plan.devices}
    nodes: list[str] = []
    for slot in rank_slots(plan):  # a tensor-parallel group's members too: a group may span the two nodes
        if dev[slot.device].node not in nodes:
            nodes.append(dev[slot.device].node)
    if len(nodes) != 2:
        raise ConfigError(f"the network-namespace path joins exactly two nodes; this plan's stages are on "
                          f"{len(nodes)} ({', '.join(nodes)}); run it with --emulate (in-process link delays)")
    cross = [l for l in plan.links if {dev[l.src].node, dev[l.dst].node} == set(nodes)]
    slowest = min(cross, key=lambda l: l.bandwidth_bytes_s)
    return ShapedLink((nodes[0], nodes[1]), slowest.bandwidth_bytes_s, max(l.latency_s for l in cross))


class NetnsPair:
    """Context manager: two namespaces ``hp<pid>n0/1`` joined by a shaped veth; removed on exit."""

    def __init__(self, link: ShapedLink) -> None:
        self.link = link
        self.names = tuple(f"hp{os.getpid()}n{i}" for i in range(2))
        self.addresses = tuple(f"{SUBNET}.{1 + i}" for i in range(2))

    def __enter__(self) -> "NetnsPair":
        a, b = self.names
        try:
            for ns in self.names:
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", f"{a}v", "type", "veth", "peer", "name", f"{b}v")
            for ns, addr in zip(self.names, self.addresses):
                _ip("link", "set", f"{ns}v", "netns", ns)
                _ip("-n", ns, "link", "set", f"{ns}v", "name", VETH)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", VETH)
                _ip("-n", ns, "link", "set", VETH, "up")
                self._shape(ns)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _shape(self, ns: str) -> None:
        """tbf under netem; tbf alone (and ``link.latency_shaped`` False) where netem is missing."""
        try:
            for args in tc_commands(VETH, bandwidth_bytes_s=self.link.bandwidth_bytes_s, latency_s=self.link.latency_s):
                _sh(["ip", "netns", "exec", ns, "tc", *args])
        except RuntimeFailure as err:
            if "netem" not in str(err):
                raise
            log.warning("no netem qdisc in this kernel: shaping the bandwidth only (%s)", err)
            self.link = dataclasses.replace(self.link, latency_shaped=False)
            _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", VETH, "root"], check=False)
            for args in tc_commands(VETH, bandwidth_bytes_s=self.link.bandwidth_bytes_s, latency_s=None):
                _sh(["ip", "netns", "exec", ns, "tc", *args])

    def __exit__(self, *exc: Any) -> None:
        for ns in self.names:  # deleting a namespace deletes its end of the veth, and so the pair
            _ip("netns", "del", ns, check=False)

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The c10d rendezvous port on node 0's address (a fresh namespace has every port free).
RDZV_PORT = 29500
#: After one launcher fails, how long the other gets to notice and exit before it is killed.
PEER_GRACE_S = 20.0


def _launchers(pair: NetnsPair, spec: Any, per_node: Sequence[int], run_dir: Path) -> list[subprocess.Popen]:
    from hetpipe.runtime.launch import WORKER_MODULE, worker_args

    procs = []
    for i, node in enumerate(pair.link.nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={per_node[i]}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={pair.addresses[0]}:{RDZV_PORT}", "--rdzv-id=hetpipe-netns",
                # Node 0 hosts the store: torchrun would look for the address among the host name's, not the veth's.
                f"--rdzv-conf=is_host={int(i == 0)}", f"--local-addr={pair.addresses[i]}", "--max-restarts=0",
                "--monitor-interval=0.1", "-m",
                WORKER_MODULE, *worker_args(spec), "--plan-node", node]
        with open(run_dir / f"torchrun-{node}.log", "w") as out:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(pair.command(i, argv), stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, "GLOO_SOCKET_IFNAME": VETH, "OMP_NUM_THREADS": "1"}))
    return procs


def _wait(procs: list[subprocess.Popen], limit_s: float) -> None:
    """Wait for both launchers; after the first failure give the other `PEER_GRACE_S`, then kill what is left."""
    deadline, failed_at = time.monotonic() + limit_s, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + PEER_GRACE_S):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.1)


def run_on_netns(plan: Any, *, model: str, steps: int, run_dir: str | Path, timeout_s: float = 60.0,
                 seq: int | None = None, seed: int = 0) -> Any:
    """Run a two-node ``plan`` with each node in its own network namespace (module docstring); a `RunReport`.

    Raises `ConfigError` when the machine does not allow it (`netns_support`) or the plan is not on two
    nodes, before anything starts; `RuntimeFailure` naming the first failing rank otherwise.

    Example:
        >>> run_on_netns("plan.json", model="gpt-tiny", seq=16, steps=3, run_dir="run")  # doctest: +SKIP
    """
    from hetpipe.plan.group_run import rank_slots
    from hetpipe.plan.schema import Plan
    from hetpipe.runtime.launch import LaunchSpec, first_error, startup_timeout_s
    from hetpipe.runtime.run import collect_report, preflight

    reason = netns_support()
    if reason:
        raise ConfigError(f"cannot run on network namespaces here: {reason}; run with --emulate (in-process link "
                          "delays) instead")
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    link = shaped_link(plan)
    preflight(plan, model=model, seq=seq, schedule=plan.training.schedule)
    folder = Path(run_dir).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    plan.save(folder / "plan.json")
    slots = rank_slots(plan)  # one rank per card: every member of a group
    spec = LaunchSpec(plan_path=folder / "plan.json", model=model, steps=steps, nproc=len(slots),
                      run_dir=folder, timeout_s=timeout_s, seed=seed, seq=seq)
    node_of = {d.id: d.node for d in plan.devices}
    per_node = [sum(node_of[s.device] == n for s in slots) for n in link.nodes]
    with NetnsPair(link) as pair:
        procs = _launchers(pair, spec, per_node, folder)
        _wait(procs, startup_timeout_s(len(slots)) + (steps + 2) * timeout_s)
        link = pair.link
    if any(p.returncode != 0 for p in procs):
        logs = "\n".join((folder / f"torchrun-{n}.log").read_text(errors="replace") for n in link.nodes)
        raise RuntimeFailure(f"{first_error(folder, logs)} (logs: {folder}/torchrun-<node>.log)")
    report = collect_report(plan, [folder])
    return dataclasses.replace(report, notes=(*report.notes, link.line()))
