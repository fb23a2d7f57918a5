"""The GPU path's unit tests run on CPU: Triton kernels through Triton's interpreter, which must
be switched on before Triton is imported (its ``jit`` decorator reads it)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
