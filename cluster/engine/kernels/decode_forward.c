/* A decode step's decoder layers in one call (CPU fp32 models with packed weights).
 *
 * The same operations, in the same order and through the same functions, as the per-op path in
 * layer_ops.NativeOps (so the hidden states are bit-identical): per layer
 *
 *   x = rms_norm(h); qkv = x W_qkv^T (+ bias); RoPE on the q and k heads; K, V into the cache;
 *   attn = paged decode attention; h += attn W_o^T; x = rms_norm(h); gu = x W_gu^T;
 *   h += swiglu(gu) W_down^T
 *
 * At batch 1 the per-op path spends about as long in Python and torch dispatch between the
 * kernels as in them; here the only Python is the call. Every row is a decode row (one token,
 * its own context); the attention is paged_decode.c's routine.
 */
#include <stdlib.h>
#include <string.h>

#include "native.h"

#define PD_MAX_SEGMENTS 4
typedef struct {
    int64_t cols, num_segments;
    int64_t qtype[PD_MAX_SEGMENTS], rows[PD_MAX_SEGMENTS], row_bytes[PD_MAX_SEGMENTS];
    const uint8_t *data[PD_MAX_SEGMENTS];
    const float *scales[PD_MAX_SEGMENTS];
} pd_matrix;

typedef struct {
    const float *input_norm, *post_norm, *qkv_bias; /* qkv_bias may be NULL */
    pd_matrix qkv, o, gate_up, down;
} pd_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, num_threads;
    float eps, scale;
    const pd_layer *layers;
    const float *cos, *sin; /* [max_len, head_dim] */
    /* the cache's layer of layers[0] (a pipeline stage's first), and the layers it holds */
    int64_t first_layer, cache_layers;
} pd_model;

/* y[n, ldy] (+)= x W^T (+ bias), segment after segment (adjacent output columns); the calling
 * thread runs hook (if any) while the first segment's job starts */
static int linear_hook(const pd_model *m, const pd_matrix *w, const float *x, int64_t n,
                       int64_t ldx, float *y, int64_t ldy, const float *bias, int accumulate,
                       pd_hook_fn hook, const void *hook_ctx) {
    int64_t r0 = 0;
    for (int64_t s = 0; s < w->num_segments; s++) {
        const int rc = pd_linear_hook((int)w->qtype[s], w->data[s], w->scales[s], w->rows[s],
                                      w->cols, w->row_bytes[s], x, n, ldx, y + r0, ldy,
                                      bias ? bias + r0 : NULL, accumulate, (int)m->num_threads,
                                      s == 0 ? hook : NULL, hook_ctx);
        if (rc != 0) return rc;
        r0 += w->rows[s];
    }
    return 0;
}

static int linear(const pd_model *m, const pd_matrix *w, const float *x, int64_t n, int64_t ldx,
                  float *y, int64_t ldy, const float *bias, int accumulate) {
    return linear_hook(m, w, x, n, ldx, y, ldy, bias, accumulate, NULL, NULL);
}

/* The K and V rows that a layer's attention is about to read: every row's context before its new
 * token (whose K and V the layer writes after its qkv projection), block by block, up to
 * PD_KV_PREFETCH_MAX bytes (about what an L2 holds beside the weights streaming through it).
 * The calling thread asks for them while the workers start on the qkv projection. At batch 1
 * the step's 96 MB of weights have flushed the L3 since the previous step read these rows, and
 * without this the attention waits on memory for a good part of its time. */
#define PD_KV_PREFETCH_MAX (256 * 1024)

typedef struct {
    const uint8_t *kv;
    const int64_t *tables, *ctx_lens;
    int64_t n, max_blocks, block_size, row, plane, block_stride, layer_off;
} kv_prefetch;

static void prefetch_kv(const void *arg) {
    const kv_prefetch *p = arg;
    int64_t budget = PD_KV_PREFETCH_MAX;
    for (int64_t i = 0; i < p->n && budget > 0; i++) {
        const int64_t ctx = p->ctx_lens[i] - 1;
        for (int64_t t0 = 0; t0 < ctx && budget > 0; t0 += p->block_size) {
            const int64_t left = ctx - t0, tokens = left < p->block_size ? left : p->block_size;
            const int64_t bytes = tokens * p->row;
            const uint8_t *k = p->kv + p->tables[i * p->max_blocks + t0 / p->block_size] *
                                           p->block_stride + p->layer_off;
            for (int64_t b = 0; b < bytes; b += 64) {
                __builtin_prefetch(k + b, 0, 3);
                __builtin_prefetch(k + p->plane + b, 0, 3);
            }
            budget -= 2 * bytes;
        }
    }
}

typedef struct {
    const float *gu;
    int64_t ld, inter;
    float *out;
} swiglu_job;

