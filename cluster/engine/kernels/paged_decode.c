/* Paged decode attention on the CPU, reading K and V straight from the block-major KV cache:
 * one routine for fp32 and int8 KV rows.
 *
 * kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, width]: fp32 rows (width =
 *           head_dim floats) or int8 rows (head_dim int8 values, then their fp32 scale: the
 *           encoding of kv_codec.Int8KV), de-quantized as they are read: q.k = s_k sum q_i k_i,
 *           out += p s_v v
 * q, out:   [batch, num_heads, head_dim]
 * tables:   [batch, max_blocks] block ids; ctx_lens: [batch] tokens of context per request
 *
 * One work item is one (request, kv head): its G = num_heads / num_kv_heads query heads share
 * every K and V row it loads, so the cache is read exactly once (no gather copy), and the
 * scores of an item stay in a scratch buffer. The items split between the pool's threads
 * (pool.c). Per item, three passes: scores, softmax, the weighted sum of V; an AVX2 variant
 * (head_dim % 8 == 0) and a portable one, chosen at run time (pd_isa).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "vec_exp.h"

#define PD_MAX_GROUP 64 /* query heads per kv head (the items' stack buffers) */
/* (row, kv head) items x context tokens from which the items are split between the threads:
 * below it a layer's attention is too short to pay for waking them (at batch 1 of the default
 * model, 3 kv heads, it splits from 64 tokens of context on) */
#define PD_PARALLEL_MIN_WORK 192

static inline float row_scale(const uint8_t *row, int64_t head_dim) {
    float s;
    memcpy(&s, row + head_dim, sizeof s);
    return s;
}

/* -- portable -------------------------------------------------------------------------------
 * A row's values as floats: fp32 as they are, int8 converted (the scale is the caller's). */

#define LANES 8

static inline float dot_row(const float *a, const uint8_t *row, int64_t n, int i8) {
    float acc[LANES] = {0};
    const float *f = (const float *)row;
    const int8_t *q = (const int8_t *)row;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * (i8 ? (float)q[i + l] : f[i + l]);
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * (i8 ? (float)q[i] : f[i]);
    return s;
}

static inline void axpy_row(float *y, float a, const uint8_t *row, int64_t n, int i8) {
    const float *f = (const float *)row;
    const int8_t *q = (const int8_t *)row;
    for (int64_t i = 0; i < n; i++) y[i] += a * (i8 ? (float)q[i] : f[i]);
}

/* One item (see attend_item_avx2 for the arguments): scores, softmax with expf, then the output
 * token by token. scores: g x pad floats. */
static void attend_item_portable(const float *qb, float *ob, int64_t g, int64_t head_dim,
                                 const uint8_t *kbase, const uint8_t *vbase,
                                 const int64_t *offs, int64_t ctx, int64_t pad, float scale,
                                 int i8, float *scores) {
    float mx[PD_MAX_GROUP], sum[PD_MAX_GROUP];
    for (int64_t j = 0; j < g; j++) mx[j] = -INFINITY;
    for (int64_t t = 0; t < ctx; t++) {
        const uint8_t *k = kbase + offs[t];
        const float ks = i8 ? row_scale(k, head_dim) * scale : scale;
        for (int64_t j = 0; j < g; j++) {
            const float s = dot_row(qb + j * head_dim, k, head_dim, i8) * ks;
            scores[j * pad + t] = s;
            if (s > mx[j]) mx[j] = s;
        }
    }
    for (int64_t j = 0; j < g; j++) {
        float acc = 0.0f;
        float *sj = scores + j * pad;
        for (int64_t t = 0; t < ctx; t++) {
            sj[t] = expf(sj[t] - mx[j]);
            acc += sj[t];
        }
        sum[j] = acc;
        memset(ob + j * head_dim, 0, sizeof(float) * (size_t)head_dim);
    }
    for (int64_t t = 0; t < ctx; t++) {
        const uint8_t *v = vbase + offs[t];
        const float vs = i8 ? row_scale(v, head_dim) : 1.0f;
        for (int64_t j = 0; j < g; j++)
            axpy_row(ob + j * head_dim, scores[j * pad + t] * vs, v, head_dim, i8);
    }
    for (int64_t j = 0; j < g; j++) {
        const float inv = 1.0f / sum[j];
        for (int64_t d = 0; d < head_dim; d++) ob[j * head_dim + d] *= inv;
    }
}

