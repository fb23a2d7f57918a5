/* Linear layers with int8 activations (model.numerics: fast): integer dot products against the
 * packed weight formats, as llama.cpp's Q8 activations, with register tiles over weight rows and
 * activation rows so each weight block is loaded once per tile for the whole batch.
 *
 * The arithmetic, the same bits in every variant (portable, AVX2, AVX-512 BW, AVX-512 VNNI):
 *
 *   activations, per row, block b of 32 inputs and lane l of 4 inputs (j = 4l .. 4l + 3):
 *     d_l = max|x_j| / 127,  q_j = round_half_even(x_j * (1 / d_l)) in [-127, 127]  (d_l = 0:
 *     q = 0);  xs_b = tree8 over l of d_l * sum q_j (the types with a minimum use it).
 *     A scale per four inputs, not per 32 as llama.cpp's Q8 blocks: the kernels multiply every
 *     int32 lane by its own scale anyway (a vector of eight), so it costs nothing here, and it
 *     keeps the greedy tokens of the default model within the quality gates (per 32: 96% top-1
 *     agreement with exact; the docs give the figures).
 *   one output y[i, r] (weight row r, activation row i):
 *     a block's 8 lanes: p_l = sum of w_j q_j over the lane's four inputs, an exact int32
 *       (w_j the block's integer: nibble - 8 for Q4_0, nibble for Q4_1, the int8 / uint8);
 *     two accumulators of 8 lanes, A[b % 2]:  A[b % 2][l] = fma((float)p_l, dw_b * d_l, A[.][l])
 *       in order of b (int8 rows: d_l alone, the row's scale after);
 *     v_l = A[0][l] + A[1][l];  s = tree8(v) = ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7));
 *     Q4_1 / int8g32: M[b % 8] = fma(m_b, xs_b, M[b % 8]) in order of b, s += tree8(M);
 *     int8 rows: s *= scale;  then + bias, or added to y (accumulate).
 *
 * So a row's output never depends on its batch or its tile (speculative verification rows equal
 * plain decode rows), and tests compare every variant with the portable one bit for bit. The
 * integer lanes agree across variants by construction: VNNI's vpdpbusd and AVX2's
 * maddubs + madd both sum four consecutive bytes per int32 lane (maddubs never saturates here:
 * 4-bit weights, or |w| <= 128 by the sign trick), with per-lane corrections added exactly:
 *   Q4_0          the nibbles as unsigned, lanes started at -8 sum q   (all variants)
 *   Q8_0, int8    VNNI: w + 128 as unsigned, lanes started at -128 sum q; others: |w|, sign(q, w)
 *   int8g32       VNNI: the uint8 as is; others: w - 128 by the sign trick, lanes at +128 sum q
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "native.h"

#define LANES 8
#define MAX_QBLOCKS 8192
#define TILE_ROWS 4 /* weight rows of a register tile */
#define TILE_X 4    /* activation rows of a register tile */
/* Activation rows per pass over a thread's weight rows: their int8 values, scales and lane
 * starts (about 3 KiB a row at 1536 inputs) stay in L2 while the weights stream once a pass. */
#define X_CHUNK 32

/* The integer kernels' variants, best first: the level a CPU allows is pd_isa()'s (its cap
 * included), with VNNI where cpuid has it; pdserve_set_qlinear_isa caps it further (tests). */
enum { QL_PORTABLE = 0, QL_AVX2 = 1, QL_AVX512BW = 2, QL_AVX512VNNI = 3 };
static int g_ql_cap = -1;

static int ql_best(void) {
#if PD_X86
    const int isa = pd_isa();
    if (isa >= PD_ISA_AVX512)
        return __builtin_cpu_supports("avx512vnni") ? QL_AVX512VNNI : QL_AVX512BW;
    if (isa >= PD_ISA_AVX2) return QL_AVX2;
#endif
    return QL_PORTABLE;
}

/* The variant in use (0 portable, 1 AVX2, 2 AVX-512 BW, 3 AVX-512 VNNI). */
int pdserve_qlinear_isa(void) {
    const int best = ql_best();
    return g_ql_cap >= 0 && g_ql_cap < best ? g_ql_cap : best;
}

