/* y = x w^T (+ b) for a few rows of x, in fp32: x [M, K], w [N, K] (a linear layer's weight,
 * row-major), y [M, N]. Each output y[m, n] is summed in one fixed order whatever M, the tile
 * it falls in, or the output range [n0, n1) a thread computes: 8 partial sums over k (lane l
 * takes k = l, l + 8, ...), added lane 0..7, then the k tail, then the bias. So a row's result
 * never depends on the other rows of the batch (batch invariance). No fused multiply-add in
 * the generic path (-ffp-contract=off); the AVX2 path always fuses: one or the other per build.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(vec v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
#else
typedef float vec __attribute__((vector_size(32)));
static inline vec VZERO(void) { vec v = {0}; return v; }
static inline vec VLOAD(const float *p) { vec v; __builtin_memcpy(&v, p, sizeof v); return v; }
#define VFMA(a, b, c) ((c) + (a) * (b))
static inline float vsum(vec t) {
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
#endif

#define TN 4 /* weight rows per tile */
#define TM 2 /* input rows per tile */

static inline float finish(float s, const float *x, const float *w, int64_t k8, int64_t k_end,
                           const float *b, int64_t n) {
    for (int64_t k = k8; k < k_end; k++) s += x[k] * w[k];
    return b ? s + b[n] : s;
}

int pdserve_rows_linear_f32(const float *x, const float *w, const float *b, float *y,
                            int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    const int64_t K8 = K & ~(int64_t)7;
    int64_t n = n0;
    for (; n + TN <= n1; n += TN) {
        const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        int64_t m = 0;
        for (; m + TM <= M; m += TM) {
            const float *xa = x + m * K, *xb = xa + K;
            vec a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
            vec c0 = VZERO(), c1 = VZERO(), c2 = VZERO(), c3 = VZERO();
            for (int64_t k = 0; k < K8; k += 8) {
                vec q0 = VLOAD(w0 + k), q1 = VLOAD(w1 + k), q2 = VLOAD(w2 + k), q3 = VLOAD(w3 + k);
                vec va = VLOAD(xa + k);
                a0 = VFMA(va, q0, a0); a1 = VFMA(va, q1, a1);
                a2 = VFMA(va, q2, a2); a3 = VFMA(va, q3, a3);
                vec vb = VLOAD(xb + k);
                c0 = VFMA(vb, q0, c0); c1 = VFMA(vb, q1, c1);
                c2 = VFMA(vb, q2, c2); c3 = VFMA(vb, q3, c3);
            }
            float *ya = y + m * N + n, *yb = ya + N;
            ya[0] = finish(vsum(a0), xa, w0, K8, K, b, n);
            ya[1] = finish(vsum(a1), xa, w1, K8, K, b, n + 1);
            ya[2] = finish(vsum(a2), xa, w2, K8, K, b, n + 2);
            ya[3] = finish(vsum(a3), xa, w3, K8, K, b, n + 3);
            yb[0] = finish(vsum(c0), xb, w0, K8, K, b, n);
            yb[1] = finish(vsum(c1), xb, w1, K8, K, b, n + 1);
            yb[2] = finish(vsum(c2), xb, w2, K8, K, b, n + 2);
            yb[3] = finish(vsum(c3), xb, w3, K8, K, b, n + 3);
        }
        for (; m < M; m++) {
            const float *xa = x + m * K;
            vec a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
            for (int64_t k = 0; k < K8; k += 8) {
                vec va = VLOAD(xa + k);
                a0 = VFMA(va, VLOAD(w0 + k), a0); a1 = VFMA(va, VLOAD(w1 + k), a1);
                a2 = VFMA(va, VLOAD(w2 + k), a2); a3 = VFMA(va, VLOAD(w3 + k), a3);
            }
            float *ya = y + m * N + n;
            ya[0] = finish(vsum(a0), xa, w0, K8, K, b, n);
            ya[1] = finish(vsum(a1), xa, w1, K8, K, b, n + 1);
            ya[2] = finish(vsum(a2), xa, w2, K8, K, b, n + 2);
            ya[3] = finish(vsum(a3), xa, w3, K8, K, b, n + 3);
        }
    }
    for (; n < n1; n++) {
        const float *w0 = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xa = x + m * K;
            vec a0 = VZERO();
            for (int64_t k = 0; k < K8; k += 8) a0 = VFMA(VLOAD(xa + k), VLOAD(w0 + k), a0);
            y[m * N + n] = finish(vsum(a0), xa, w0, K8, K, b, n);
        }
    }
    return 0;
}