/* -- AVX2 + FMA -------------------------------------------------------------------------------
 *
 * The same three passes per item, laid out for the vector units and the caches:
 *   scores:  eight tokens at a time, one accumulator per token over the head's vectors, the eight
 *            reduced together into one vector of eight scores (a token's arithmetic does not
 *            depend on its place in the tile: the tail repeats the tile's first token and drops
 *            it); while a tile is scored, the K rows two tiles on and this tile's V rows are
 *            asked for (at batch 1 the rows come from memory: the step's weights flush the L3);
 *   softmax: exp(s - max) eight at a time (vec_exp.h, within 2 ulp of expf) and their sum;
 *   output:  sum_t p_t v_t in token order, chunks of 32 tokens whose V rows stay in L1 while
 *            every query head of the item reads them, 64 dimensions' accumulators in registers;
 *            then times 1 / sum.
 * At batch 1 this is several times faster than the portable loops (whose per-token dot ends in a
 * serial reduction, whose axpy reloads the output for every token, and whose expf is a call per
 * score). Needs head_dim % 8 == 0. */
#if PD_X86
#define PD_TILE 8
#define PD_PV_CHUNK 32

/* lane i of the result = the sum of a_i's eight lanes */
PD_AVX2 static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                           __m256 a6, __m256 a7) {
    const __m256 s01 = _mm256_hadd_ps(a0, a1), s23 = _mm256_hadd_ps(a2, a3);
    const __m256 s45 = _mm256_hadd_ps(a4, a5), s67 = _mm256_hadd_ps(a6, a7);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* the eight tokens' rows of [t0, t0 + 8) (past ctx: token t0's again) */
static inline void tile_rows(const uint8_t *base, const int64_t *offs, int64_t t0, int64_t ctx,
                             const uint8_t *rows[PD_TILE]) {
    for (int i = 0; i < PD_TILE; i++) rows[i] = base + offs[t0 + i < ctx ? t0 + i : t0];
}

/* ask for the rows of tokens [t0, t1) (`bytes` each) */
PD_AVX2 static inline void prefetch_rows(const uint8_t *base, const int64_t *offs, int64_t t0,
                                 int64_t t1, int64_t bytes) {
    for (int64_t t = t0; t < t1; t++)
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)base + offs[t] + b,
                                                             _MM_HINT_T0);
}

/* the rest of the rows of tokens [t0, t1): the bytes [from, to) after each row's start, into
 * the outer caches (the next kv heads' items read them) */
PD_AVX2 static inline void prefetch_rest(const uint8_t *base, const int64_t *offs, int64_t t0,
                                         int64_t t1, int64_t from, int64_t to) {
    for (int64_t t = t0; t < t1; t++)
        for (int64_t b = from; b < to; b += 64)
            _mm_prefetch((const char *)base + offs[t] + b, _MM_HINT_T2);
}

/* bytes of 8 values of a row: fp32, or int8 */
static inline int64_t vec_bytes(int i8) { return i8 ? 8 : 32; }

PD_AVX2 static inline __m256 load_k(const uint8_t *p, int i8) {
    if (!i8) return _mm256_loadu_ps((const float *)p);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* dot(q, k) over nv vectors for eight tokens' rows at once (fp32 rows, or int8 rows) */
PD_AVX2 static inline __m256 dots8(const float *q, const uint8_t *const r[PD_TILE], int64_t nv, int i8) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const int64_t es = vec_bytes(i8);
    for (int64_t v = 0; v < nv; v++) {
        const __m256 qv = _mm256_loadu_ps(q + 8 * v);
        a0 = _mm256_fmadd_ps(qv, load_k(r[0] + v * es, i8), a0);
        a1 = _mm256_fmadd_ps(qv, load_k(r[1] + v * es, i8), a1);
        a2 = _mm256_fmadd_ps(qv, load_k(r[2] + v * es, i8), a2);
        a3 = _mm256_fmadd_ps(qv, load_k(r[3] + v * es, i8), a3);
        a4 = _mm256_fmadd_ps(qv, load_k(r[4] + v * es, i8), a4);
        a5 = _mm256_fmadd_ps(qv, load_k(r[5] + v * es, i8), a5);
        a6 = _mm256_fmadd_ps(qv, load_k(r[6] + v * es, i8), a6);
        a7 = _mm256_fmadd_ps(qv, load_k(r[7] + v * es, i8), a7);
    }
    return hsum8(a0, a1, a2, a3, a4, a5, a6, a7);
}

