"""llama.cpp's ``llama-server``, the serving anchor of ``bench anchor-serve``: found, or built.

Found as ``$LLAMA_SERVER`` (a binary the user points at), ``llama-server`` on the PATH, or the
one ``make llama-server`` built into pdserve's cache. Built from the llama.cpp sources inside the
llama-cpp-python source distribution (the package registry is the one source this machine
reaches; the version of the ``llamacpp`` extra's install where there is one) with cmake, for
this CPU (``GGML_NATIVE``), without CURL.

    python -m benchmarks.llama_server build   # what ``make llama-server`` runs
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def _version() -> str:
    """The installed llama-cpp-python's version (the llamacpp extra's), else the one this was
    written against: both anchors then run the same llama.cpp."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        return "0.3.36"


LLAMA_CPP_PYTHON = _version()
HOW_TO_GET = (
    "build it with `make llama-server` (cmake and a C++ compiler; the sources come from "
    "llama-cpp-python's sdist on PyPI) or point $LLAMA_SERVER at a llama-server binary"
)


def built_path(cache_dir: Path) -> Path:
    return cache_dir / "llama.cpp" / LLAMA_CPP_PYTHON / "llama-server"


def find(cache_dir: Path) -> Path | None:
    """The llama-server to run, or None (the caller says how to get one: ``HOW_TO_GET``).
    ``$LLAMA_SERVER`` naming something that is not an executable file is an error."""
    named = os.environ.get("LLAMA_SERVER")
    if named:
        path = Path(named)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"$LLAMA_SERVER={named}: not an executable file")
        return path
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    built = built_path(cache_dir)
    return built if built.is_file() else None


def build(cache_dir: Path, jobs: int | None = None) -> Path:
    """Download llama-cpp-python's sdist, build its llama.cpp's ``llama-server`` target, and
    keep the binary (and the shared libraries it links) in the cache."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs {tool} on the PATH")
    target = built_path(cache_dir)
    with tempfile.TemporaryDirectory(prefix="pdserve-llama-") as tmp:
        work = Path(tmp)
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"),
                *(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(work)),
            ],
            check=True,
        )
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        (src,) = work.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp")
        build_dir = work / "build"
        subprocess.run(
            [
                *("cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release"),
                *("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"),
                *("-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"),
                *("-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF"),
                # no web UI: its prebuilt assets would be downloaded from the Hugging Face hub
                *("-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"),
            ],
            check=True,
        )
        subprocess.run(
            [
                *("cmake", "--build", str(build_dir), "--target", "llama-server"),
                *("-j", str(jobs or os.cpu_count() or 2)),
            ],
            check=True,
        )
        (binary,) = build_dir.glob("bin/llama-server")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(binary, target)
    return target


def main(argv: list[str]) -> int:
    from cluster.config import ClusterConfig

    cache_dir = ClusterConfig().paths.resolved_cache_dir
    if argv[:1] != ["build"]:
        print("usage: python -m benchmarks.llama_server build", file=sys.stderr)
        return 2
    found = find(cache_dir)
    if found is not None:
        print(f"llama-server: {found} (already there)")
        return 0
    print(f"llama-server: built {build(cache_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
