"""What one pass (forward or backward) of a unit does, split the way a calibrated CPU prices it (torch-free).

`hetpipe.cost_models.flops.CostCounter` fills a `PassWork` per pass: the totals the roofline
model of `hetpipe.cost_models.timing` always used (FLOPs, bytes of memory-bound ops, kernels)
and, per op kind, the share of them a calibrated profile prices at that kind's own measured
rate (``DeviceProfile.op_rates``, issue 17 item 4):

* ``attention`` / ``attention_backward``: FLOPs of fused scaled-dot-product attention
  (forward / backward kernels), counted with torch's SDPA formulas;
* ``matmul:<s>``: FLOPs of the matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``) whose two smaller
  dimensions of M, K, N multiply to ``s`` (`matmul_key`): a CPU's matmul rate falls with the operands'
  narrow side (1024 tokens x 128 x 128 ran at ~0.8x the 1024^3 rate, x 512 x 512 at ~1.0x);
* an aten op name (``gelu``, ``native_layer_norm_backward``, ...): bytes read + written by
  that memory-bound op (`hetpipe.cost_models.flops.traffic_bytes`).

Example:
    >>> a = PassWork(flops=10, traffic_bytes=8, kernels=1, by_op=(("gelu", 8),))
    >>> b = PassWork(flops=5, traffic_bytes=4, kernels=2, by_op=(("add", 4), ("gelu", 2)))
    >>> a.plus(b)
    PassWork(flops=15, traffic_bytes=12, kernels=3, by_op=(('add', 4), ('gelu', 10)), view_ops=0)
    >>> a.plus(b).amount("gelu"), a.amount("silu")
    (10, 0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

#: Work-table key of fused attention forward kernels (amount: FLOPs, torch's ``sdpa_flop_count``).
ATTENTION_KEY = "attention"
#: Work-table key of fused attention backward kernels (amount: FLOPs, ``sdpa_backward_flop_count``).
ATTENTION_BWD_KEY = "attention_backward"
#: Keys whose amount is FLOPs (priced instead of the matmul rate); every other key is bytes, except
#: the matmul keys (`is_matmul_key`), FLOPs too.
FLOP_KEYS = frozenset({ATTENTION_KEY, ATTENTION_BWD_KEY})
#: Key of ``DeviceProfile.op_rates`` whose rate is forward ops per second: the fixed cost per op (kernel or
#: view) of a model's forward, measured on tiny transformers (`hetpipe.cost_models.forward_fixed`); never a
#: work-table key (a pass's ops are its ``kernels`` and ``view_ops``).
FORWARD_OP_KEY = "forward_op"
#: Key of ``DeviceProfile.op_rates`` whose rate is bytes per second: what a forward in training mode pays per
#: byte of the activations it holds for backward (fresh memory, beyond the caches), measured on a CPU
#: (`hetpipe.cost_models.forward_fixed.measure_held_bytes_s`); priced on ``Unit.activation_bytes``.
HELD_KEY = "held_bytes"
#: Prefix of the matmul work keys: ``matmul:<product of the two smaller of M, K, N>``.
MATMUL_PREFIX = "matmul:"


def matmul_key(m: int, k: int, n: int) -> str:
    """The work key of an (m x k) @ (k x n) matmul (batch folded into m): its narrow side's size.

    Example:
        >>> matmul_key(1024, 128, 512), matmul_key(128, 1024, 128)  # a forward and a weight gradient
        ('matmul:65536', 'matmul:16384')
    """
    a, b, _ = sorted((int(m), int(k), int(n)))
    return f"{MATMUL_PREFIX}{a * b}"


def is_matmul_key(key: str) -> bool:
    """Whether `key` is a `matmul_key` (its amount is FLOPs)."""
    return key.startswith(MATMUL_PREFIX)


def matmul_size(key: str) -> int:
    """The size ``s`` of a `matmul_key`."""
    return int(key[len(MATMUL_PREFIX):])


@dataclass(frozen=True)
class PassWork:
    """One pass of one unit for one micro-batch.

    Attributes:
        flops: all FLOPs (matmuls, attention and the formula FLOPs of memory-bound ops).
        traffic_bytes: bytes read + written by memory-bound ops.
        kernels: kernels launched (views excluded).
        by_op: ``(op kind, amount)`` sorted by kind: FLOPs for `FLOP_KEYS`, else bytes of that
            memory-bound aten op; a part of `flops` / `traffic_bytes`, not in addition.
        view_ops: ops that launch no kernel but still pass the dispatcher (views, aliases, detach,
            allocations): each pays a fixed cost on a CPU (`DeviceProfile.view_op_s`).
    """

    flops: int = 0
    traffic_bytes: int = 0
    kernels: int = 0
    by_op: tuple[tuple[str, int], ...] = ()
    view_ops: int = 0

    @staticmethod
    def of(*, flops: int, traffic_bytes: int, kernels: int, by_op: Mapping[str, int], view_ops: int = 0) -> PassWork:
        """A `PassWork` whose table is `by_op` sorted, zero amounts dropped."""
        return PassWork(flops, traffic_bytes, kernels, tuple(sorted((k, v) for k, v in by_op.items() if v)), view_ops)

    def amount(self, key: str) -> int:
        """The amount recorded under `key` (0 when absent)."""
        return dict(self.by_op).get(key, 0)

    def plus(self, other: PassWork) -> PassWork:
        """Both passes' work (a unit's nodes, or a unit and the loss)."""
        table = dict(self.by_op)
        for key, value in other.by_op:
            table[key] = table.get(key, 0) + value
        return PassWork.of(flops=self.flops + other.flops, traffic_bytes=self.traffic_bytes + other.traffic_bytes,
                           kernels=self.kernels + other.kernels, by_op=table, view_ops=self.view_ops + other.view_ops)

    def minus(self, earlier: PassWork) -> PassWork:
        """The work done since `earlier` (a snapshot of the same counter)."""
        table = dict(self.by_op)
        for key, value in earlier.by_op:
            table[key] = table.get(key, 0) - value
        return PassWork.of(flops=self.flops - earlier.flops, traffic_bytes=self.traffic_bytes - earlier.traffic_bytes,
                           kernels=self.kernels - earlier.kernels, by_op=table,
                           view_ops=self.view_ops - earlier.view_ops)


def total_work(works: Iterable[PassWork]) -> PassWork:
    """The sum of `works` (a unit's nodes).

    Example:
        >>> total_work([PassWork(1, 2, 1), PassWork(3, 0, 1)])
        PassWork(flops=4, traffic_bytes=2, kernels=2, by_op=(), view_ops=0)
    """
    total = PassWork()
    for work in works:
        total = total.plus(work)
    return total