/* o[0..64) (+)= sum_{t in [t0, t1)} p[t] v_t[v0 * 8 ..] (first: start from 0) */
PD_AVX2 static inline void pv64(float *o, const float *p, const uint8_t *vbase, const int64_t *offs,
                        int64_t t0, int64_t t1, int64_t v0, int i8, int first) {
    const int64_t es = vec_bytes(i8);
    __m256 a0, a1, a2, a3, a4, a5, a6, a7;
    if (first) {
        a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    } else {
        a0 = _mm256_loadu_ps(o), a1 = _mm256_loadu_ps(o + 8), a2 = _mm256_loadu_ps(o + 16);
        a3 = _mm256_loadu_ps(o + 24), a4 = _mm256_loadu_ps(o + 32), a5 = _mm256_loadu_ps(o + 40);
        a6 = _mm256_loadu_ps(o + 48), a7 = _mm256_loadu_ps(o + 56);
    }
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *vr = vbase + offs[t] + v0 * es;
        const __m256 pt = _mm256_set1_ps(p[t]);
        a0 = _mm256_fmadd_ps(pt, load_k(vr, i8), a0);
        a1 = _mm256_fmadd_ps(pt, load_k(vr + es, i8), a1);
        a2 = _mm256_fmadd_ps(pt, load_k(vr + 2 * es, i8), a2);
        a3 = _mm256_fmadd_ps(pt, load_k(vr + 3 * es, i8), a3);
        a4 = _mm256_fmadd_ps(pt, load_k(vr + 4 * es, i8), a4);
        a5 = _mm256_fmadd_ps(pt, load_k(vr + 5 * es, i8), a5);
        a6 = _mm256_fmadd_ps(pt, load_k(vr + 6 * es, i8), a6);
        a7 = _mm256_fmadd_ps(pt, load_k(vr + 7 * es, i8), a7);
    }
    _mm256_storeu_ps(o, a0), _mm256_storeu_ps(o + 8, a1), _mm256_storeu_ps(o + 16, a2);
    _mm256_storeu_ps(o + 24, a3), _mm256_storeu_ps(o + 32, a4), _mm256_storeu_ps(o + 40, a5);
    _mm256_storeu_ps(o + 48, a6), _mm256_storeu_ps(o + 56, a7);
}

/* o[0..8) (+)= sum_{t in [t0, t1)} p[t] v_t[v * 8 ..]: what head_dim % 64 leaves */
PD_AVX2 static inline void pv8(float *o, const float *p, const uint8_t *vbase, const int64_t *offs,
                       int64_t t0, int64_t t1, int64_t v, int i8, int first) {
    const int64_t es = vec_bytes(i8);
    __m256 a = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o);
    for (int64_t t = t0; t < t1; t++)
        a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), load_k(vbase + offs[t] + v * es, i8), a);
    _mm256_storeu_ps(o, a);
}

/* One item: g query heads (qb, ob: [g, head_dim]) against kv head rows at kbase / vbase (the
 * item's head in its layer's K and V planes) + offs[t] for token t (`width` bytes: head_dim
 * floats, or head_dim int8 and their fp32 scale). scores: g x (ctx rounded up to 8) floats. */
