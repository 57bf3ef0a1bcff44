"""Every dotted ``hetpipe.x.y.name`` the README and docs/*.md name must import and resolve
(the README once named `hetpipe.plan.build.partition_replicas`, which lives in `hetpipe.plan.replicas`)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"\bhetpipe(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FROM_IMPORT = re.compile(r"from (hetpipe(?:\.[A-Za-z_][A-Za-z0-9_]*)*) import ([A-Za-z_][A-Za-z0-9_]*)")


def _named_paths() -> list[str]:
    found: set[str] = set()
    for doc in DOCS:
        text = doc.read_text()
        found.update(DOTTED.findall(text))
        found.update(f"{mod}.{name}" for mod, name in FROM_IMPORT.findall(text))
    return sorted(found)


def _resolve(path: str) -> object:
    """The object `path` names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError: the docs name something that is not there
        return obj
    raise ModuleNotFoundError(path)


def test_the_docs_name_some_paths():
    assert "hetpipe.plan.replicas.partition_replicas" in _named_paths()


@pytest.mark.parametrize("path", _named_paths())
def test_every_named_hetpipe_path_resolves(path):
    assert _resolve(path) is not None
