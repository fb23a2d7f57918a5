"""Builds pdserve's native library into the wheel; every other setting is in pyproject.toml.

The library is one shared object built from ``cluster/engine/kernels/*.c`` by that package's
``build.py`` (its flags, its source tag), loaded with ctypes: declared as an Extension so the
wheel is tagged for its platform and an editable install builds it in place. Optional: without a
C compiler the wheel is built without it, and the engine compiles it on first use or runs torch.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_BUILD_PY = Path(__file__).resolve().parent / "cluster" / "engine" / "kernels" / "build.py"
# build.py by path: importing the package would import its dependencies, absent while a wheel
# is being built
_spec = importlib.util.spec_from_file_location("_pdserve_kernels_build", _BUILD_PY)
assert _spec is not None and _spec.loader is not None
native_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native_build)


class BuildNative(build_ext):
    """Compile the library with build.py rather than setuptools' compiler settings."""

    def build_extension(self, ext: Extension) -> None:
        out = Path(self.get_ext_fullpath(ext.name))
        try:
            native_build.compile_library(out)
        except native_build.BuildError as e:
            logging.getLogger("pdserve.setup").warning(
                "pdserve native library not built (%s): compiled on first use, or torch", e
            )


setup(
    ext_modules=[
        Extension(
            "cluster.engine.kernels._native",
            sources=[f"cluster/engine/kernels/{name}" for name in native_build.SOURCES],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
