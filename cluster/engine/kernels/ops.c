/* The small per-layer ops around the linears (CPU fp32 models with the native kernels): RMSNorm,
 * RoPE, SwiGLU and the KV write. Each replaces several torch ops (and their per-op dispatch cost,
 * which at batch 1 exceeds the arithmetic) with one call, computing the same expressions in the
 * same order: products and sums round as torch's separate ops do (-ffp-contract=off). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"
#include "vec_exp.h"


typedef struct {
    const float *x;
    int64_t ldx;
    const float *w;
    float *out;
    int64_t ldo, h;
    float eps;
} norm_job;

static void norm_task(const void *ctx, int64_t i0, int64_t i1) {
    const norm_job *j = ctx;
    for (int64_t i = i0; i < i1; i++) {
        const float *x = j->x + i * j->ldx;
        float *o = j->out + i * j->ldo;
        float acc[8] = {0};
        int64_t k = 0;
        for (; k + 8 <= j->h; k += 8)
            for (int l = 0; l < 8; l++) acc[l] += x[k + l] * x[k + l];
        float ss = 0.0f;
        for (int l = 0; l < 8; l++) ss += acc[l];
        for (; k < j->h; k++) ss += x[k] * x[k];
        const float r = 1.0f / sqrtf(ss / (float)j->h + j->eps);
        for (k = 0; k < j->h; k++) o[k] = j->w[k] * (x[k] * r);
    }
}

/* out[i] = w * (x[i] * rsqrt(mean(x[i]^2) + eps)), rows of h values */
int pdserve_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo,
                     int64_t n, int64_t h, float eps, int num_threads) {
    const norm_job job = {x, ldx, w, out, ldo, h, eps};
    pd_run_parallel(norm_task, &job, n, 1, n >= 64 ? num_threads : 1);
    return 0;
}

/* RoPE in place on the first num_heads heads of each row of x (the q heads then the k heads of
 * a fused qkv row): v[j] = v[j] cos[j] - v[j + D/2] sin[j]; v[j + D/2] = v[j + D/2] cos + v[j] sin
 * with cos, sin: [positions, head_dim] tables. */
int pdserve_rope(float *x, int64_t ldx, int64_t n, int64_t num_heads, int64_t head_dim,
                 const float *cos_t, const float *sin_t, const int64_t *positions) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < n; i++) {
        const float *c = cos_t + positions[i] * head_dim, *s = sin_t + positions[i] * head_dim;
        for (int64_t hd = 0; hd < num_heads; hd++) {
            float *v = x + i * ldx + hd * head_dim;
            for (int64_t k = 0; k < half; k++) {
                const float a = v[k], b = v[k + half];
                v[k] = a * c[k] + (-b) * s[k];
                v[k + half] = b * c[k + half] + a * s[k + half];
            }
        }
    }
    return 0;
}

#if PD_X86
PD_AVX2 static PD_INLINE __m256 swiglu8_avx2(__m256 g, __m256 u) {
    const __m256 e = pd_exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f))); /* e^-g */
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* Eight at a time; the last count % 8 through a padded copy, so every element is computed by
 * the same formula wherever a split puts it (the decode step splits the rows between threads). */
PD_AVX2 static void swiglu_span_avx2(const float *g, const float *u, float *o, int64_t count) {
    int64_t k = 0;
    for (; k + 8 <= count; k += 8)
        _mm256_storeu_ps(o + k, swiglu8_avx2(_mm256_loadu_ps(g + k), _mm256_loadu_ps(u + k)));
    if (k < count) {
        float gt[8] = {0}, ut[8] = {0}, ot[8];
        memcpy(gt, g + k, sizeof(float) * (size_t)(count - k));
        memcpy(ut, u + k, sizeof(float) * (size_t)(count - k));
        _mm256_storeu_ps(ot, swiglu8_avx2(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
        memcpy(o + k, ot, sizeof(float) * (size_t)(count - k));
    }
}
#endif

/* out[i, k] = silu(gu[i, k]) * gu[i, inter + k]: g / (1 + e^-g) * u (AVX2: vec_exp.h's e^-g,
 * eight at a time, instead of an expf call per element) */
void pd_swiglu_span(const float *g, const float *u, float *o, int64_t count) {
#if PD_X86
    if (pd_isa() >= PD_ISA_AVX2) {
        swiglu_span_avx2(g, u, o, count);
        return;
    }
#endif
    for (int64_t k = 0; k < count; k++) o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
}

int pdserve_swiglu(const float *gu, int64_t ld, int64_t n, int64_t inter, float *out,
                   int64_t ldo) {
    for (int64_t i = 0; i < n; i++)
        pd_swiglu_span(gu + i * ld, gu + i * ld + inter, out + i * ldo, inter);
    return 0;
}

/* Write this step's K and V rows (from the fused qkv rows) into their cache slots of `layer`.
 * kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, width] of fp32 (int8 = 0, width =
 * head_dim) or bytes (int8 = 1, width = head_dim + 4: int8 values q = round(x / s), s = max|x| /
 * 127, then s), the encoding of kv_codec.Int8KV. */
int pdserve_write_kv(void *kv, const float *k, const float *v, int64_t ld, int64_t n,
                     const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t num_layers,
                     int64_t layer, int64_t block_size, int64_t num_kv_heads, int64_t row_heads,
                     int64_t head_dim, int int8) {
    const int64_t width = int8 ? head_dim + 4 : head_dim;
    const int64_t esize = int8 ? 1 : 4;
    const int64_t row = row_heads * width * esize; /* bytes of one token's heads in memory */
    const int64_t plane = block_size * row;
    const int64_t block_stride = num_layers * 2 * plane;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *base = (uint8_t *)kv + slot_blocks[i] * block_stride + layer * 2 * plane +
                        slot_offsets[i] * row;
        for (int kv_i = 0; kv_i < 2; kv_i++) {
            const float *src = (kv_i ? v : k) + i * ld;
            uint8_t *dst = base + kv_i * plane;
            for (int64_t hd = 0; hd < num_kv_heads; hd++) {
                const float *x = src + hd * head_dim;
                uint8_t *r = dst + hd * width * esize;
                if (!int8) {
                    memcpy(r, x, sizeof(float) * (size_t)head_dim);
                    continue;
                }
                float amax = 0.0f;
                for (int64_t d = 0; d < head_dim; d++) amax = fmaxf(amax, fabsf(x[d]));
                const float scale = amax / 127.0f;
                const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
                for (int64_t d = 0; d < head_dim; d++) {
                    float q = nearbyintf(x[d] * inv);
                    q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
                    r[d] = (uint8_t)(int8_t)q;
                }
                memcpy(r + head_dim, &scale, sizeof scale);
            }
        }
    }
    return 0;
}
