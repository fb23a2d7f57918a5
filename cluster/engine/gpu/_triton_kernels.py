"""The Triton kernels behind ``triton_attention`` (imported only when a kernel is first used).

Both kernels read the paged cache in place through block tables, one (token, KV head) row at a
time, de-quantizing int8 rows as they load them, and run an online softmax in fp32 over tiles
of ``KV_TILE`` tokens; a tile may span several cache blocks (each token looks up its block), so
any block size works with any tile. Head sizes that are not a power of two (80) are padded to
``HEAD_P`` lanes that load as zeros and are never stored.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(
    kv_ptr,
    scale_ptr,
    rows,
    d,
    tmask,
    dmask,
    HEAD_DIM: tl.constexpr,
    INT8: tl.constexpr,
):
    """[T, HEAD_P] fp32 values of the cache rows starting at element offsets ``rows`` [T]."""
    x = tl.load(kv_ptr + rows[:, None] + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0)
    x = x.to(tl.float32)
    if INT8:  # int8 values, then the row's fp32 scale (4-aligned: row_width % 4 == 0)
        s = tl.load(scale_ptr + (rows + HEAD_DIM) // 4, mask=tmask, other=0.0)
        x = x * s[:, None]
    return x


@triton.jit
def _token_rows(tables_ptr, tok, tmask, s_blk, s_tok, BLOCK: tl.constexpr):
    """Element offsets of tokens ``tok`` [T] of one sequence (``tables_ptr`` is its table row)."""
    blk = tl.load(tables_ptr + tok // BLOCK, mask=tmask, other=0).to(tl.int64)
    return blk * s_blk + (tok % BLOCK).to(tl.int64) * s_tok


@triton.jit
def _dot(a, b, LOW: tl.constexpr, EMULATE: tl.constexpr, DTYPE: tl.constexpr):
    """a @ b accumulated in fp32: fp32 operands (``LOW`` off); operands rounded to ``DTYPE``
    (fp16/bf16 tensor cores), or under the interpreter the same rounding then an fp32 dot
    (``EMULATE``: its bf16 dot is not exact)."""
    if LOW:
        if EMULATE:
            return tl.dot(
                a.to(DTYPE).to(tl.float32), b.to(DTYPE).to(tl.float32), input_precision="ieee"
            )
        return tl.dot(a.to(DTYPE), b.to(DTYPE))
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def paged_decode_kernel(
    q_ptr,
    kv_ptr,
    scale_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    sm_scale,
    s_qb,
    s_qh,
    s_ob,
    s_oh,
    s_tb,
    s_blk,
    s_tok,
    s_head,
    k_off,
    v_off,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,
    BLOCK: tl.constexpr,
    KV_TILE: tl.constexpr,
    INT8: tl.constexpr,
):
    """One program per (sequence, KV head): its ``GROUP`` query heads over its context."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_P)
    t = tl.arange(0, KV_TILE)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    qmask = gmask[:, None] & dmask[None, :]
    q_offs = b.to(tl.int64) * s_qb + (kvh * GROUP + g)[:, None] * s_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=qmask, other=0.0).to(tl.float32)
    ctx = tl.load(lens_ptr + b)
    table = tables_ptr + b.to(tl.int64) * s_tb
    head = kvh.to(tl.int64) * s_head
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_P], tl.float32)
    for j in range(0, tl.cdiv(ctx, KV_TILE)):
        tok = j * KV_TILE + t
        tmask = tok < ctx
        rows = _token_rows(table, tok, tmask, s_blk, s_tok, BLOCK) + head
        k = _load_rows(kv_ptr, scale_ptr, rows + k_off, d, tmask, dmask, HEAD_DIM, INT8)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale  # [GROUP_P, KV_TILE]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v = _load_rows(kv_ptr, scale_ptr, rows + v_off, d, tmask, dmask, HEAD_DIM, INT8)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / den[:, None]
    o_offs = b.to(tl.int64) * s_ob + (kvh * GROUP + g)[:, None] * s_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def paged_prefill_kernel(
    q_ptr,
    kv_ptr,
    scale_ptr,
    tables_ptr,
    starts_ptr,
    counts_ptr,
    ctx_ptr,
    out_ptr,
    sm_scale,
    s_qn,
    s_qh,
    s_on,
    s_oh,
    s_tb,
    s_blk,
    s_tok,
    s_head,
    k_off,
    v_off,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KV_TILE: tl.constexpr,
    INT8: tl.constexpr,
    LOW: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """One program per (tile of ``BLOCK_M`` queries, query head, sequence): query i of a chunk
    sits at position ctx + i and sees cached tokens 0 .. ctx + i (earlier context, then its own
    chunk causally)."""
    mt = tl.program_id(0)
    h = tl.program_id(1)
    sq = tl.program_id(2)
    n = tl.load(counts_ptr + sq)
    ctx = tl.load(ctx_ptr + sq)
    start = tl.load(starts_ptr + sq).to(tl.int64)
    r = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_P)
    t = tl.arange(0, KV_TILE)
    rmask = r < n
    dmask = d < HEAD_DIM
    qmask = rmask[:, None] & dmask[None, :]
    q_offs = (start + r)[:, None] * s_qn + h * s_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=qmask, other=0.0).to(tl.float32)
    pos = ctx + r  # each query's absolute position
    # keys up to the tile's last query; none for a tile past the chunk's end
    hi = tl.where(mt * BLOCK_M < n, ctx + tl.minimum(n, (mt + 1) * BLOCK_M), 0)
    table = tables_ptr + sq.to(tl.int64) * s_tb
    head = (h // GROUP).to(tl.int64) * s_head
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    dtype = q_ptr.dtype.element_ty
    for j in range(0, tl.cdiv(hi, KV_TILE)):
        tok = j * KV_TILE + t
        tmask = tok < hi
        rows = _token_rows(table, tok, tmask, s_blk, s_tok, BLOCK) + head
        k = _load_rows(kv_ptr, scale_ptr, rows + k_off, d, tmask, dmask, HEAD_DIM, INT8)
        s = _dot(q, tl.trans(k), LOW, EMULATE, dtype) * sm_scale  # [BLOCK_M, KV_TILE]
        s = tl.where(tok[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v = _load_rows(kv_ptr, scale_ptr, rows + v_off, d, tmask, dmask, HEAD_DIM, INT8)
        acc = acc * alpha[:, None] + _dot(p, v, LOW, EMULATE, dtype)
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    o_offs = (start + r)[:, None] * s_on + h * s_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=qmask)
