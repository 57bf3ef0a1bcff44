"""Save and restore one rank's training state with torch.distributed.checkpoint (DCP), keyed by the
model's own parameter names so that a checkpoint moves between plans.

Each rank saves its stage's parameters and buffers (``model/<name>``), the optimizer state of
those parameters (``optim/<name>/<key>``: keyed by parameter NAME, not by the optimizer's index,
which differs on every cut) and its random generators (``rng/stage-<k>/...``) in one collective
``dcp.save`` (`hetpipe.runtime.checkpoint.files` has the layout and the completion protocol).  A
tied parameter (GPT's embedding and head on two stages) is saved once, by its owner stage:
its replicas hold the same values and optimizer state because their gradients are summed
before every step.

On resume each rank asks DCP for exactly the keys of its new stage (DCP reads only the
requested keys), so a checkpoint of 3 stages resumes on 2 or 4 stages with other cuts.  The
random generators are restored only when the plan is the same one (`plan_digest`): on another
cut a rank's stream has no counterpart.

Example (one process, no process group: ``dcp`` then runs without collectives):
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> lin = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    >>> lin(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> st = StageState(lin, {"weight": "0.weight", "bias": "0.bias"}, {"weight": "0.weight", "bias": "0.bias"},
    ...                 opt, stage=0)
    >>> sorted(stage_state_dict(st))[:3]
    ['model/0.bias', 'model/0.weight', 'optim/0.bias/momentum_buffer']
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import random
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.runtime.checkpoint.groups import GroupSlices, WholeState, gather_whole, member_slices, sliced_value
from hetpipe.runtime.checkpoint.files import (
    MODEL_PREFIX,
    OPTIM_PREFIX,
    RNG_PREFIX,
    CheckpointInfo,
    check_names,
    params_fingerprint,
    plan_digest,
    prepare_tmp,
    publish,
    saved_keys,
)

log = logging.getLogger(__name__)

_SCALAR = "#scalar"  # a non-tensor optimizer state value, saved as a 0-d float64 tensor


@dataclass(frozen=True)
class StageState:
    """What one rank checkpoints: its stage module, its names, its optimizer.

    ``names``: local name -> the model's canonical name for every parameter and buffer of the
    stage; ``owned``: the subset this stage saves (a tied parameter only on its owner stage; on a
    tensor-parallel group, only the lead's).  ``member``: this rank's member of its stage's group
    (0: the lead, or a width-1 stage); ``slices``: its split parameters
    (`hetpipe.runtime.checkpoint.groups`), None off a group stage.
    """

    module: nn.Module
    names: Mapping[str, str]
    owned: Mapping[str, str]
    optimizer: torch.optim.Optimizer
    stage: int
    member: int = 0
    slices: GroupSlices | None = None


def canonical_names(program: Any, stage: int) -> dict[str, str]:
    """Local name -> canonical (first) model name of every parameter and buffer of ``stage``."""
    from hetpipe.runtime.stage.weights import stage_names

    return {name: keys[0] for name, keys, _ in stage_names(program, stage)}


def model_shapes(program: Any, *, parameters_only: bool = False,
                 stages: Any = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Canonical name -> (shape, dtype) of every tensor ``stages`` (default: all) hold, on meta."""
    from hetpipe.runtime.stage.weights import stage_names

    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for s in range(program.num_stages) if stages is None else stages:
        local = _local(program.modules[s])
        for name, keys, kind in stage_names(program, s):
            if not (parameters_only and kind != "parameter"):
                out[keys[0]] = (tuple(local[name].shape), local[name].dtype)
    return out


def program_fingerprint(program: Any) -> str:
    """The model's identity for checkpoints: the same for every cut of the same model."""
    return params_fingerprint(model_shapes(program))


def _local(module: nn.Module) -> dict[str, torch.Tensor]:
    local = dict(module.named_parameters(remove_duplicate=False))
    local.update(module.named_buffers(remove_duplicate=False))
    return local


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def rng_prefix(stage: int, member: int = 0) -> str:
    """Where a rank's random generators are saved: ``rng/stage-<k>/``, a group's other members
    ``rng/stage-<k>-member-<m>/`` (each rank's own stream).

    Example:
        >>> rng_prefix(2), rng_prefix(2, 1)
        ('rng/stage-2/', 'rng/stage-2-member-1/')
    """
    return f"{RNG_PREFIX}stage-{stage}{f'-member-{member}' if member else ''}/"


def rng_tensors(stage: int, member: int = 0) -> dict[str, torch.Tensor]:
    """This process's random generators (torch CPU, CUDA when present, python, numpy when imported)."""
    prefix = rng_prefix(stage, member)
    out = {prefix + "torch": torch.get_rng_state(), prefix + "python": _bytes_tensor(pickle.dumps(random.getstate()))}
    if torch.cuda.is_available():
        out[prefix + "cuda"] = torch.cuda.get_rng_state()
    if "numpy" in sys.modules:
        out[prefix + "numpy"] = _bytes_tensor(pickle.dumps(sys.modules["numpy"].random.get_state()))
    return out


def _set_rng(values: Mapping[str, torch.Tensor]) -> None:
    """Restore the random generators ``rng_tensors`` saved (keys: their sources, the prefix removed)."""
    for source, t in values.items():
        if source == "torch":
            torch.set_rng_state(t)
        elif source == "cuda" and torch.cuda.is_available():
            torch.cuda.set_rng_state(t)
        elif source == "python":
            random.setstate(pickle.loads(t.numpy().tobytes()))  # our own file, written by rng_tensors
        elif source == "numpy" and "numpy" in sys.modules:
            sys.modules["numpy"].random.set_state(pickle.loads(t.numpy().tobytes()))


def stage_state_dict(state: StageState, whole: WholeState | None = None) -> dict[str, torch.Tensor]:
    """The flat DCP state dict one rank saves (see the module docstring for the keys); ``whole``: a
    group member's split tensors gathered whole (`gather_whole`), saved in place of its slices."""
    local = _local(state.module)
    local.update(whole.tensors if whole is not None else {})
    out = {MODEL_PREFIX + key: local[name].detach() for name, key in state.owned.items()}
    name_of: dict[int, str] = {}
    for n, p in state.module.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(p), n)  # the first local name, the one `owned` and `names` are keyed by
    for param, values in state.optimizer.state.items():
        name = name_of.get(id(param))
        if name is None or name not in state.owned:  # a tied replica: its owner saves the same state
            continue
        prefix = f"{OPTIM_PREFIX}{state.owned[name]}/"
        for key, value in values.items():
            value = whole.optim.get((name, key), value) if whole is not None else value
            if isinstance(value, torch.Tensor):
                out[prefix + key] = value.detach()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[prefix + key + _SCALAR] = torch.tensor(float(value), dtype=torch.float64)
    out.update(rng_tensors(state.stage, state.member))
    return out


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what we asked for (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save_checkpoint(root: Path, *, step: int, state: StageState, info: CheckpointInfo) -> Path:
    """Collective over the world: every rank writes its stage into ``step-NNNNNN.tmp/``; after all
    finished, rank 0 writes the marker and renames the folder (`publish`).  Returns the folder.
    A tensor-parallel group's members first gather their split tensors whole (`gather_whole`)."""
    import torch.distributed.checkpoint as dcp

    started = time.monotonic()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        prepare_tmp(root, step)
    if dist.is_initialized():
        dist.barrier()
    tmp = root / f"step-{step:06d}.tmp"
    whole = gather_whole(state.slices, state.module, state.optimizer) if state.slices is not None else None
    sd = stage_state_dict(state, whole)
    wrote = time.monotonic()
    with _single_process_quiet():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=not dist.is_initialized())
    mine = (state.stage, time.monotonic() - wrote, *_bytes_by_prefix(sd),
            whole.seconds if whole is not None else 0.0, whole.bytes if whole is not None else 0)
    every = [mine]
    if dist.is_initialized():  # also the barrier: every rank's files are written
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    if rank == 0:
        info = dataclasses.replace(info, **_per_stage(every))
    final = publish(root, step, info) if rank == 0 else root / f"step-{step:06d}"
    if dist.is_initialized():
        dist.barrier()  # nobody moves on (or saves again) before the folder is complete
    log.info("rank %d: saved stage %d at step %d in %.3f s", rank, state.stage, step, time.monotonic() - started)
    return final


