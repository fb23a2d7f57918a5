"""The checks every config section validates with: the error always names the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def check(ok: bool, name: str, message: str) -> None:
    if not ok:
        fail(name, message)


def check_choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        fail(name, f"unknown value {value!r}; valid values: {', '.join(choices)}")


def check_choices(section: Any, name: str) -> None:
    """Check each key the section's ``CHOICES`` names (every item of a list) against its valid
    values. ``CHOICES`` is also what the configuration reference lists, so the two agree."""
    choices: Mapping[str, tuple[str, ...]] = type(section).CHOICES
    for key, valid in choices.items():
        value = getattr(section, key)
        for item in value if isinstance(value, tuple) else (value,):
            check_choice(item, f"{name}.{key}", valid)
