"""Typed JSON (de)serialisation of frozen dataclasses, with path-naming errors.

Encoding: dataclasses become objects (fields in declaration order), tuples
become lists, mappings stay objects.  Decoding follows the type hints and
raises `PlanError` naming the JSON path of the first bad value, so a hand-
edited plan gets "stages[2].device: expected int, got str" rather than a
traceback.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class P:
    ...     x: int
    ...     ys: tuple[float, ...]
    >>> to_json(P(1, (2.0,)))
    {'x': 1, 'ys': [2.0]}
    >>> from_json(P, {'x': 1, 'ys': [2.0]})
    P(x=1, ys=(2.0,))
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar, Union

from hetpipe.errors import PlanError

T = TypeVar("T")


def to_json(obj: Any) -> Any:
    """Encode dataclasses, tuples, mappings and primitives as JSON-ready values.

    A field declared with ``metadata={"since": N}`` (added in plan version N) is left out
    while it holds its default, so a plan that does not use it stays readable by a hetpipe
    that predates the field (which refuses unknown fields).
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not ("since" in f.metadata and getattr(obj, f.name) == f.default)}
    if isinstance(obj, (tuple, list)):
        return [to_json(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_json(v) for k, v in obj.items()}
    return obj


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _decode_primitive(tp: type, value: Any, path: str) -> Any:
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise PlanError(f"{path}: expected {tp.__name__}, got {_type_name(value)} ({value!r:.40})")


def _decode(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], value, path)
    if dataclasses.is_dataclass(tp):
        return from_json(tp, value, path=path)
    if origin is tuple:
        if not isinstance(value, list):
            raise PlanError(f"{path}: expected a list, got {_type_name(value)}")
        (item,) = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return tuple(_decode(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping, typing.Mapping) or tp is dict:
        if not isinstance(value, dict):
            raise PlanError(f"{path}: expected an object, got {_type_name(value)}")
        args = typing.get_args(tp)
        val_tp = args[1] if args else Any
        return {k: _decode(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    return _decode_primitive(tp, value, path)


def from_json(cls: type[T], data: Any, *, path: str = "plan") -> T:
    """Decode `data` into dataclass `cls`, checking every field against its type hint."""
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected an object, got {_type_name(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    for key in data:
        if key not in names:  # an extra field is a typo or another tool's: refuse rather than drop it
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PlanError(f"{path}.{str(key)[:60]}: unknown field; {hint}remove it (fields here: {', '.join(names)})")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if has_default:
                continue
            raise PlanError(f"{path}: missing field {f.name!r}")
        kwargs[f.name] = _decode(hints[f.name], data[f.name], f"{path}.{f.name}")
    return cls(**kwargs)


def least_version(obj: Any, floor: int = 1) -> int:
    """The lowest plan version that can carry `obj`: the largest ``since`` of a field (anywhere
    in the dataclass tree) that holds something other than its default.

    Example:
        >>> from dataclasses import dataclass, field
        >>> @dataclass(frozen=True)
        ... class S:
        ...     a: int
        ...     b: tuple = field(default=(), metadata={"since": 3})
        >>> least_version((S(1), S(2))), least_version((S(1), S(2, (7,))))
        (1, 3)
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if "since" in f.metadata and value != f.default:
                floor = max(floor, int(f.metadata["since"]))
            floor = least_version(value, floor)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            floor = least_version(v, floor)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            floor = least_version(v, floor)
    return floor