PD_AVX2 static void attend_item_avx2(const float *qb, float *ob, int64_t g, int64_t head_dim,
                             int64_t width, const uint8_t *kbase, const uint8_t *vbase,
                             const int64_t *offs, int64_t ctx, float scale, int i8,
                             int64_t rest, float *scores) {
    const int64_t nv = head_dim / 8, pad = (ctx + PD_TILE - 1) / PD_TILE * PD_TILE;
    const uint8_t *r[PD_TILE];
    if (ctx <= 0) { /* nothing to attend to (a caller never asks) */
        memset(ob, 0, sizeof(float) * (size_t)(g * head_dim));
        return;
    }
    prefetch_rows(kbase, offs, 0, ctx < 2 * PD_TILE ? ctx : 2 * PD_TILE, width);
    for (int64_t t0 = 0; t0 < ctx; t0 += PD_TILE) {
        const int64_t t1 = t0 + PD_TILE < ctx ? t0 + PD_TILE : ctx;
        const int64_t ahead = t0 + 2 * PD_TILE;
        if (ahead < ctx)
            prefetch_rows(kbase, offs, ahead, ahead + PD_TILE < ctx ? ahead + PD_TILE : ctx, width);
        prefetch_rows(vbase, offs, t0, t1, width);
        if (rest > 0) { /* a request's first kv head: the whole token rows, read in order */
            prefetch_rest(kbase, offs, t0, t1, width, width + rest);
            prefetch_rest(vbase, offs, t0, t1, width, width + rest);
        }
        tile_rows(kbase, offs, t0, ctx, r);
        __m256 ks = _mm256_set1_ps(scale);
        if (i8) {
            float f[PD_TILE];
            for (int i = 0; i < PD_TILE; i++) f[i] = row_scale(r[i], head_dim) * scale;
            ks = _mm256_loadu_ps(f);
        }
        for (int64_t j = 0; j < g; j++)
            _mm256_storeu_ps(scores + j * pad + t0,
                             _mm256_mul_ps(dots8(qb + j * head_dim, r, nv, i8), ks));
    }
    float inv[64];
    for (int64_t j = 0; j < g; j++) {
        float *sj = scores + j * pad;
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 8 <= ctx; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sj + t));
        float m[8], mx;
        _mm256_storeu_ps(m, m8);
        mx = m[0];
        for (int i = 1; i < 8; i++) mx = m[i] > mx ? m[i] : mx;
        for (; t < ctx; t++) mx = sj[t] > mx ? sj[t] : mx;
        for (t = ctx; t < pad; t++) sj[t] = mx; /* the tail's lanes: exp(0), not counted */
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 s8 = _mm256_setzero_ps();
        for (t = 0; t + 8 <= ctx; t += 8) {
            const __m256 e = pd_exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mv));
            _mm256_storeu_ps(sj + t, e);
            s8 = _mm256_add_ps(s8, e);
        }
        float sum = 0.0f, tail[8];
        if (t < ctx) {
            _mm256_storeu_ps(tail, pd_exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mv)));
            for (int64_t i = t; i < ctx; i++) sj[i] = tail[i - t], sum += tail[i - t];
        }
        _mm256_storeu_ps(m, s8);
        for (int i = 0; i < 8; i++) sum += m[i];
        inv[j] = 1.0f / sum;
        if (i8) /* p_t times the row's scale, as the portable path's axpy coefficient */
            for (t = 0; t < ctx; t++) sj[t] *= row_scale(vbase + offs[t], head_dim);
    }
    for (int64_t c0 = 0; c0 < ctx; c0 += PD_PV_CHUNK) { /* V rows of a chunk stay in L1 */
        const int64_t c1 = c0 + PD_PV_CHUNK < ctx ? c0 + PD_PV_CHUNK : ctx;
        for (int64_t j = 0; j < g; j++) {
            int64_t v0 = 0;
            for (; v0 + 8 <= nv; v0 += 8)
                pv64(ob + j * head_dim + 8 * v0, scores + j * pad, vbase, offs, c0, c1, v0, i8,
                     c0 == 0);
            for (; v0 < nv; v0++)
                pv8(ob + j * head_dim + 8 * v0, scores + j * pad, vbase, offs, c0, c1, v0, i8,
                    c0 == 0);
        }
    }
    for (int64_t j = 0; j < g; j++) {
        const __m256 iv = _mm256_set1_ps(inv[j]);
        for (int64_t v = 0; v < nv; v++)
            _mm256_storeu_ps(ob + j * head_dim + 8 * v,
                             _mm256_mul_ps(_mm256_loadu_ps(ob + j * head_dim + 8 * v), iv));
    }
}

#endif /* PD_X86 */

/* -- the routine --------------------------------------------------------------------------- */