/* elements [e0, e1) of the [n, inter] output, row-major: each computed as pdserve_swiglu does */
static void swiglu_task(const void *ctx, int64_t e0, int64_t e1) {
    const swiglu_job *j = ctx;
    while (e0 < e1) {
        const int64_t i = e0 / j->inter, k0 = e0 % j->inter;
        const int64_t k1 = j->inter < k0 + (e1 - e0) ? j->inter : k0 + (e1 - e0);
        const float *g = j->gu + i * j->ld;
        pd_swiglu_span(g + k0, g + j->inter + k0, j->out + i * j->inter + k0, k1 - k0);
        e0 += k1 - k0;
    }
}

/* silu(gate) * up over [n, inter] on the threads (an expf per element: at batch 32 on one
 * thread it was a visible part of the step); the same values whatever the split */
static void swiglu_parallel(const float *gu, int64_t ld, int64_t n, int64_t inter, float *out,
                            int num_threads) {
    const swiglu_job job = {gu, ld, inter, out};
    const int64_t total = n * inter;
    pd_run_parallel(swiglu_task, &job, total, 256, total >= 1024 ? num_threads : 1);
}

/* h [n, hidden] in place through every layer. kv: [num_blocks, L, 2, block_size, Hkv, width] of
 * fp32 (kv_int8 = 0) or int8 rows with their scales (1); tables [n, max_blocks]; ctx_lens [n]
 * (position + 1); slot_blocks / slot_offsets: where each row's K and V go. 0, -1 (a format the
 * linear does not know) or -2 (no memory, or the attention failed). */
int pdserve_decode_forward(const pd_model *m, float *h, int64_t n, const int64_t *positions,
                           void *kv, int64_t block_size, int kv_int8, const int64_t *tables,
                           int64_t max_blocks, const int64_t *ctx_lens,
                           const int64_t *slot_blocks, const int64_t *slot_offsets) {
    const int64_t H = m->hidden, hq = m->num_heads, hkv = m->num_kv_heads, d = m->head_dim;
    const int64_t I = m->inter, qkv_w = (hq + 2 * hkv) * d;
    float *buf = malloc(sizeof(float) * (size_t)(n * (H + qkv_w + 2 * hq * d + 3 * I)));
    if (!buf) return -2;
    float *x = buf, *qkv = x + n * H, *q = qkv + n * qkv_w, *att = q + n * hq * d;
    float *gu = att + n * hq * d, *act = gu + n * 2 * I;
    const int64_t kv_row = hkv * (kv_int8 ? d + 4 : d * 4), kv_plane = block_size * kv_row;
    kv_prefetch pf = {kv, tables, ctx_lens, n, max_blocks, block_size, kv_row, kv_plane,
                      m->cache_layers * 2 * kv_plane, 0};
    int rc = 0;
    for (int64_t l = 0; l < m->num_layers && rc == 0; l++) {
        const pd_layer *lw = &m->layers[l];
        pdserve_rms_norm(h, H, lw->input_norm, x, H, n, H, m->eps, (int)m->num_threads);
        const int64_t cl = m->first_layer + l; /* the layer's rows in the cache */
        pf.layer_off = cl * 2 * kv_plane;
        if ((rc = linear_hook(m, &lw->qkv, x, n, H, qkv, qkv_w, lw->qkv_bias, 0, prefetch_kv, &pf)))
            break;
        pdserve_rope(qkv, qkv_w, n, hq + hkv, d, m->cos, m->sin, positions);
        pdserve_write_kv(kv, qkv + hq * d, qkv + (hq + hkv) * d, qkv_w, n, slot_blocks,
                         slot_offsets, m->cache_layers, cl, block_size, hkv, hkv, d, kv_int8);
        for (int64_t i = 0; i < n; i++) memcpy(q + i * hq * d, qkv + i * qkv_w, sizeof(float) * hq * d);
        if (pdserve_paged_decode(q, kv, tables, ctx_lens, att, n, hq, hkv, hkv, d, max_blocks,
                                 block_size, m->cache_layers, cl, m->scale, kv_int8,
                                 (int)m->num_threads) != 0) {
            rc = -2;
            break;
        }
        if ((rc = linear(m, &lw->o, att, n, hq * d, h, H, NULL, 1))) break;
        pdserve_rms_norm(h, H, lw->post_norm, x, H, n, H, m->eps, (int)m->num_threads);
        if ((rc = linear(m, &lw->gate_up, x, n, H, gu, 2 * I, NULL, 0))) break;
        swiglu_parallel(gu, 2 * I, n, I, act, (int)m->num_threads);
        rc = linear(m, &lw->down, act, n, I, h, H, NULL, 1);
    }
    free(buf);
    return rc;
}
