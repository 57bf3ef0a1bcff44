"""The GPU catalog: peak figures per device kind, with sources, and name lookup.

``catalog.json`` (package data next to this module) holds one row per kind: the
`DeviceProfile` fields plus the accumulate mode, the dense/sparse note, the PCIe and
NVLink figures the link model needs, and a ``source`` per row (from
``shared/reference/gpu_specs.md``; figures that file lacks cite NVIDIA datasheets by
name and are marked ``[not in gpu_specs.md]``).

Names resolve case- and punctuation-insensitively, with the vendor words ``NVIDIA``,
``GeForce`` and ``Tesla`` ignored, against the keys and each row's aliases, so
``"RTX 3090"``, ``"3090"`` and NVML's ``"NVIDIA GeForce RTX 3090"`` all mean ``rtx3090``.

Example:
    >>> lookup_gpu("NVIDIA GeForce RTX 3090").kind
    'rtx3090'
    >>> load_catalog().resolve("A100 80GB")
    'a100-80gb'
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Mapping

from hetpipe.cost_models.devices import DeviceProfile
from hetpipe.errors import ConfigError

#: Package resource holding the catalog.
CATALOG_RESOURCE = "catalog.json"
#: Catalog format accepted by `load_catalog`.
CATALOG_FORMAT, CATALOG_VERSION = "hetpipe.catalog", 1
#: Words dropped before matching a name (vendor and product-line prefixes NVML adds).
IGNORED_WORDS = ("nvidia", "geforce", "tesla")
#: Close matches listed when a name is unknown.
MAX_SUGGESTIONS = 3
_PROFILE_FIELDS = ("memory_bytes", "tensor_flops_s", "fp32_flops_s", "memory_bandwidth_bytes_s")


@dataclass(frozen=True)
class CatalogEntry:
    """One catalog row.

    Attributes:
        profile: the `DeviceProfile` (peaks, nvlink/p2p flags, source).
        name: display name.
        aliases: other spellings that resolve to this row.
        pcie_bandwidth_bytes_s: PCIe x16 rate per direction (None for the CPU row).
        nvlink_bandwidth_bytes_s: NVIDIA's NVLink figure (all links, both directions), or None.
        accumulate: accumulate mode of ``profile.tensor_flops_s`` (``fp32``).
        note: caveats (P2P, variants, unverified figures).
        fp32_source: citation of ``profile.fp32_flops_s``.
    """

    profile: DeviceProfile
    name: str
    aliases: tuple[str, ...]
    pcie_bandwidth_bytes_s: float | None
    nvlink_bandwidth_bytes_s: float | None
    accumulate: str
    note: str
    fp32_source: str

    @property
    def key(self) -> str:
        return self.profile.kind


def normalize_name(name: str) -> str:
    """Lower-case `name`, drop vendor words and everything but letters and digits.

    Example:
        >>> normalize_name("NVIDIA GeForce RTX 3060"), normalize_name("a100-80gb")
        ('rtx3060', 'a10080gb')
    """
    words = re.split(r"[^a-z0-9]+", name.lower())
    return "".join(w for w in words if w not in IGNORED_WORDS)


@dataclass(frozen=True)
class Catalog:
    """All rows, by key, and the normalized-name index."""

    entries: Mapping[str, CatalogEntry]
    index: Mapping[str, str]

    def resolve(self, name: str) -> str:
        """The key `name` means, or `ConfigError` listing close matches.

        Example:
            >>> load_catalog().resolve("3060")
            'rtx3060-12gb'
        """
        key = self.index.get(normalize_name(str(name)))
        if key is None:
            raise ConfigError(self.unknown_message(str(name)))
        return key

    def unknown_message(self, name: str) -> str:
        """One line: the unknown name, close matches, and the fix."""
        spellings = {**{k: k for k in self.entries}, **{a: e.key for e in self.entries.values() for a in e.aliases}}
        close = difflib.get_close_matches(name, list(spellings), n=10, cutoff=0.5)
        close += difflib.get_close_matches(normalize_name(name), list(self.index), n=10, cutoff=0.5)
        keys: list[str] = []
        for match in close:
            key = spellings.get(match) or self.index[match]
            if key not in keys:
                keys.append(key)
        hint = f"did you mean {', '.join(repr(k) for k in keys[:MAX_SUGGESTIONS])}? " if keys else ""
        return (f"unknown GPU {name!r}; {hint}known: {', '.join(self.entries)}; or describe the card "
                "with name, memory, tensor_tflops, fp32_tflops and memory_bandwidth")

    def entry(self, name: str) -> CatalogEntry:
        return self.entries[self.resolve(name)]


def _entry(key: str, row: Mapping[str, Any]) -> CatalogEntry:
    for f in _PROFILE_FIELDS:
        if not isinstance(row.get(f), (int, float)) or row[f] <= 0:
            raise ConfigError(f"catalog.json: gpus.{key}.{f} must be a positive number; fix the package data")
    if not row.get("source"):
        raise ConfigError(f"catalog.json: gpus.{key} has no source; every row must cite one")
    profile = DeviceProfile(
        kind=key, memory_bytes=int(row["memory_bytes"]), tensor_flops_s=float(row["tensor_flops_s"]),
        fp32_flops_s=float(row["fp32_flops_s"]), memory_bandwidth_bytes_s=float(row["memory_bandwidth_bytes_s"]),
        nvlink=bool(row.get("nvlink", False)), p2p=bool(row.get("p2p", False)), source=str(row["source"]),
    )
    return CatalogEntry(
        profile=profile, name=str(row.get("name", key)), aliases=tuple(row.get("aliases", ())),
        pcie_bandwidth_bytes_s=row.get("pcie_bandwidth_bytes_s"),
        nvlink_bandwidth_bytes_s=row.get("nvlink_bandwidth_bytes_s"),
        accumulate=str(row.get("accumulate", "fp32")), note=str(row.get("note", "")),
        fp32_source=str(row.get("fp32_source", "")),
    )


def catalog_from_dict(doc: Mapping[str, Any]) -> Catalog:
    """Build a `Catalog` from the parsed JSON document (checked: figures positive, sources present,
    no two spellings of different rows colliding).

    Example:
        >>> row = {"memory_bytes": 1, "tensor_flops_s": 1.0, "fp32_flops_s": 1.0,
        ...        "memory_bandwidth_bytes_s": 1.0, "source": "test", "aliases": ["Card X"]}
        >>> catalog_from_dict({"format": "hetpipe.catalog", "version": 1, "gpus": {"x1": row}}).resolve("card-x")
        'x1'
    """
    if doc.get("format") != CATALOG_FORMAT or doc.get("version") != CATALOG_VERSION:
        raise ConfigError(f"catalog.json: expected format {CATALOG_FORMAT!r} version {CATALOG_VERSION}; "
                          "reinstall hetpipe")
    entries = {key: _entry(key, row) for key, row in doc["gpus"].items()}
    index: dict[str, str] = {}
    for key, entry in entries.items():
        for spelling in (key, *entry.aliases):
            norm = normalize_name(spelling)
            if index.setdefault(norm, key) != key:
                raise ConfigError(f"catalog.json: {spelling!r} names both {index[norm]!r} and {key!r}")
    return Catalog(entries=entries, index=index)


@functools.lru_cache(maxsize=1)
def load_catalog() -> Catalog:
    """The packaged catalog (parsed once).

    Example:
        >>> len(load_catalog().entries) >= 15
        True
    """
    text = resources.files("hetpipe.cost_models").joinpath(CATALOG_RESOURCE).read_text(encoding="utf-8")
    return catalog_from_dict(json.loads(text))


def lookup_gpu(name: str) -> DeviceProfile:
    """The catalog profile `name` resolves to; `ConfigError` with close matches otherwise.

    Example:
        >>> lookup_gpu("RTX 4090").tensor_flops_s
        165200000000000.0
    """
    return load_catalog().entry(name).profile
