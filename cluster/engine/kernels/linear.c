/* Linear layers on the CPU: fp32 activations times weight rows in any of pdserve's formats.
 *
 * Weight formats (one row = one output feature, `row_bytes` bytes):
 *   F32 (ggml type 0):   `cols` fp32 values (a dense fp32 matrix, as it is)
 *   Q4_0 (ggml type 2):  blocks of 32 values, 18 bytes: fp16 d, 16 bytes of nibbles; w = d * (q - 8)
 *   Q4_1 (ggml type 3):  blocks of 32 values, 20 bytes: fp16 d, fp16 m, 16 bytes; w = d * q + m
 *   Q8_0 (ggml type 8):  blocks of 32 values, 34 bytes: fp16 d, 32 int8;            w = d * q
 *   I8_ROW (ours, 1000): `cols` int8 values, one fp32 scale per row (row_scales);   w = s * q
 *   I8_G32 (ours, 1001): blocks of 32 values, 36 bytes: fp16 d, fp16 m, 32 uint8;  w = d * q + m
 * In a 4-bit block, byte j holds value j in its low nibble and value j + 16 in its high nibble.
 * A row of blocks is held planar (kernels/quant.py to_planar): all its blocks' values, then all
 * their d, then all their m: the same bytes as GGUF's, in an order the kernels load faster.
 *
 *   y[i, r] = (accumulate ? y[i, r] : 0) + bias[r] + sum_k x[i, k] * w[r, k]
 *
 * The weights are exactly the values a de-quantizing reference computes (dequant_row with
 * -ffp-contract=off, so d * q + m rounds twice as numpy does). One activation row uses the fused
 * block kernels, which stream the weights once and never expand them: per block they compute
 * d * sum q x + m * sum x, the reference's dot up to the rounding of fp32 sums. A few rows
 * (AVX-512, AVX2) decode each weight block once and dot it with up to 8 activation rows, with
 * the very operations and order of that ISA's one-row kernel, so a row's output does not depend
 * on the batch it ran in (speculative verification rows equal plain decode rows bit for bit);
 * the portable path and int8 rows run every activation row through the one-row kernel. F32 rows
 * are summed in one fixed order per output whatever the batch (f32_rows). Many rows are the
 * caller's business (de-quantize tiles with pdserve_dequant_rows and use BLAS: models/packed.py
 * says from how many rows).
 *
 * Variants: AVX-512, AVX2 and portable per function, chosen at run time (pd_isa, pool.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "native.h"

#define MAX_BLOCKS 8192 /* cols up to 262144 */

/* -- portable: de-quantize one row, and dot one row -------------------------------------- */

static void dequant_block_portable(int qt, const uint8_t *q, float d, float m, float *o) {
    if (qt == QT_Q4_0) {
        for (int j = 0; j < 16; j++) {
            o[j] = (float)((int)(q[j] & 15) - 8) * d;
            o[j + 16] = (float)((int)(q[j] >> 4) - 8) * d;
        }
    } else if (qt == QT_Q4_1) {
        for (int j = 0; j < 16; j++) {
            o[j] = d * (float)(q[j] & 15) + m;
            o[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    } else if (qt == QT_I8_G32) {
        for (int j = 0; j < QK; j++) o[j] = d * (float)q[j] + m;
    } else { /* Q8_0 */
        for (int j = 0; j < QK; j++) o[j] = (float)(int8_t)q[j] * d;
    }
}

static inline float block_d(int qt, const uint8_t *w, int64_t nb, int64_t b) {
    return f16_to_f32(load_u16(row_d(qt, w, nb) + 2 * b));
}
static inline float block_m(int qt, const uint8_t *w, int64_t nb, int64_t b) {
    return HAS_MIN(qt) ? f16_to_f32(load_u16(row_m(qt, w, nb) + 2 * b)) : 0.0f;
}

static void dequant_row_portable(int qt, const uint8_t *w, float scale, int64_t cols, float *out) {
    if (qt == QT_I8_ROW) {
        const int8_t *q = (const int8_t *)w;
        for (int64_t k = 0; k < cols; k++) out[k] = (float)q[k] * scale;
        return;
    }
    const int64_t nb = cols / QK;
    const int qb = quant_bytes(qt);
    for (int64_t b = 0; b < nb; b++)
        dequant_block_portable(qt, w + b * qb, block_d(qt, w, nb, b), block_m(qt, w, nb, b),
                               out + b * QK);
}

static float dot_row_portable(int qt, const uint8_t *w, float scale, int64_t cols,
                              const float *x) {
    float tmp[QK];
    float acc = 0.0f;
    if (qt == QT_I8_ROW) {
        const int8_t *q = (const int8_t *)w;
        for (int64_t k = 0; k < cols; k++) acc += (float)q[k] * x[k];
        return acc * scale;
    }
    const int64_t nb = cols / QK;
    const int qb = quant_bytes(qt);
    for (int64_t b = 0; b < nb; b++) {
        dequant_block_portable(qt, w + b * qb, block_d(qt, w, nb, b), block_m(qt, w, nb, b), tmp);
        for (int j = 0; j < QK; j++) acc += tmp[j] * x[b * QK + j];
    }
    return acc;
}


/* -- AVX2 + FMA + F16C ------------------------------------------------------------------- */
#if PD_X86

PD_AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

PD_AVX2 static inline __m256 u8lo_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
PD_AVX2 static inline __m256 u8hi_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}
PD_AVX2 static inline __m256 i8lo_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
PD_AVX2 static inline __m256 i8hi_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

/* 8 bytes from memory, zero-extended to 8 int32 lanes (one load+shuffle uop) */
PD_AVX2 static PD_INLINE __m256i u8x8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
PD_AVX2 static PD_INLINE __m256 i8x8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* One block's 32 values as floats (before its scale) in w[0..3], 8 each. A 4-bit block is
 * widened byte -> int32 first and split into nibbles there (and / shift), so each 8 values
 * cost one shuffle, one integer op and one conversion. */
PD_AVX2 static PD_INLINE void decode_block_avx2(int qt, const uint8_t *qs, __m256 w[4]) {
    if (qt == QT_Q8_0 || qt == QT_I8_ROW) {
        w[0] = i8x8_ps(qs), w[1] = i8x8_ps(qs + 8), w[2] = i8x8_ps(qs + 16);
        w[3] = i8x8_ps(qs + 24);
    } else if (qt == QT_I8_G32) {
        w[0] = _mm256_cvtepi32_ps(u8x8(qs)), w[1] = _mm256_cvtepi32_ps(u8x8(qs + 8));
        w[2] = _mm256_cvtepi32_ps(u8x8(qs + 16)), w[3] = _mm256_cvtepi32_ps(u8x8(qs + 24));
    } else {
        const __m256i m4 = _mm256_set1_epi32(0x0F);
        const __m256i a = u8x8(qs), b = u8x8(qs + 8); /* bytes 0-7, 8-15 */
        w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, m4)); /* values 0-7 */
        w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, m4)); /* 8-15 */
        w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)); /* 16-23 */
        w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); /* 24-31 */
    }
}

