"""Optimizer-state offload of one stage: the bytes it moves off the card and the seconds it pays.

A stage that offloads keeps its optimizer state in host memory and steps there (ZeRO-Offload,
Ren et al., USENIX ATC'21, arXiv:2101.06840; `shared/reference/apis_next.md` section 7).  Per
trainable parameter of the stage (P of them, tied replicas included), for the training
precision (weight bytes w, gradient bytes g, fp32 master copy or not) and the optimizer
(n fp32 moments, `cost_models.memory.OPTIMIZER_STATE_VALUES`):

* **bytes off the card**: ``host_bytes = 4 n + (4 if master else 0)`` -- the moments and, for
  the mixed precisions, the fp32 master weights (ZeRO-Offload's split: the card keeps the
  16-bit weights and gradients, the host the fp32 master weights and Adam's m, v).  The card
  keeps its weights and its gradient buffer (1F1B accumulates gradients over the m
  micro-batches on the card).  fp32 Adam: 8 of 16 B/param; bf16-mixed Adam: 12 of 16.
* **host-link bytes per step**: ``link_bytes = g + w`` -- the gradients down, the updated
  weights up (ZeRO-Offload: 2Psi + 2Psi in fp16), over the card's PCIe link to the host
  (`Device.host_link_bytes_s`: the catalog's PCIe x16 figure per direction, `gpu_specs.md`;
  a node's ``host_link`` in the cluster file overrides it).
* **host-memory bytes per step**: ``step_bytes = g + 2 (4 + 4 n) + (w if master else 0)`` -- the
  host step reads the gradient, reads and writes the fp32 weight and each fp32 moment, and
  (mixed) writes the compute-precision copy it uploads; Adam: 28 B/param in both precisions.
  It runs at the host's memory bandwidth (`Device.host_memory_bytes_s`, default
  `HOST_MEMORY_BYTES_S`): Adam is memory-bound on a CPU (`apis_next.md` s.7: torch's fused CPU
  Adam steps 1.3 G param/s on 2 threads, 36 GB/s at 28 B/param).

Time: ``O_s = P link_bytes / host_link + P step_bytes / host_memory``.  The model assumes no
overlap: the stage copies its gradients out after its last backward of the step, steps on
the host, and copies the weights back before the next step's first forward, so ``O_s`` is
a tail after the stage's last backward (ZeRO-Offload overlaps the copies with the backward;
hetpipe does not claim that).  It also assumes each offloading card has its own link and
the host's full memory bandwidth: two offloading stages on one node contend for the host's
memory in reality (an underestimate there, stated in the README).

Example (fp32 Adam, 1000 parameters, 32 GB/s link, 51.2 GB/s host memory):
    >>> r = offload_rates("adam", "fp32")
    >>> r.host_bytes_per_param, r.link_bytes_per_param, r.step_bytes_per_param
    (8, 8, 28)
    >>> offload_rates("adam", "bf16-mixed").host_bytes_per_param
    12
    >>> round(offload_tail_s(1000, r, host_link_bytes_s=32e9, host_memory_bytes_s=51.2e9) * 1e9, 1)  # ns
    796.9
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpipe.cost_models.memory import FP32_BYTES, OPTIMIZER_STATE_VALUES, PRECISIONS, check_optimizer, \
    check_precision
from hetpipe.errors import ConfigError

#: The lever's settings: ``auto`` = a stage offloads only where that lowers T (in practice only
#: where its state does not fit otherwise, since offloading adds a tail), ``never``, ``all`` =
#: every stage offloads (DeepSpeed ZeRO-Offload on every card; for baselines).
OFFLOAD_MODES = ("auto", "never", "all")

#: Host memory bandwidth the host optimizer step runs at: dual-channel DDR4-3200 peak,
#: 2 channels x 8 bytes x 3.2 GT/s = 51.2 GB/s (JEDEC JESD79-4 transfer rate; a desktop
#: home-lab node).  A node's ``host_memory_bandwidth`` in the cluster file overrides it.
HOST_MEMORY_BYTES_S = 51.2e9


@dataclass(frozen=True)
class OffloadRates:
    """Bytes per trainable parameter of an offloading stage (module docstring)."""

    state_bytes_per_param: int  # everything a trainable parameter costs on the card without offload
    grad_bytes_per_param: int
    host_bytes_per_param: int  # moved off the card
    link_bytes_per_param: int  # over the host link per step (gradient down + weight up)
    step_bytes_per_param: int  # host memory traffic of the host step


def check_offload_option(mode: object) -> None:
    """Refuse anything but one of `OFFLOAD_MODES` (``--offload``, ``offload=``).

    Example:
        >>> check_offload_option("never")
        >>> check_offload_option("yes")
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: offload (--offload): 'yes' is not a setting; use one of auto, never, all
    """
    if mode not in OFFLOAD_MODES:
        raise ConfigError(f"offload (--offload): {mode!r} is not a setting; use one of {', '.join(OFFLOAD_MODES)}")


def offload_rates(optimizer: str, precision: str) -> OffloadRates:
    """Per-parameter bytes of offloading `optimizer`'s state under `precision` (module docstring)."""
    weight_b, grad_b, master = PRECISIONS[check_precision(precision)]
    moments = OPTIMIZER_STATE_VALUES[check_optimizer(optimizer)]
    master_b = FP32_BYTES if master else 0
    return OffloadRates(
        state_bytes_per_param=weight_b + grad_b + master_b + FP32_BYTES * moments,
        grad_bytes_per_param=grad_b,
        host_bytes_per_param=FP32_BYTES * moments + master_b,
        link_bytes_per_param=grad_b + weight_b,
        step_bytes_per_param=grad_b + 2 * (FP32_BYTES + FP32_BYTES * moments) + (weight_b if master else 0),
    )


def offload_tail_s(params: int, rates: OffloadRates, *, host_link_bytes_s: float,
                   host_memory_bytes_s: float) -> float:
    """O_s: seconds an offloading stage with `params` trainable parameters adds after its last backward."""
    return (params * rates.link_bytes_per_param / host_link_bytes_s
            + params * rates.step_bytes_per_param / host_memory_bytes_s)


@dataclass(frozen=True)
class OffloadCost:
    """What offloading does to one stage: bytes off its card, seconds after its last backward."""

    saved_bytes: int
    tail_s: float


#: A stage that does not offload.
NO_OFFLOAD = OffloadCost(0, 0.0)


def offload_cost(params: int, rates: OffloadRates, *, host_link_bytes_s: float,
                 host_memory_bytes_s: float) -> OffloadCost:
    """Bytes saved and tail seconds of an offloading stage with `params` trainable parameters.

    Example:
        >>> offload_cost(10, offload_rates("adam", "fp32"), host_link_bytes_s=8.0, host_memory_bytes_s=28.0)
        OffloadCost(saved_bytes=80, tail_s=20.0)
    """
    return OffloadCost(params * rates.host_bytes_per_param,
                       offload_tail_s(params, rates, host_link_bytes_s=host_link_bytes_s,
                                      host_memory_bytes_s=host_memory_bytes_s))
