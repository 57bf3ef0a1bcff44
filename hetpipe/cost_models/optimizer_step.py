"""S_s: the time of one optimizer step on a stage's card (torch-free; issue 17, item 1).

The step is a streaming, memory-bound update: every parameter's weight, gradient and
optimizer state are read once and the new weight and state are written once, so

    S = params * step_traffic_bytes_per_param(optimizer, precision)
            / (memory_bandwidth_bytes_s * bandwidth_efficiency)
        + STEP_KERNELS[optimizer] * kernel_overhead_s

Bytes per parameter (fp32 values are 4 B, bf16/fp16 2 B; ZeRO paper §3.1 for what
mixed precision keeps, cost_formulas.md §3.2):

==========  ============================  ==============================  =====  =====
optimizer   read                          written                         fp32   mixed
==========  ============================  ==============================  =====  =====
sgd         weight, grad                  weight                           12     12
momentum    weight, grad, buffer          weight, buffer                   20     20
adam(w)     weight, grad, m, v            weight, m, v                     28     28
==========  ============================  ==============================  =====  =====

Under ``bf16-mixed`` / ``fp16-mixed`` the weight read and written is the fp32 master copy
(4 B), the gradient is half precision (2 B), and the half-precision compute copy is
written once more (2 B): Adam reads 4 + 2 + 8 and writes 4 + 8 + 2.  The bandwidth is the
catalog's peak DRAM figure (gpu_specs.md) times the achieved fraction `timing.py` uses for
every memory-bound op (`DEFAULT_BANDWIDTH_EFFICIENCY`, or the calibrated one); the launch
term counts the multi-tensor (``foreach``) calls of PyTorch's default optimizer path per
step (torch/optim/sgd.py, adam.py, adamw.py ``_multi_tensor_*``) at the profile's kernel
overhead.  The emulated runtime does not stretch the step; the run report shows the
measured step next to this figure.

Where the optimizer runs PyTorch's per-tensor loop instead (``_single_tensor_*``, the default
for CPU tensors: ``torch.optim.optimizer._default_to_fused_or_foreach`` picks ``foreach`` only
for CUDA-like devices), every parameter tensor pays the step's ops itself, so the launch term
becomes ``tensors * STEP_KERNELS[optimizer] * step_op_s``, with ``step_op_s`` the seconds per
op of that loop measured by ``hetpipe profile --calibrate`` (`DeviceProfile.step_op_s`;
`hetpipe.cost_models.calibrate.measure_step_op_s`), paid per unit (`tensor_step_s`).

That loop also moves more bytes than one fused pass: each op reads and writes whole tensors
and ``denom`` is a temporary.  Counted in torch/optim/adam.py ``_single_tensor_adam`` (fp32,
no weight decay, not capturable; values read + written per parameter): ``m.lerp_(g)`` 3,
``v.mul_`` 2, ``.addcmul_(g, g)`` 3, ``v.sqrt()`` 2, ``/ bias_correction2_sqrt`` 2,
``.add_(eps)`` 2, ``p.addcdiv_(m, denom)`` 4: 18 values, 72 B, against the fused pass's 7
(28 B).  AdamW adds ``p.mul_`` (2 values: 80 B); momentum SGD (sgd.py ``_single_tensor_sgd``)
runs ``buf.mul_`` 2, ``.add_(g)`` 3, ``p.add_(buf)`` 3 (8 values, 32 B); plain SGD's
``p.add_(g)`` is the fused pass.  `loop_traffic_bytes_per_param` adds those extra values (at
fp32: they are state and temporaries; a mixed-precision gradient re-read is counted at 4 B,
2 B high).  Much of that traffic hits the caches (one tensor's ops run back to back), so it is
priced at the loop's own measured rate, ``step_bytes_s`` (`DeviceProfile.step_bytes_s`,
`hetpipe.cost_models.op_calibration.measure_step_bytes_s`): `loop_unit_step_s`.

Example:
    >>> step_traffic_bytes_per_param("adam", "fp32"), step_traffic_bytes_per_param("adam", "bf16-mixed")
    (28, 28)
    >>> step_traffic_bytes_per_param("sgd", "fp32"), step_traffic_bytes_per_param("momentum", "fp16-mixed")
    (12, 20)
    >>> loop_traffic_bytes_per_param("adam", "fp32"), loop_traffic_bytes_per_param("sgd", "fp32")
    (72, 12)
    >>> round(step_time_s(params=1_000_000, optimizer="adam", precision="fp32",
    ...                   memory_bandwidth_bytes_s=1e12, bandwidth_efficiency=1.0, kernel_overhead_s=0.0), 9)
    2.8e-05
"""

from __future__ import annotations

from hetpipe.errors import ConfigError

#: Bytes of one fp32 value and of one bf16/fp16 value.
_FP32_B, _HALF_B = 4, 2

#: fp32 state values per parameter read and written besides the weight (Adam: m and v).
_STATE_VALUES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}

