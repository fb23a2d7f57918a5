"""Paged attention in Triton, reading the block-major KV cache in place (no gather, no SDPA).

The cache is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, row_width]`` (see
``cluster/engine/attention.py``); a row is one (token, KV head): ``head_dim`` values of the
cache dtype (fp32/fp16/bf16), or for int8 KV ``head_dim`` int8 values then their fp32 scale
(``row_width == head_dim + 4`` uint8, see ``kv_codec.py``). The kernels view an int8 cache both
as int8 (the values) and as fp32 (the scales: ``head_dim % 4 == 0`` keeps them aligned).

* ``triton_paged_decode(q, kv_cache, block_tables, ctx_lens, layer, scale)`` has the signature of
  ``AttentionMetadata.decode_kernel``: one query row per sequence (a decode token or a draft),
  one program per (sequence, KV head) computing the ``Hq / Hkv`` query heads of that KV head
  together (GQA: each K/V tile is loaded once for the group). The context length is read on
  the device (no host sync), so the call can be captured in a CUDA graph.
* ``triton_prefill_attention(q, kv_cache, layer, p, scale)`` takes a ``PrefillSeq``: the chunk's
  ``n`` queries at positions ``num_context .. num_context + n - 1`` attend every earlier cached
  token (a prefix hit, earlier chunks) and their own chunk causally, all read from the cache (the
  chunk's KV is written before attention, so int8 rows are seen round-tripped, as the torch path
  sees them). ``triton_prefill_batch`` runs every prefill chunk of a step in one launch.

Numerics: scores, the online softmax and the accumulators are fp32 for every dtype. The decode
kernel multiplies in fp32 (no tensor cores: it is bound by reading the cache); the prefill
kernel's two matmuls use fp32 operands for an fp32 model and fp16/bf16 operands (fp32
accumulation) otherwise. Against an fp32 reference over the same de-quantized values the
outputs agree to about 1e-5 (fp32), 2e-3 (fp16 outputs), 2e-2 (bf16 outputs): see
``tests/unit/gpu_path/test_triton_attention.py``.

Triton is imported on first use only, so the product imports without it. Under
``TRITON_INTERPRET=1`` (set before triton is imported) the kernels run on CPU tensors through
Triton's interpreter, which is how the unit tests check them; its bf16 ``tl.dot`` is not exact,
so there the prefill kernel rounds its operands to bf16 and multiplies in fp32, which is the
tensor-core arithmetic up to summation order.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch

from cluster.engine.attention import PrefillSeq

KV_TILE = 32  # cache tokens per inner-loop tile (spanning blocks when block_size is smaller)
BLOCK_M = 16  # prefill queries per program (tl.dot needs 16)


@cache
def _kernels() -> ModuleType:
    from cluster.engine.gpu import _triton_kernels

    return _triton_kernels


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (n - 1).bit_length())


@dataclass(frozen=True, slots=True)
class _CacheView:
    """What the kernels need of the cache for one layer: the values' and scales' tensors, the
    element strides of a block, a token and a KV head, and where the layer's K and V start."""

    values: torch.Tensor
    scales: torch.Tensor
    strides: tuple[int, int, int]
    k_off: int
    v_off: int
    head_dim: int
    block_size: int
    int8: bool


def _cache_view(kv_cache: torch.Tensor, layer: int, head_dim: int) -> _CacheView:
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache: rows must be contiguous")
    int8 = kv_cache.dtype == torch.uint8
    values, scales = kv_cache, kv_cache
    if int8:
        if head_dim % 4 or kv_cache.shape[-1] != head_dim + 4:
            raise ValueError(
                f"int8 KV needs rows of head_dim + 4 bytes and head_dim % 4 == 0, "
                f"got row_width {kv_cache.shape[-1]}, head_dim {head_dim}"
            )
        values = kv_cache.view(torch.int8)
        scales = kv_cache.view(torch.float32)
    s_blk, s_layer, s_kv, s_tok, s_head, _ = kv_cache.stride()
    return _CacheView(
        values,
        scales,
        (s_blk, s_tok, s_head),
        layer * s_layer,
        layer * s_layer + s_kv,
        head_dim,
        kv_cache.shape[3],
        int8,
    )


