"""Parse the quantities a cluster file spells with units: memory, bandwidth, latency.

Every parser takes a number (already in the base unit: bytes, bytes/s, seconds) or a
string "<number> <unit>" and returns the base-unit value, or raises `ValueError` with
a message listing the accepted units (the cluster loader turns it into a
`ConfigError` naming the file and field).

Decimal prefixes are powers of 1000 (``GB`` = 1e9 B), binary prefixes powers of 1024
(``GiB`` = 2**30 B), as in IEC 80000-13.  Bandwidth accepts bytes (``GB/s``) and bits
(``Gbit/s``, ``Gbps``, ``Gb/s``): a lower-case ``b`` means bits, as in network specs.

Example:
    >>> parse_bytes("24GB"), parse_bytes("1 GiB"), parse_bytes("24e9"), parse_bytes(512)
    (24000000000, 1073741824, 24000000000, 512)
    >>> parse_bandwidth_bytes_s("1Gbit/s"), parse_bandwidth_bytes_s("10GB/s")
    (125000000.0, 10000000000.0)
    >>> parse_latency_s("0.2ms"), parse_latency_s("30 ms"), parse_latency_s("5us")
    (0.0002, 0.03, 5e-06)
"""

from __future__ import annotations

import math
import re

#: Bits per byte (the factor between network bit rates and byte rates).
BITS_PER_BYTE = 8

_DECIMAL = {"": 1, "K": 10**3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}

#: Memory units -> bytes.
BYTE_UNITS: dict[str, int] = {
    **{f"{p}B": f for p, f in _DECIMAL.items()},
    **{f"{p}B": f for p, f in _BINARY.items()},
}

#: Bandwidth units -> bytes per second.
BANDWIDTH_UNITS: dict[str, float] = {
    **{f"{u}/s": float(f) for u, f in BYTE_UNITS.items()},
    **{f"{p}bit/s": f / BITS_PER_BYTE for p, f in _DECIMAL.items()},
    **{f"{p}b/s": f / BITS_PER_BYTE for p, f in _DECIMAL.items() if p},
    **{f"{p}bps": f / BITS_PER_BYTE for p, f in _DECIMAL.items()},
}

#: Time units -> seconds (``us`` and ``µs`` both mean microseconds).
TIME_UNITS: dict[str, float] = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(\S*)\s*$")


def _split(value: object, units: dict[str, float] | dict[str, int], what: str) -> tuple[float, float]:
    """(number, factor) of `value`; a bare number has factor 1 (the base unit)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a {what}, got {value!r}")
    if isinstance(value, (int, float)):
        number, factor = float(value), 1.0
    elif isinstance(value, str):
        match = _QUANTITY.match(value)
        if not match:
            raise ValueError(f"cannot read {value!r} as a {what}; write e.g. {_example(units)}")
        unit = match.group(2)
        if unit and unit not in units:
            raise ValueError(f"unknown unit {unit!r} in {value!r}; use one of {', '.join(u for u in units if u)}")
        number, factor = float(match.group(1)), float(units[unit]) if unit else 1.0
    else:
        raise ValueError(f"expected a {what} (number or string with a unit), got {type(value).__name__}")
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {value!r}; give a finite number with a unit")
    return number, factor


def _example(units: dict[str, float] | dict[str, int]) -> str:
    if "GB" in units:
        return "'24GB', '24 GiB', '24e9' or a byte count"
    if "Gbit/s" in units:
        return "'1Gbit/s', '10GB/s' or '125MB/s'"
    return "'0.2ms', '30 ms' or '5us'"


def _tidy(x: float) -> float:
    """`x` rounded to 15 significant digits: ``5 * 1e-6`` reads back as ``5e-06`` (unit products only)."""
    return float(f"{x:.15g}")


def parse_bytes(value: object) -> int:
    """Bytes from ``24GB``, ``24 GiB``, ``24e9``, ``512MB`` or an integer byte count.

    Example:
        >>> parse_bytes("512 MiB")
        536870912
    """
    number, factor = _split(value, BYTE_UNITS, "memory size")
    total = number * factor
    if not math.isfinite(total):  # 1e300TB: finite number, infinite product
        raise ValueError(f"{str(value)[:40]!r} is too large to be a memory size; check the unit and the exponent")
    rounded = round(total)
    if abs(total - rounded) > 1e-6 * max(1.0, abs(total)):
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(rounded)


def parse_bandwidth_bytes_s(value: object) -> float:
    """Bytes per second from ``1Gbit/s``, ``100 Mbps``, ``10GB/s``, ``125MB/s`` or a number of B/s.

    Example:
        >>> parse_bandwidth_bytes_s("100Mbit/s")
        12500000.0
    """
    number, factor = _split(value, BANDWIDTH_UNITS, "bandwidth")
    return number if factor == 1.0 else _tidy(number * factor)


def parse_latency_s(value: object) -> float:
    """Seconds from ``0.2ms``, ``30 ms``, ``5us``, ``1s`` or a number of seconds.

    Example:
        >>> parse_latency_s("250 us")
        0.00025
    """
    number, factor = _split(value, TIME_UNITS, "latency")
    return number if factor == 1.0 else _tidy(number * factor)


def format_bytes(num_bytes: int) -> str:
    """A short, exact-enough spelling parse_bytes reads back (``24GiB``, ``1.5GB``, ``123B``).

    Example:
        >>> format_bytes(24 * 2**30), format_bytes(1_500_000_000), parse_bytes(format_bytes(123_456_789))
        ('24GiB', '1.5GB', 123456789)
    """
    for unit in ("TiB", "GiB", "MiB"):
        if num_bytes and num_bytes % BYTE_UNITS[unit] == 0:
            return f"{num_bytes // BYTE_UNITS[unit]}{unit}"
    for unit in ("TB", "GB", "MB"):
        scaled = num_bytes / BYTE_UNITS[unit]
        spelled = f"{round(scaled, 3):.15g}{unit}"
        if scaled >= 1 and parse_bytes(spelled) == num_bytes:
            return spelled
    return f"{num_bytes}B"


def human_bytes(num_bytes: float) -> str:
    """Bytes with a binary prefix, two decimals, for tables and messages.

    Example:
        >>> human_bytes(3 * 2**20), human_bytes(1.5 * 2**30), human_bytes(512)
        ('3.00 MiB', '1.50 GiB', '512 B')
    """
    for unit in ("GiB", "MiB", "KiB"):
        if abs(num_bytes) >= BYTE_UNITS[unit]:
            return f"{num_bytes / BYTE_UNITS[unit]:.2f} {unit}"
    return f"{int(num_bytes)} B"