#: Multi-tensor kernel launches per step (PyTorch's default foreach path, counted in
#: torch/optim: SGD one ``_foreach_add_``; momentum SGD mul, add, add; Adam step count, lerp,
#: mul, addcmul, sqrt, div, add, addcdiv; AdamW Adam's plus the decoupled weight-decay mul).
STEP_KERNELS: dict[str, int] = {"sgd": 1, "momentum": 3, "adam": 8, "adamw": 9}

#: fp32 values per parameter the per-tensor loop reads + writes beyond the fused pass (module docstring:
#: Adam 18 - 7, AdamW 20 - 7, momentum SGD 8 - 5, SGD 3 - 3; torch/optim ``_single_tensor_*``).
LOOP_EXTRA_VALUES: dict[str, int] = {"sgd": 0, "momentum": 3, "adam": 11, "adamw": 13}

#: The precisions this formula knows: (weight bytes read/written, grad bytes, extra half copy written).
_PRECISION_BYTES = {"fp32": (_FP32_B, _FP32_B, 0), "bf16-mixed": (_FP32_B, _HALF_B, _HALF_B),
                    "fp16-mixed": (_FP32_B, _HALF_B, _HALF_B)}


def step_traffic_bytes_per_param(optimizer: str, precision: str) -> int:
    """DRAM bytes read plus written per parameter by one optimizer step (module table)."""
    if optimizer not in _STATE_VALUES:
        raise ConfigError(f"unknown optimizer {optimizer!r}; use one of: {', '.join(sorted(_STATE_VALUES))}")
    if precision not in _PRECISION_BYTES:
        raise ConfigError(f"unknown precision {precision!r}; use one of: {', '.join(sorted(_PRECISION_BYTES))}")
    weight_b, grad_b, copy_b = _PRECISION_BYTES[precision]
    state_b = _STATE_VALUES[optimizer] * _FP32_B
    read = weight_b + grad_b + state_b
    written = weight_b + state_b + copy_b
    return read + written


def step_time_s(*, params: int, optimizer: str, precision: str, memory_bandwidth_bytes_s: float,
                bandwidth_efficiency: float, kernel_overhead_s: float) -> float:
    """S for `params` parameters on one card (module docstring); 0 parameters step for free."""
    if params <= 0:
        return 0.0
    traffic = params * step_traffic_bytes_per_param(optimizer, precision)
    launches = STEP_KERNELS[optimizer] * kernel_overhead_s
    return traffic / (memory_bandwidth_bytes_s * bandwidth_efficiency) + launches


def unit_step_s(*, params: int, optimizer: str, precision: str, memory_bandwidth_bytes_s: float,
                bandwidth_efficiency: float) -> float:
    """The per-parameter (bandwidth) share of S for one unit's `params`: additive over units.

    A stage's S is the sum of its units' shares plus `step_launch_s` once.

    Example:
        >>> unit_step_s(params=10, optimizer="sgd", precision="fp32", memory_bandwidth_bytes_s=120.0,
        ...             bandwidth_efficiency=1.0)
        1.0
    """
    return params * step_traffic_bytes_per_param(optimizer, precision) / (memory_bandwidth_bytes_s * bandwidth_efficiency)


def step_launch_s(optimizer: str, kernel_overhead_s: float) -> float:
    """The launch share of S: paid once per stage and step (module docstring)."""
    if optimizer not in STEP_KERNELS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; use one of: {', '.join(sorted(STEP_KERNELS))}")
    return STEP_KERNELS[optimizer] * kernel_overhead_s


def tensor_step_s(*, tensors: int, optimizer: str, step_op_s: float) -> float:
    """The per-tensor loop's ops for `tensors` parameter tensors: additive over units (module docstring).

    Example:
        >>> round(tensor_step_s(tensors=12, optimizer="adam", step_op_s=5e-6), 9)  # 12 x 8 ops x 5 us
        0.00048
    """
    if optimizer not in STEP_KERNELS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; use one of: {', '.join(sorted(STEP_KERNELS))}")
    return tensors * STEP_KERNELS[optimizer] * step_op_s


def loop_traffic_bytes_per_param(optimizer: str, precision: str) -> int:
    """Bytes read plus written per parameter by PyTorch's per-tensor loop (module docstring)."""
    return step_traffic_bytes_per_param(optimizer, precision) + LOOP_EXTRA_VALUES[optimizer] * _FP32_B


def loop_unit_step_s(*, params: int, tensors: int, optimizer: str, precision: str, step_bytes_s: float,
                     step_op_s: float) -> float:
    """One unit's share of S under the per-tensor loop: its bytes at the loop's measured rate plus its ops.

    Example:
        >>> round(loop_unit_step_s(params=1000, tensors=2, optimizer="adam", precision="fp32",
        ...                        step_bytes_s=72e9, step_op_s=1e-6), 9)  # 1e-6 s of bytes + 16 ops
        1.7e-05
    """
    if params <= 0:
        return 0.0
    traffic = params * loop_traffic_bytes_per_param(optimizer, precision)
    return traffic / step_bytes_s + tensor_step_s(tensors=tensors, optimizer=optimizer, step_op_s=step_op_s)
