"""U_s: what a stage's optimizer step allocates at once on its card (memory model 5; torch-free).

At its optimizer step a stage holds its parameters, gradients and optimizer state and nothing of
the micro-batches (`hetpipe.schedule.held`: the moment after ``STEP``), and the step itself
allocates temporaries.  Read in torch 2.13's torch/optim (the runtime's optimizers,
`hetpipe.runtime.rank.make_optimizer`: Adam and AdamW at their defaults, SGD with or without
momentum, no weight decay for SGD, never ``maximize``, ``amsgrad`` or ``capturable``):

* Adam / AdamW, the multi-tensor path (``adam.py`` ``_multi_tensor_adam``):
  ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` is one new tensor per
  parameter, all alive until ``_foreach_addcdiv_`` (the other ops are in place; AdamW's decay is
  ``_foreach_mul_`` in place): **1 x the stepped parameters' bytes** at once (an H200 measured
  1.00 x, benchmarks/results/gpu_check.md);
* Adam / AdamW, the per-tensor loop (``_single_tensor_adam``): ``denom = (exp_avg_sq.sqrt() /
  bias_correction2_sqrt).add_(eps)`` holds ``sqrt()``'s result and the division's at once, and the
  previous parameter's ``denom`` is still bound to the loop's variable until that assignment ends:
  2 x the tensor stepped + the one before it, **at most 3 x the largest stepped tensor's bytes** (an
  upper bound: gpt-tiny's CPU step measured 2 x 64 KiB + 1 KiB, tests/test_step_transient.py);
* SGD and momentum SGD, either path (``sgd.py``): every op is in place (``buf.mul_().add_()``,
  ``p.add_``); the first step's momentum buffer is optimizer state, already in state_s: **0**.

Which path runs: ``torch.optim.optimizer._default_to_fused_or_foreach`` picks ``foreach`` where
every parameter is on a foreach-capable device (CUDA), the per-tensor loop for CPU tensors
(`hetpipe.cost_models.devices.steps_foreach`).  The stepped tensors are fp32 (`STEP_VALUE_BYTES`):
the weights under fp32, the fp32 master copy under bf16/fp16-mixed (ZeRO's layout,
`cost_models.memory`), so their moments' temporaries are fp32 too.  Only parameters with a
gradient are stepped (a parameter whose grad is None is skipped), the ones `Unit.grad_bytes` counts.

Example (Adam on a card and on a CPU; 1,000 stepped bytes, the largest tensor 400):
    >>> step_transient("adam", foreach=True).bytes(param_bytes=1000, tensor_bytes=400)
    1000
    >>> step_transient("adam", foreach=False).bytes(param_bytes=1000, tensor_bytes=400)
    1200
    >>> step_transient("momentum", foreach=True)
    StepTransient(list_multiple=0, tensor_multiple=0)
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpipe.errors import ConfigError

#: Bytes of one stepped parameter value: fp32 weights, or the fp32 master copy under mixed precision.
STEP_VALUE_BYTES = 4

#: Per optimizer, the multi-tensor step's temporaries in multiples of the stepped parameter bytes
#: (module docstring: Adam/AdamW ``_foreach_sqrt``'s list; SGD's ops are in place).
FOREACH_MULTIPLE: dict[str, int] = {"sgd": 0, "momentum": 0, "adam": 1, "adamw": 1}
#: Per optimizer, the per-tensor loop's temporaries in multiples of its largest stepped tensor (module
#: docstring: Adam/AdamW ``sqrt()`` and the division held at once, and the previous tensor's ``denom``).
LOOP_MULTIPLE: dict[str, int] = {"sgd": 0, "momentum": 0, "adam": 3, "adamw": 3}

#: The two paths a device's optimizer step takes, as a plan records them (`Plan.step_paths`).
STEP_PATHS = ("foreach", "per-tensor")


@dataclass(frozen=True)
class StepTransient:
    """U = list_multiple x the stepped parameter bytes + tensor_multiple x the largest stepped tensor's."""

    list_multiple: int
    tensor_multiple: int

    def bytes(self, *, param_bytes: int, tensor_bytes: int) -> int:
        return self.list_multiple * param_bytes + self.tensor_multiple * tensor_bytes


#: No transient: a problem without the tables (plans of memory model 4 and before), or SGD.
NO_STEP_TRANSIENT = StepTransient(0, 0)


def step_transient(optimizer: str, *, foreach: bool) -> StepTransient:
    """The multiples of `optimizer`'s step on the foreach path or the per-tensor loop (module docstring)."""
    if optimizer not in FOREACH_MULTIPLE:
        raise ConfigError(f"unknown optimizer {optimizer!r}; use one of: {', '.join(sorted(FOREACH_MULTIPLE))}")
    if foreach:
        return StepTransient(FOREACH_MULTIPLE[optimizer], 0)
    return StepTransient(0, LOOP_MULTIPLE[optimizer])


def path_transient(optimizer: str, path: str) -> StepTransient:
    """`step_transient` for a path named as in `STEP_PATHS` (a plan's record).

    Example:
        >>> path_transient("adamw", "per-tensor")
        StepTransient(list_multiple=0, tensor_multiple=3)
    """
    if path not in STEP_PATHS:
        raise ConfigError(f"unknown optimizer step path {path!r}; use one of: {', '.join(STEP_PATHS)}")
    return step_transient(optimizer, foreach=path == STEP_PATHS[0])