def _per_stage(every: Any) -> dict[str, tuple[Any, ...]]:
    """The marker's per-stage figures from every rank's (stage, save s, model bytes, optimizer bytes,
    gather s, gathered bytes): a group stage's slowest member's seconds, its members' bytes summed.

    Example:
        >>> _per_stage([(0, 0.2, 10, 20, 0.1, 30), (1, 0.1, 5, 5, 0.0, 0), (0, 0.3, 0, 0, 0.2, 30)])["stage_save_s"]
        (0.3, 0.1)
    """
    stages = sorted({e[0] for e in every})
    pick = {s: [e for e in every if e[0] == s] for s in stages}
    return {"stage_save_s": tuple(max(e[1] for e in pick[s]) for s in stages),
            "stage_model_bytes": tuple(sum(e[2] for e in pick[s]) for s in stages),
            "stage_optim_bytes": tuple(sum(e[3] for e in pick[s]) for s in stages),
            "stage_gather_s": tuple(max(e[4] for e in pick[s]) for s in stages),
            "stage_gather_bytes": tuple(sum(e[5] for e in pick[s]) for s in stages)}


def _bytes_by_prefix(sd: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(parameter + buffer bytes, optimizer state bytes) of a rank's state dict."""
    size = {p: sum(t.numel() * t.element_size() for k, t in sd.items() if k.startswith(p))
            for p in (MODEL_PREFIX, OPTIM_PREFIX)}
    return size[MODEL_PREFIX], size[OPTIM_PREFIX]


def restore_checkpoint(folder: Path, state: StageState, *, same_plan: bool) -> None:
    """Collective: load this stage's tensors, its parameters' optimizer state and (on the same plan)
    its random generators from ``folder``; reads only the keys of this stage.  A group member
    reads the whole tensors of its split parameters and keeps its slices (`sliced_value`)."""
    import torch.distributed.checkpoint as dcp

    keys = saved_keys(folder)
    local = _local(state.module)
    split = state.slices.specs if state.slices is not None else {}
    wanted: dict[str, torch.Tensor] = {}
    for name, key in state.names.items():
        if MODEL_PREFIX + key in keys:  # absent buffers (never saved) keep the stage's own
            shape, dtype = keys[MODEL_PREFIX + key]
            wanted[MODEL_PREFIX + key] = torch.empty(shape, dtype=dtype) if name in split else local[name].detach()
    optim: dict[nn.Parameter, dict[str, str]] = {}
    whole_shape: dict[nn.Parameter, tuple[int, ...] | None] = {}
    for name, param in state.module.named_parameters():
        prefix = f"{OPTIM_PREFIX}{state.names[name]}/"
        whole_shape[param] = keys.get(MODEL_PREFIX + state.names[name], (None,))[0]
        for key, (shape, dtype) in keys.items():
            if key.startswith(prefix):
                wanted[key] = torch.empty(shape, dtype=dtype)
                optim.setdefault(param, {})[key[len(prefix):]] = key
    rng_at = rng_prefix(state.stage, state.member)
    rng = {k: torch.empty(s, dtype=d) for k, (s, d) in keys.items() if k.startswith(rng_at)} if same_plan else {}
    wanted.update(rng)
    with _single_process_quiet():
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=not dist.is_initialized())
    with torch.no_grad():
        for name, canonical in state.names.items():  # a member keeps its slice of the whole tensor just read
            key = MODEL_PREFIX + canonical
            if name in split and key in wanted:
                local[name].copy_(sliced_value(state.slices, name, wanted[key], tuple(wanted[key].shape)))
    names = {id(p): n for n, p in state.module.named_parameters()}
    for param, subkeys in optim.items():
        state.optimizer.state[param] = {
            _state_key(sub): _state_value(sliced_value(state.slices, names[id(param)], wanted[key], whole_shape[param]),
                                          param, sub) for sub, key in subkeys.items()}
    reload = getattr(state.optimizer, "reload_weights", None)
    if reload is not None:  # an offloading stage steps host copies: they must be the weights just loaded
        reload()
    if same_plan:
        _set_rng({k[len(rng_at):]: wanted[k] for k in rng})