typedef struct {
    const float *q;
    const uint8_t *kv;
    const int64_t *tables, *ctx_lens;
    float *out;
    int64_t hq, hkv, row_heads, d, max_blocks, block_size, num_layers, layer;
    float scale;
    int i8;
    _Atomic int failed;
} attn_job;

/* Items [i0, i1): each request's token offsets once for all its kv heads, then every item
 * through the variant this CPU runs. */
static void attn_items(const void *ctx, int64_t i0, int64_t i1) {
    attn_job *j = (attn_job *)ctx;
    const int64_t hkv = j->hkv, d = j->d, g = j->hq / hkv;
    const int64_t width = j->i8 ? d + 4 : d * 4; /* bytes of one (token, head) row */
    const int64_t row = j->row_heads * width, plane = j->block_size * row;
    const int64_t block_stride = j->num_layers * 2 * plane, layer_off = j->layer * 2 * plane;
    int64_t max_ctx = 0;
    for (int64_t it = i0; it < i1; it++) {
        const int64_t c = j->ctx_lens[it / hkv];
        if (c > max_ctx) max_ctx = c;
    }
    const int64_t pad = (max_ctx + 8) / 8 * 8;
    /* scores [g, pad], then the byte offset of each token's row from its head's plane [pad] */
    float *scores = malloc((sizeof(float) * (size_t)g + sizeof(int64_t)) * (size_t)pad);
    if (!scores) {
        j->failed = 1;
        return;
    }
    int64_t *offs = (int64_t *)(scores + g * pad), offs_of = -1;
#if PD_X86
    const int vector = pd_isa() >= PD_ISA_AVX2 && d % 8 == 0;
#endif
    for (int64_t it = i0; it < i1; it++) {
        const int64_t b = it / hkv, h = it % hkv, ctx = j->ctx_lens[b];
        if (offs_of != b) {
            const int64_t *table = j->tables + b * j->max_blocks;
            for (int64_t t0 = 0; t0 < ctx; t0 += j->block_size) {
                const int64_t base = table[t0 / j->block_size] * block_stride;
                for (int64_t t = t0; t < ctx && t < t0 + j->block_size; t++)
                    offs[t] = base + (t - t0) * row;
            }
            offs_of = b;
        }
        const uint8_t *kbase = j->kv + layer_off + h * width;
        const float *qb = j->q + (b * j->hq + h * g) * d;
        float *ob = j->out + (b * j->hq + h * g) * d;
#if PD_X86
        if (vector) {
            attend_item_avx2(qb, ob, g, d, width, kbase, kbase + plane, offs, ctx, j->scale, j->i8,
                             h == 0 && it + 1 < i1 ? (hkv - 1) * width : 0, scores);
            continue;
        }
#endif
        attend_item_portable(qb, ob, g, d, kbase, kbase + plane, offs, ctx, pad, j->scale, j->i8,
                             scores);
    }
    free(scores);
}

/* 0; -1: no memory for the scratch; -2: more query heads per kv head than PD_MAX_GROUP */
int pdserve_paged_decode(const float *q, const void *kv, const int64_t *tables,
                         const int64_t *ctx_lens, float *out, int64_t batch, int64_t num_heads,
                         int64_t num_kv_heads, int64_t row_heads, int64_t head_dim,
                         int64_t max_blocks, int64_t block_size, int64_t num_layers,
                         int64_t layer, float scale, int kv_int8, int num_threads) {
    if (num_heads / num_kv_heads > PD_MAX_GROUP) return -2;
    attn_job job = {q,         kv,         tables,     ctx_lens,   out,   num_heads,
                    num_kv_heads, row_heads, head_dim, max_blocks, block_size, num_layers,
                    layer,     scale,      kv_int8,    0};
    const int64_t items = batch * num_kv_heads;
    int64_t max_ctx = 0;
    for (int64_t i = 0; i < batch; i++) max_ctx = ctx_lens[i] > max_ctx ? ctx_lens[i] : max_ctx;
    const int threads = items * max_ctx >= PD_PARALLEL_MIN_WORK
                            ? (int)(num_threads < items ? num_threads : items)
                            : 1;
    pd_run_parallel(attn_items, &job, items, 1, threads);
    return job.failed ? -1 : 0;
}
