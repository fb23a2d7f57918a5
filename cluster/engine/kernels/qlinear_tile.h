/* The AVX-512 register tile of qlinear.c, included once per variant with QL_ATTR (the target),
 * QL_TILE (the function's name) and QL_VNNI (1: vpdpbusd; 0: maddubs + madd, AVX-512 BW).
 *
 * Up to TILE_ROWS weight rows x TILE_X activation rows; two blocks per step: a 512-bit vector
 * holds blocks b (bytes 0-31, int32 lanes 0-7) and b + 1 (lanes 8-15), so one accumulator holds
 * qlinear.c's A[0] (even blocks) in its low half and A[1] (odd blocks) in its high half; an odd
 * last block goes to the low half alone (masked). */

QL_ATTR static PD_INLINE void QL_TILE(const qjob *j, int qt, int64_t r0, int nr, int64_t i0,
                                      int nx) {
    const int64_t nb = j->nb, cols = j->cols;
    const int qb = qt == QT_I8_ROW ? QK : quant_bytes(qt);
    const int q4 = qt == QT_Q4_0 || qt == QT_Q4_1;
    /* BW: signed weights by the sign trick (|w| unsigned, q negated where w < 0) */
    const int signed8 = !QL_VNNI && !q4;
    const int has_bias = j->a->bias != NULL;
    const __m512i zero = _mm512_setzero_si512();
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    /* VNNI takes unsigned weights: Q8_0 / int8 as w + 128; BW's sign trick takes signed ones:
     * int8g32 as w - 128 (the same xor) */
    const int xor80 = QL_VNNI ? qt == QT_Q8_0 || qt == QT_I8_ROW : qt == QT_I8_G32;
    const uint8_t *wr[TILE_ROWS], *dr[TILE_ROWS];
    __m512 acc[TILE_ROWS][TILE_X];
#pragma GCC unroll 4
    for (int r = 0; r < TILE_ROWS; r++) {
        wr[r] = j->w + (r0 + (r < nr ? r : 0)) * j->row_bytes;
        dr[r] = qt == QT_I8_ROW ? NULL : row_d(qt, wr[r], nb);
#pragma GCC unroll 4
        for (int i = 0; i < TILE_X; i++) acc[r][i] = _mm512_setzero_ps();
    }
#define QL_DOT(wv, qv, start)                                                                   \
    (QL_VNNI ? _mm512_dpbusd_epi32(start, wv, qv)                                               \
             : _mm512_add_epi32(                                                                \
                   _mm512_madd_epi16(_mm512_maddubs_epi16(wv, qv), _mm512_set1_epi16(1)), start))
    /* the first activation tile streams the weight rows from memory: prefetch them ahead */
    const int prefetch = i0 == 0 && nr == TILE_ROWS;
    const int64_t pstep = prefetch_step(j->row_bytes, (nb + 1) / 2);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        if (prefetch) prefetch_ahead(wr[0], pstep, b / 2);
        __m512i wv[TILE_ROWS];
        __mmask64 neg[TILE_ROWS];
        __m512 dw[TILE_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < TILE_ROWS; r++) {
            if (r >= nr) break;
            const uint8_t *qs = wr[r] + b * qb;
            __m512i v;
            if (q4) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)qs);
                const __m256i m4 = _mm256_set1_epi8(0x0F);
                const __m512i z = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_and_si256(raw, m4)),
                    _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), 1);
                v = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
            } else {
                v = _mm512_loadu_si512((const void *)qs);
                if (xor80) v = _mm512_xor_si512(v, flip);
            }
            if (signed8) {
                neg[r] = _mm512_movepi8_mask(v);
                v = _mm512_abs_epi8(v);
            }
            wv[r] = v;
            if (qt != QT_I8_ROW) {
                uint32_t d2;
                memcpy(&d2, dr[r] + 2 * b, 4);
                dw[r] = _mm512_permutexvar_ps(
                    pair, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)d2))));
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < TILE_X; i++) {
            if (i >= nx) break;
            const int64_t k = (i0 + i) * nb + b;
            const __m512i qv = _mm512_loadu_si512((const void *)(j->a->q + (i0 + i) * cols + b * QK));
            const __m512 dx = _mm512_loadu_ps(j->a->dv + k * LANES);
            const __m512i start =
                has_bias ? _mm512_loadu_si512((const void *)(j->a->bias + k * LANES)) : zero;
#pragma GCC unroll 4
            for (int r = 0; r < TILE_ROWS; r++) {
                if (r >= nr) break;
                const __m512i q2 = signed8 ? _mm512_mask_sub_epi8(qv, neg[r], zero, qv) : qv;
                const __m512 s = qt == QT_I8_ROW ? dx : _mm512_mul_ps(dw[r], dx);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(QL_DOT(wv[r], q2, start)), s,
                                            acc[r][i]);
            }
        }
    }
    if (b < nb) { /* the last, even block: low lanes only */
        const __mmask16 low = 0x00FF;
        for (int r = 0; r < nr; r++) {
            const uint8_t *qs = wr[r] + b * qb;
            __m512i v;
            if (q4) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0x0F);
                v = _mm512_zextsi256_si512(_mm256_set_m128i(
                    _mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4)));
            } else {
                v = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)qs));
                if (xor80) v = _mm512_xor_si512(v, flip);
            }
            __mmask64 ng = 0;
            if (signed8) {
                ng = _mm512_movepi8_mask(v);
                v = _mm512_abs_epi8(v);
            }
            const __m512 dw1 = qt == QT_I8_ROW ? _mm512_set1_ps(1.0f)
                                               : _mm512_set1_ps(_cvtsh_ss(load_u16(dr[r] + 2 * b)));
            for (int i = 0; i < nx; i++) {
                const int64_t k = (i0 + i) * nb + b;
                const __m512i qv = _mm512_zextsi256_si512(
                    _mm256_loadu_si256((const __m256i *)(j->a->q + (i0 + i) * cols + b * QK)));
                const __m512 dx = _mm512_maskz_loadu_ps(low, j->a->dv + k * LANES);
                const __m512i start =
                    has_bias ? _mm512_maskz_loadu_epi32(low, j->a->bias + k * LANES) : zero;
                const __m512i q2 = signed8 ? _mm512_mask_sub_epi8(qv, ng, zero, qv) : qv;
                const __m512 s = qt == QT_I8_ROW ? dx : _mm512_mul_ps(dw1, dx);
                acc[r][i] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(QL_DOT(v, q2, start)), s,
                                                  acc[r][i], low);
            }
        }
    }
