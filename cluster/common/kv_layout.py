"""The KV cache layout both pools must agree on before any block moves (torch-free).

Every pool stores its paged KV cache as one tensor

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so one block is one contiguous region across all layers (K then V per layer): a transfer sends
and receives whole blocks in place, with no gather or scatter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class KVLayout:
    model: str
    dtype: str  # float32 | bfloat16 | float16
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype: unknown KV dtype {self.dtype!r}; valid: {list(DTYPE_SIZES)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * DTYPE_SIZES[self.dtype]
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def mismatch(self, other: KVLayout) -> str | None:
        """A readable description of the first difference, or None when compatible."""
        for key, mine in self.to_dict().items():
            theirs = getattr(other, key)
            if mine != theirs:
                return f"{key}: {mine!r} here, {theirs!r} at the peer"
        return None
