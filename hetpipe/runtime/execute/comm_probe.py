"""The runtime's own message path, for the link calibration (issue 17 item 4).

`hetpipe.cost_models.link_calibration` times one-way messages between two pinned gloo ranks.
Its built-in sender and receiver imitate `hetpipe.runtime.execute.comm` (a header, a fresh frame,
the copy), but a 512 KiB message through `StageComm.send` / `StageComm.recv` (the spec checks,
`encode_header` / `pack_frame`, the bounded wait, `unpack_frame` and the header check) took
1.2-1.8x the imitation's time (five comparisons in pinned pairs of processes, load 5-9 on 2 cores,
`benchmarks/cpu_link.py`), and the runs' C 1.8-2.0x its price.  `RuntimePath` hands the
calibration this module's `StageComm` instead, so the price is measured on the code a run runs;
the cost-model layer cannot import the runtime, so the CLI passes it in
(`hetpipe profile --calibrate --cpu-devices N`).

Each message is one cut of one float32 tensor (uint8 when the size is not a multiple of 4)
between stage 0 (rank 0, the sender) and stage 1 (rank 1); ``seq`` numbers the messages, so
every one has its own tag as a run's micro-batches do.  ``RuntimePath(extra=specs)`` sends those
tensors besides, in the same message of the same bytes (`benchmarks/cpu_link_cuts.py`: a cut of
several tensors, as the HF Llama's forward cut with its mask and rotary tables, against one).

Example:
    >>> import torch
    >>> path = RuntimePath()
    >>> path.spec(1024)
    TensorSpec(name='calibration', shape=(256,), dtype=torch.float32, requires_grad=True)
    >>> path.spec(1023).dtype
    torch.uint8
    >>> extra = (TensorSpec("mask", (8, 16), torch.bool, False),)
    >>> [t.numel() * t.element_size() for t in RuntimePath(extra).tensors(1152)]
    [128, 1024]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from hetpipe.runtime.execute.comm import StageComm
from hetpipe.runtime.stage.types import TensorSpec
from hetpipe.schedule.actions import Action, Op

#: Seconds a calibration message may take before the wait fails (the calibration's own guard,
#: `cost_models.calibrate.LINK_OP_TIMEOUT_S`, bounds the whole process group besides).
PROBE_TIMEOUT_S = 60.0
_FLOAT_BYTES = 4


@dataclass(frozen=True)
class _ProbeCut:
    """What `StageComm` reads of a cut: its index and the tensors crossing it each way."""

    index: int
    tensors: tuple[TensorSpec, ...]
    grad_tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class _ProbeStage:
    """What `StageComm` reads of a stage (`hetpipe.runtime.stage.build.StageModule`'s fields)."""

    stage: int
    device: torch.device
    in_cut: _ProbeCut | None
    out_cut: _ProbeCut | None
    num_stages: int = 2


def _spec(num_bytes: int) -> TensorSpec:
    if num_bytes % _FLOAT_BYTES == 0:
        return TensorSpec("calibration", (num_bytes // _FLOAT_BYTES,), torch.float32, True)
    return TensorSpec("calibration", (num_bytes,), torch.uint8, False)


def _specs(num_bytes: int, extra: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """A `num_bytes` message's tensors: `extra`, then one tensor holding the rest of the bytes."""
    rest = num_bytes - sum(t.num_bytes for t in extra)
    if rest < 1:
        raise ValueError(f"a {num_bytes}-byte message cannot hold the extra tensors' {num_bytes - rest} bytes")
    return (*extra, _spec(rest))


@functools.lru_cache(maxsize=64)
def _stage_comm(rank: int, num_bytes: int, extra: tuple[TensorSpec, ...] = ()) -> StageComm:
    """One `StageComm` per end, size and cut, built once as a run builds one per stage (not timed)."""
    cut = _ProbeCut(0, _specs(num_bytes, extra), ())
    stage = _ProbeStage(rank, torch.device("cpu"), cut if rank == 1 else None, cut if rank == 0 else None)
    return StageComm(stage, rank=rank, stage_ranks=(0, 1), timeout_s=PROBE_TIMEOUT_S,  # type: ignore[arg-type]
                     send_delay_s=lambda cut, num_bytes: 0.0, on_comm_bytes=lambda key, num_bytes: None)


@dataclass(frozen=True)
class RuntimePath:
    """Send and receive a calibration message through `StageComm` (picklable: spawned workers take it).

    `hetpipe.cost_models.link_calibration.MessagePath` is the protocol it meets.  `extra`: tensors every
    message carries besides the payload, within its bytes (module docstring).
    """

    extra: tuple[TensorSpec, ...] = ()

    def spec(self, num_bytes: int) -> TensorSpec:
        """The payload of a `num_bytes` message (the bytes past `extra`): float32 as activations are, else uint8."""
        return _specs(num_bytes, self.extra)[-1]

    def tensors(self, num_bytes: int) -> list[torch.Tensor]:
        """Every tensor of a `num_bytes` message, `extra` first (ones; bool ones are True)."""
        return [torch.ones(s.shape, dtype=s.dtype) for s in _specs(num_bytes, self.extra)]

    def payload(self, num_bytes: int) -> torch.Tensor:
        """A tensor the sender sends as a `num_bytes` message (with `extra`: the last, the others kept per size)."""
        return self.tensors(num_bytes)[-1]

    def send(self, payload: torch.Tensor, seq: int) -> Callable[[], None]:
        """Post message `seq` to rank 1 as a SEND_F does; returns the wait for its delivery."""
        num_bytes = payload.numel() * payload.element_size() + sum(t.num_bytes for t in self.extra)
        comm = _stage_comm(0, num_bytes, self.extra)
        comm.reset()  # as at a step's start: the previous message was waited for
        comm.send(Action(0, Op.SEND_F, seq), [*_extra_tensors(self.extra), payload])
        return comm.wait_sends

    def post_recv(self, num_bytes: int, seq: int) -> Callable[[], None]:
        """Post the receive of message `seq` from rank 0; returns the RECV_F (wait, checks, unpack, and the
        received tensors' ``requires_grad_`` as the stage's RECV does)."""
        comm, action = _stage_comm(1, num_bytes, self.extra), Action(1, Op.RECV_F, seq)
        comm.reset()
        comm.post_recv(action)
        specs = _specs(num_bytes, self.extra)

        def receive() -> None:
            for t, spec in zip(comm.recv(action), specs):
                t.requires_grad_(spec.requires_grad)
        return receive


@functools.lru_cache(maxsize=8)
def _extra_tensors(extra: tuple[TensorSpec, ...]) -> tuple[torch.Tensor, ...]:
    """The sender's extra tensors, made once (a run's mask and rotary tables are made once per forward, early)."""
    return tuple(torch.ones(s.shape, dtype=s.dtype) for s in extra)
