"""Output files: checked writable before any long work, replaced atomically after it.

`check_writable` runs before a solve or a run (so a typo in ``-o`` does not throw away
minutes of work); `atomic_write` writes into a temporary file in the same directory and
renames it over the target only when the content is complete, so a failing run never
truncates an existing plan, report or picture.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> check_writable(d / "plan.json", "-o")
    >>> atomic_write_text(d / "plan.json", "{}")
    >>> (d / "plan.json").read_text()
    '{}'
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from hetpipe.errors import ConfigError


def check_writable(path: str | Path, option: str) -> None:
    """Raise `ConfigError` unless a file can be written at `path` (its folder exists and is writable)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a directory; give a file name inside it, e.g. "
                          f"{str(path / 'out')!r}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"{option} {str(path)!r}: the folder {str(parent)!r} does not exist; create it "
                          "(mkdir -p) or write elsewhere")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{option} {str(path)!r}: not writable; check the permissions or write elsewhere")


def writable_folder(path: str | os.PathLike[str], option: str) -> str:
    """Create the output folder `path` (parents too) and return it absolute; a `ConfigError`
    naming `option` when it cannot be created or written.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> writable_folder(d / "a" / "b", "--save-weights") == str(d / "a" / "b")
        True
    """
    out = Path(path).absolute()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{option} {path}: cannot create the folder ({err.strerror}); pass a writable "
                          "folder") from None
    if not os.access(out, os.W_OK):
        raise ConfigError(f"{option} {path}: the folder is not writable; pass a writable folder")
    return str(out)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path next to `path`; renamed onto `path` when the block ends without error.

    Example:
        >>> import tempfile, pathlib
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "t.txt"
        >>> with atomic_path(target) as tmp:
        ...     _ = tmp.write_text("done")
        >>> target.read_text()
        'done'
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent or ".")
    os.close(fd)
    tmp = Path(name)
    # mkstemp makes the file 0600; give it the mode a plain open() would (or the replaced file's).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~umask)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through `atomic_path` (never a half-written file)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
