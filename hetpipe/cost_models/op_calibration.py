"""Per-op rates and the optimizer's cost per op, measured on a CPU (issue 17 item 4).

A 1024^3 matmul, a 64 MiB copy and a chain of tiny ops price a CPU's matmuls, its streaming
ops and its fixed cost per op well; they miss three things the CPU truth benchmark found
(``benchmarks/cpu_truth.py``, per-op CPU times of gpt-demo and a Llama under a dispatch timer):

* fused attention (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) reaches
  about half the matmul rate per counted FLOP: its blocks are 32-wide and it evaluates an
  exp per score;
* memory-bound ops with transcendental arithmetic are compute-bound on a CPU: GELU's tanh
  form runs at ~4 GB/s of traffic where a copy streams at ~17 GB/s; layer norm, softmax and
  the bias-gradient sums lie between;
* matmuls with a narrow side (the demo models' 128-wide projections) run below the 1024^3
  rate: a chain of `MATMUL_LAYERS` linear layers, forward and backward, is timed at each width of
  `MATMUL_WIDTHS` on `OP_ROWS` tokens (`measure_matmul_rates`, work keys `hetpipe.cost_models.work.matmul_key`);
* fixed costs per op besides a forward kernel's (`calibrate.measure_op_overhead_s`): a backward op
  runs through the autograd engine (`measure_backward_op_s`), and views, detaches and allocations
  pass the dispatcher without a kernel (`measure_view_op_s`);
* PyTorch's optimizers run a per-tensor loop on CPU tensors (`cost_models.optimizer_step`):
  a fixed cost per op (`measure_step_op_s`) and more bytes than one fused pass, streamed at
  the loop's own rate (`measure_step_bytes_s`).

`measure_op_rates` times each op kind of `OP_KINDS` on tensors of `OP_ROWS` x `OP_COLS` fp32
(2 MiB: one micro-batch of 1024 tokens x 512 features, as in the demo models, large enough
that the per-call cost is amortised) and divides the work the capture counts for that very
call (`hetpipe.cost_models.flops.CostCounter` on meta tensors: bytes of traffic, or attention
FLOPs by torch's SDPA formulas) by the median time.  `hetpipe.cost_models.timing.pass_time_s`
prices a unit's ops with these rates.

Example:
    >>> rates = dict(measure_op_rates("cpu", repeats=1, kinds=("gelu",)))
    >>> rates["gelu"] > 0
    True
    >>> 0 < measure_step_op_s(repeats=1) < 0.01
    True
    >>> measure_step_bytes_s(step_op_s=0.0, repeats=1, tensors=2) > 0
    True
    >>> 0 < measure_view_op_s(repeats=1) < 0.01 and 0 < measure_backward_op_s(repeats=1) < 0.01
    True
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from hetpipe.cost_models.flops import CostCounter
from hetpipe.cost_models.optimizer_step import STEP_KERNELS, loop_traffic_bytes_per_param
from hetpipe.cost_models.rates import median_rate
from hetpipe.cost_models.work import ATTENTION_BWD_KEY, ATTENTION_KEY, matmul_key
from hetpipe.errors import ConfigError, RuntimeFailure

aten = torch.ops.aten

#: Shape of the memory-bound ops' tensors: 1024 tokens (8 x 128) x 512 features, fp32 = 2 MiB.
OP_ROWS, OP_COLS = 1024, 512
#: Attention's shape (batch, heads, sequence, head dim): the demo models' 8 x 128 tokens, 4 heads of 32,
#: causal (the language models this benchmark runs; torch's formula counts the masked half too).
ATTENTION_SHAPE = (8, 4, 128, 32)
#: Widths of the square linear layers `measure_matmul_rates` chains (narrow sides 64^2 .. 512^2; wider matmuls
#: get the 512 rate, which was within ~5% of the 1024^3 one).
MATMUL_WIDTHS = (64, 128, 256, 512)
#: A GPU's widths and tokens (benchmarks/gpu_check.py): GPT-2 small's 768 to a 7B model's 4096 and beyond, on
#: 4096 tokens (4 x 1024, the check's micro-batch), so that one layer's work outlasts its launch.
GPU_MATMUL_WIDTHS, GPU_OP_ROWS = (256, 512, 768, 1024, 2048, 4096, 8192), 4096
#: Layers per chain: at width 128 their inputs and outputs (4 x 2 x 512 KiB) outgrow the 2 MiB L2 of the
#: reference VM, as a model's activations do between its matmuls.
MATMUL_LAYERS = 4
#: FLOPs of a linear layer's forward and backward (grad input, grad weight) over its forward's.
LINEAR_FWD_BWD_FACTOR = 3
#: Ops per chain of `measure_backward_op_s` / `measure_view_op_s`, on tiny tensors (the arithmetic is nothing).
FIXED_COST_CHAIN_OPS, FIXED_COST_SHAPE = 200, (2, 4)
#: Parameter tensors and their elements for `measure_step_op_s`: tiny, so the time is the loop's ops.
STEP_TENSORS, STEP_TENSOR_NUMEL = 64, 8
#: Parameter tensors of `measure_step_bytes_s`, each `STEP_RATE_SHAPE` fp32 (1 MiB: the demo models' largest
#: matrices): 16 MiB of weights, 64 MiB with gradients, m and v -- beyond the 32 MiB last-level cache of the
#: reference VM, as a step finds its state after a backward pass has streamed the activations through.
STEP_RATE_TENSORS, STEP_RATE_SHAPE = 16, (512, 512)
#: The optimizer `measure_step_op_s` times (the benchmarks' and the CLI's default).
STEP_OPTIMIZER = "adam"


def _memory_bound_calls(device: str) -> dict[str, Callable[[], object]]:
    """One call per op kind on `device` (the same call runs on meta to count its bytes)."""
    x = torch.randn(OP_ROWS, OP_COLS, device=device) if device != "meta" else torch.empty(OP_ROWS, OP_COLS,
                                                                                            device=device)
    g = torch.ones_like(x)
    w, b = torch.ones(OP_COLS, device=device), torch.zeros(OP_COLS, device=device)
    y = torch.softmax(x, -1)
    mean, rstd = aten.native_layer_norm(x, [OP_COLS], w, b, 1e-5)[1:]
    return {
        "gelu": lambda: aten.gelu(x, approximate="tanh"),
        "gelu_backward": lambda: aten.gelu_backward(g, x, approximate="tanh"),
        "silu": lambda: aten.silu(x),
        "silu_backward": lambda: aten.silu_backward(g, x),
        "tanh": lambda: aten.tanh(x),
        "native_layer_norm": lambda: aten.native_layer_norm(x, [OP_COLS], w, b, 1e-5),
        "native_layer_norm_backward": lambda: aten.native_layer_norm_backward(
            g, x, [OP_COLS], mean, rstd, w, b, [True, True, True]),
        "_softmax": lambda: aten._softmax(x, -1, False),
        "_softmax_backward_data": lambda: aten._softmax_backward_data(g, y, -1, torch.float32),
        "_log_softmax": lambda: aten._log_softmax(x, -1, False),
        "_log_softmax_backward_data": lambda: aten._log_softmax_backward_data(g, y, -1, torch.float32),
        "sum": lambda: aten.sum.dim_IntList(x, [0]),  # a bias gradient: the sum over tokens
        "mean": lambda: aten.mean.dim(x, [-1], True),  # RMS norm's mean of squares
    }


#: The memory-bound op kinds measured (aten op names, as `CostCounter` records them).
OP_KINDS: tuple[str, ...] = tuple(_memory_bound_calls("meta"))


def _counted_bytes(kind: str) -> int:
    """Traffic the capture counts for the calibration call of `kind` (run on meta)."""
    with CostCounter() as counter:
        _memory_bound_calls("meta")[kind]()
    return counter.work().amount(kind)


def _attention_rates(device: str, repeats: int) -> list[tuple[str, float]]:
    """FLOP/s of the CPU's fused causal attention, forward and backward (torch's SDPA FLOP formulas)."""
    q, k, v = (torch.randn(*ATTENTION_SHAPE, device=device) for _ in range(3))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    grad = torch.ones_like(out)
    fwd_flops = sdpa_flop_count(q.shape, k.shape, v.shape)
    bwd_flops = sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)
    fwd = median_rate(lambda: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True),
                      device=device, work=float(fwd_flops), repeats=repeats)
    bwd = median_rate(lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, True), device=device, work=float(bwd_flops), repeats=repeats)
    return [(ATTENTION_KEY, fwd), (ATTENTION_BWD_KEY, bwd)]


def measure_matmul_rates(device: str = "cpu", *, repeats: int = 3, widths: Sequence[int] = MATMUL_WIDTHS,
                         rows: int = OP_ROWS) -> list[tuple[str, float]]:
    """FLOP/s of a chain of `MATMUL_LAYERS` bias-free linear layers on ``rows`` tokens, forward and backward,
    per width of ``widths``, under the work key of one layer's matmul (`work.matmul_key`).

    A CPU is measured at `MATMUL_WIDTHS` on `OP_ROWS` tokens (`measure_op_rates`); a GPU at wider layers
    (`GPU_MATMUL_WIDTHS` on `GPU_OP_ROWS` tokens: benchmarks/gpu_check.py).

    Example:
        >>> [key for key, _ in measure_matmul_rates("cpu", repeats=1, widths=(16, 32), rows=64)]
        ['matmul:256', 'matmul:1024']
    """
    out = []
    for width in widths:
        layers = [torch.nn.Linear(width, width, bias=False, device=device) for _ in range(MATMUL_LAYERS)]
        x = torch.randn(rows, width, device=device, requires_grad=True)

        def chain() -> None:
            y = x
            for layer in layers:
                y = layer(y)
            y.backward(torch.ones_like(y))
            for layer in layers:
                layer.weight.grad = None  # each call writes fresh gradients, as one backward pass does

        work = float(LINEAR_FWD_BWD_FACTOR * MATMUL_LAYERS * 2 * rows * width * width)
        out.append((matmul_key(rows, width, width), median_rate(chain, device=device, work=work, repeats=repeats)))
    return out


def measure_op_rates(device: str = "cpu", *, repeats: int = 3,
                     kinds: Sequence[str] = OP_KINDS) -> tuple[tuple[str, float], ...]:
    """``(op kind, work per second)`` sorted by kind: attention and matmul FLOP/s, bytes/s of each of `kinds`.

    Only a CPU is measured (its fused attention kernel is the CPU one; a GPU keeps the roofline).
    """
    if device != "cpu":
        raise ConfigError(f"per-op rates are measured on a CPU only, not {device!r}; calibrate a GPU without them")
    unknown = sorted(set(kinds) - set(OP_KINDS))
    if unknown:
        raise ConfigError(f"no calibration call for op kind(s) {', '.join(unknown)}; choose from {', '.join(OP_KINDS)}")
    calls = _memory_bound_calls(device)
    rates = _attention_rates(device, repeats) + measure_matmul_rates(device, repeats=repeats)
    for kind in kinds:
        rates.append((kind, median_rate(calls[kind], device=device, work=float(_counted_bytes(kind)),
                                        repeats=repeats)))
    return tuple(sorted(rates))


def measure_step_op_s(*, repeats: int = 3) -> float:
    """Seconds per op of PyTorch's per-tensor optimizer loop on this CPU.

    Times ``torch.optim.Adam(foreach=False)`` stepping `STEP_TENSORS` tiny tensors and divides by
    tensors x ``STEP_KERNELS["adam"]``: what `optimizer_step.tensor_step_s` multiplies back.
    """
    params = [torch.nn.Parameter(torch.ones(STEP_TENSOR_NUMEL)) for _ in range(STEP_TENSORS)]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.Adam(params, foreach=False)
    optimizer.step()  # the state (m, v, step) is created on the first step
    ops = STEP_TENSORS * STEP_KERNELS[STEP_OPTIMIZER]
    return 1.0 / median_rate(optimizer.step, device="cpu", work=float(ops), repeats=repeats)


def measure_step_bytes_s(*, step_op_s: float, repeats: int = 3, tensors: int = STEP_RATE_TENSORS) -> float:
    """Bytes per second PyTorch's per-tensor Adam loop streams on this CPU.

    Times ``torch.optim.Adam(foreach=False)`` stepping `tensors` tensors of `STEP_RATE_SHAPE`, takes
    away their ops' fixed cost (tensors x ``STEP_KERNELS["adam"]`` x `step_op_s`, priced separately by
    `optimizer_step.tensor_step_s`) and divides the loop's traffic
    (`optimizer_step.loop_traffic_bytes_per_param`) by the rest: what `optimizer_step.loop_unit_step_s`
    divides by.
    """
    params = [torch.nn.Parameter(torch.randn(*STEP_RATE_SHAPE)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.Adam(params, foreach=False)
    optimizer.step()  # the state (m, v, step) is created on the first step
    traffic = float(sum(p.numel() for p in params) * loop_traffic_bytes_per_param(STEP_OPTIMIZER, "fp32"))
    step_s = traffic / median_rate(optimizer.step, device="cpu", work=traffic, repeats=repeats)
    stream_s = step_s - tensors * STEP_KERNELS[STEP_OPTIMIZER] * step_op_s
    if stream_s <= 0:
        raise RuntimeFailure(f"the optimizer loop took {step_s:.3g} s, less than its ops' fixed cost; "
                             "rerun the calibration on a quieter machine")
    return traffic / stream_s


def measure_backward_op_s(*, repeats: int = 3) -> float:
    """Seconds per op of the backward of a chain of tiny elementwise ops (one autograd node and one kernel each).

    The forward is built outside the timing: each repeat times only ``backward()`` over
    `FIXED_COST_CHAIN_OPS` nodes (`median_rate` times a fresh graph's backward per call).
    """
    x = torch.ones(*FIXED_COST_SHAPE, requires_grad=True)
    graphs: list[torch.Tensor] = []

    def build() -> None:
        y = x
        for _ in range(FIXED_COST_CHAIN_OPS):
            y = y * 1.0
        graphs.append(y)

    def backward() -> None:
        graphs.pop().backward(torch.ones_like(x))

    return _timed_per_op(build, backward, repeats=repeats)


def measure_view_op_s(*, repeats: int = 3) -> float:
    """Seconds per view op (a transpose of a tensor autograd records) on this CPU: no kernel, only dispatch."""
    x = torch.ones(*FIXED_COST_SHAPE, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(FIXED_COST_CHAIN_OPS):
            y = y.transpose(0, 1)

    return 1.0 / median_rate(chain, device="cpu", work=float(FIXED_COST_CHAIN_OPS), repeats=repeats)


def _timed_per_op(build: Callable[[], None], run: Callable[[], None], *, repeats: int) -> float:
    """Median seconds per op of `run` over `repeats` calls, each after an untimed `build` (rates.CLOCK)."""
    from hetpipe.cost_models import rates as rates_mod  # the clock a benchmark may have swapped

    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        build()
        start = rates_mod.CLOCK()
        run()
        times.append(rates_mod.CLOCK() - start)
    return statistics.median(times[1:]) / FIXED_COST_CHAIN_OPS
