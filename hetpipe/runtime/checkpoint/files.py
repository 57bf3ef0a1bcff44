"""Training checkpoints on disk: the folder layout, the completion marker, and the checks a resume
makes before anything is launched.

``--checkpoint-dir DIR`` holds one folder per saved step::

    DIR/step-000002/          a complete checkpoint
        .metadata             torch.distributed.checkpoint's index of every saved key (written last by DCP)
        __0_0.distcp ...      one file per rank: its stage's tensors
        hetpipe-checkpoint.json   the marker: step, data position, model and plan identity
    DIR/step-000004.tmp/      being written (or interrupted mid-write): never read

Every rank writes into ``step-NNNNNN.tmp/``; after all of them finished, rank 0 writes the
marker into it and renames the folder to ``step-NNNNNN/``.  A folder counts as complete only
when its name has no ``.tmp`` suffix and it holds both the marker and DCP's ``.metadata``,
so a crash at any moment leaves either the previous checkpoint or the new one, never half of
one.  `find_checkpoint` picks the newest complete one (or the one named).

Keys (the model's own fully-qualified names, so any other cut finds them):
``model/<name>`` for parameters and buffers, ``optim/<name>/<state key>`` for the optimizer
state of that parameter (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``; SGD's
``momentum_buffer``), ``rng/stage-<k>/<source>`` for stage k's random generators (a
tensor-parallel group's other members: ``rng/stage-<k>-member-<m>/<source>``).  A group stage's
split tensors are saved whole, as a width-1 stage saves them (`hetpipe.runtime.checkpoint.groups`).

Example:
    >>> step_dir_name(123)
    'step-000123'
    >>> parse_step("step-000123"), parse_step("step-000123.tmp"), parse_step("other")
    (123, None, None)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hetpipe.errors import ConfigError

log = logging.getLogger(__name__)

MARKER = "hetpipe-checkpoint.json"
DCP_METADATA = ".metadata"  # written last by FileSystemWriter.finish (apis_next.md §3)
FORMAT = "hetpipe.checkpoint"
VERSION = 1
MODEL_PREFIX, OPTIM_PREFIX, RNG_PREFIX = "model/", "optim/", "rng/"
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_LISTED = 5  # names listed in one error message


@dataclass(frozen=True)
class CheckpointInfo:
    """The marker of one complete checkpoint (``hetpipe-checkpoint.json``).

    ``step`` optimizer steps were taken; the next step reads global batch number
    ``batches_consumed`` (0-based) of the data stream.  ``params_fingerprint`` is a sha256 over
    the model's saved names, shapes and dtypes (independent of the cut and the micro-batch size);
    ``plan_digest`` identifies the cut and batch settings: equal digests resume bitwise.
    """

    step: int
    batches_consumed: int
    model: str
    params_fingerprint: str
    plan_digest: str
    num_stages: int
    optimizer: str
    seed: int
    saved_time_s: float
    # The plan's global batch (samples per step): ``batches_consumed`` counts batches of this size.
    # None in markers written before it was recorded: unknown, never taken for a mismatch.
    global_batch: int | None = None
    # Per stage, measured by each rank: seconds in dcp.save, parameter + buffer bytes, optimizer bytes.
    stage_save_s: tuple[float, ...] = ()
    stage_model_bytes: tuple[int, ...] = ()
    stage_optim_bytes: tuple[int, ...] = ()
    # Per stage, a tensor-parallel group's gather of its split tensors before the save (0 elsewhere):
    # its slowest member's seconds, and the whole tensors' bytes gathered, summed over its members.
    stage_gather_s: tuple[float, ...] = ()
    stage_gather_bytes: tuple[int, ...] = ()
    format: str = FORMAT
    version: int = VERSION

    def save(self, folder: Path) -> None:
        """Write the marker into ``folder`` durably (tmp file, fsync, rename)."""
        path, tmp = folder / MARKER, folder / f".{MARKER}.tmp"
        with tmp.open("w") as f:
            json.dump(asdict(self), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @staticmethod
    def load(folder: Path) -> "CheckpointInfo":
        try:
            raw = json.loads((folder / MARKER).read_text())
            info = CheckpointInfo(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"--resume {folder}: its {MARKER} is unreadable ({type(err).__name__}: {err}); pass "
                              "another step-NNNNNN folder of the checkpoint directory") from None
        if info.format != FORMAT or info.version > VERSION:
            raise ConfigError(f"--resume {folder}: {MARKER} is format {info.format!r} version {info.version}; this "
                              f"hetpipe reads {FORMAT!r} up to version {VERSION}: upgrade hetpipe")
        return info


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def parse_step(name: str) -> int | None:
    """The step of a complete checkpoint folder's name, None for anything else (``.tmp`` included)."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def is_complete(folder: Path) -> bool:
    """A folder named ``step-NNNNNN`` (no ``.tmp``) with the marker and DCP's ``.metadata``."""
    return parse_step(folder.name) is not None and (folder / MARKER).is_file() and (folder / DCP_METADATA).is_file()


