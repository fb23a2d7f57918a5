/* The F32 linear kernel's body, included by linear.c once per instruction-set variant with
 * F32_ROWS / F32_TILE / F32_FINISH (the functions' names), F32_ATTR (their target), F32_TM (the
 * activation rows of a register tile), vec, VZERO, VLOAD, VFMA and vsum defined.
 *
 * y[m, n] for weight rows n in [n0, n1) and every activation row m: each output is summed in one
 * fixed order whatever the number of rows, the tile it falls in, or the range a thread takes:
 * 8 partial sums over k (lane l takes k = l, l + 8, ...; acc = fma(x, w, acc) in k order), added
 * lane 0..7 pairwise, then the k tail, then the bias (store). So a row's result never depends on
 * the other rows of its batch (batch invariance), nor on F32_TM. Register tiles of 4 weight rows
 * x F32_TM activation rows: each weight vector loaded feeds F32_TM multiply-adds, and the 4
 * weight rows stay in L1 while every activation row passes. */
#define F32_TN 4

F32_ATTR static inline float F32_FINISH(float s, const float *x, const float *w, int64_t k8,
                                        int64_t k_end) {
    for (int64_t k = k8; k < k_end; k++) s += x[k] * w[k];
    return s;
}

/* rows m0 .. m0 + TM - 1 (TM <= F32_TM, a constant where inlined) against weight rows wr[0..3] */
F32_ATTR static inline __attribute__((always_inline)) void
F32_TILE(const linear_job *j, const float *const wr[F32_TN], int64_t n, int64_t m0, int tm) {
    const int64_t K = j->cols, K8 = K & ~(int64_t)7;
    const float *x = j->x + m0 * j->ldx;
    vec acc[F32_TM][F32_TN];
#pragma GCC unroll 8
    for (int i = 0; i < F32_TM; i++)
#pragma GCC unroll 4
        for (int t = 0; t < F32_TN; t++) acc[i][t] = VZERO();
    for (int64_t k = 0; k < K8; k += 8) {
        vec wv[F32_TN];
#pragma GCC unroll 4
        for (int t = 0; t < F32_TN; t++) wv[t] = VLOAD(wr[t] + k);
#pragma GCC unroll 8
        for (int i = 0; i < F32_TM; i++) {
            if (i >= tm) break;
            const vec xv = VLOAD(x + i * j->ldx + k);
#pragma GCC unroll 4
            for (int t = 0; t < F32_TN; t++) acc[i][t] = VFMA(xv, wv[t], acc[i][t]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < F32_TM; i++) {
        if (i >= tm) break;
        const float *xi = x + i * j->ldx;
        float *yi = j->y + (m0 + i) * j->ldy;
#pragma GCC unroll 4
        for (int t = 0; t < F32_TN; t++)
            store(j, yi, n + t, F32_FINISH(vsum(acc[i][t]), xi, wr[t], K8, K));
    }
}

F32_ATTR static void F32_ROWS(const linear_job *j, int64_t n0, int64_t n1) {
    const int64_t M = j->n, ldw = j->row_bytes / (int64_t)sizeof(float);
    const float *w = (const float *)j->w;
    int64_t n = n0;
    for (; n + F32_TN <= n1; n += F32_TN) {
        const float *const wr[F32_TN] = {w + n * ldw, w + (n + 1) * ldw, w + (n + 2) * ldw,
                                         w + (n + 3) * ldw};
        int64_t m = 0;
        for (; m + F32_TM <= M; m += F32_TM) F32_TILE(j, wr, n, m, F32_TM);
        for (; m < M; m++) F32_TILE(j, wr, n, m, 1);
    }
    for (; n < n1; n++) { /* the last rows of a matrix whose rows are not a multiple of 4 */
        const float *w0 = w + n * ldw;
        for (int64_t m = 0; m < M; m++) {
            const float *xa = j->x + m * j->ldx;
            vec a0 = VZERO();
            const int64_t K = j->cols, K8 = K & ~(int64_t)7;
            for (int64_t k = 0; k < K8; k += 8) a0 = VFMA(VLOAD(xa + k), VLOAD(w0 + k), a0);
            store(j, j->y + m * j->ldy, n, F32_FINISH(vsum(a0), xa, w0, K8, K));
        }
    }
}
#undef F32_TN