/* Cap the variant at `level` (-1: none); returns the variant now in use. */
int pdserve_set_qlinear_isa(int level) {
    g_ql_cap = level;
    return pdserve_qlinear_isa();
}

/* The constant a variant starts each lane at, times the lane's sum of q (see the top). */
static int lane_bias(int qt, int level) {
    if (qt == QT_Q4_0) return -8;
    if (qt == QT_Q8_0 || qt == QT_I8_ROW) return level == QL_AVX512VNNI ? -128 : 0;
    if (qt == QT_I8_G32) return level == QL_AVX512VNNI || level == QL_PORTABLE ? 0 : 128;
    return 0;
}

/* -- the quantized activations ------------------------------------------------------------ */

typedef struct {
    int8_t *q;     /* [n, cols] */
    float *dv;     /* [n, nb, 8]: the scale d of each lane (four inputs) of each block */
    int32_t *bias; /* [n, nb, 8]: lane_bias x each lane's sum of q, or NULL */
    float *xs;     /* [n, nb]: tree8 of d_l * sum q over lane l, or NULL */
} qacts;

/* ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) */
static inline float tree8(const float *v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

static void quant_block_portable(const float *x, int8_t *q, float *dv, int32_t *bias, int mult,
                                 float *xs) {
    float prod[LANES];
    for (int l = 0; l < LANES; l++) {
        float amax = 0.0f;
        for (int j = 4 * l; j < 4 * l + 4; j++) {
            const float a = fabsf(x[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t ls = 0;
        for (int j = 4 * l; j < 4 * l + 4; j++) {
            int v = (int)nearbyintf(x[j] * id);
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            q[j] = (int8_t)v;
            ls += v;
        }
        dv[l] = d;
        if (bias) bias[l] = mult * ls;
        prod[l] = d * (float)ls;
    }
    if (xs) *xs = tree8(prod);
}

#if PD_X86
/* The same values: the lanes' maxima gathered into one vector (d and 1 / d computed once per
 * lane, as IEEE divisions, then spread back to the lane's four inputs); vcvtps2dq rounds half to
 * even (the default MXCSR), as nearbyintf does. */
PD_AVX2 static void quant_block_avx2(const float *x, int8_t *q, float *dv, int32_t *bias,
                                     int mult, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m[4];
    for (int t = 0; t < 4; t++) { /* v[t]: lanes 2t and 2t + 1 */
        v[t] = _mm256_loadu_ps(x + 8 * t);
        __m256 a = _mm256_andnot_ps(sign, v[t]);
        a = _mm256_max_ps(a, _mm256_shuffle_ps(a, a, _MM_SHUFFLE(1, 0, 3, 2)));
        m[t] = _mm256_max_ps(a, _mm256_shuffle_ps(a, a, _MM_SHUFFLE(2, 3, 0, 1)));
    }
    /* [g0 g0 g2 g2 | g1 g1 g3 g3], [g4 g4 g6 g6 | g5 g5 g7 g7] -> [g0 g2 g4 g6 | g1 g3 g5 g7] */
    const __m256 lo = _mm256_shuffle_ps(m[0], m[1], 0), hi = _mm256_shuffle_ps(m[2], m[3], 0);
    const __m256 g = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                                              _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m256 d = _mm256_div_ps(g, _mm256_set1_ps(127.0f));
    const __m256 nz = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_NEQ_OQ);
    const __m256 id = _mm256_and_ps(nz, _mm256_div_ps(_mm256_set1_ps(1.0f), d));
    const __m256i hi127 = _mm256_set1_epi32(127), lo127 = _mm256_set1_epi32(-127);
    __m256i qi[4];
    for (int t = 0; t < 4; t++) {
        const __m256 idt = _mm256_permutevar8x32_ps(
            id, _mm256_setr_epi32(2 * t, 2 * t, 2 * t, 2 * t, 2 * t + 1, 2 * t + 1, 2 * t + 1,
                                  2 * t + 1));
        qi[t] = _mm256_max_epi32(
            lo127, _mm256_min_epi32(hi127, _mm256_cvtps_epi32(_mm256_mul_ps(v[t], idt))));
    }
    const __m256i b = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, b);
    const __m256i ls = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), b),
                                         _mm256_set1_epi16(1));
    _mm256_storeu_ps(dv, d);
    if (bias) _mm256_storeu_si256((__m256i *)bias, _mm256_mullo_epi32(ls, _mm256_set1_epi32(mult)));
    if (xs) {
        float prod[LANES];
        _mm256_storeu_ps(prod, _mm256_mul_ps(d, _mm256_cvtepi32_ps(ls)));
        *xs = tree8(prod);
    }
}
#endif