/* sum_j q_j x_j over one decoded block (Q4_0's -8 goes through xsum), x in x0..x3: two
 * independent halves, then their sum (a shorter dependency chain than four in a row). */
PD_AVX2 static PD_INLINE __m256 blocksum_avx2(const __m256 w[4], __m256 x0, __m256 x1, __m256 x2,
                                        __m256 x3) {
    return _mm256_add_ps(_mm256_fmadd_ps(w[1], x1, _mm256_mul_ps(w[0], x0)),
                         _mm256_fmadd_ps(w[3], x3, _mm256_mul_ps(w[2], x2)));
}

PD_AVX2 static PD_INLINE __m256 blockdot_avx2(int qt, const uint8_t *qs, __m256 x0, __m256 x1,
                                        __m256 x2, __m256 x3) {
    __m256 w[4];
    decode_block_avx2(qt, qs, w);
    return blocksum_avx2(w, x0, x1, x2, x3);
}

/* the fp16 at p as a float in all 8 lanes (a block's scale) */
PD_AVX2 static PD_INLINE __m256 f16_bcast_avx2(const uint8_t *p) {
    return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(p))));
}

/* A row's output from its blocks' accumulator: acc's lanes plus the row's sum_b m_b xsum_b
 * (Q4_0: -8 sum_b d_b xsum_b; nothing for the types without a minimum or offset), eight blocks'
 * scales at a time, then one reduction. The one-row and the multi-row kernels both end a row
 * with it, so their results agree bit for bit. */
PD_AVX2 static PD_INLINE float row_out_avx2(int qt, __m256 acc, const uint8_t *wr, int64_t nb,
                                      const float *xsum) {
    if (qt != QT_Q4_0 && !HAS_MIN(qt)) return hsum256(acc);
    const uint8_t *src = qt == QT_Q4_0 ? row_d(qt, wr, nb) : row_m(qt, wr, nb);
    __m256 macc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * b)));
        macc = _mm256_fmadd_ps(v, _mm256_loadu_ps(xsum + b), macc);
    }
    if (b < nb && nb >= 8) { /* the last nb % 8 blocks: the row's last eight, those before b
                                * zeroed (a 576-column row has 18 blocks: scalar fp16
                                * conversions for the last two cost as much as the rest) */
        const int64_t w0 = nb - 8;
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)(b - w0) - 1)));
        const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * w0)));
        macc = _mm256_fmadd_ps(v, _mm256_and_ps(keep, _mm256_loadu_ps(xsum + w0)), macc);
        b = nb;
    }
    const float k = qt == QT_Q4_0 ? -8.0f : 1.0f;
    float out = hsum256(_mm256_fmadd_ps(macc, _mm256_set1_ps(k), acc));
    for (; b < nb; b++) out += k * f16_to_f32(load_u16(src + 2 * b)) * xsum[b]; /* nb < 8 */
    return out;
}

/* y[r] for rows r0 .. r0 + NR - 1 (NR <= 4) of a block type, one activation row x. The four
 * accumulators are named variables (an indexed array kept them on the stack: a store and a
 * reload in every block's dependency chain). */
PD_AVX2 static PD_INLINE void dot_rows_avx2(int qt, const uint8_t *w, int64_t row_bytes, int nr,
                                      int64_t nb, const float *x, const float *xsum,
                                      float *out) {
    const int qb = quant_bytes(qt);
    const int64_t step = prefetch_step(row_bytes, nb);
    const uint8_t *w0 = w, *w1 = w + row_bytes, *w2 = w + 2 * row_bytes, *w3 = w + 3 * row_bytes;
    const uint8_t *d0 = row_d(qt, w0, nb), *d1 = row_d(qt, w1, nb);
    const uint8_t *d2 = row_d(qt, w2, nb), *d3 = row_d(qt, w3, nb);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#define PD_ROW_STEP(acc, wr, dr)                                                                 \
    acc = _mm256_fmadd_ps(                                                                      \
        f16_bcast_avx2(dr + 2 * b),                                                             \
        blockdot_avx2(qt, wr + b * qb, x0, x1, x2, x3), acc)
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        prefetch_ahead(w, step, b);
        PD_ROW_STEP(a0, w0, d0);
        if (nr > 1) PD_ROW_STEP(a1, w1, d1);
        if (nr > 2) PD_ROW_STEP(a2, w2, d2);
        if (nr > 3) PD_ROW_STEP(a3, w3, d3);
    }
