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

Example:
    >>> step_traffic_bytes_per_param("adam", "fp32"), step_traffic_bytes_per_param("adam", "bf16-mixed")
    (28, 28)
    >>> step_traffic_bytes_per_param("sgd", "fp32"), step_traffic_bytes_per_param("momentum", "fp16-mixed")
    (12, 20)
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
