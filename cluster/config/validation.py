"""The three checks every config section validates with: the error always names the field."""

from __future__ import annotations


def fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def check(ok: bool, name: str, message: str) -> None:
    if not ok:
        fail(name, message)


def check_choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        fail(name, f"unknown value {value!r}; valid values: {', '.join(choices)}")