typedef struct {
    const float *x;
    int64_t ldx, cols, nb;
    const qacts *a;
    int mult, simd;
} quant_job;

static void quant_task(const void *ctx, int64_t i0, int64_t i1) {
    const quant_job *j = ctx;
    const qacts *a = j->a;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t b = 0; b < j->nb; b++) {
            const int64_t k = i * j->nb + b;
            const float *x = j->x + i * j->ldx + b * QK;
            int8_t *q = a->q + i * j->cols + b * QK;
            int32_t *bias = a->bias ? a->bias + k * LANES : NULL;
            float *xs = a->xs ? a->xs + k : NULL;
#if PD_X86
            if (j->simd) {
                quant_block_avx2(x, q, a->dv + k * LANES, bias, j->mult, xs);
                continue;
            }
#endif
            quant_block_portable(x, q, a->dv + k * LANES, bias, j->mult, xs);
        }
}

/* -- the weight side: one block's integers, and the minimum term --------------------------- */

/* w_j of block b as an int (the portable reference) */
static inline int weight_int(int qt, const uint8_t *qs, int j) {
    switch (qt) {
    case QT_Q4_0: return (int)(j < 16 ? qs[j] & 15 : qs[j - 16] >> 4) - 8;
    case QT_Q4_1: return j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
    case QT_I8_G32: return qs[j];
    default: return (int8_t)qs[j]; /* Q8_0, int8 rows */
    }
}


/* sum_b m_b xs_b in lanes b % 8 (the minimum term), portable */
static float min_term_portable(const uint8_t *m, const float *xs, int64_t nb) {
    float acc[LANES] = {0};
    for (int64_t b = 0; b < nb; b++)
        acc[b % LANES] = fmaf(f16_to_f32(load_u16(m + 2 * b)), xs[b], acc[b % LANES]);
    return tree8(acc);
}

#if PD_X86
/* The same sums eight blocks at a time; the last nb % 8 lanes blended in (never an fma of
 * padding, which could turn a -0 lane into +0). */
PD_AVX2 static float min_term_avx2(const uint8_t *m, const float *xs, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + LANES <= nb; b += LANES)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + 2 * b))),
                              _mm256_loadu_ps(xs + b), acc);
    if (b < nb) {
        uint16_t mt[LANES] = {0};
        float xt[LANES] = {0};
        memcpy(mt, m + 2 * b, (size_t)(nb - b) * 2);
        memcpy(xt, xs + b, (size_t)(nb - b) * 4);
        const __m256 f = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mt)),
                                         _mm256_loadu_ps(xt), acc);
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32((int)(nb - b)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        acc = _mm256_blendv_ps(acc, f, keep);
    }
    float v[LANES];
    _mm256_storeu_ps(v, acc);
    return tree8(v);
}
#endif

/* -- the job ------------------------------------------------------------------------------ */

typedef struct {
    int qt, level;
    const uint8_t *w;
    const float *scales;
    int64_t row_bytes, cols, nb, n;
    const qacts *a;
    float *y;
    int64_t ldy;
    const float *bias;
    int accumulate;
} qjob;

/* y[i, r] from its two accumulators' 16 lanes (A[0] then A[1]) */
static inline void finish(const qjob *j, int64_t r, int64_t i, const float *lanes) {
    float v[LANES];
    for (int l = 0; l < LANES; l++) v[l] = lanes[l] + lanes[LANES + l];
    float s = tree8(v);
    if (HAS_MIN(j->qt)) {
        const uint8_t *m = row_m(j->qt, j->w + r * j->row_bytes, j->nb);
        const float *xs = j->a->xs + i * j->nb;
#if PD_X86
        s += j->level >= QL_AVX2 ? min_term_avx2(m, xs, j->nb) : min_term_portable(m, xs, j->nb);
#else
        s += min_term_portable(m, xs, j->nb);
#endif
    }
    if (j->qt == QT_I8_ROW) s *= j->scales[r];
    if (j->bias) s += j->bias[r];
    float *yr = j->y + i * j->ldy + r;
    *yr = j->accumulate ? *yr + s : s;
}