#undef PD_ROW_STEP
    const __m256 acc[4] = {a0, a1, a2, a3};
    for (int r = 0; r < nr; r++)
        out[r] = row_out_avx2(qt, acc[r], w + r * row_bytes, nb, xsum);
}

/* One instantiation per (type, row count): both are compile-time constants inside. */
typedef void (*dot_rows_fn)(const uint8_t *w, int64_t rb, int nr, int64_t nb, const float *x,
                            const float *xs, float *o);
#define DOT_ROWS(name, body_fn, attr, qt)                                                       \
    attr static void name(const uint8_t *w, int64_t rb, int nr, int64_t nb, const float *x,      \
                          const float *xs, float *o) {                                          \
        if (nr == 4) body_fn(qt, w, rb, 4, nb, x, xs, o);                                        \
        else body_fn(qt, w, rb, nr, nb, x, xs, o);                                               \
    }
DOT_ROWS(dot_rows_avx2_q4_0, dot_rows_avx2, PD_AVX2, QT_Q4_0)
DOT_ROWS(dot_rows_avx2_q4_1, dot_rows_avx2, PD_AVX2, QT_Q4_1)
DOT_ROWS(dot_rows_avx2_q8_0, dot_rows_avx2, PD_AVX2, QT_Q8_0)
DOT_ROWS(dot_rows_avx2_i8_g32, dot_rows_avx2, PD_AVX2, QT_I8_G32)

/* One weight row against NX activation rows (NX <= 8): each block is decoded once and dotted
 * with every activation row, each output in exactly the order of dot_rows_avx2 (per block
 * s = (w0 x0 + w1 x1) + (w2 x2 + w3 x3), acc += d s; then the row's minimum part and one
 * reduction), so a row's result is the same bits whatever the batch. Batches stream the weights
 * once per eight activation rows from L1 instead of decoding them for every row. */
PD_AVX2 static PD_INLINE void dot_xrows_avx2(int qt, const uint8_t *w, int64_t nb, int nx,
                                       const float *x, int64_t ldx, const float *xsum,
                                       float *out) {
    const int qb = quant_bytes(qt);
    const uint8_t *dp = row_d(qt, w, nb);
    /* named accumulators, as in dot_rows_avx2 (an array was zeroed with rep stos on every call:
     * about 7% of a 576-column row's time) */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t b = 0; b < nb; b++) {
        __m256 wv[4];
        decode_block_avx2(qt, w + b * qb, wv);
        const __m256 d = f16_bcast_avx2(dp + 2 * b);
#define PD_XROW(i, acc)                                                                          \
    if (nx > i) {                                                                               \
        const float *xb = x + i * ldx + b * QK;                                                 \
        acc = _mm256_fmadd_ps(d, blocksum_avx2(wv, _mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), \
                                               _mm256_loadu_ps(xb + 16),                        \
                                               _mm256_loadu_ps(xb + 24)),                       \
                              acc);                                                             \
    }
        PD_XROW(0, a0) PD_XROW(1, a1) PD_XROW(2, a2) PD_XROW(3, a3)
        PD_XROW(4, a4) PD_XROW(5, a5) PD_XROW(6, a6) PD_XROW(7, a7)
#undef PD_XROW
    }
    const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int i = 0; i < nx; i++)
        out[i] = row_out_avx2(qt, acc[i], w, nb, xsum ? xsum + i * nb : NULL);
}

typedef void (*dot_xrows_fn)(const uint8_t *w, int64_t nb, int nx, const float *x, int64_t ldx,
                             const float *xs, float *o);
/* one instantiation per (type, activation rows): both constants inside */
#define DOT_XROWS(name, body_fn, attr, qt)                                                      \
    attr static void name(const uint8_t *w, int64_t nb, int nx, const float *x, int64_t ldx,    \
                          const float *xs, float *o) {                                          \
        switch (nx) {                                                                           \
        case 8: body_fn(qt, w, nb, 8, x, ldx, xs, o); break;                                    \
        case 4: body_fn(qt, w, nb, 4, x, ldx, xs, o); break;                                    \
        case 2: body_fn(qt, w, nb, 2, x, ldx, xs, o); break;                                    \
        default: body_fn(qt, w, nb, 1, x, ldx, xs, o); break;                                   \
        }                                                                                       \
    }
DOT_XROWS(dot_xrows_avx2_q4_0, dot_xrows_avx2, PD_AVX2, QT_Q4_0)
DOT_XROWS(dot_xrows_avx2_q4_1, dot_xrows_avx2, PD_AVX2, QT_Q4_1)
DOT_XROWS(dot_xrows_avx2_q8_0, dot_xrows_avx2, PD_AVX2, QT_Q8_0)
DOT_XROWS(dot_xrows_avx2_i8_g32, dot_xrows_avx2, PD_AVX2, QT_I8_G32)

