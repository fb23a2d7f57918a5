"""Find and load pdserve's one native library, or say why not.

In order: the library prebuilt into the package (``make setup``, or the wheel: ``build.py``),
when it was built from the sources the package has now; else the one compiled into
``cache_dir/kernels`` (keyed by the sources, the compiler and the machine's architecture),
compiling it there on first use. Where neither works (no compiler, a compile error, a library
the loader refuses) the engine runs its torch paths, and the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from cluster.engine.kernels import build

logger = logging.getLogger(__name__)

PREBUILT = build.HERE / build.PREBUILT_NAME


@dataclass(frozen=True, slots=True)
class Loaded:
    lib: ctypes.CDLL | None
    path: Path | None
    reason: str  # where it came from, or why there is none


def _open(path: Path, tag: str) -> ctypes.CDLL | None:
    """``path`` loaded, when it was built from the sources tagged ``tag``."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        logger.debug("native library %s does not load: %s", path, e)
        return None
    fn = getattr(lib, "pdserve_source_tag", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    return lib if fn() == tag.encode() else None


def _from_cache(cache_dir: Path, tag: str) -> Loaded:
    kernels = cache_dir / "kernels"
    cc = build.find_compiler()
    if cc is None:  # no compiler: a library some earlier process compiled still serves
        for path in sorted(kernels.glob("libpdserve-*.so")):
            lib = _open(path, tag)
            if lib is not None:
                return Loaded(lib, path, f"cached {path}")
        return Loaded(None, None, build.missing_compiler())
    try:
        path = kernels / build.cache_name(tag, tuple(cc))
        if not path.is_file():
            build.compile_library(path, cc)
            logger.info("compiled the native library into %s", path)
    except build.BuildError as e:
        return Loaded(None, None, str(e))
    lib = _open(path, tag)
    if lib is None:
        return Loaded(None, None, f"{path} does not load or was built from other sources")
    return Loaded(lib, path, f"compiled {path}")


def locate(cache_dir: Path, prebuilt: Path | None = None) -> Loaded:
    """The library (see the module docstring), uncached: tests call it with their own paths."""
    prebuilt = prebuilt or PREBUILT
    tag = build.source_tag()
    if prebuilt.is_file():
        lib = _open(prebuilt, tag)
        if lib is not None:
            return Loaded(lib, prebuilt, f"prebuilt {prebuilt}")
        logger.info("the prebuilt %s is from other sources: using the cache", prebuilt.name)
    return _from_cache(cache_dir, tag)


@functools.cache
def load_library(cache_dir: Path) -> Loaded:
    """The library for this process (one load per cache directory); the reason is logged once
    where there is none."""
    loaded = locate(cache_dir)
    if loaded.lib is None:
        logger.warning("no native library (%s): the engine uses its torch paths", loaded.reason)
    else:
        logger.debug("native library: %s", loaded.reason)
    return loaded