def triton_paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    layer: int,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D]; block_tables: [B, max_blocks]; ctx_lens: [B] (>= 1) -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = kv_cache.shape[4]
    group = hq // hkv
    cv = _cache_view(kv_cache, layer, d)
    out = torch.empty_like(q)
    if b == 0:
        return out
    _kernels().paged_decode_kernel[(b, hkv)](
        q,
        cv.values,
        cv.scales,
        block_tables,
        ctx_lens,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        *cv.strides,
        cv.k_off,
        cv.v_off,
        GROUP=group,
        GROUP_P=_pow2(group),
        HEAD_DIM=d,
        HEAD_P=_pow2(d, 16),
        BLOCK=cv.block_size,
        KV_TILE=KV_TILE,
        INT8=cv.int8,
    )
    return out


@dataclass(slots=True)
class PrefillBatch:
    """A step's prefill chunks as the prefill kernel reads them (built once per step)."""

    starts: torch.Tensor  # [S] first row of each chunk in q
    counts: torch.Tensor  # [S] rows of each chunk
    contexts: torch.Tensor  # [S] tokens before each chunk
    tables: torch.Tensor  # [S, max_blocks] block ids (padded with 0)
    max_count: int  # the longest chunk (the grid)

    @classmethod
    def of(cls, prefills: list[PrefillSeq], device: torch.device, row0: int = 0) -> PrefillBatch:
        """``row0``: subtracted from each ``start`` (q holds the prefill rows only)."""
        width = max(int(p.block_ids.shape[0]) for p in prefills)
        tables = torch.zeros((len(prefills), width), dtype=torch.long, device=device)
        for i, p in enumerate(prefills):
            tables[i, : p.block_ids.shape[0]] = p.block_ids

        def long(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            long([p.start - row0 for p in prefills]),
            long([p.num_tokens for p in prefills]),
            long([p.num_context for p in prefills]),
            tables,
            max(p.num_tokens for p in prefills),
        )


def triton_prefill_batch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    batch: PrefillBatch,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every chunk of ``batch`` in one launch: q [N, Hq, D] -> ``out`` [N, Hq, D], where the
    rows of each chunk are written (other rows are left as they are)."""
    _, hq, d = q.shape
    group = hq // kv_cache.shape[4]
    cv = _cache_view(kv_cache, layer, d)
    out = torch.empty_like(q) if out is None else out
    grid = (-(-batch.max_count // BLOCK_M), hq, batch.counts.shape[0])
    _kernels().paged_prefill_kernel[grid](
        q,
        cv.values,
        cv.scales,
        batch.tables,
        batch.starts,
        batch.counts,
        batch.contexts,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        batch.tables.stride(0),
        *cv.strides,
        cv.k_off,
        cv.v_off,
        GROUP=group,
        HEAD_DIM=d,
        HEAD_P=_pow2(d, 16),
        BLOCK=cv.block_size,
        BLOCK_M=BLOCK_M,
        KV_TILE=KV_TILE,
        INT8=cv.int8,
        LOW=q.dtype != torch.float32,
        EMULATE=interpreting(),
    )
    return out


def triton_prefill_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, p: PrefillSeq, scale: float
) -> torch.Tensor:
    """One chunk: q [n, Hq, D] (the chunk's rows) -> [n, Hq, D]. Its KV is already written."""
    batch = PrefillBatch.of([p], q.device, row0=p.start)
    return triton_prefill_batch(q, kv_cache, layer, batch, scale)


PrefillKernel = Callable[[torch.Tensor, torch.Tensor, int, float, torch.Tensor], torch.Tensor]


def prefill_kernel_for(prefills: list[PrefillSeq], device: torch.device) -> PrefillKernel:
    """``AttentionMetadata.prefill_kernel`` for a step's chunks: their ``PrefillBatch`` built
    once (a few small host-to-device copies), then one launch per layer over the whole q."""
    batch = PrefillBatch.of(prefills, device)

    def kernel(
        q: torch.Tensor, kv_cache: torch.Tensor, layer: int, scale: float, out: torch.Tensor
    ) -> torch.Tensor:
        return triton_prefill_batch(q, kv_cache, layer, batch, scale, out)

    return kernel
