"""Paged attention over the block-major KV cache, in plain torch (CPU fp32, CUDA bf16/fp16).

KV cache layout, chosen for the transfer (one block = one contiguous region across all layers):

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, row_width]

Per layer the runner takes strided views ``kv_cache[:, layer, 0]`` (K) and ``[:, layer, 1]`` (V),
each ``[num_blocks, block_size, num_kv_heads, row_width]``. A row holds one (token, KV head) as
its ``KVCodec`` stores it (``row_width == head_dim`` for float KV; int8 values and their scale
for int8 KV, see ``kv_codec.py``): values are encoded when written and decoded where read.

A step's tokens are flattened: the decode tokens (one per request) first, then each prefill
chunk. Decodes are attended in one batched pass over padded block tables; prefill chunks one
sequence at a time (they are few per step and long). On CUDA the runner may name kernels that
read the cache in place instead (``decode_kernel``, ``prefill_kernel``: the Triton ones of
``cluster/engine/gpu``); on the CPU ``decode_kernel`` is the native library's, if any.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.engine.kv_codec import FLOAT_KV, KVCodec


@dataclass(slots=True)
class PrefillSeq:
    start: int  # first row of this chunk in the flattened step
    num_tokens: int  # rows of this chunk
    num_context: int  # tokens whose KV precedes the chunk (cached or earlier chunks)
    block_ids: torch.Tensor  # [num_blocks_needed] long: blocks covering context + chunk


@dataclass(slots=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [num_tokens] long: block of each new token's KV
    slot_offsets: torch.Tensor  # [num_tokens] long: offset inside that block
    num_decodes: int
    # Decodes: for layer 0's K, the row of every (kv head, request, context slot) in the cache
    # viewed as [-1, head_dim]; other layers and V are a constant offset away.
    decode_rows: torch.Tensor | None  # [Hkv * num_decodes * T] long, T = padded context
    decode_mask: torch.Tensor | None  # [num_decodes, T] additive 0 / -inf
    prefills: list[PrefillSeq]
    # The native path instead reads the cache in place through the block tables.
    decode_kernel: Callable[..., torch.Tensor] | None = None
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] long
    decode_ctx_lens: torch.Tensor | None = None  # [num_decodes] long
    # The GPU path instead attends every prefill chunk of the step in one call reading the
    # cache (the chunks' KV already written): (q, kv_cache, layer, scale, out) -> out with the
    # chunks' rows written (``gpu.triton_attention.prefill_kernel_for``). None: one SDPA a chunk.
    prefill_kernel: Callable[..., torch.Tensor] | None = None


def decode_row_index(
    block_tables: torch.Tensor,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    heads: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Rows of layer 0's K for padded block tables [B, max_blocks] -> [H * B * T], for the
    cache's heads ``heads`` (default all ``num_kv_heads``: a tensor-parallel rank's range)."""
    h0, h1 = heads if heads is not None else (0, num_kv_heads)
    nb = block_tables.shape[1]
    t = nb * block_size
    rows_per_block = num_layers * 2 * block_size * num_kv_heads
    slot = torch.arange(t, device=block_tables.device)
    blk = block_tables[:, slot // block_size]  # [B, T]
    row_bt = blk * rows_per_block + (slot % block_size) * num_kv_heads  # [B, T]
    head_ids = torch.arange(h0, h1, device=block_tables.device).view(-1, 1, 1)
    return (row_bt.unsqueeze(0) + head_ids).reshape(-1)  # [H * B * T]


def padding_mask(ctx_lens: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The torch gather's additive mask [B, width]: 0 over each row's context, -inf past it."""
    cols = torch.arange(width, device=ctx_lens.device)
    mask = torch.zeros((ctx_lens.shape[0], width), dtype=dtype, device=ctx_lens.device)
    return mask.masked_fill_(cols[None, :] >= ctx_lens[:, None], float("-inf"))


def cache_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The whole cache as [rows, row_width], one (token, KV head) a row, and the heads a
    token's row holds: also for a tensor-parallel rank's view of its heads, which it reads
    through the rows ``decode_row_index`` gives for its range."""
    width = kv_cache.shape[-1]
    if kv_cache.is_contiguous():
        return kv_cache.view(-1, width), kv_cache.shape[4]
    row_heads = kv_cache.stride(3) // width
    total = kv_cache.shape[0] * kv_cache.stride(0) // width
    return torch.as_strided(kv_cache, (total, width), (width, 1), 0), row_heads


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    codec: KVCodec = FLOAT_KV,
) -> None:
    # k_cache: [num_blocks, block_size, num_kv_heads, row_width] (strided view); k: [N, Hkv, D]
    k_cache.index_put_((meta.slot_blocks, meta.slot_offsets), codec.encode(k))
    v_cache.index_put_((meta.slot_blocks, meta.slot_offsets), codec.encode(v))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    codec: KVCodec = FLOAT_KV,
) -> torch.Tensor:
    """Attention of the step's queries over each request's cached context (KV already written).

    q: [N, Hq, D]; k, v: [N, Hkv, D] (this step's new keys and values, already in the cache).
    Returns [N, Hq, D].
    """
    nd = meta.num_decodes
    if nd == q.shape[0]:  # a decode-only step
        return _decode_attention(q, kv_cache, layer, meta, scale, codec)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode_attention(q[:nd], kv_cache, layer, meta, scale, codec)
    if meta.prefill_kernel is not None and meta.prefills:
        return meta.prefill_kernel(q, kv_cache, layer, scale, out)
    k_cache, v_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    if meta.prefills:
        # What the cache returns for this step's own keys and values (exact for float KV).
        k, v = codec.roundtrip(k), codec.roundtrip(v)
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, p, scale, codec)
    return out