#undef QL_DOT
    if (nr < TILE_ROWS) { /* a partial row tile (a matrix's last rows): one output at a time */
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < nx; i++) {
                float lanes[2 * LANES];
                _mm512_storeu_ps(lanes, acc[r][i]);
                finish(j, r0 + r, i0 + i, lanes);
            }
        return;
    }
    /* four rows' outputs per activation row at once, in finish()'s order: the two halves
     * added, reduce4's tree, the minimum term (its own tree), the scale, the bias */
    __m128 sum[TILE_X];
#pragma GCC unroll 4
    for (int i = 0; i < TILE_X; i++) {
        if (i >= nx) break;
        __m256 v[TILE_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < TILE_ROWS; r++)
            v[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][i]),
                                 _mm256_castsi256_ps(_mm512_extracti64x4_epi64(
                                     _mm512_castps_si512(acc[r][i]), 1)));
        sum[i] = reduce4(v[0], v[1], v[2], v[3]);
    }
    if (HAS_MIN(qt)) {
        const uint8_t *mr[TILE_ROWS];
        __m256 mac[TILE_ROWS][TILE_X];
#pragma GCC unroll 4
        for (int r = 0; r < TILE_ROWS; r++) {
            mr[r] = row_m(qt, wr[r], nb);
#pragma GCC unroll 4
            for (int i = 0; i < TILE_X; i++) mac[r][i] = _mm256_setzero_ps();
        }
        for (int64_t m0 = 0; m0 < nb; m0 += LANES) {
            const __mmask8 k = nb - m0 >= LANES ? 0xFF : (__mmask8)((1u << (nb - m0)) - 1);
            __m256 mv[TILE_ROWS];
#pragma GCC unroll 4
            for (int r = 0; r < TILE_ROWS; r++)
                mv[r] = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(k, mr[r] + 2 * m0));
#pragma GCC unroll 4
            for (int i = 0; i < TILE_X; i++) {
                if (i >= nx) break;
                const __m256 xv = _mm256_maskz_loadu_ps(k, j->a->xs + (i0 + i) * nb + m0);
#pragma GCC unroll 4
                for (int r = 0; r < TILE_ROWS; r++)
                    mac[r][i] = _mm256_mask3_fmadd_ps(mv[r], xv, mac[r][i], k);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < TILE_X; i++) {
            if (i >= nx) break;
            sum[i] = _mm_add_ps(sum[i], reduce4(mac[0][i], mac[1][i], mac[2][i], mac[3][i]));
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < TILE_X; i++) {
        if (i >= nx) break;
        __m128 s4 = sum[i];
        if (qt == QT_I8_ROW) s4 = _mm_mul_ps(s4, _mm_loadu_ps(j->scales + r0));
        if (j->bias) s4 = _mm_add_ps(s4, _mm_loadu_ps(j->bias + r0));
        float *y = j->y + (i0 + i) * j->ldy + r0;
        _mm_storeu_ps(y, j->accumulate ? _mm_add_ps(_mm_loadu_ps(y), s4) : s4);
    }
}