PD_AVX2 static float dot_i8row_avx2(const int8_t *q, float scale, int64_t cols, const float *x) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + QK <= cols; k += QK) {
        const __m128i lo = _mm_loadu_si128((const __m128i *)(q + k));
        const __m128i hi = _mm_loadu_si128((const __m128i *)(q + k + 16));
        acc0 = _mm256_fmadd_ps(i8lo_ps(lo), _mm256_loadu_ps(x + k), acc0);
        acc1 = _mm256_fmadd_ps(i8hi_ps(lo), _mm256_loadu_ps(x + k + 8), acc1);
        acc0 = _mm256_fmadd_ps(i8lo_ps(hi), _mm256_loadu_ps(x + k + 16), acc0);
        acc1 = _mm256_fmadd_ps(i8hi_ps(hi), _mm256_loadu_ps(x + k + 24), acc1);
    }
    float s = hsum256(_mm256_add_ps(acc0, acc1));
    for (; k < cols; k++) s += (float)q[k] * x[k];
    return s * scale;
}

PD_AVX2 static void dequant_row_avx2(int qt, const uint8_t *w, float scale, int64_t cols,
                                  float *out) {
    if (qt == QT_I8_ROW) {
        const int8_t *q = (const int8_t *)w;
        const __m256 s = _mm256_set1_ps(scale);
        int64_t k = 0;
        for (; k + 16 <= cols; k += 16) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(q + k));
            _mm256_storeu_ps(out + k, _mm256_mul_ps(i8lo_ps(v), s));
            _mm256_storeu_ps(out + k + 8, _mm256_mul_ps(i8hi_ps(v), s));
        }
        for (; k < cols; k++) out[k] = (float)q[k] * scale;
        return;
    }
    const int64_t nb = cols / QK;
    const int qb = quant_bytes(qt);
    const uint8_t *dp = row_d(qt, w, nb), *mp = row_m(qt, w, nb);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = w + b * qb;
        float *o = out + b * QK;
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(dp + 2 * b)));
        __m256 w0, w1, w2, w3;
        if (qt == QT_Q8_0) {
            const __m128i lo = _mm_loadu_si128((const __m128i *)q);
            const __m128i hi = _mm_loadu_si128((const __m128i *)(q + 16));
            w0 = i8lo_ps(lo), w1 = i8hi_ps(lo), w2 = i8lo_ps(hi), w3 = i8hi_ps(hi);
            w0 = _mm256_mul_ps(w0, d), w1 = _mm256_mul_ps(w1, d);
            w2 = _mm256_mul_ps(w2, d), w3 = _mm256_mul_ps(w3, d);
        } else if (qt == QT_I8_G32) {
            const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(mp + 2 * b)));
            const __m128i lo = _mm_loadu_si128((const __m128i *)q);
            const __m128i hi = _mm_loadu_si128((const __m128i *)(q + 16));
            /* two roundings, as the reference: (d * q) + m (-ffp-contract=off) */
            w0 = _mm256_add_ps(_mm256_mul_ps(d, u8lo_ps(lo)), m);
            w1 = _mm256_add_ps(_mm256_mul_ps(d, u8hi_ps(lo)), m);
            w2 = _mm256_add_ps(_mm256_mul_ps(d, u8lo_ps(hi)), m);
            w3 = _mm256_add_ps(_mm256_mul_ps(d, u8hi_ps(hi)), m);
        } else {
            const __m128i v = _mm_loadu_si128((const __m128i *)q);
            __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
            if (qt == QT_Q4_0) {
                const __m128i eight = _mm_set1_epi8(8);
                lo = _mm_sub_epi8(lo, eight), hi = _mm_sub_epi8(hi, eight);
                w0 = _mm256_mul_ps(i8lo_ps(lo), d), w1 = _mm256_mul_ps(i8hi_ps(lo), d);
                w2 = _mm256_mul_ps(i8lo_ps(hi), d), w3 = _mm256_mul_ps(i8hi_ps(hi), d);
            } else {
                const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(mp + 2 * b)));
                /* two roundings, as the reference: (d * q) + m (-ffp-contract=off) */
                w0 = _mm256_add_ps(_mm256_mul_ps(d, u8lo_ps(lo)), m);
                w1 = _mm256_add_ps(_mm256_mul_ps(d, u8hi_ps(lo)), m);
                w2 = _mm256_add_ps(_mm256_mul_ps(d, u8lo_ps(hi)), m);
                w3 = _mm256_add_ps(_mm256_mul_ps(d, u8hi_ps(hi)), m);
            }
        }
        _mm256_storeu_ps(o, w0), _mm256_storeu_ps(o + 8, w1);
        _mm256_storeu_ps(o + 16, w2), _mm256_storeu_ps(o + 24, w3);
    }
}

/* -- AVX-512 (F, BW, VL) ----------------------------------------------------------------- */

/* One block's 32 values as floats (values 0-15 in w01, 16-31 in w23), before its scale. */
PD_AVX512 static PD_INLINE void decode_avx512(int qt, const uint8_t *qs, __m512 nibble_values,
                                        __m512 *w01, __m512 *w23) {
    if (qt == QT_Q8_0 || qt == QT_I8_ROW) {
        *w01 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
        *w23 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
    } else if (qt == QT_I8_G32) {
        *w01 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs)));
        *w23 = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
    } else { /* bytes 0-15 widened to int32: low nibbles are values 0-15, high 16-31 */
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        /* the low nibble as a float by table lookup (vpermps reads an index's low 4 bits), the
         * high one by conversion: the two halves of the work go to different ports */
        *w01 = _mm512_permutexvar_ps(a, nibble_values);
        *w23 = _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4));
    }
}

