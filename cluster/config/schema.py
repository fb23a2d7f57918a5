"""Plain data (parsed YAML, dotted overrides) <-> the frozen config dataclasses, generically.

Values are checked (and gently coerced: int -> float, list -> tuple) against each field's type
hint, with a ``ValueError`` naming the dotted field; unknown keys are refused with the valid
ones listed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from cluster.config.validation import fail


def apply_dotted(data: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                valid = ", ".join(sorted(k for k, v in node.items() if isinstance(v, dict)))
                raise ValueError(f"{prefix}: unknown config section; valid sections: {valid}")
            node = child
        leaf = parts[-1]
        if leaf not in node:
            valid = ", ".join(sorted(node))
            raise ValueError(f"{dotted}: unknown config key; valid keys here: {valid}")
        node[leaf] = value


def coerce_value(value: Any, tp: Any, name: str) -> Any:
    """Check (and gently coerce: int -> float, list -> tuple) a YAML value against a type hint."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), name)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            fail(name, f"must be a mapping (section), got {type(value).__name__}")
        return build_dataclass(tp, value, name)
    if origin is tuple:
        return _coerce_tuple(value, typing.get_args(tp)[0], name)
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        return _coerce_dict(value, key_tp, val_tp, name)
    if tp is Any:
        return value
    if value is None:
        fail(name, "must not be null")
    coerce = _SCALARS.get(tp)
    if coerce is None:
        raise TypeError(f"{name}: unsupported config type {tp!r}")  # a bug in this module
    return coerce(value, name)


def _coerce_union(value: Any, args: tuple[Any, ...], name: str) -> Any:
    """The first member type the value fits (``X | None`` accepts null); else the first error."""
    if value is None:
        if type(None) in args:
            return None
        fail(name, "must not be null")
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce_value(value, arg, name)
        except ValueError as e:
            errors.append(str(e))
    raise ValueError(errors[0] if errors else f"{name}: invalid value {value!r}")


def _coerce_tuple(value: Any, item_tp: Any, name: str) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        fail(name, f"must be a list, got {type(value).__name__}")
    return tuple(coerce_value(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value))


def _coerce_dict(value: Any, key_tp: Any, val_tp: Any, name: str) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        fail(name, f"must be a mapping, got {type(value).__name__}")
    return {
        coerce_value(k, key_tp, name): coerce_value(v, val_tp, f"{name}.{k}")
        for k, v in value.items()
    }


def _coerce_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        fail(name, f"must be true or false, got {value!r}")
    return bool(value)


def _coerce_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(name, f"must be an integer, got {value!r}")
    return int(value)


def _coerce_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        fail(name, f"must be a number, got {value!r}")
    if math.isnan(float(value)):
        fail(name, "must not be NaN")
    return float(value)


def _coerce_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        fail(name, f"must be a string, got {value!r}")
    return str(value)


_SCALARS: dict[Any, Callable[[Any, str], Any]] = {
    bool: _coerce_bool,
    int: _coerce_int,
    float: _coerce_float,
    str: _coerce_str,
}


def build_dataclass(cls: Any, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(
            f"{where}{unknown[0]}: unknown config key; valid keys"
            f"{' in ' + prefix if prefix else ''}: {', '.join(names)}"
        )
    kwargs = {
        k: coerce_value(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()
    }
    return cls(**kwargs)


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_plain(v) for v in obj]
    return obj
