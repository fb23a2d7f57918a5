"""Regenerate the protobuf/gRPC stubs in ``cluster/pb/`` from ``protos/`` (``make protos``).

The generated modules are committed and never edited by hand; a test regenerates them into a
temporary folder and diffs, so a changed .proto without regenerated stubs fails CI.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "cluster" / "pb"
PACKAGE = "cluster.pb"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path = OUT) -> list[Path]:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for path in sorted(out_dir.rglob("*_pb2*.py*")):
        if path.suffix not in (".py", ".pyi"):  # compiled caches (__pycache__/*.pyc)
            continue
        text = path.read_text()
        # protoc emits absolute imports rooted at protos/; make them package-absolute.
        fixed = re.sub(
            r"^from (pdserve\.\S+) import", rf"from {PACKAGE}.\1 import", text, flags=re.M
        )
        # ... and the module name the messages record (pickling, e.g. by Ray Serve's gRPC proxy,
        # imports a message's class by that name).
        fixed = re.sub(
            r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')(pdserve\.)",
            rf"\1{PACKAGE}.\2",
            fixed,
        )
        path.write_text(fixed)
        written.append(path)
    for d in {p.parent for p in written}:
        while d != out_dir and d.is_relative_to(out_dir):
            init = d / "__init__.py"
            if not init.exists():
                init.write_text("")
            d = d.parent
    return written


if __name__ == "__main__":
    for p in generate():
        print(p.relative_to(ROOT), file=sys.stderr)
