"""The KV cache layout both pools must agree on before any block moves (torch-free).

Every pool stores its paged KV cache as one tensor

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, row_width]

so one block is one contiguous region across all layers (K then V per layer): a transfer sends
and receives whole blocks in place, with no gather or scatter. A row is one (token, KV head):
``head_dim`` values, or for int8 KV ``head_dim`` int8 values then their fp32 scale (``head_dim +
4`` uint8), so scales move with their block. The fingerprint compared at the hand-off is all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# the quantization scheme of each KV dtype: int8 has one fp32 absmax scale per (token, KV head)
SCHEMES = {"float32": "none", "bfloat16": "none", "float16": "none", "int8": "absmax_row_f32"}


@dataclass(frozen=True, slots=True)
class KVLayout:
    model: str
    dtype: str  # float32 | bfloat16 | float16 | int8
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    quantization: str = "none"  # SCHEMES[dtype]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype: unknown KV dtype {self.dtype!r}; valid: {list(DTYPE_SIZES)}")
        if self.quantization != SCHEMES[self.dtype]:
            raise ValueError(f"quantization: {self.dtype} KV uses {SCHEMES[self.dtype]!r}")

    @property
    def storage_dtype(self) -> str:  # the cache tensor's elements: raw bytes for int8 rows
        return "uint8" if self.dtype == "int8" else self.dtype

    @property
    def row_width(self) -> int:  # storage elements per (token, KV head) row
        return self.head_dim + 4 if self.dtype == "int8" else self.head_dim

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.row_width)

    @property
    def bytes_per_token(self) -> int:
        size = 1 if self.dtype == "int8" else DTYPE_SIZES[self.dtype]
        return self.num_layers * 2 * self.num_kv_heads * self.row_width * size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def mismatch(self, other: KVLayout) -> str | None:
        """The first difference, naming both whole layouts; None when they are equal."""
        for f in fields(self):
            key = f.name
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine != theirs:
                return f"{key}: {mine!r} here, {theirs!r} at the peer (here: {self}; peer: {other})"
        return None