/* the portable reference: one output at a time */
static void out_portable(const qjob *j, int64_t r, int64_t i) {
    const uint8_t *w = j->w + r * j->row_bytes;
    const int qb = j->qt == QT_I8_ROW ? QK : quant_bytes(j->qt);
    const int8_t *q = j->a->q + i * j->cols;
    const float *dv = j->a->dv + i * j->nb * LANES;
    float acc[2 * LANES] = {0};
    for (int64_t b = 0; b < j->nb; b++) {
        const uint8_t *qs = w + b * qb;
        const float dw = j->qt == QT_I8_ROW ? 1.0f : f16_to_f32(load_u16(row_d(j->qt, w, j->nb) + 2 * b));
        float *a = acc + (b % 2) * LANES;
        for (int l = 0; l < LANES; l++) {
            const float dx = dv[b * LANES + l];
            const float s = j->qt == QT_I8_ROW ? dx : dw * dx;
            int32_t p = 0;
            for (int t = 4 * l; t < 4 * l + 4; t++) p += weight_int(j->qt, qs, t) * q[b * QK + t];
            a[l] = fmaf((float)p, s, a[l]);
        }
    }
    finish(j, r, i, acc);
}

#if PD_X86
/* -- AVX2: one block of 32 values per step --------------------------------------------------- */

/* The sums of four outputs' 8 lanes, each in tree8's order: hadd pairs lanes (v0 + v1, v2 + v3
 * | v4 + v5, v6 + v7), the second hadd pairs those, and the halves add last. */
PD_AVX2 static PD_INLINE __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* A weight block as the bytes maddubs takes: unsigned nibbles (Q4), or the signed int8 whose
 * |w| and sign the dot uses (Q8_0, int8; int8g32 as w - 128). */
PD_AVX2 static PD_INLINE __m256i wblock_avx2(int qt, const uint8_t *qs) {
    if (qt == QT_Q4_0 || qt == QT_Q4_1) {
        const __m128i v = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0x0F);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)qs);
    return qt == QT_I8_G32 ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
}

/* the 8 int32 lanes of one block: sum_j w_j q_j (+ the lanes' start) */
PD_AVX2 static PD_INLINE __m256i dot_avx2(int qt, __m256i wv, __m256i qv, __m256i start) {
    __m256i t;
    if (qt == QT_Q4_0 || qt == QT_Q4_1) t = _mm256_maddubs_epi16(wv, qv);
    else t = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(qv, wv));
    return _mm256_add_epi32(_mm256_madd_epi16(t, _mm256_set1_epi16(1)), start);
}

/* outputs of weight rows r0 .. r0 + nr - 1 and activation rows i0 .. i0 + nx - 1 (nr, nx <= 2,
 * constants where inlined); block b feeds acc[.][.][b % 2] */
PD_AVX2 static PD_INLINE void tile_avx2(const qjob *j, int qt, int64_t r0, int nr, int64_t i0,
                                        int nx) {
    const int64_t nb = j->nb;
    const int qb = qt == QT_I8_ROW ? QK : quant_bytes(qt);
    const int has_bias = j->a->bias != NULL;
    __m256 acc[2][2][2];
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++)
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 2)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* h: the block's parity, a constant once unrolled */
            const int64_t b = b0 + h;
            if (b >= nb) break;
            __m256i wv[2];
            __m256 dw[2];
#pragma GCC unroll 2
            for (int r = 0; r < 2; r++) {
                if (r >= nr) break;
                const uint8_t *w = j->w + (r0 + r) * j->row_bytes;
                wv[r] = wblock_avx2(qt, w + b * qb);
                dw[r] = qt == QT_I8_ROW
                            ? _mm256_set1_ps(1.0f)
                            : _mm256_set1_ps(_cvtsh_ss(load_u16(row_d(qt, w, nb) + 2 * b)));
            }
