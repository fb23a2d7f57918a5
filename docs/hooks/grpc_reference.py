"""MkDocs hook: renders the gRPC API reference from ``protos/`` (services, RPCs, messages,
enums, fields and their comments).

protoc (grpcio-tools) compiles the .proto files into a descriptor set with source info; the
comments come from that, so the page says what the .proto files say.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2 as d

MARKER = "<!-- generated: grpc-reference -->"
ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"

# FileDescriptorProto / DescriptorProto field numbers, the paths SourceCodeInfo uses.
_SYNTAX, _MESSAGE, _ENUM, _SERVICE = 12, 4, 5, 6
_FIELD, _NESTED, _NESTED_ENUM = 2, 3, 4
_ENUM_VALUE, _METHOD = 2, 2
_LABEL = {d.FieldDescriptorProto.LABEL_REPEATED: "repeated "}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())


def descriptor_set() -> d.FileDescriptorSet:
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "protos.pb"
        args = ["protoc", f"-I{PROTO_ROOT}", "--include_source_info", f"-o{out}", *files]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        return d.FileDescriptorSet.FromString(out.read_bytes())


def render() -> str:
    out: list[str] = []
    for f in descriptor_set().file:
        out += _file(f)
    return "\n".join(out)


def _file(f: d.FileDescriptorProto) -> list[str]:
    comments = {tuple(loc.path): loc for loc in f.source_code_info.location}

    def doc(*path: int) -> str:
        loc = comments.get(path)
        if loc is None:
            return ""
        return " ".join((loc.leading_comments + " " + loc.trailing_comments).split())

    header = comments.get((_SYNTAX,))
    lines = [f"## `{f.name}` (package `{f.package}`)", ""]
    if header is not None:
        text = "".join([*header.leading_detached_comments, header.leading_comments])
        lines += ["```text", *_dedent(text), "```", ""]
    for i, svc in enumerate(f.service):
        lines += [f"### service `{svc.name}`", "", *_para(doc(_SERVICE, i))]
        lines += ["| RPC | request | response | description |", "|---|---|---|---|"]
        for j, m in enumerate(svc.method):
            stream = "stream " if m.server_streaming else ""
            req, resp = _short(m.input_type), _short(m.output_type)
            lines.append(
                f"| `{m.name}` | [`{req}`](#{req}) | {stream}[`{resp}`](#{resp}) | "
                f"{_cell(doc(_SERVICE, i, _METHOD, j))} |"
            )
        lines.append("")
    for i, msg in enumerate(f.message_type):
        lines += _message(msg, (_MESSAGE, i), doc)
    for i, enum in enumerate(f.enum_type):
        lines += _enum(enum, (_ENUM, i), doc)
    return lines


def _message(msg: d.DescriptorProto, path: tuple[int, ...], doc: Any, outer: str = "") -> list[str]:
    name = f"{outer}{msg.name}"
    if msg.options.map_entry:
        return []
    lines = [f"### `{name}` {{ #{name} }}", "", *_para(doc(*path))]
    if msg.field:
        lines += ["| field | number | type | description |", "|---|---|---|---|"]
        maps = {f"{name}.{n.name}": n for n in msg.nested_type if n.options.map_entry}
        for j, fld in enumerate(msg.field):
            kind = _field_type(fld, maps, name)
            if fld.HasField("oneof_index") and not fld.proto3_optional:
                kind += f" (one of `{msg.oneof_decl[fld.oneof_index].name}`)"
            lines.append(
                f"| `{fld.name}` | {fld.number} | {kind} | {_cell(doc(*path, _FIELD, j))} |"
            )
        lines.append("")
    for j, nested in enumerate(msg.nested_type):
        lines += _message(nested, (*path, _NESTED, j), doc, f"{name}.")
    for j, enum in enumerate(msg.enum_type):
        lines += _enum(enum, (*path, _NESTED_ENUM, j), doc, f"{name}.")
    return lines


def _enum(
    enum: d.EnumDescriptorProto, path: tuple[int, ...], doc: Any, outer: str = ""
) -> list[str]:
    name = f"{outer}{enum.name}"
    lines = [f"### enum `{name}` {{ #{name} }}", "", *_para(doc(*path))]
    lines += ["| value | number | description |", "|---|---|---|"]
    for j, v in enumerate(enum.value):
        lines.append(f"| `{v.name}` | {v.number} | {_cell(doc(*path, _ENUM_VALUE, j))} |")
    return [*lines, ""]


def _field_type(fld: d.FieldDescriptorProto, maps: dict[str, d.DescriptorProto], owner: str) -> str:
    if fld.type_name and _short(fld.type_name) in maps:
        entry = maps[_short(fld.type_name)]
        key, value = (_field_type(f, {}, owner) for f in entry.field)
        return f"map&lt;{key}, {value}&gt;"
    if fld.type_name:
        target = _short(fld.type_name)
        base = f"[`{target}`](#{target})" if not target.startswith("grpc.") else f"`{target}`"
    else:
        base = f"`{d.FieldDescriptorProto.Type.Name(fld.type)[5:].lower()}`"
    optional = "optional " if fld.proto3_optional else ""
    return f"{optional}{_LABEL.get(fld.label, '')}{base}"


def _short(type_name: str) -> str:
    """``.pdserve.v1.GenerateRequest`` -> ``GenerateRequest`` (nested: ``Outer.Inner``)."""
    parts = type_name.lstrip(".").split(".")
    # the package is the leading lower-case parts
    while parts and parts[0][:1].islower():
        parts.pop(0)
    return ".".join(parts)


def _dedent(comment: str) -> list[str]:
    lines = comment.rstrip("\n").split("\n")
    return [line[1:] if line.startswith(" ") else line for line in lines]


def _para(text: str) -> list[str]:
    return [text, ""] if text else []


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