/* 16 fp16 values from p (n of them, the rest 0) as floats */
PD_AVX512 static PD_INLINE __m512 load_f16x16(const uint8_t *p, int n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p));
}

/* y[r] for rows r0 .. r0 + NR - 1 (NR <= 4), one activation row x. Every sixteen blocks the
 * rows' d (and m) come in one load each, converted into a small buffer that the block loop's
 * multiply-adds broadcast from memory (no shuffle); the minimum's part sum_b m_b xsum_b is one
 * multiply-add per sixteen blocks. */
PD_AVX512 static PD_INLINE void dot_rows_avx512(int qt, const uint8_t *w, int64_t row_bytes, int nr,
                                          int64_t nb, const float *x, const float *xsum,
                                          float *out) {
    const int qb = quant_bytes(qt);
    const __m512 nibble_values =
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float dbuf[4][16] __attribute__((aligned(64)));
    __m512 acc[4], macc[4];
    for (int r = 0; r < 4; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    const int64_t step = prefetch_step(row_bytes, nb);
    for (int64_t b = 0; b < nb; b++) {
        const int j = (int)(b & 15);
        if (j == 0) {
            const int cnt = nb - b < 16 ? (int)(nb - b) : 16;
            const __m512 xs = _mm512_maskz_loadu_ps((__mmask16)((1u << cnt) - 1u), xsum + b);
            for (int r = 0; r < 4; r++) {
                if (r >= nr) break;
                const uint8_t *wr = w + r * row_bytes;
                const __m512 dv = load_f16x16(row_d(qt, wr, nb) + 2 * b, cnt);
                _mm512_store_ps(dbuf[r], dv);
                if (qt == QT_Q4_0) /* sum d (q - 8) x = d sum q x - 8 d sum x */
                    macc[r] = _mm512_fmadd_ps(dv, _mm512_mul_ps(xs, _mm512_set1_ps(-8.0f)),
                                              macc[r]);
                else if (HAS_MIN(qt))
                    macc[r] = _mm512_fmadd_ps(load_f16x16(row_m(qt, wr, nb) + 2 * b, cnt), xs,
                                              macc[r]);
            }
        }
        const __m512 x01 = _mm512_loadu_ps(x + b * QK), x23 = _mm512_loadu_ps(x + b * QK + 16);
        prefetch_ahead(w, step, b);
        for (int r = 0; r < 4; r++) {
            if (r >= nr) break;
            __m512 w01, w23;
            decode_avx512(qt, w + r * row_bytes + b * qb, nibble_values, &w01, &w23);
            const __m512 s = _mm512_fmadd_ps(w23, x23, _mm512_mul_ps(w01, x01));
            acc[r] = _mm512_fmadd_ps(s, _mm512_set1_ps(dbuf[r][j]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], macc[r]));
}

DOT_ROWS(dot_rows_avx512_q4_0, dot_rows_avx512, PD_AVX512, QT_Q4_0)
DOT_ROWS(dot_rows_avx512_q4_1, dot_rows_avx512, PD_AVX512, QT_Q4_1)
DOT_ROWS(dot_rows_avx512_q8_0, dot_rows_avx512, PD_AVX512, QT_Q8_0)
DOT_ROWS(dot_rows_avx512_i8_g32, dot_rows_avx512, PD_AVX512, QT_I8_G32)

/* One weight row against NX activation rows (NX <= 8), each output computed in exactly the
 * order dot_rows_avx512 computes it (per block: acc += (q d) x over values 0-15, then 16-31;
 * per sixteen blocks the minimum's part; then one reduction), so a row's result is the same bits whatever
 * the batch: only the block's decode is shared between the activation rows. */
PD_AVX512 static PD_INLINE void dot_xrows_avx512(int qt, const uint8_t *w, int64_t nb, int nx,
                                           const float *x, int64_t ldx, const float *xsum,
                                           float *out) {
    const int qb = quant_bytes(qt);
    const __m512 nibble_values =
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float dbuf[16] __attribute__((aligned(64)));
    __m512 acc[8], macc[8];
    for (int i = 0; i < 8; i++) acc[i] = macc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int j = (int)(b & 15);
        if (j == 0) {
            const int cnt = nb - b < 16 ? (int)(nb - b) : 16;
            const __mmask16 mask = (__mmask16)((1u << cnt) - 1u);
            const __m512 dv = load_f16x16(row_d(qt, w, nb) + 2 * b, cnt);
            _mm512_store_ps(dbuf, dv);
            if (qt == QT_Q4_0 || HAS_MIN(qt)) {
                const __m512 mv = HAS_MIN(qt) ? load_f16x16(row_m(qt, w, nb) + 2 * b, cnt) : dv;
                for (int i = 0; i < 8; i++) {
                    if (i >= nx) break;
                    const __m512 xs = _mm512_maskz_loadu_ps(mask, xsum + i * nb + b);
                    const __m512 xm = qt == QT_Q4_0 ? _mm512_mul_ps(xs, _mm512_set1_ps(-8.0f)) : xs;
                    macc[i] = _mm512_fmadd_ps(mv, xm, macc[i]);
                }
            }
        }
        __builtin_prefetch(w + PREFETCH_AHEAD / 4 + b * qb, 0, 3);
        __m512 w01, w23;
        decode_avx512(qt, w + b * qb, nibble_values, &w01, &w23);
        const __m512 d = _mm512_set1_ps(dbuf[j]);
        for (int i = 0; i < 8; i++) {
            if (i >= nx) break;
            const float *xb = x + i * ldx + b * QK;
            const __m512 s = _mm512_fmadd_ps(w23, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w01, _mm512_loadu_ps(xb)));
            acc[i] = _mm512_fmadd_ps(s, d, acc[i]);
        }
    }
    for (int i = 0; i < nx; i++) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], macc[i]));
}