#pragma GCC unroll 2
            for (int i = 0; i < 2; i++) {
                if (i >= nx) break;
                const int64_t k = (i0 + i) * nb + b;
                const __m256i qv =
                    _mm256_loadu_si256((const __m256i *)(j->a->q + (i0 + i) * j->cols + b * QK));
                const __m256 dx = _mm256_loadu_ps(j->a->dv + k * LANES);
                const __m256i start =
                    has_bias ? _mm256_loadu_si256((const __m256i *)(j->a->bias + k * LANES))
                             : _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int r = 0; r < 2; r++) {
                    if (r >= nr) break;
                    const __m256 s = qt == QT_I8_ROW ? dx : _mm256_mul_ps(dw[r], dx);
                    acc[r][i][h] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(dot_avx2(qt, wv[r], qv, start)), s, acc[r][i][h]);
                }
            }
        }
    if (nr < 2 || nx < 2) { /* a partial tile: one output at a time */
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < nx; i++) {
                float lanes[2 * LANES];
                _mm256_storeu_ps(lanes, acc[r][i][0]);
                _mm256_storeu_ps(lanes + LANES, acc[r][i][1]);
                finish(j, r0 + r, i0 + i, lanes);
            }
        return;
    }
    /* the tile's four outputs (r, i) = (0, 0), (1, 0), (0, 1), (1, 1) at once, in finish()'s
     * order */
    float sum[4];
    _mm_storeu_ps(sum, reduce4(_mm256_add_ps(acc[0][0][0], acc[0][0][1]),
                               _mm256_add_ps(acc[1][0][0], acc[1][0][1]),
                               _mm256_add_ps(acc[0][1][0], acc[0][1][1]),
                               _mm256_add_ps(acc[1][1][0], acc[1][1][1])));
    if (HAS_MIN(qt)) {
        const uint8_t *mr[2] = {row_m(qt, j->w + r0 * j->row_bytes, nb),
                                row_m(qt, j->w + (r0 + 1) * j->row_bytes, nb)};
        const float *xr[2] = {j->a->xs + i0 * nb, j->a->xs + (i0 + 1) * nb};
        __m256 mac[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()},
                            {_mm256_setzero_ps(), _mm256_setzero_ps()}};
        for (int64_t m0 = 0; m0 < nb; m0 += LANES) {
            const int64_t left = nb - m0;
            __m256 mv[2], xv[2];
            __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            if (left >= LANES) {
                for (int t = 0; t < 2; t++) {
                    mv[t] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mr[t] + 2 * m0)));
                    xv[t] = _mm256_loadu_ps(xr[t] + m0);
                }
            } else { /* the last nb % 8 blocks, from zero-padded copies; blended in below */
                for (int t = 0; t < 2; t++) {
                    uint16_t mt[LANES] = {0};
                    float xt[LANES] = {0};
                    memcpy(mt, mr[t] + 2 * m0, (size_t)left * 2);
                    memcpy(xt, xr[t] + m0, (size_t)left * 4);
                    mv[t] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mt));
                    xv[t] = _mm256_loadu_ps(xt);
                }
                keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                    _mm256_set1_epi32((int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
            }
            for (int r = 0; r < 2; r++)
                for (int i = 0; i < 2; i++)
                    mac[r][i] = _mm256_blendv_ps(
                        mac[r][i], _mm256_fmadd_ps(mv[r], xv[i], mac[r][i]), keep);
        }
        float msum[4];
        _mm_storeu_ps(msum, reduce4(mac[0][0], mac[1][0], mac[0][1], mac[1][1]));
        for (int t = 0; t < 4; t++) sum[t] += msum[t];
    }
    for (int t = 0; t < 4; t++) {
        const int64_t r = r0 + (t & 1), i = i0 + (t >> 1);
        float s = sum[t];
        if (qt == QT_I8_ROW) s *= j->scales[r];
        if (j->bias) s += j->bias[r];
        float *y = j->y + i * j->ldy + r;
        *y = j->accumulate ? *y + s : s;
    }
}

/* one instantiation per (variant, type): tiles of full weight rows with constant sizes inside,
 * each activation-row count of its own (a decode step of 1-3 rows, or drafts, is not a padded
 * full tile nor the generic body: 2 and 3 rows ran slower than 4 that way) */
