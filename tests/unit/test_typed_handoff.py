"""The PD hand-off is typed end to end: no dict-typed KV handle or KV layout crosses a function
boundary inside ``cluster/`` (issue 35).

``KVTransferParams`` and ``KVLayout`` travel as themselves (inside ``PrefillReply``,
``PrefillProgress``, ``PrefillCall`` and the KV wire messages); their plain form exists only in
the KV codec (``cluster/kv_transfer/protocol.py``: ``to_plain`` / ``from_plain`` /
``decode_params``), for bytes on pdserve's own sockets and pipes. The checks here are static (every
annotation and call in ``cluster/``) and at run time (the message types' resolved field types),
and the static one is shown to catch a regression.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

import pytest

from cluster.common import protocol
from cluster.common.kv_layout import KVLayout
from cluster.common.kv_params import KVTransferParams

ROOT = Path(__file__).resolve().parents[2] / "cluster"
CODEC = "kv_transfer/protocol.py"  # the one place a handle or a layout becomes plain data

# A parameter, field or variable of one of these names holds a KV handle or a KV layout.
KV_NAME = re.compile(r"(^|_)(kv|layout|kv_layout|kv_params|transfer_params)$")
# ... and must not be annotated as one of these (a dict in disguise, or anything at all).
UNTYPED = {"dict", "Dict", "Mapping", "MutableMapping", "Any", "object"}
# Calls that turn a dataclass into plain data (or back).
PLAIN_CALLS = {"asdict", "to_dict", "from_dict", "vars"}
# The KV codec's own (``cluster.kv_transfer.protocol``): plain KV data, whatever they are given.
CODEC_CALLS = {"to_plain", "from_plain", "decode_params"}


def _names_in(annotation: ast.expr) -> set[str]:
    return {
        n.id if isinstance(n, ast.Name) else n.attr
        for n in ast.walk(annotation)
        if isinstance(n, ast.Name | ast.Attribute)
    }


def _annotated(tree: ast.AST) -> list[tuple[str, ast.expr, int]]:
    """Every (name, annotation, line) of a parameter, a return (named after its function) or an
    annotated assignment (a dataclass field, a variable)."""
    out: list[tuple[str, ast.expr, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                if arg.annotation is not None:
                    out.append((arg.arg, arg.annotation, node.lineno))
            if node.returns is not None:
                out.append((node.name.lstrip("_"), node.returns, node.lineno))
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            out.append((name, node.annotation, node.lineno))
    return out


def dict_typed_kv(source: str, where: str) -> list[str]:
    """The places in ``source`` where a KV handle or layout is (or becomes) a dict."""
    tree = ast.parse(source)
    found = [
        f"{where}:{line}: {name}: {ast.unparse(ann)}"
        for name, ann, line in _annotated(tree)
        if KV_NAME.search(name) and _names_in(ann) & UNTYPED
    ]
    if where.endswith(CODEC):
        return found
    codec = _codec_imports(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _plain(node.value):
            found.extend(
                f"{where}:{node.lineno}: {ast.unparse(t)} = {ast.unparse(node.value)[:60]}"
                for t in node.targets
                if isinstance(t, ast.Attribute | ast.Name)
                and KV_NAME.search(t.attr if isinstance(t, ast.Attribute) else t.id)
            )
        if not isinstance(node, ast.Call):
            continue
        called = _called(node)
        splat = any(k.arg is None for k in node.keywords)
        if called in codec or (called in PLAIN_CALLS and _touches_kv(node)):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:80]}")
        elif called in ("KVLayout", "KVTransferParams") and splat:
            found.append(f"{where}:{node.lineno}: {called} rebuilt from a mapping")
        found.extend(
            f"{where}:{node.lineno}: {k.arg}={ast.unparse(k.value)[:60]}"
            for k in node.keywords
            if k.arg is not None and KV_NAME.search(k.arg) and _plain(k.value)
        )
    return found


def _called(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _codec_imports(tree: ast.AST) -> set[str]:
    """The KV codec's plain-data functions this module imports (by the name it uses)."""
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "cluster.kv_transfer.protocol"
        for alias in node.names
        if alias.name in CODEC_CALLS
    }


