"""How K and V values are stored in the paged KV cache rows: as they are, or as int8.

A row of the cache is one (token, KV head) (see ``cluster/common/kv_layout.py``):

    float KV: [head_dim] of the cache dtype
    int8 KV:  [head_dim + 4] uint8 = head_dim int8 values q, then the fp32 scale s (little-endian)
              value = q * s, s = max|x| / 127 over the row, q = round(x / s) in [-127, 127]

Values are quantized once, when written; every reader (the decode kernels, the torch decode
path, prefill attention over cached context) de-quantizes the same bytes, and a prefill chunk
attends to the round-tripped values of its own new tokens too, so a request sees the same KV
whether its prefix was computed here, in an earlier chunk, or by another pool.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cluster.common.kv_layout import KVLayout

SCALE_BYTES = 4  # the fp32 scale after a row's int8 values


class KVCodec(Protocol):
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] values -> [..., row_width] cache rows."""
        ...

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., row_width] cache rows -> [..., head_dim] values of ``dtype``."""
        ...

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What a reader of the cache will see for ``x`` (x itself when stored exactly)."""
        ...


class FloatKV:
    """Rows are the values in the cache dtype (a cast when it differs from the model's)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows if rows.dtype == dtype else rows.to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.dtype == self.dtype else x.to(self.dtype).to(x.dtype)


class Int8KV:
    """int8 values with one fp32 absmax scale per row, scale stored after the values."""

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0  # [..., 1]
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(xf * inv).clamp_(-127, 127).to(torch.int8)  # [..., head_dim]
        scale_bytes = scale.view(torch.uint8)  # [..., 4]
        return torch.cat((q.view(torch.uint8), scale_bytes), dim=-1)  # [..., head_dim + 4]

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = self.head_dim
        q = rows[..., :d].view(torch.int8)
        scale = rows[..., d : d + SCALE_BYTES].view(torch.float32)  # [..., 1]
        return (q.float() * scale).to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x), x.dtype)


FLOAT_KV = FloatKV(torch.float32)
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_codec_for(layout: KVLayout) -> KVCodec:
    if layout.dtype == "int8":
        return Int8KV(layout.head_dim)
    return FloatKV(_FLOAT_DTYPES[layout.dtype])