#define QL_TILE_FNS(name, attr, body, qt, full)                                                 \
    attr static void name(const qjob *j, int64_t r0, int nr, int64_t i0, int nx) {              \
        if (nr == (full) && nx == (full)) body(j, qt, r0, full, i0, full);                       \
        else if (nr == (full) && nx == 1) body(j, qt, r0, full, i0, 1);                          \
        else if (nr == (full) && (full) > 2 && nx == 2) body(j, qt, r0, full, i0, 2);            \
        else if (nr == (full) && (full) > 3 && nx == 3) body(j, qt, r0, full, i0, 3);            \
        else body(j, qt, r0, nr, i0, nx);                                                        \
    }
typedef void (*tile_fn)(const qjob *j, int64_t r0, int nr, int64_t i0, int nx);
QL_TILE_FNS(tile_avx2_q4_0, PD_AVX2, tile_avx2, QT_Q4_0, 2)
QL_TILE_FNS(tile_avx2_q4_1, PD_AVX2, tile_avx2, QT_Q4_1, 2)
QL_TILE_FNS(tile_avx2_q8_0, PD_AVX2, tile_avx2, QT_Q8_0, 2)
QL_TILE_FNS(tile_avx2_i8_g32, PD_AVX2, tile_avx2, QT_I8_G32, 2)
QL_TILE_FNS(tile_avx2_i8_row, PD_AVX2, tile_avx2, QT_I8_ROW, 2)

/* -- AVX-512: two blocks per step, once with maddubs (BW) and once with vpdpbusd (VNNI) ------- */

#define QL_ATTR PD_AVX512
#define QL_TILE tile_avx512bw
#define QL_VNNI 0
#include "qlinear_tile.h"
#undef QL_ATTR
#undef QL_TILE
#undef QL_VNNI
#define QL_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define QL_TILE tile_avx512vnni
#define QL_VNNI 1
#include "qlinear_tile.h"
#undef QL_ATTR
#undef QL_TILE
#undef QL_VNNI

QL_TILE_FNS(tile_avx512bw_q4_0, PD_AVX512, tile_avx512bw, QT_Q4_0, 4)
QL_TILE_FNS(tile_avx512bw_q4_1, PD_AVX512, tile_avx512bw, QT_Q4_1, 4)
QL_TILE_FNS(tile_avx512bw_q8_0, PD_AVX512, tile_avx512bw, QT_Q8_0, 4)
QL_TILE_FNS(tile_avx512bw_i8_g32, PD_AVX512, tile_avx512bw, QT_I8_G32, 4)
QL_TILE_FNS(tile_avx512bw_i8_row, PD_AVX512, tile_avx512bw, QT_I8_ROW, 4)
#define PD_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
QL_TILE_FNS(tile_avx512vnni_q4_0, PD_VNNI, tile_avx512vnni, QT_Q4_0, 4)
QL_TILE_FNS(tile_avx512vnni_q4_1, PD_VNNI, tile_avx512vnni, QT_Q4_1, 4)
QL_TILE_FNS(tile_avx512vnni_q8_0, PD_VNNI, tile_avx512vnni, QT_Q8_0, 4)
QL_TILE_FNS(tile_avx512vnni_i8_g32, PD_VNNI, tile_avx512vnni, QT_I8_G32, 4)
QL_TILE_FNS(tile_avx512vnni_i8_row, PD_VNNI, tile_avx512vnni, QT_I8_ROW, 4)

static int type_index(int qt) {
    switch (qt) {
    case QT_Q4_0: return 0;
    case QT_Q4_1: return 1;
    case QT_Q8_0: return 2;
    case QT_I8_G32: return 3;
    default: return 4; /* int8 rows */
    }
}

/* the tile function of a variant and type, with the tile's largest size */
static tile_fn tile_for(int level, int qt, int *tr, int *tx) {
    static const tile_fn avx2[5] = {tile_avx2_q4_0, tile_avx2_q4_1, tile_avx2_q8_0,
                                    tile_avx2_i8_g32, tile_avx2_i8_row};
    static const tile_fn bw[5] = {tile_avx512bw_q4_0, tile_avx512bw_q4_1, tile_avx512bw_q8_0,
                                  tile_avx512bw_i8_g32, tile_avx512bw_i8_row};
    static const tile_fn vnni[5] = {tile_avx512vnni_q4_0, tile_avx512vnni_q4_1,
                                    tile_avx512vnni_q8_0, tile_avx512vnni_i8_g32,
                                    tile_avx512vnni_i8_row};
    *tr = level == QL_AVX2 ? 2 : TILE_ROWS;
    *tx = level == QL_AVX2 ? 2 : TILE_X;
    if (level == QL_AVX512VNNI) return vnni[type_index(qt)];
    if (level == QL_AVX512BW) return bw[type_index(qt)];
    if (level == QL_AVX2) return avx2[type_index(qt)];
    return NULL;
}
#endif /* PD_X86 */