def _state_key(sub: str) -> str:
    return sub[: -len(_SCALAR)] if sub.endswith(_SCALAR) else sub


def _state_value(t: torch.Tensor, param: torch.Tensor, sub: str) -> Any:
    """Back to what the optimizer held: a Python number, a 0-d CPU tensor (Adam's ``step``), or a
    tensor on the parameter's device (moments, momentum buffers)."""
    if sub.endswith(_SCALAR):
        return t.item()
    return t if t.dim() == 0 else t.to(param.device)


@dataclass(frozen=True)
class Checkpointing:
    """One rank's checkpoint settings in a run: where, how often, and what identifies the model/plan."""

    root: Path | None
    every: int | None
    model: str
    fingerprint: str
    plan: Any
    seed: int

    def due(self, steps_done: int, *, last: bool) -> bool:
        """Whether to save after ``steps_done`` steps: every ``every`` steps and at the end."""
        if self.root is None:
            return False
        return last or (self.every is not None and steps_done % self.every == 0)

    def info(self, steps_done: int) -> CheckpointInfo:
        return CheckpointInfo(step=steps_done, batches_consumed=steps_done, model=self.model,
                              params_fingerprint=self.fingerprint, plan_digest=plan_digest(self.plan),
                              num_stages=len(self.plan.stages), optimizer=self.plan.training.optimizer,
                              seed=self.seed, saved_time_s=time.time(),
                              global_batch=self.plan.training.global_batch)