def _plain(value: ast.expr) -> bool:
    """A dict display, or a call that makes plain data."""
    return isinstance(value, ast.Dict) or (
        isinstance(value, ast.Call) and _called(value) in PLAIN_CALLS | CODEC_CALLS
    )


def _touches_kv(call: ast.Call) -> bool:
    """A plain-data call whose receiver or argument reads as a KV handle or layout."""
    parts: list[ast.expr] = [*call.args]
    if isinstance(call.func, ast.Attribute):
        parts.append(call.func.value)
    text = " ".join(ast.unparse(p) for p in parts)
    return (
        any(KV_NAME.search(word) for word in re.findall(r"[A-Za-z_]+", text))
        or "KVLayout" in text
        or "KVTransferParams" in text
    )


def test_no_dict_typed_kv_handle_or_layout_crosses_a_boundary_in_cluster() -> None:
    found = [
        hit
        for path in sorted(ROOT.rglob("*.py"))
        if "/pb/" not in path.as_posix()
        for hit in dict_typed_kv(path.read_text(), path.relative_to(ROOT).as_posix())
    ]
    assert found == []


@pytest.mark.parametrize(
    "regression",
    [
        "def reply(kv: dict[str, Any]) -> None: ...",
        "def call(kv_layout: Mapping[str, object] | None) -> None: ...",
        "class PrefillCall:\n    kv_layout: dict[str, object] | None = None",
        "class Hello:\n    layout: dict[str, str | int]",
        "def kv_params(x: int) -> dict[str, Any]: ...",
        "reply = PrefillReply(kv=params.to_dict())",
        "reply.kv = params.to_dict()",
        "wire = dataclasses.asdict(pool.layout)",
        "params = KVTransferParams.from_dict(reply.kv)",
        "mismatch = pool.layout.mismatch(KVLayout(**call.kv_layout))",
        "from cluster.kv_transfer.protocol import to_plain\ndata = to_plain(reply)",
        "PrefillCall(rid, prompt, hashes, params, seed, kv_layout={'model': 'm'})",
    ],
)
def test_the_check_catches_a_dict_typed_regression(regression: str) -> None:
    assert dict_typed_kv(regression, "cluster/decode_worker/request_handoff.py") != []
    assert dict_typed_kv("def pull(kv: KVTransferParams) -> KVLayout: ...", "x.py") == []


def test_the_handle_and_the_layout_have_no_dict_form_of_their_own() -> None:
    for cls in (KVTransferParams, KVLayout):
        for name in ("to_dict", "from_dict"):
            assert not hasattr(cls, name), f"{cls.__name__}.{name}: use the KV codec"


def _mentions(tp: object, target: type) -> bool:
    return tp is target or any(_mentions(a, target) for a in typing.get_args(tp))


@pytest.mark.parametrize(
    ("cls", "field", "target"),
    [
        (protocol.PrefillCall, "kv_layout", KVLayout),
        (protocol.PrefillProgress, "kv", KVTransferParams),
        (protocol.PrefillReply, "kv", KVTransferParams),
        (KVTransferParams, "layout", KVLayout),
    ],
)
def test_the_messages_between_pools_carry_typed_kv(cls: type, field: str, target: type) -> None:
    tp = typing.get_type_hints(cls)[field]
    assert _mentions(tp, target) and dict not in {typing.get_origin(a) for a in typing.get_args(tp)}
    assert typing.get_origin(tp) is not dict


def test_every_message_between_pools_is_frozen() -> None:
    for name in ("GenerateCall", "PrefillCall", "PrefillProgress", "PrefillReply", "FirstToken",
                 "StreamChunk", "Usage", "Accepted"):  # fmt: skip
        cls = getattr(protocol, name)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