/* weight rows [r0, r1): tiles of weight rows, each against every activation row in tiles (the
 * tile's weight rows stay in L1 while the activations pass) */
static void qlinear_task(const void *ctx, int64_t r0, int64_t r1) {
    const qjob *j = ctx;
#if PD_X86
    int tr = 1, tx = 1;
    const tile_fn fn = tile_for(j->level, j->qt, &tr, &tx);
    if (fn) {
        for (int64_t c = 0; c < j->n; c += X_CHUNK) {
            const int64_t ce = c + X_CHUNK < j->n ? c + X_CHUNK : j->n;
            for (int64_t r = r0; r < r1; r += tr) {
                const int nr = r1 - r < tr ? (int)(r1 - r) : tr;
                for (int64_t i = c; i < ce; i += tx) fn(j, r, nr, i, ce - i < tx ? (int)(ce - i) : tx);
            }
        }
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < j->n; i++) out_portable(j, r, i);
}

/* -- scratch and the entry point ------------------------------------------------------------ */

/* The quantized activations of the calling thread's last call, grown as needed (a fresh
 * allocation of this size per call would be an mmap and its page faults, every linear). */
static __thread struct {
    void *buf;
    size_t size;
} scratch;

static int qacts_alloc(qacts *a, int64_t n, int64_t cols, int bias, int xs) {
    const int64_t nb = cols / QK;
    const size_t q = (size_t)(n * cols + 63) & ~(size_t)63;
    const size_t dv = (size_t)(n * nb * LANES) * 4, bs = bias ? dv : 0, x = xs ? (size_t)(n * nb) * 4 : 0;
    const size_t need = q + dv + bs + x;
    if (need > scratch.size) {
        free(scratch.buf);
        scratch.size = 0;
        if (posix_memalign(&scratch.buf, 64, need) != 0) {
            scratch.buf = NULL;
            return -2;
        }
        scratch.size = need;
    }
    uint8_t *p = scratch.buf;
    a->q = (int8_t *)p;
    a->dv = (float *)(p + q);
    a->bias = bias ? (int32_t *)(p + q + dv) : NULL;
    a->xs = xs ? (float *)(p + q + dv + bs) : NULL;
    return 0;
}

int pd_qlinear(int qt, const uint8_t *w, const float *scales, int64_t rows, int64_t cols,
               int64_t row_bytes, const float *x, int64_t n, int64_t ldx, float *y, int64_t ldy,
               const float *bias, int accumulate, int num_threads, pd_hook_fn hook,
               const void *hook_ctx) {
    const int known = qt == QT_Q4_0 || qt == QT_Q4_1 || qt == QT_Q8_0 || qt == QT_I8_G32 ||
                      (qt == QT_I8_ROW && scales);
    if (!known || cols % QK || cols / QK > MAX_QBLOCKS) /* int8 rows of other lengths: exact */
        return qt == QT_I8_ROW && scales && cols % QK
                   ? pd_linear_hook(qt, w, scales, rows, cols, row_bytes, x, n, ldx, y, ldy, bias,
                                    accumulate, num_threads, hook, hook_ctx)
                   : -1;
    const int level = pdserve_qlinear_isa(), mult = lane_bias(qt, level);
    qacts a;
    if (qacts_alloc(&a, n, cols, mult != 0, HAS_MIN(qt)) != 0) return -2;
    const quant_job qj = {x, ldx, cols, cols / QK, &a, mult, level >= QL_AVX2};
    /* a decode step's rows quantize faster than the pool wakes */
    pd_run_parallel(quant_task, &qj, n, 1, n * cols >= (1 << 16) ? num_threads : 1);
    const qjob job = {qt, level, w, scales, row_bytes, cols, cols / QK, n, &a, y, ldy, bias,
                      accumulate};
    pd_run_parallel_hook(qlinear_task, &job, rows, 16, num_threads, hook, hook_ctx);
    return 0;
}
