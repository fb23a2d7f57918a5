/* exp(x) for eight floats at a time (AVX2 + FMA): the attention's softmax (paged_decode.c) and
 * SwiGLU (ops.c) both use it.
 *
 * Within 2 ulp of expf over [-87.3, 88], to which x is clamped (0 below: under the smallest
 * normal float; 2^127 e^r above); NaN stays NaN. x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two
 * parts, so n times the first is exact), e^r by its Taylor series to r^7 (the truncation is under
 * a tenth of an ulp there), then times 2^n through the exponent bits. */
#ifndef PDSERVE_VEC_EXP_H
#define PDSERVE_VEC_EXP_H
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

__attribute__((target("avx2,fma"))) static inline __m256 pd_exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(lo, _mm256_min_ps(_mm256_set1_ps(88.0f), x)); /* NaN: x (the 2nd operand) */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2's first 9 bits */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);    /* ln2 - 0.693359375 */
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif
#endif
