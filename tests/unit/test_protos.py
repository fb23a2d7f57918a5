"""The committed stubs in cluster/pb are exactly what `make protos` generates from protos/."""

from __future__ import annotations

from pathlib import Path

from cluster.pb.generate import OUT, generate


def test_stubs_are_up_to_date(tmp_path: Path) -> None:
    fresh = {p.relative_to(tmp_path): p.read_text() for p in generate(tmp_path)}
    committed = {
        p.relative_to(OUT): p.read_text()
        for p in OUT.rglob("*_pb2*.py*")
        if p.is_file() and p.suffix in (".py", ".pyi")  # not __pycache__'s .pyc
    }
    assert fresh.keys() == committed.keys(), "run `make protos` and commit the stubs"
    for name, text in fresh.items():
        assert committed[name] == text, f"{name} is stale: run `make protos` and commit it"


def test_every_rpc_is_documented() -> None:
    for proto in Path("protos").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("rpc "):
                assert lines[i - 1].strip().startswith("//"), f"{proto}: undocumented {line}"
