"""S3: a static ban on unsafe deserialization anywhere in ``cluster/``.

Pickle over ZeroMQ gave remote code execution in two major engines; pdserve's sockets carry
msgpack headers and raw frames only. This scan fails on: importing pickle-family modules,
``recv_pyobj`` / ``send_pyobj``, ``eval`` / ``exec``, ``torch.load`` without
``weights_only=True``, ``yaml.load`` / ``yaml.unsafe_load`` and ``numpy.load(allow_pickle=True)``.
A justified exception goes in ``ALLOWED`` below with the reason (none so far).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "cluster"

BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal"}
BANNED_ATTRS = {"recv_pyobj", "send_pyobj", "recv_serialized", "unsafe_load"}
BANNED_BUILTINS = {"eval", "exec"}

# "relative/path.py:lineno" -> why it is safe. Keep this empty unless there is no alternative.
ALLOWED: dict[str, str] = {}


def _kwarg_is_true(call: ast.Call, name: str) -> bool:
    return any(
        kw.arg == name and isinstance(kw.value, ast.Constant) and kw.value.value is True
        for kw in call.keywords
    )


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _import_findings(node: ast.Import | ast.ImportFrom) -> list[str]:
    """A banned module imported, or a banned name imported from anywhere."""
    if isinstance(node, ast.Import):
        return [f"import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
    found = []
    if (node.module or "").split(".")[0] in BANNED_MODULES:
        found.append(f"from {node.module} import ...")
    banned_names = BANNED_ATTRS | BANNED_BUILTINS
    return found + [f"import of {a.name}" for a in node.names if a.name in banned_names]


def _call_finding(node: ast.Call) -> str | None:
    """What is unsafe about this call, if anything."""
    name = _dotted(node.func)
    if name in BANNED_BUILTINS or name in {f"builtins.{b}" for b in BANNED_BUILTINS}:
        return f"{name}()"
    if name == "torch.load" and not _kwarg_is_true(node, "weights_only"):
        return "torch.load without weights_only=True"
    if name in {"yaml.load", "yaml.full_load"}:
        return f"{name} (use yaml.safe_load)"
    if name in {"np.load", "numpy.load"} and _kwarg_is_true(node, "allow_pickle"):
        return f"{name}(allow_pickle=True)"
    return None


def scan(source: str, filename: str = "<src>") -> list[tuple[int, str]]:
    findings: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            findings += [(node.lineno, what) for what in _import_findings(node)]
        elif isinstance(node, ast.Attribute) and node.attr in BANNED_ATTRS:
            findings.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call) and (what := _call_finding(node)) is not None:
            findings.append((node.lineno, what))
    return findings


def test_the_scanner_finds_every_banned_form() -> None:
    bad = "\n".join(
        [
            "import pickle",
            "from cloudpickle import loads",
            "import marshal as m",
            "sock.recv_pyobj()",
            "eval('1')",
            "exec('x = 1')",
            "torch.load(path)",
            "torch.load(path, weights_only=False)",
            "yaml.load(text)",
            "np.load(path, allow_pickle=True)",
        ]
    )
    assert sorted(line for line, _ in scan(bad)) == list(range(1, 11))
    good = "\n".join(
        [
            "torch.load(path, weights_only=True)",
            "yaml.safe_load(text)",
            "np.load(path)",
            "msgpack.unpackb(data)",
            "self.evaluate(x)",
        ]
    )
    assert scan(good) == []


@pytest.mark.parametrize(
    "path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT.parent))
)
def test_no_unsafe_deserialization_in_cluster(path: Path) -> None:
    rel = str(path.relative_to(ROOT.parent))
    findings = [
        f"{rel}:{line}: {what}"
        for line, what in scan(path.read_text(), rel)
        if f"{rel}:{line}" not in ALLOWED
    ]
    assert not findings, "unsafe deserialization:\n" + "\n".join(findings)
