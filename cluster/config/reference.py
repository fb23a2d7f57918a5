"""The configuration reference, read from the config dataclasses themselves.

Each key's description is the attribute docstring under its field (the string literal on the
line after it, the convention Sphinx and pydantic read too); its type comes from the type hint,
its default from the field, its valid values from the section's ``CHOICES`` (the same mapping
``__post_init__`` validates with). The docs site renders ``config_keys()`` and a unit test fails
on any key without a description, so the reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cluster.config.tree import ClusterConfig


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """One key of the tree: ``path`` is dotted (``decode.routing.policy``)."""

    path: str
    value_type: str
    default: str
    doc: str
    choices: tuple[str, ...] = ()
    section: type | None = None  # the dataclass whose keys lie under this one, when a section


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring, for ``cls`` and the dataclasses it inherits."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for stmt, after in itertools.pairwise(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            if isinstance(after.value.value, str):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def config_keys(cls: type = ClusterConfig, prefix: str = "") -> Iterator[ConfigKey]:
    """Every key under ``cls``, depth first in declaration order, sections before their keys."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    choices: dict[str, tuple[str, ...]] = dict(getattr(cls, "CHOICES", {}))
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        section: type | None = tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None
        yield ConfigKey(
            path=path,
            value_type=type_name(tp),
            default="" if section else yaml_value(_default(f)),
            doc=docs.get(f.name, ""),
            choices=choices.get(f.name, ()),
            section=section,
        )
        if section is not None:
            yield from config_keys(section, path)


def undocumented_keys(cls: type = ClusterConfig) -> list[str]:
    """The dotted keys under ``cls`` whose field has no description."""
    return [key.path for key in config_keys(cls) if not key.doc.strip()]


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def type_name(tp: Any) -> str:
    """A type hint as a YAML user reads it: ``int | null``, ``list of string``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(tp))
    if origin is tuple:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        return f"mapping of {type_name(key_tp)} to {type_name(val_tp)}"
    if dataclasses.is_dataclass(tp):
        return "section"
    names = {type(None): "null", str: "string", int: "int", float: "float", bool: "bool"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def yaml_value(value: Any) -> str:
    """A default as YAML spells it (``null``, ``true``, ``[shm, zmq]``, ``{}``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return '""' if value == "" else value
    if dataclasses.is_dataclass(value):
        return "(section)"
    return repr(value)