DOT_XROWS(dot_xrows_avx512_q4_0, dot_xrows_avx512, PD_AVX512, QT_Q4_0)
DOT_XROWS(dot_xrows_avx512_q4_1, dot_xrows_avx512, PD_AVX512, QT_Q4_1)
DOT_XROWS(dot_xrows_avx512_q8_0, dot_xrows_avx512, PD_AVX512, QT_Q8_0)
DOT_XROWS(dot_xrows_avx512_i8_g32, dot_xrows_avx512, PD_AVX512, QT_I8_G32)

PD_AVX512 static float dot_i8row_avx512(const int8_t *q, float scale, int64_t cols,
                                     const float *x) {
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
        const __m512 wv =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k))));
        acc = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + k), acc);
    }
    float s = _mm512_reduce_add_ps(acc);
    for (; k < cols; k++) s += (float)q[k] * x[k];
    return s * scale;
}
#endif /* PD_X86 */

/* -- dispatch ----------------------------------------------------------------------------- */

static void dequant_row(int qt, const uint8_t *w, float scale, int64_t cols, float *out) {
#if PD_X86
    if (pd_isa() >= PD_ISA_AVX2) {
        dequant_row_avx2(qt, w, scale, cols, out);
        return;
    }
#endif
    dequant_row_portable(qt, w, scale, cols, out);
}

/* out[r - r0] = w[r] . x for rows [r0, r1) of one activation row */
static void matvec_rows(int qt, const uint8_t *w, const float *scales, int64_t row_bytes,
                        int64_t cols, const float *x, const float *xsum, int64_t r0, int64_t r1,
                        float *out) {
    const int level = pd_isa();
    if (qt == QT_I8_ROW) {
        for (int64_t r = r0; r < r1; r++) {
            const int8_t *q = (const int8_t *)(w + r * row_bytes);
#if PD_X86
            if (level == PD_ISA_AVX512) {
                out[r - r0] = dot_i8row_avx512(q, scales[r], cols, x);
                continue;
            }
            if (level == PD_ISA_AVX2) {
                out[r - r0] = dot_i8row_avx2(q, scales[r], cols, x);
                continue;
            }
#endif
            out[r - r0] = dot_row_portable(qt, (const uint8_t *)q, scales[r], cols, x);
        }
        return;
    }
    const int64_t nb = cols / QK;
    dot_rows_fn fn = NULL;
#if PD_X86
    if (level == PD_ISA_AVX512)
        fn = qt == QT_Q4_0   ? dot_rows_avx512_q4_0
             : qt == QT_Q4_1 ? dot_rows_avx512_q4_1
             : qt == QT_I8_G32 ? dot_rows_avx512_i8_g32
                               : dot_rows_avx512_q8_0;
    else if (level == PD_ISA_AVX2)
        fn = qt == QT_Q4_0   ? dot_rows_avx2_q4_0
             : qt == QT_Q4_1 ? dot_rows_avx2_q4_1
             : qt == QT_I8_G32 ? dot_rows_avx2_i8_g32
                               : dot_rows_avx2_q8_0;
#endif
    for (int64_t r = r0; r < r1; r += 4) {
        const int nr = r1 - r < 4 ? (int)(r1 - r) : 4;
        const uint8_t *wr = w + r * row_bytes;
        float *o = out + (r - r0);
        if (fn) {
            fn(wr, row_bytes, nr, nb, x, xsum, o);
            continue;
        }
        for (int i = 0; i < nr; i++) o[i] = dot_row_portable(qt, wr + i * row_bytes, 1.0f, cols, x);
    }
}

/* -- the entry points --------------------------------------------------------------------- */

typedef struct {
    int qt;
    const uint8_t *w;
    const float *scales;
    int64_t row_bytes, cols;
    const float *x;
    int64_t n, ldx;
    float *y;
    int64_t ldy;
    const float *bias;
    int accumulate;
    const float *xsum; /* [n, nb] sums of x's blocks (types with a minimum or offset), or NULL */
} linear_job;

static inline void store(const linear_job *j, float *yr, int64_t r, float v) {
    if (j->bias) v += j->bias[r];
    yr[r] = j->accumulate ? yr[r] + v : v;
}

/* -- F32 rows: f32_rows.h once per variant ------------------------------------------------ */

/* portable: GCC's vectors of 8 floats, no fused multiply-add (-ffp-contract=off) */
typedef float vec8 __attribute__((vector_size(32)));
#define vec vec8
#define F32_ATTR
#define F32_ROWS f32_rows_portable
#define F32_TILE f32_tile_portable
#define F32_FINISH f32_finish_portable
#define F32_TM 2
/* macros, not functions: a function passing 32-byte vectors without AVX warns of its ABI */
#define VZERO() ((vec8){0})
#define VLOAD(p)                                                                                \
    ({                                                                                          \
        vec8 v_;                                                                                \
        memcpy(&v_, (p), sizeof v_);                                                            \
        v_;                                                                                     \
    })