def find_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, CheckpointInfo]:
    """The checkpoint ``--resume PATH`` means: PATH itself if it is a complete step folder, else the
    newest complete ``step-NNNNNN`` folder inside PATH.  Interrupted (``.tmp``) folders are ignored.

    Example:
        >>> find_checkpoint("no/such/dir")
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: --resume no/such/dir: no such folder; pass the --checkpoint-dir of an earlier run or one of its step-NNNNNN folders
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"--resume {path}: no such folder; pass the --checkpoint-dir of an earlier run or one of "
                          "its step-NNNNNN folders")
    if is_complete(root):
        return root, CheckpointInfo.load(root)
    if root.name.endswith(".tmp"):
        raise ConfigError(f"--resume {path}: this checkpoint was interrupted mid-write (a .tmp folder) and is never "
                          "used; pass its parent folder to resume from the newest complete one")
    complete = sorted((parse_step(d.name), d) for d in root.iterdir() if d.is_dir() and is_complete(d))
    if not complete:
        partial = sorted(d.name for d in root.iterdir() if d.is_dir() and d.name.startswith("step-"))
        seen = f" ({', '.join(partial[:_LISTED])} {'is' if len(partial) == 1 else 'are'} incomplete: interrupted " \
               "mid-write, ignored)" if partial else ""
        raise ConfigError(f"--resume {path}: holds no complete checkpoint{seen}; pass a folder written by "
                          "--checkpoint-dir, or start without --resume")
    folder = complete[-1][1]
    return folder, CheckpointInfo.load(folder)


def refuse_reused_dir(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Refuse, for a run that does not resume, a ``--checkpoint-dir`` already holding complete checkpoints:
    the run would overwrite some of them and a later ``--resume`` would pick another run's newest one.

    Example:
        >>> refuse_reused_dir("no/such/dir")  # a new folder is fine
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return
    steps = sorted(s for d in root.iterdir() if d.is_dir() and is_complete(d) and (s := parse_step(d.name)) is not None)
    if steps:
        raise ConfigError(f"--checkpoint-dir {checkpoint_dir}: already holds {len(steps)} checkpoint(s) of an earlier "
                          f"run (newest {step_dir_name(steps[-1])}); pass --resume {checkpoint_dir} to continue that "
                          "run, or an empty or new folder to start a new one")


def check_run_settings(folder: Path, info: CheckpointInfo, *, seed: int, global_batch: int) -> None:
    """Refuse a resume whose seed or global batch differs from the checkpointed run's: the data stream
    (synthetic batches are drawn from the seed) and its position (``batches_consumed`` global batches of
    ``info.global_batch`` samples) would not continue that run.  A marker without ``global_batch`` (an
    older one) is not checked for it.

    Example:
        >>> info = CheckpointInfo(step=2, batches_consumed=2, model="m", params_fingerprint="", plan_digest="",
        ...                       num_stages=1, optimizer="adam", seed=0, saved_time_s=0.0, global_batch=4)
        >>> check_run_settings(Path("ck/step-000002"), info, seed=0, global_batch=8)
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: --resume ck/step-000002: the checkpoint was saved at global batch 4 (2 batches of 4 samples consumed) but the plan's global batch is 8; re-plan with --global-batch 4 to continue it
    """
    if info.seed != seed:
        raise ConfigError(f"--resume {folder}: the checkpoint was saved by a run with --seed {info.seed} but this run "
                          f"has --seed {seed} (another data stream); pass --seed {info.seed} to continue it")
    if info.global_batch is not None and info.global_batch != global_batch:
        raise ConfigError(f"--resume {folder}: the checkpoint was saved at global batch {info.global_batch} "
                          f"({info.batches_consumed} batches of {info.global_batch} samples consumed) but the plan's "
                          f"global batch is {global_batch}; re-plan with --global-batch {info.global_batch} to "
                          "continue it")


def saved_keys(folder: Path) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Every key DCP saved in ``folder`` -> (shape, dtype), from its ``.metadata`` (no tensor data read)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(folder)).read_metadata()
    except Exception as err:  # noqa: BLE001 - a truncated or foreign .metadata
        raise ConfigError(f"--resume {folder}: cannot read its {DCP_METADATA} ({type(err).__name__}: {err}); pass "
                          "another checkpoint folder") from None
    out = {}
    for key, md in meta.state_dict_metadata.items():
        size = getattr(md, "size", None)
        if size is not None:
            out[key] = (tuple(size), md.properties.dtype)
    return out


def params_fingerprint(shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> str:
    """sha256 over sorted (name, shape, dtype): the model's identity, independent of how it is cut.

    Example:
        >>> import torch
        >>> a = params_fingerprint({"w": ((2, 3), torch.float32)})
        >>> a == params_fingerprint({"w": ((3, 2), torch.float32)}), len(a)
        (False, 64)
    """
    text = json.dumps([(k, list(s), str(d)) for k, (s, d) in sorted(shapes.items())])
    return hashlib.sha256(text.encode()).hexdigest()


def plan_digest(plan: Any) -> str:
    """sha256 of what makes a resumed run bitwise identical: the captured graph, the cuts, the batch split."""
    t = plan.training
    text = json.dumps([plan.model.fingerprint, [(s.first_unit, s.last_unit) for s in plan.stages],
                       t.global_batch, t.microbatches, t.optimizer])
    return hashlib.sha256(text.encode()).hexdigest()


def check_names(folder: Path, info: CheckpointInfo, *, model: str, fingerprint: str,
                needed: Mapping[str, tuple[tuple[int, ...], Any]], stage: int | None = None) -> None:
    """Refuse, with one `ConfigError`, a checkpoint of another model or one lacking a tensor ``needed``
    (canonical name -> (shape, dtype), parameters only) or holding it with another shape."""
    keys = saved_keys(folder)
    missing = [n for n in needed if MODEL_PREFIX + n not in keys]
    shaped = [f"{n} {keys[MODEL_PREFIX + n][0]} (expected {s})" for n, (s, _) in needed.items()
              if MODEL_PREFIX + n in keys and tuple(keys[MODEL_PREFIX + n][0]) != tuple(s)]
    who = f"stage {stage} needs" if stage is not None else "the model needs"
    fix = (f"resume with --model {info.model} if that is the model, or pass a checkpoint saved by this model "
           "(hetpipe run --checkpoint-dir)")
    if missing or shaped:
        what = (f"lacks {len(missing)} tensor(s) {who}: {_few(missing)}" if missing else
                f"holds tensors of other shapes: {_few(shaped)}")
        raise ConfigError(f"--resume {folder}: checkpoint of model {info.model!r} {what}; {fix}")
    if info.params_fingerprint != fingerprint:
        raise ConfigError(f"--resume {folder}: checkpoint of model {info.model!r} (parameter fingerprint "
                          f"{info.params_fingerprint[:12]}) does not match {model!r} ({fingerprint[:12]}); {fix}")


def _few(names: Iterable[str]) -> str:
    items = list(names)
    more = f" (+{len(items) - _LISTED} more)" if len(items) > _LISTED else ""
    return ", ".join(items[:_LISTED]) + more


# ----------------------------------------------------------------------------- writing


def tmp_folder(root: Path, step: int) -> Path:
    return root / f"{step_dir_name(step)}.tmp"


def prepare_tmp(root: Path, step: int) -> Path:
    """Rank 0, before every rank writes: a fresh ``step-NNNNNN.tmp/`` (a stale one from a crash removed)."""
    tmp = tmp_folder(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish(root: Path, step: int, info: CheckpointInfo) -> Path:
    """Rank 0, after every rank wrote: the marker, then the rename that makes the checkpoint complete.

    An older complete folder of the same step (a re-run into the same directory) is moved
    aside first and removed only after the new one is in place.
    """
    tmp, final = tmp_folder(root, step), root / step_dir_name(step)
    info.save(tmp)
    old = root / f".{step_dir_name(step)}.old-{int(time.time())}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint %s complete (step %d)", final, step)
    return final


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory: the rename is still atomic
        pass
    finally:
        os.close(fd)
