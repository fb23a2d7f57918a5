"""The decode step's layers in one native call (``decode_forward.c``), and its model description.

``DecodeForward`` holds, once per model, a C description of every layer (norm weights, and each
matrix's packed segments: format, bytes, scales) pointing into the model's own tensors; a call
runs all layers of a decode-only step over the residual stream ``h`` in place, through the
library's linear kernel, per-layer ops and paged decode attention. Under ``model.numerics:
fast`` the described packed segments carry ``FAST`` in their type ids, as ``PackedLinear``'s
calls do, so the one call and the per-layer loop stay the same arithmetic.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.engine.kernels.quant import F32, FAST, PackedRows

MAX_SEGMENTS = 4  # PD_MAX_SEGMENTS in decode_forward.c

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Matrix(ctypes.Structure):
    _fields_ = [
        ("cols", _i64),
        ("num_segments", _i64),
        ("qtype", _i64 * MAX_SEGMENTS),
        ("rows", _i64 * MAX_SEGMENTS),
        ("row_bytes", _i64 * MAX_SEGMENTS),
        ("data", _ptr * MAX_SEGMENTS),
        ("scales", _ptr * MAX_SEGMENTS),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv_bias", _ptr),
        ("qkv", _Matrix),
        ("o", _Matrix),
        ("gate_up", _Matrix),
        ("down", _Matrix),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("inter", _i64),
        ("num_threads", _i64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)),
        ("cos", _ptr),
        ("sin", _ptr),
        ("first_layer", _i64),
        ("cache_layers", _i64),
    ]


@dataclass(frozen=True, slots=True)
class LayerDescription:
    """One decoder layer's weights as the call reads them."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_bias: torch.Tensor | None
    # each matrix: its columns, its row segments in output order, and whether its packed
    # segments take int8 activations (model.numerics: fast, as PackedLinear runs the matrix)
    qkv: tuple[int, Sequence[PackedRows], bool]
    o: tuple[int, Sequence[PackedRows], bool]
    gate_up: tuple[int, Sequence[PackedRows], bool]
    down: tuple[int, Sequence[PackedRows], bool]


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _matrix(cols: int, segments: Sequence[PackedRows], fast: bool) -> _Matrix:
    """``fast``: packed (not F32) segments' type ids or'ed with ``FAST`` (int8 activations)."""
    m = _Matrix(cols=cols, num_segments=len(segments))
    for i, s in enumerate(segments):
        m.qtype[i] = s.qtype | FAST if fast and s.qtype != F32 else s.qtype
        m.rows[i] = s.data.shape[0]
        m.row_bytes[i] = s.data.stride(0) * s.data.element_size()
        m.data[i], m.scales[i] = s.data.data_ptr(), _ptr_of(s.scales)
    return m


class DecodeForward:
    """All layers of a decode-only step in one call (see the module docstring)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        layers: Sequence[LayerDescription],
        shape: tuple[int, int, int, int, int],  # hidden, heads, kv heads, head dim, inter
        eps: float,
        scale: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_threads: int,
        layers_in_cache: tuple[int, int] | None = None,
    ) -> None:
        """``layers_in_cache``: (the cache's layer of ``layers[0]``, the layers the cache holds),
        for a pipeline stage's layers; default (0, len(layers))."""
        self._keep = (layers, cos, sin)  # the described tensors outlive the description
        c_layers = (_Layer * len(layers))()
        for i, lw in enumerate(layers):
            c_layers[i] = _Layer(
                _ptr_of(lw.input_norm),
                _ptr_of(lw.post_norm),
                _ptr_of(lw.qkv_bias),
                _matrix(*lw.qkv),
                _matrix(*lw.o),
                _matrix(*lw.gate_up),
                _matrix(*lw.down),
            )
        hidden, heads, kv_heads, head_dim, inter = shape
        self._layers = c_layers
        first, total = layers_in_cache or (0, len(layers))
        self._model = _Model(
            len(layers), hidden, heads, kv_heads, head_dim, inter, num_threads, eps, scale,
            c_layers, cos.data_ptr(), sin.data_ptr(), first, total,
        )  # fmt: skip
        fn = lib.pdserve_decode_forward
        fn.argtypes = [ctypes.POINTER(_Model), _ptr, _i64, _ptr, _ptr, _i64, ctypes.c_int]
        fn.argtypes += [_ptr, _i64, _ptr, _ptr, _ptr]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(
        self,
        h: torch.Tensor,  # [n, hidden] fp32, contiguous: updated in place
        positions: torch.Tensor,  # [n] int64
        kv_cache: torch.Tensor,  # [num_blocks, L, 2, block_size, Hkv, width] fp32 or uint8
        tables: torch.Tensor,  # [n, max_blocks] int64
        ctx_lens: torch.Tensor,  # [n] int64
        slot_blocks: torch.Tensor,  # [n] int64
        slot_offsets: torch.Tensor,  # [n] int64
    ) -> None:
        rc = self._fn(
            ctypes.byref(self._model),
            h.data_ptr(),
            h.shape[0],
            positions.data_ptr(),
            kv_cache.data_ptr(),
            kv_cache.shape[3],
            int(kv_cache.dtype == torch.uint8),
            tables.data_ptr(),
            tables.shape[1],
            ctx_lens.data_ptr(),
            slot_blocks.data_ptr(),
            slot_offsets.data_ptr(),
        )
        if rc == -1:
            raise ValueError("decode_forward: a weight format the linear kernel does not know")
        if rc != 0:
            raise MemoryError("decode_forward: out of memory (scratch or attention buffers)")
