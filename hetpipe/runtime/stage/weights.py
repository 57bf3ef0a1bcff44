"""Read a stage's weights from a checkpoint without loading the whole model, and write them back.

``--weights PATH`` accepts what people have on disk:

* a ``.safetensors`` file;
* a folder in Hugging Face ``save_pretrained`` layout: ``model.safetensors``, or
  ``model.safetensors.index.json`` whose ``weight_map`` names the shard of every tensor;
* a ``torch.save`` state-dict file (``.pt``/``.pth``/``.bin``, or ``pytorch_model.bin``
  in a folder), opened with ``torch.load(mmap=True, weights_only=True)`` so its storages
  are mapped, not read.

`Checkpoint` is a read-only ``Mapping[str, Tensor]`` over such a path: its keys are known
up front (safetensors headers, the index's ``weight_map``, the mapped state dict) and a
tensor is read from its file only when it is looked up (``safe_open(...).get_tensor``:
only that tensor's bytes).  `build_stage` looks up exactly its own stage's names, one
at a time, and copies each into the stage's already allocated tensor, so a rank holds
its stage's bytes plus one tensor in flight, never the whole model.  `check_stage`
checks every name and shape of a stage against the headers first and raises one
`ConfigError` naming the key, the file and the fix.

`save_stage` writes one stage's parameters and buffers as one safetensors shard
(``model-0000k-of-0000p.safetensors``, stage k-1 of p), a tied parameter only on its
owner stage and under its first name (the embedding's: HF tied checkpoints omit
``lm_head.weight``); `write_index` merges the shards' key lists into
``model.safetensors.index.json``, so the folder is again a ``--weights`` folder and a
``from_pretrained`` folder.

Example:
    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> d = tempfile.mkdtemp()
    >>> save_file({"0.weight": torch.ones(2, 3), "0.bias": torch.zeros(2)}, f"{d}/model.safetensors")
    >>> ckpt = Checkpoint(d)
    >>> sorted(ckpt), ckpt.shape("0.weight"), "1.weight" in ckpt
    (['0.bias', '0.weight'], (2, 3), False)
    >>> ckpt["0.weight"].sum().item()
    6.0
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hetpipe.errors import ConfigError

log = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"  # transformers.utils.SAFE_WEIGHTS_NAME
SAFE_INDEX_NAME = "model.safetensors.index.json"  # transformers.utils.SAFE_WEIGHTS_INDEX_NAME
#: The shards `shard_name` writes; only files of this form are removed as stale (`remove_stale_shards`).
SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
TORCH_WEIGHTS_NAME = "pytorch_model.bin"  # transformers.utils.WEIGHTS_NAME
_FIX = ("pass --weights a file or folder saved from this model (`hetpipe run --save-weights`, "
        "`model.save_pretrained(dir)`, `safetensors.torch.save_model` or `torch.save(model.state_dict(), f)`)")


def _files(path: Path) -> tuple[str, list[Path], dict[str, str]]:
    """(format, files, key -> file name from an index) of a weights path; raises `ConfigError`."""
    if not path.exists():
        raise ConfigError(f"--weights {path}: no such file or folder; {_FIX}")
    if path.is_dir():
        index = path / SAFE_INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ConfigError(f"--weights {index}: not a safetensors index ({type(err).__name__}: {err}); it "
                                  "must be JSON with a 'weight_map' {tensor name: shard file}") from None
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (path / s).is_file()]
            if missing:
                raise ConfigError(f"--weights {index} names shard {missing[0]!r}, which is not in {path}; copy every "
                                  "shard the index lists next to it")
            return "safetensors", [path / s for s in shards], dict(weight_map)
        for name, fmt in ((SAFE_WEIGHTS_NAME, "safetensors"), (TORCH_WEIGHTS_NAME, "torch")):
            if (path / name).is_file():
                return fmt, [path / name], {}
        raise ConfigError(f"--weights {path}: a folder must hold {SAFE_WEIGHTS_NAME}, {SAFE_INDEX_NAME} (with its "
                          f"shards) or {TORCH_WEIGHTS_NAME}; {_FIX}")
    return ("safetensors" if path.suffix == ".safetensors" else "torch"), [path], {}


class Checkpoint(Mapping[str, torch.Tensor]):
    """Lazy, read-only name -> tensor view of a weights file or folder (see the module docstring).

    Raises `ConfigError` when the path is missing, unreadable or not a checkpoint.
    Tensors are read on ``ckpt[name]`` (CPU, the file's dtype); ``name in ckpt``,
    `shape` and `file_of` read headers only.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.format, self.files, by_index = _files(self.path)
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        if self.format == "torch":
            self._torch = self._open_torch(self.files[0])
            self._where = dict.fromkeys(self._torch, self.files[0])
        elif by_index:
            self._where = {k: self.path / f for k, f in by_index.items()}
        else:
            for f in self.files:
                self._where.update(dict.fromkeys(self._safe(f).keys(), f))

    @staticmethod
    def _open_torch(path: Path) -> Mapping[str, torch.Tensor]:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # noqa: BLE001 - pickle/zip/permission errors all mean "not loadable"
            raise ConfigError(f"--weights {path}: cannot read it as a torch state dict ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); save it with "
                              "torch.save(model.state_dict(), path) or as .safetensors") from None
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ConfigError(f"--weights {path}: holds a {type(state).__name__}, not a flat state dict of tensors; "
                              "save model.state_dict() itself (not a dict around it)")
        return state

    def _safe(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as err:  # noqa: BLE001 - header/IO errors from the Rust reader
                raise ConfigError(f"--weights {path}: not a readable safetensors file ({type(err).__name__}: "
                                  f"{err}); {_FIX}") from None
        return self._handles[path]

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._where

    def __getitem__(self, key: str) -> torch.Tensor:
        where = self._where[key]
        if self.format == "torch":
            return self._torch[key]
        try:
            return self._safe(where).get_tensor(key)
        except Exception as err:  # noqa: BLE001 - a key the index lists but the shard lacks, a truncated file
            raise ConfigError(f"--weights {self.path}: cannot read {key!r} from {where} ({type(err).__name__}: "
                              f"{err}); the index and its shards disagree: re-save the checkpoint") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def file_of(self, key: str) -> Path:
        """The file holding ``key``."""
        return self._where[key]

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of ``key`` from the file's header (no tensor data read)."""
        if self.format == "torch":
            return tuple(self._torch[key].shape)
        return tuple(self._safe(self._where[key]).get_slice(key).get_shape())


def open_weights(path: str | os.PathLike[str] | None) -> Checkpoint | None:
    """`Checkpoint` of ``path`` (None for None): the check `hetpipe run` does before launching.

    Example:
        >>> open_weights("no/such/dir")
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: --weights no/such/dir: no such file or folder; pass --weights a file or folder saved from this model (`hetpipe run --save-weights`, `model.save_pretrained(dir)`, `safetensors.torch.save_model` or `torch.save(model.state_dict(), f)`)
    """
    if path is None:
        return None
    ckpt = Checkpoint(path)
    if not os.access(ckpt.files[0], os.R_OK):
        raise ConfigError(f"--weights {ckpt.files[0]}: not readable by this user; fix its permissions")
    return ckpt


def stage_names(program: Any, stage: int) -> list[tuple[str, tuple[str, ...], str]]:
    """(local name, every name it is known by, kind) for each parameter and buffer of ``stage``."""
    module = program.modules[stage]
    seen: dict[int, tuple[str, list[str], str]] = {}
    for kind, items in (("parameter", module.named_parameters(remove_duplicate=False)),
                        ("buffer", module.named_buffers(remove_duplicate=False))):
        for name, t in items:
            seen.setdefault(id(t), (name, [], kind))[1].extend(program.aliases.get(name, (name,)))
    return [(name, tuple(dict.fromkeys(keys)), kind) for name, keys, kind in seen.values()]


def check_stage(program: Any, stage: int, ckpt: Checkpoint) -> None:
    """Raise one `ConfigError` for the first tensor of ``stage`` missing from ``ckpt`` or of another shape.

    Buffers may be absent (non-persistent ones, e.g. rotary tables, are not saved):
    `build_stage` then uses the traced module's own.
    """
    module = program.modules[stage]
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    for name, keys, kind in stage_names(program, stage):
        key = next((k for k in keys if k in ckpt), None)
        if key is None:
            if kind == "buffer":
                continue
            also = f" (or {', '.join(map(repr, keys[1:]))})" if len(keys) > 1 else ""
            files = ", ".join(str(f) for f in ckpt.files[:3]) + (" ..." if len(ckpt.files) > 3 else "")
            raise ConfigError(f"--weights {ckpt.path}: stage {stage} needs {kind} {keys[0]!r}{also}, which is not in "
                              f"{files}; {_FIX}")
        want, got = tuple(tensors[name].shape), ckpt.shape(key)
        if got != want:
            raise ConfigError(f"--weights {ckpt.path}: {key!r} in {ckpt.file_of(key)} has shape {got}, the model "
                              f"expects {want}; pass weights of this model's configuration")


# ----------------------------------------------------------------------------- saving


def shard_name(stage: int, num_stages: int) -> str:
    """HF's shard naming: ``model-00001-of-00003.safetensors`` for stage 0 of 3.

    Example:
        >>> shard_name(2, 3)
        'model-00003-of-00003.safetensors'
    """
    return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def saved_names(program: Any, stage: int) -> dict[str, str]:
    """Local name -> name to save under, for what ``stage`` saves: its parameters and buffers,
    a tied parameter only on its owner stage (the first holding it) and under its first name."""
    not_mine = {g.local_name(stage) for g in program.tied if g.owner_stage != stage}
    return {name: keys[0] for name, keys, _ in stage_names(program, stage) if name not in not_mine}


def save_stage(module: torch.nn.Module, names: Mapping[str, str], out_dir: str | os.PathLike[str], *,
               stage: int, num_stages: int) -> tuple[str, dict[str, int]]:
    """Write ``module``'s tensors listed in ``names`` to its shard; returns (file name, key -> bytes)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    local = dict(module.named_parameters(remove_duplicate=False))
    local.update(module.named_buffers(remove_duplicate=False))
    tensors = {key: local[name].detach().to("cpu").contiguous() for name, key in names.items()}
    file = shard_name(stage, num_stages)
    tmp = out / f".{file}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / file)  # a reader never sees half a shard
    return file, {k: t.numel() * t.element_size() for k, t in tensors.items()}


def write_index(out_dir: str | os.PathLike[str], shards: Sequence[tuple[str, Mapping[str, int]]]) -> Path:
    """``model.safetensors.index.json`` over every stage's (file, key -> bytes); refuses a key saved twice."""
    weight_map: dict[str, str] = {}
    for file, keys in shards:
        for key in keys:
            if key in weight_map:
                raise ConfigError(f"--save-weights: {key!r} is saved by both {weight_map[key]} and {file}; this is "
                                  "a bug in hetpipe's tied-parameter bookkeeping")
            weight_map[key] = file
    total = sum(n for _, keys in shards for n in keys.values())
    path = Path(out_dir) / SAFE_INDEX_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                              indent=2))
    os.replace(tmp, path)
    remove_stale_shards(out_dir, {file for file, _ in shards} | set(weight_map.values()))
    return path


