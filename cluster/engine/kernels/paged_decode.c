/* Paged decode attention on the CPU, reading K and V straight from the block-major KV cache.
 *
 * kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (fp32, contiguous)
 * q, out:   [batch, num_heads, head_dim]
 * tables:   [batch, max_blocks] block ids; ctx_lens: [batch] tokens of context per request
 *
 * One work item is one (request, kv head): its G = num_heads / num_kv_heads query heads share
 * every K and V row it loads, so the cache is read exactly once (no gather copy), and the
 * scores of an item stay in a small scratch buffer. Items [item_begin, item_end) let the caller
 * split the batch across threads (the call runs without the GIL).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

int pdserve_paged_decode_f32(
    const float *q, const float *kv, const int64_t *tables, const int64_t *ctx_lens,
    float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t max_blocks,
    int64_t block_size, int64_t num_layers, int64_t layer, float scale,
    int64_t item_begin, int64_t item_end) {
    const int64_t g = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;            /* one token of one k/v plane */
    const int64_t plane = block_size * row;                 /* one block of one k/v plane */
    const int64_t block_stride = num_layers * 2 * plane;    /* one whole block */
    const int64_t layer_off = layer * 2 * plane;
    int64_t max_ctx = 0;
    for (int64_t it = item_begin; it < item_end; it++) {
        int64_t c = ctx_lens[it / num_kv_heads];
        if (c > max_ctx) max_ctx = c;
    }
    float *scores = malloc(sizeof(float) * (size_t)(g * (max_ctx > 0 ? max_ctx : 1)));
    if (!scores) return -1;
    for (int64_t it = item_begin; it < item_end; it++) {
        const int64_t b = it / num_kv_heads, h = it % num_kv_heads;
        const int64_t ctx = ctx_lens[b];
        const int64_t *table = tables + b * max_blocks;
        const float *qb = q + (b * num_heads + h * g) * head_dim;
        float *ob = out + (b * num_heads + h * g) * head_dim;
        float mx[64], sum[64];
        for (int64_t j = 0; j < g; j++) mx[j] = -INFINITY;
        for (int64_t t = 0; t < ctx; t++) {
            const float *k = kv + table[t / block_size] * block_stride + layer_off
                             + (t % block_size) * row + h * head_dim;
            for (int64_t j = 0; j < g; j++) {
                float s = dot(qb + j * head_dim, k, head_dim) * scale;
                scores[j * ctx + t] = s;
                if (s > mx[j]) mx[j] = s;
            }
        }
        for (int64_t j = 0; j < g; j++) {
            float acc = 0.0f;
            float *sj = scores + j * ctx;
            for (int64_t t = 0; t < ctx; t++) {
                sj[t] = expf(sj[t] - mx[j]);
                acc += sj[t];
            }
            sum[j] = acc;
            for (int64_t d = 0; d < head_dim; d++) ob[j * head_dim + d] = 0.0f;
        }
        for (int64_t t = 0; t < ctx; t++) {
            const float *v = kv + table[t / block_size] * block_stride + layer_off + plane
                             + (t % block_size) * row + h * head_dim;
            for (int64_t j = 0; j < g; j++) axpy(ob + j * head_dim, scores[j * ctx + t], v, head_dim);
        }
        for (int64_t j = 0; j < g; j++) {
            const float inv = 1.0f / sum[j];
            for (int64_t d = 0; d < head_dim; d++) ob[j * head_dim + d] *= inv;
        }
    }
    free(scores);
    return 0;
}

/* The same over an int8 KV cache: each (token, kv head) row is head_dim int8 values followed by
 * their fp32 scale (kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + 4]
 * bytes), de-quantized here as it is read: q.k = s_k * sum q_i k_i; out += p * s_v * v. */
static inline float dot_i8(const float *a, const int8_t *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * (float)b[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * (float)b[i];
    return s;
}

static inline void axpy_i8(float *y, float a, const int8_t *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * (float)x[i];
}

static inline float row_scale(const uint8_t *row, int64_t head_dim) {
    float s;
    memcpy(&s, row + head_dim, sizeof s);
    return s;
}

int pdserve_paged_decode_i8(
    const float *q, const uint8_t *kv, const int64_t *tables, const int64_t *ctx_lens,
    float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t max_blocks,
    int64_t block_size, int64_t num_layers, int64_t layer, float scale,
    int64_t item_begin, int64_t item_end) {
    const int64_t g = num_heads / num_kv_heads;
    const int64_t width = head_dim + 4;                     /* bytes of one (token, head) row */
    const int64_t row = num_kv_heads * width;               /* one token of one k/v plane */
    const int64_t plane = block_size * row;
    const int64_t block_stride = num_layers * 2 * plane;
    const int64_t layer_off = layer * 2 * plane;
    int64_t max_ctx = 0;
    for (int64_t it = item_begin; it < item_end; it++) {
        int64_t c = ctx_lens[it / num_kv_heads];
        if (c > max_ctx) max_ctx = c;
    }
    float *scores = malloc(sizeof(float) * (size_t)(g * (max_ctx > 0 ? max_ctx : 1)));
    if (!scores) return -1;
    for (int64_t it = item_begin; it < item_end; it++) {
        const int64_t b = it / num_kv_heads, h = it % num_kv_heads;
        const int64_t ctx = ctx_lens[b];
        const int64_t *table = tables + b * max_blocks;
        const float *qb = q + (b * num_heads + h * g) * head_dim;
        float *ob = out + (b * num_heads + h * g) * head_dim;
        float mx[64], sum[64];
        for (int64_t j = 0; j < g; j++) mx[j] = -INFINITY;
        for (int64_t t = 0; t < ctx; t++) {
            const uint8_t *k = kv + table[t / block_size] * block_stride + layer_off
                               + (t % block_size) * row + h * width;
            const float ks = row_scale(k, head_dim) * scale;
            for (int64_t j = 0; j < g; j++) {
                float s = dot_i8(qb + j * head_dim, (const int8_t *)k, head_dim) * ks;
                scores[j * ctx + t] = s;
                if (s > mx[j]) mx[j] = s;
            }
        }
        for (int64_t j = 0; j < g; j++) {
            float acc = 0.0f;
            float *sj = scores + j * ctx;
            for (int64_t t = 0; t < ctx; t++) {
                sj[t] = expf(sj[t] - mx[j]);
                acc += sj[t];
            }
            sum[j] = acc;
            for (int64_t d = 0; d < head_dim; d++) ob[j * head_dim + d] = 0.0f;
        }
        for (int64_t t = 0; t < ctx; t++) {
            const uint8_t *v = kv + table[t / block_size] * block_stride + layer_off + plane
                               + (t % block_size) * row + h * width;
            const float vs = row_scale(v, head_dim);
            for (int64_t j = 0; j < g; j++)
                axpy_i8(ob + j * head_dim, scores[j * ctx + t] * vs, (const int8_t *)v, head_dim);
        }
        for (int64_t j = 0; j < g; j++) {
            const float inv = 1.0f / sum[j];
            for (int64_t d = 0; d < head_dim; d++) ob[j * head_dim + d] *= inv;
        }
    }
    free(scores);
    return 0;
}
