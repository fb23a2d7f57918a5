"""MkDocs hook: renders the configuration reference from the config dataclasses.

The page ``configuration/reference.md`` holds the marker below; every key's type, default,
valid values and description come from ``cluster.config.reference`` at build time, so the page
cannot drift from the code.
"""

from __future__ import annotations

from typing import Any

from cluster.config.reference import ConfigKey, config_keys

MARKER = "<!-- generated: config-reference -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())


def render() -> str:
    keys = list(config_keys())
    sections = [k for k in keys if k.section is not None]
    out: list[str] = []
    for section in sections:
        out += _section(section, [k for k in keys if _parent(k.path) == section.path])
    return "\n".join(out)


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _section(section: ConfigKey, members: list[ConfigKey]) -> list[str]:
    lines = [f"## `{section.path}` {{ #{section.path} }}", "", _one_line(section.doc), ""]
    subsections = [k for k in members if k.section is not None]
    if subsections:
        links = ", ".join(f"[`{k.path}`](#{k.path})" for k in subsections)
        lines += [f"Subsections: {links}.", ""]
    leaves = [k for k in members if k.section is None]
    if leaves:
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        lines += [_row(k) for k in leaves]
        lines.append("")
    return lines


def _row(key: ConfigKey) -> str:
    doc = _one_line(key.doc)
    if key.choices:
        doc += " Valid values: " + ", ".join(f"`{c}`" for c in key.choices) + "."
    name = key.path.rpartition(".")[2]
    return f"| `{name}` | {_cell(key.value_type)} | `{key.default}` | {_cell(doc)} |"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