def remove_stale_shards(out_dir: str | os.PathLike[str], keep: set[str]) -> list[str]:
    """Delete an earlier save's shards (``model-0000k-of-0000p.safetensors``) from ``out_dir`` that the new index
    does not list: a save into a folder saved before with another stage count would leave them beside the new
    ones.  Only files named like a shard go; returns their names.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("model-00001-of-00002.safetensors", "model-00001-of-00003.safetensors", "notes.txt"):
        ...     _ = (d / name).write_bytes(b"")
        >>> remove_stale_shards(d, {"model-00001-of-00003.safetensors"}), sorted(p.name for p in d.iterdir())
        (['model-00001-of-00002.safetensors'], ['model-00001-of-00003.safetensors', 'notes.txt'])
    """
    stale = sorted(p.name for p in Path(out_dir).iterdir()
                   if p.is_file() and SHARD_PATTERN.fullmatch(p.name) and p.name not in keep)
    for name in stale:
        (Path(out_dir) / name).unlink(missing_ok=True)  # another saver may have removed it first
    if stale:
        log.info("--save-weights: removed %d shard(s) of an earlier save: %s", len(stale), ", ".join(stale))
    return stale


def save_pipeline(module: torch.nn.Module, names: Mapping[str, str], out_dir: str | os.PathLike[str], *,
                  stage: int, num_stages: int, group: Any = None) -> None:
    """Every rank of a pipeline writes its shard; the first stage's rank then writes the index.

    Collective over ``group`` (default: the world; every stage must call it).
    """
    import torch.distributed as dist

    mine = save_stage(module, names, out_dir, stage=stage, num_stages=num_stages)
    if not (dist.is_available() and dist.is_initialized()):
        write_index(out_dir, [mine])
        return
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (stage, mine), group=group)
    if stage == 0:
        write_index(out_dir, [shard for _, shard in sorted(every)])
    dist.barrier(group=group)


def copy_side_files(weights: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Copy what a ``save_pretrained`` folder holds besides weights (``config.json``,
    ``generation_config.json``, tokenizer files) from a ``--weights`` folder into ``out_dir``,
    so the saved folder loads with ``from_pretrained`` as the original did; files already there
    are kept.  Returns the files copied (none when ``weights`` is a file).

    Example:
        >>> import tempfile, pathlib
        >>> src, dst = pathlib.Path(tempfile.mkdtemp()), pathlib.Path(tempfile.mkdtemp())
        >>> _ = (src / "config.json").write_text("{}"); _ = (src / "model.safetensors").write_bytes(b"")
        >>> [p.name for p in copy_side_files(src, dst)]
        ['config.json']
    """
    import shutil

    src, out = Path(weights), Path(out_dir)
    if not src.is_dir():
        return []
    weight_like = (".safetensors", ".bin", ".pt", ".pth")
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != SAFE_INDEX_NAME and not f.name.endswith(weight_like) \
                and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
            copied.append(out / f.name)
    return copied