def _decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    codec: KVCodec = FLOAT_KV,
) -> torch.Tensor:
    if meta.decode_kernel is not None:
        return meta.decode_kernel(
            q, kv_cache, meta.decode_block_tables, meta.decode_ctx_lens, layer, scale
        )
    assert meta.decode_rows is not None and meta.decode_mask is not None
    b, hq, d = q.shape
    _, _, _, block_size, hkv, _ = kv_cache.shape
    g = hq // hkv
    t = meta.decode_mask.shape[1]
    flat, row_heads = cache_rows(kv_cache)  # [rows, row_width]: one (token, kv head) each
    k_rows = meta.decode_rows + (layer * 2) * block_size * row_heads
    # One gather per K and V straight into [Hkv * B, T, D], the layout the matmuls want.
    kh = codec.decode(flat.index_select(0, k_rows), q.dtype).view(hkv * b, t, d)
    v_rows = k_rows + block_size * row_heads
    vh = codec.decode(flat.index_select(0, v_rows), q.dtype).view(hkv * b, t, d)
    qh = q.view(b, hkv, g, d).transpose(0, 1).reshape(hkv * b, g, d)  # [Hkv*B, G, D]
    scores = torch.bmm(qh, kh.transpose(1, 2)).view(hkv, b, g, t)  # [Hkv, B, G, T]
    scores.mul_(scale).add_(meta.decode_mask.view(1, b, 1, t))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs.view(hkv * b, g, t), vh)  # [Hkv*B, G, D]
    return out.view(hkv, b, g, d).transpose(0, 1).reshape(b, hq, d)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    p: PrefillSeq,
    scale: float,
    codec: KVCodec,
) -> torch.Tensor:
    n = p.num_tokens
    if p.num_context == 0:
        # No earlier context: attend to this chunk's own keys, causally.
        kc, vc = k, v  # [n, Hkv, D]
        mask = None
        causal = True
    else:
        total = p.num_context + n
        kc = codec.decode(k_cache[p.block_ids].flatten(0, 1)[:total], q.dtype)  # [total, Hkv, D]
        vc = codec.decode(v_cache[p.block_ids].flatten(0, 1)[:total], q.dtype)
        # Query i (absolute position num_context + i) sees keys 0 .. num_context + i.
        cols = torch.arange(total, device=q.device)
        rows = torch.arange(n, device=q.device) + p.num_context
        mask = cols[None, :] <= rows[:, None]  # [n, total] bool
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
        kc.transpose(0, 1).unsqueeze(0),  # [1, Hkv, total, D]
        vc.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )  # [1, Hq, n, D]
    return out[0].transpose(0, 1)