def for_run(run: Any, optimizer: torch.optim.Optimizer, *, root: str | Path | None, every: int | None,
            model: str, seed: int) -> tuple[StageState, Checkpointing]:
    """(what this rank saves, when and as what) for a worker's or `Trainer`'s prepared run.  On a
    tensor-parallel group the lead writes the stage's tensors, gathered whole; a member only its
    random generators (`hetpipe.runtime.checkpoint.groups`)."""
    member = run.slot.member if getattr(run, "slot", None) is not None else 0
    st = StageState(run.stage.module, canonical_names(run.program, run.index), run.saved_names if member == 0 else {},
                    optimizer, run.index, member=member, slices=member_slices(run))
    ckpt = Checkpointing(root=Path(root) if root is not None else None, every=every, model=model,
                         fingerprint=program_fingerprint(run.program), plan=run.plan, seed=seed)
    return st, ckpt


def check_optimizer(folder: Path, info: CheckpointInfo, plan: Any) -> None:
    """Refuse optimizer state of another kind (Adam moments cannot become SGD momentum)."""
    if info.optimizer.lower() != plan.training.optimizer.lower():
        raise ConfigError(f"--resume {folder}: the checkpoint holds {info.optimizer!r} optimizer state but the plan "
                          f"trains with {plan.training.optimizer!r}; re-plan with --optimizer {info.optimizer}")


def resume_stage(folder: Path, info: CheckpointInfo, state: StageState, *, program: Any, ckpt: Checkpointing) -> int:
    """Check ``folder`` against this stage (model, names, shapes, optimizer) and restore it; returns the
    number of steps already taken (the next step's index)."""
    check_optimizer(folder, info, ckpt.plan)
    check_names(folder, info, model=ckpt.model, fingerprint=ckpt.fingerprint,
                needed=model_shapes(program, parameters_only=True, stages=[state.stage]), stage=state.stage)
    same = info.plan_digest == plan_digest(ckpt.plan)
    restore_checkpoint(folder, state, same_plan=same)
    log.info("stage %d resumed from %s at step %d (%s plan%s)", state.stage, folder, info.step,
             "same" if same else "another", "" if same else ": random generators not restored")
    return info.step


def resume_marker(plan: Any, resume: str | Path, *, steps: int, seed: int) -> tuple[Path, CheckpointInfo]:
    """The checkpoint ``--resume`` means, checked from its marker alone (no capture, no tensor read):
    steps left, seed, global batch, optimizer."""
    from hetpipe.runtime.checkpoint.files import check_run_settings, find_checkpoint

    folder, info = find_checkpoint(resume)
    if info.step >= steps:
        raise ConfigError(f"--resume {folder}: the checkpoint is at step {info.step} and --steps {steps} is the "
                          f"total to reach; pass --steps larger than {info.step}")
    check_run_settings(folder, info, seed=seed, global_batch=plan.training.global_batch)
    check_optimizer(folder, info, plan)
    return folder, info


def preflight_resume(plan: Any, graph: Any, example: Any, resume: str | Path, *, model: str,
                     steps: int, seed: int) -> tuple[Path, CheckpointInfo]:
    """Before launching: the checkpoint ``--resume`` means, checked against every stage of ``plan``
    (model fingerprint, names, shapes, optimizer, steps left) from DCP's metadata alone."""
    from hetpipe.runtime.rank import node_to_stage
    from hetpipe.runtime.stage.build import split_stages

    folder, info = resume_marker(plan, resume, steps=steps, seed=seed)
    if plan.replicas:  # every replica holds the whole model: one stage covers every name
        program = split_stages(graph.module, {}, example_inputs=example, num_stages=1)
    else:
        program = split_stages(graph.module, node_to_stage(plan, graph.module), example_inputs=example,
                               num_stages=len(plan.stages))
    check_names(folder, info, model=model, fingerprint=program_fingerprint(program),
                needed=model_shapes(program, parameters_only=True))
    return folder, info
