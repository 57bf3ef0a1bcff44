"""Output files: checked writable before any long work, replaced atomically after it.

`check_writable` runs before a solve or a run (so a typo in ``-o`` does not throw away
minutes of work); `atomic_write` writes into a temporary file in the same directory and
renames it over the target only when the content is complete, so a failing run never
truncates an existing plan, report or picture.

A folder is writable when a file can be created in it: the checks create (and remove) one,
because `os.access` says yes to root for read-only file systems such as ``/proc`` and ``/sys``.
A write that fails anyway (a full disk) is a `ConfigError`, one line, never a traceback.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> check_writable(d / "plan.json", "-o")
    >>> atomic_write_text(d / "plan.json", "{}")
    >>> (d / "plan.json").read_text()
    '{}'
    >>> sorted(p.name for p in d.iterdir())  # the checks leave no file behind
    ['plan.json']
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from hetpipe.errors import ConfigError


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` when it is a file, not a folder (``/etc/hostname`` for
    ``/etc/hostname/x.json``); None when it is a folder."""
    for folder in path.parents:
        if folder.exists():
            return None if folder.is_dir() else folder
    return None


def _cannot_create_in(folder: Path) -> str | None:
    """Why no file can be created in `folder` (the OS's reason), or None when one can: a probe file is
    created and removed at once."""
    try:
        fd, name = tempfile.mkstemp(prefix=".hetpipe-probe-", dir=folder)
    except OSError as err:
        return err.strerror or str(err)
    os.close(fd)
    os.unlink(name)
    return None


def _file_problem(path: Path) -> str | None:
    """What stops a file being written at `path`, as the tail of a message, or None (see `check_writable`)."""
    if path.is_dir():
        return f" is a directory; give a file name inside it, e.g. {str(path / 'out')!r}"
    blocker = _file_in_the_way(path)
    if blocker is not None:
        return f": {str(blocker)!r} is a file, not a folder; give a path in a folder"
    if path.exists() and not path.is_file():
        # Replacing a device or a pipe (/dev/null) with a regular file would break it for everyone.
        return " is not a regular file (a device, pipe or socket); give a file path"
    if not path.parent.is_dir():
        return f": the folder {str(path.parent)!r} does not exist; create it (mkdir -p) or write elsewhere"
    why = _cannot_create_in(path.parent)
    if why is not None:
        return f": not writable: cannot create a file in {str(path.parent)!r} ({why}); write elsewhere"
    if path.exists() and not os.access(path, os.W_OK):
        return ": not writable; check the permissions or write elsewhere"
    return None


def check_writable(path: str | Path, option: str) -> None:
    """Raise `ConfigError` unless a file can be written at `path` (its folder exists and a file can be created in it).

    Example:
        >>> try:
        ...     check_writable("", "-o/--output")
        ... except ConfigError as err:
        ...     print(err)
        -o/--output '': the path is empty; give a file path
    """
    if not str(path):
        raise ConfigError(f"{option} '': the path is empty; give a file path")
    try:
        problem = _file_problem(Path(path))
    except OSError as err:  # a folder on the way that may not be searched
        problem = f": cannot look at it ({err.strerror}); check the permissions or write elsewhere"
    if problem is not None:
        raise ConfigError(f"{option} {str(path)!r}{problem}")


def check_folder(path: str | Path, option: str) -> None:
    """Raise `ConfigError` unless `path` is a folder files can be written in, or one that can be made in an
    existing writable folder (nothing is created).

    Example:
        >>> import tempfile
        >>> check_folder(Path(tempfile.mkdtemp()) / "new", "--out")
    """
    if not str(path):
        raise ConfigError(f"{option} '': the path is empty; give a folder")
    path = Path(path)
    try:
        is_dir = path.is_dir()
    except OSError:
        is_dir = False  # check_writable says why it cannot be looked at
    if not is_dir:
        check_writable(path, option)  # a new folder: its parent must take it
        return
    why = _cannot_create_in(path)
    if why is not None:
        raise ConfigError(f"{option} {str(path)!r}: not writable: cannot create a file in it ({why}); give a "
                          "writable folder")


def writable_folder(path: str | os.PathLike[str], option: str) -> str:
    """Create the output folder `path` (parents too) and return it absolute; a `ConfigError`
    naming `option` when it cannot be created or written.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> writable_folder(d / "a" / "b", "--save-weights") == str(d / "a" / "b")
        True
    """
    if not os.fspath(path):
        raise ConfigError(f"{option} '': the path is empty; pass a folder")
    out = Path(path).absolute()
    try:
        blocker = out if out.exists() and not out.is_dir() else _file_in_the_way(out)
    except OSError:
        blocker = None  # a folder on the way that may not be searched: mkdir below says why
    if blocker is not None:
        raise ConfigError(f"{option} {path}: {str(blocker)!r} is a file, not a folder; pass a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{option} {path}: cannot create the folder ({err.strerror}); pass a writable "
                          "folder") from None
    why = _cannot_create_in(out)
    if why is not None:
        raise ConfigError(f"{option} {path}: the folder is not writable ({why}); pass a writable folder")
    return str(out)


def _write_error(path: Path, err: OSError, option: str) -> ConfigError:
    named = f"{option} {str(path)!r}" if option else repr(str(path))
    return ConfigError(f"cannot write {named}: {err.strerror or err}; choose a writable path"
                       + (f" with {option}" if option else "") + " (and check the free space)")


@contextlib.contextmanager
def atomic_path(path: str | Path, *, option: str = "") -> Iterator[Path]:
    """A temporary path next to `path`; renamed onto `path` when the block ends without error.

    An `OSError` (creating, writing or renaming) becomes a one-line `ConfigError` naming `path`
    and `option` (the flag that gave it, if any).

    Example:
        >>> import tempfile, pathlib
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "t.txt"
        >>> with atomic_path(target) as tmp:
        ...     _ = tmp.write_text("done")
        >>> target.read_text()
        'done'
    """
    path = Path(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent)
    except OSError as err:
        raise _write_error(path, err, option) from None
    os.close(fd)
    tmp = Path(name)
    try:
        # mkstemp makes the file 0600; give it the mode a plain open() would (or the replaced file's).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~umask)
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        raise _write_error(path, err, option) from None
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str, *, option: str = "") -> None:
    """Write `text` to `path` through `atomic_path` (never a half-written file)."""
    with atomic_path(path, option=option) as tmp:
        tmp.write_text(text, encoding="utf-8")
