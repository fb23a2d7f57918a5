"""Build pdserve's one native library (``libpdserve``) from the C sources beside this file.

Standard library only: ``setup.py`` loads this file by path to build the library into a wheel,
``make setup`` runs ``python -m cluster.engine.kernels.build`` to build it into the package
(an editable install's source tree), and ``library.py`` compiles it into the cache on first use
where neither ran. One build for every CPU of an architecture: the sources carry AVX-512, AVX2
and portable variants per function and choose at run time (no ``-march=native``).

The library records the hash of the sources and flags it was built from (``source_tag``,
exported as ``pdserve_source_tag``), so a prebuilt library left over from older sources is
never loaded.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("pool.c", "linear.c", "qlinear.c", "ops.c", "paged_decode.c", "decode_forward.c")
HEADERS = ("native.h", "blocks.h", "qlinear_tile.h", "f32_rows.h", "vec_exp.h")
# No fp contraction: d * q + m rounds twice, exactly as the de-quantizing reference computes it
# (the vector variants fuse where they say so, with explicit FMA intrinsics).
FLAGS = ("-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared", "-pthread")
# The prebuilt library's file name in the package: what setuptools names the Extension
# ``cluster.engine.kernels._native`` (setup.py), so the wheel and ``make setup`` agree.
PREBUILT_NAME = "_native" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


class BuildError(RuntimeError):
    """Why the library could not be built (no compiler, a compile error): logged, then torch."""


def source_tag(root: Path = HERE) -> str:
    """The hash of every source and header and of the flags: what a library was built from."""
    h = hashlib.sha256(" ".join(FLAGS).encode())
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (root / name).read_bytes())
    return h.hexdigest()[:16]


def find_compiler() -> list[str] | None:
    """``$CC`` (which may carry arguments, e.g. ``ccache gcc``) or ``cc`` / ``gcc``; None
    when none is found."""
    env = os.environ.get("CC")
    if env:
        cmd = shlex.split(env)
        return cmd if cmd and shutil.which(cmd[0]) else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def missing_compiler() -> str:
    """Why ``find_compiler`` found none."""
    env = os.environ.get("CC")
    if env:
        return f"no C compiler: CC={env!r} is not an executable"
    return "no C compiler: neither cc nor gcc is on PATH (or set CC)"


@functools.cache
def compiler_id(cc: tuple[str, ...]) -> str:
    """The compiler's first ``--version`` line: part of the cache key (another compiler,
    another binary)."""
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"the C compiler {shlex.join(cc)} does not run ({e})") from e
    return (out.stdout.splitlines() or [""])[0].strip()


def cache_name(tag: str, cc: tuple[str, ...]) -> str:
    """The library's file name in a cache directory: its sources, the compiler and the
    machine's architecture (not its CPU model: the variants are chosen at run time)."""
    key = f"{tag}|{compiler_id(cc)}|{platform.machine()}|{platform.system()}"
    return f"libpdserve-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def compile_library(out: Path, cc: list[str] | None = None, root: Path = HERE) -> Path:
    """Compile the sources under ``root`` into ``out`` (atomically: a concurrent loader never
    sees a partial file). Raises ``BuildError`` with the reason."""
    cc = cc or find_compiler()
    if cc is None:
        raise BuildError(missing_compiler())
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    tag = source_tag(root)
    cmd = [*cc, *FLAGS, f'-DPD_SOURCE_TAG="{tag}"', "-o", tmp]
    cmd += [str(root / s) for s in SOURCES] + ["-lm"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        Path(tmp).unlink(missing_ok=True)
        raise BuildError(f"{shlex.join(cc)} failed: {(e.stderr or '').strip()[-2000:]}") from e
    except (OSError, subprocess.SubprocessError) as e:
        Path(tmp).unlink(missing_ok=True)
        raise BuildError(f"{shlex.join(cc)} could not run ({e})") from e
    return out


def built_tag(path: Path) -> str | None:
    """The source tag of the library at ``path``; None if there is none or it does not load."""
    import ctypes

    try:
        fn = ctypes.CDLL(str(path)).pdserve_source_tag
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_char_p
    return bytes(fn()).decode()


def main(argv: list[str] | None = None) -> int:
    """Build the library into the package (``make setup``), unless the one there is from these
    sources. A missing compiler is not an error: the engine then uses its torch paths, and says
    why when it starts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / PREBUILT_NAME)
    args = parser.parse_args(argv)
    if args.out.is_file() and built_tag(args.out) == source_tag():
        print(f"pdserve native library: {args.out} is up to date")
        return 0
    try:
        path = compile_library(args.out)
    except BuildError as e:
        print(f"pdserve native library not built: {e}; the engine will use torch", file=sys.stderr)
        return 0
    print(f"pdserve native library: {path} (sources {source_tag()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