#define VFMA(a, b, c) ((c) + (a) * (b))
#define vsum(t)                                                                                 \
    ({                                                                                          \
        const vec8 t_ = (t);                                                                    \
        ((t_[0] + t_[1]) + (t_[2] + t_[3])) + ((t_[4] + t_[5]) + (t_[6] + t_[7]));              \
    })
#include "f32_rows.h"
#undef vec
#undef F32_ATTR
#undef F32_ROWS
#undef F32_TILE
#undef F32_FINISH
#undef F32_TM
#undef VZERO
#undef VLOAD
#undef VFMA
#undef vsum

#if PD_X86
/* AVX2 and AVX-512: the same eight-lane operations, every multiply-add fused, so both give the
 * same bits; AVX-512's 32 vector registers hold a register tile of 4 x 4 outputs, AVX2's 16 one
 * of 4 x 3 (the largest tile each holds without spilling: more outputs per weight load) */
#define vec __m256
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vsum(v)                                                                                 \
    ({                                                                                          \
        float t_[8];                                                                            \
        _mm256_storeu_ps(t_, (v));                                                              \
        ((t_[0] + t_[1]) + (t_[2] + t_[3])) + ((t_[4] + t_[5]) + (t_[6] + t_[7]));              \
    })
#define F32_ATTR PD_AVX2
#define F32_ROWS f32_rows_avx2
#define F32_TILE f32_tile_avx2
#define F32_FINISH f32_finish_avx2
#define F32_TM 3
#include "f32_rows.h"
#undef F32_ATTR
#undef F32_ROWS
#undef F32_TILE
#undef F32_FINISH
#undef F32_TM
#define F32_ATTR PD_AVX512
#define F32_ROWS f32_rows_avx512
#define F32_TILE f32_tile_avx512
#define F32_FINISH f32_finish_avx512
#define F32_TM 4
#include "f32_rows.h"
#undef F32_ATTR
#undef F32_ROWS
#undef F32_TILE
#undef F32_FINISH
#undef F32_TM
#undef vec
#undef VZERO
#undef VLOAD
#undef VFMA
#undef vsum
#endif

static void f32_task(const void *ctx, int64_t r0, int64_t r1) {
#if PD_X86
    if (pd_isa() >= PD_ISA_AVX512) {
        f32_rows_avx512(ctx, r0, r1);
        return;
    }
    if (pd_isa() >= PD_ISA_AVX2) {
        f32_rows_avx2(ctx, r0, r1);
        return;
    }
#endif
    f32_rows_portable(ctx, r0, r1);
}

/* -- the block formats and int8 rows -------------------------------------------------------- */

#define ROW_CHUNK 256
/* weight rows per tile of the multi-row path: their activation rows are read from L1 */
#define XROW_TILE 16

static dot_xrows_fn xrows_fn(int qt) {
#if PD_X86
    if (pd_isa() == PD_ISA_AVX512 && qt != QT_I8_ROW)
        return qt == QT_Q4_0   ? dot_xrows_avx512_q4_0
               : qt == QT_Q4_1 ? dot_xrows_avx512_q4_1
               : qt == QT_I8_G32 ? dot_xrows_avx512_i8_g32
                                 : dot_xrows_avx512_q8_0;
    if (pd_isa() == PD_ISA_AVX2 && qt != QT_I8_ROW)
        return qt == QT_Q4_0   ? dot_xrows_avx2_q4_0
               : qt == QT_Q4_1 ? dot_xrows_avx2_q4_1
               : qt == QT_I8_G32 ? dot_xrows_avx2_i8_g32
                                 : dot_xrows_avx2_q8_0;
#endif
    (void)qt;
    return NULL;
}

/* Every path computes an output y[i, r] the way the one-row kernel does, so a row's result does
 * not depend on how many rows came with it (a draft verified in a batch equals the token
 * decoded alone). Several activation rows share each weight block's decode (AVX-512, AVX2), or
 * else (portable, int8 rows) reuse four weight rows from L1 for every activation row; the
 * weights stream from memory once. */
static void linear_task(const void *ctx, int64_t r0, int64_t r1) {
    const linear_job *j = ctx;
    const int64_t nb = j->cols / QK;
    const dot_xrows_fn xfn = j->n > 1 ? xrows_fn(j->qt) : NULL;
    float out[ROW_CHUNK];
    if (xfn) { /* tiles of XROW_TILE weight rows: a group's activation rows stay in L1 */
        for (int64_t rt = r0; rt < r1; rt += XROW_TILE) {
            const int64_t re = rt + XROW_TILE < r1 ? rt + XROW_TILE : r1;
            for (int64_t i0 = 0; i0 < j->n;) {
                const int64_t left = j->n - i0;
                const int nx = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
                for (int64_t r = rt; r < re; r++) {
                    xfn(j->w + r * j->row_bytes, nb, nx, j->x + i0 * j->ldx, j->ldx,
                        j->xsum ? j->xsum + i0 * nb : NULL, out);
                    for (int k = 0; k < nx; k++) store(j, j->y + (i0 + k) * j->ldy, r, out[k]);
                }
                i0 += nx;
            }
        }
        return;
    }
    const int64_t step = j->n == 1 ? ROW_CHUNK : 4;
    for (int64_t r = r0; r < r1; r += step) {
        const int64_t re = r + step < r1 ? r + step : r1;
        for (int64_t i = 0; i < j->n; i++) {
            matvec_rows(j->qt, j->w, j->scales, j->row_bytes, j->cols, j->x + i * j->ldx,
                        j->xsum ? j->xsum + i * nb : NULL, r, re, out);
            float *yi = j->y + i * j->ldy;
            for (int64_t k = r; k < re; k++) store(j, yi, k, out[k - r]);
        }
    }
}

/* The sum of one block's 32 activations: eight lanes of (x_l + x_l+8) + (x_l+16 + x_l+24), then
 * the lanes pairwise. Independent adds that the compiler vectorizes, instead of a chain of 32
 * dependent adds per block that the caller would run alone before each linear's threads start. */
static inline float block_sum(const float *x) {
    float a[8];
    for (int l = 0; l < 8; l++) a[l] = (x[l] + x[8 + l]) + (x[16 + l] + x[24 + l]);
    for (int l = 0; l < 4; l++) a[l] += a[l + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* F32 matrices below this many weights run on the calling thread alone: waking the pool costs
 * more than it saves on a small matrix (the block formats always split: their rows cost more) */
#define F32_PARALLEL_MIN_WEIGHTS (1 << 18)

/* y[n, ldy] (+)= x[n, ldx] @ W^T + bias, W: `rows` rows of `row_bytes` bytes. 0, -1 (a format or
 * shape the kernel does not take) or -2 (no memory). */
int pdserve_linear(int qt, const uint8_t *w, const float *scales, int64_t rows, int64_t cols,
                   int64_t row_bytes, const float *x, int64_t n, int64_t ldx, float *y,
                   int64_t ldy, const float *bias, int accumulate, int num_threads) {
    return pd_linear_hook(qt, w, scales, rows, cols, row_bytes, x, n, ldx, y, ldy, bias,
                          accumulate, num_threads, NULL, NULL);
}

int pd_linear_hook(int qt, const uint8_t *w, const float *scales, int64_t rows, int64_t cols,
                   int64_t row_bytes, const float *x, int64_t n, int64_t ldx, float *y,
                   int64_t ldy, const float *bias, int accumulate, int num_threads,
                   pd_hook_fn hook, const void *hook_ctx) {
    if (qt & PD_QT_FAST) { /* int8 activations (qlinear.c); F32 has no such path */
        qt &= ~PD_QT_FAST;
        if (qt != QT_F32)
            return pd_qlinear(qt, w, scales, rows, cols, row_bytes, x, n, ldx, y, ldy, bias,
                              accumulate, num_threads, hook, hook_ctx);
    }
    if (qt == QT_F32) {
        if (row_bytes < cols * (int64_t)sizeof(float) || row_bytes % sizeof(float)) return -1;
        const linear_job job = {qt, w, scales, row_bytes, cols, x, n, ldx, y, ldy, bias,
                                accumulate, NULL};
        const int threads = rows * cols >= F32_PARALLEL_MIN_WEIGHTS ? num_threads : 1;
        pd_run_parallel_hook(f32_task, &job, rows, 16, threads, hook, hook_ctx);
        return 0;
    }
    if (qt != QT_I8_ROW && (block_bytes(qt) == 0 || cols % QK || cols / QK > MAX_BLOCKS))
        return -1;
    if (qt == QT_I8_ROW && !scales) return -1;
    float *xsum = NULL;
    if (qt == QT_Q4_0 || HAS_MIN(qt)) { /* the sums the blocks' minimum (or offset) multiplies */
        const int64_t nb = cols / QK;
        xsum = malloc(sizeof(float) * (size_t)(n * nb));
        if (!xsum) return -2;
        for (int64_t i = 0; i < n; i++)
            for (int64_t b = 0; b < nb; b++) xsum[i * nb + b] = block_sum(x + i * ldx + b * QK);
    }
    const linear_job job = {qt, w, scales, row_bytes, cols, x, n, ldx, y, ldy, bias, accumulate,
                            xsum};
    pd_run_parallel_hook(linear_task, &job, rows, 16, num_threads, hook, hook_ctx);
    free(xsum);
    return 0;
}

typedef struct {
    int qt;
    const uint8_t *w;
    const float *scales;
    int64_t row_bytes, cols;
    const int64_t *row_ids; /* NULL: rows row0 .. */
    int64_t row0;
    float *out;
    int64_t ldo;
} dequant_job;

static void dequant_task(const void *ctx, int64_t i0, int64_t i1) {
    const dequant_job *j = ctx;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = j->row_ids ? j->row_ids[i] : j->row0 + i;
        dequant_row(j->qt, j->w + r * j->row_bytes, j->scales ? j->scales[r] : 1.0f, j->cols,
                    j->out + i * j->ldo);
    }
}

/* out[i, :cols] = W[row(i)] as fp32, row(i) = row_ids[i] or row0 + i, for i < count; -2 when a
 * row is outside [0, rows). */
int pdserve_dequant_rows(int qt, const uint8_t *w, const float *scales, int64_t rows,
                         int64_t cols, int64_t row_bytes, const int64_t *row_ids, int64_t row0,
                         int64_t count, float *out, int64_t ldo, int num_threads) {
    if (qt != QT_I8_ROW && (block_bytes(qt) == 0 || cols % QK)) return -1;
    if (qt == QT_I8_ROW && !scales) return -1;
    if (row_ids) {
        for (int64_t i = 0; i < count; i++)
            if (row_ids[i] < 0 || row_ids[i] >= rows) return -2;
    } else if (row0 < 0 || row0 + count > rows) {
        return -2;
    }
    const dequant_job job = {qt, w, scales, row_bytes, cols, row_ids, row0, out, ldo};
    pd_run_parallel(dequant_task, &job, count, 4, count >= 64 ? num_threads : 1);
    return 0;
}

