/* The F32 linear kernel's body, included by linear.c once per instruction-set variant with
 * F32_ROWS (the function's name), F32_ATTR (its target), vec, VZERO, VLOAD, VFMA and vsum
 * defined.
 *
 * y[m, n] for weight rows n in [n0, n1) and every activation row m: each output is summed in one
 * fixed order whatever the number of rows, the tile it falls in, or the range a thread takes:
 * 8 partial sums over k (lane l takes k = l, l + 8, ...), added lane 0..7 pairwise, then the k
 * tail, then the bias (store). So a row's result never depends on the other rows of its batch
 * (batch invariance). Tiles of 4 weight rows x 2 activation rows: the weight rows stay in L1
 * while every activation row passes. */
F32_ATTR static inline float F32_FINISH(float s, const float *x, const float *w, int64_t k8,
                                        int64_t k_end) {
    for (int64_t k = k8; k < k_end; k++) s += x[k] * w[k];
    return s;
}

F32_ATTR static void F32_ROWS(const linear_job *j, int64_t n0, int64_t n1) {
    const int64_t K = j->cols, K8 = K & ~(int64_t)7, M = j->n, ldx = j->ldx, ldy = j->ldy;
    const int64_t ldw = j->row_bytes / (int64_t)sizeof(float);
    const float *w = (const float *)j->w, *x = j->x;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        const float *w0 = w + n * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            const float *xa = x + m * ldx, *xb = xa + ldx;
            vec a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
            vec c0 = VZERO(), c1 = VZERO(), c2 = VZERO(), c3 = VZERO();
            for (int64_t k = 0; k < K8; k += 8) {
                vec q0 = VLOAD(w0 + k), q1 = VLOAD(w1 + k), q2 = VLOAD(w2 + k), q3 = VLOAD(w3 + k);
                vec va = VLOAD(xa + k);
                a0 = VFMA(va, q0, a0), a1 = VFMA(va, q1, a1);
                a2 = VFMA(va, q2, a2), a3 = VFMA(va, q3, a3);
                vec vb = VLOAD(xb + k);
                c0 = VFMA(vb, q0, c0), c1 = VFMA(vb, q1, c1);
                c2 = VFMA(vb, q2, c2), c3 = VFMA(vb, q3, c3);
            }
            float *ya = j->y + m * ldy, *yb = ya + ldy;
            store(j, ya, n, F32_FINISH(vsum(a0), xa, w0, K8, K));
            store(j, ya, n + 1, F32_FINISH(vsum(a1), xa, w1, K8, K));
            store(j, ya, n + 2, F32_FINISH(vsum(a2), xa, w2, K8, K));
            store(j, ya, n + 3, F32_FINISH(vsum(a3), xa, w3, K8, K));
            store(j, yb, n, F32_FINISH(vsum(c0), xb, w0, K8, K));
            store(j, yb, n + 1, F32_FINISH(vsum(c1), xb, w1, K8, K));
            store(j, yb, n + 2, F32_FINISH(vsum(c2), xb, w2, K8, K));
            store(j, yb, n + 3, F32_FINISH(vsum(c3), xb, w3, K8, K));
        }
        for (; m < M; m++) {
            const float *xa = x + m * ldx;
            vec a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
            for (int64_t k = 0; k < K8; k += 8) {
                vec va = VLOAD(xa + k);
                a0 = VFMA(va, VLOAD(w0 + k), a0), a1 = VFMA(va, VLOAD(w1 + k), a1);
                a2 = VFMA(va, VLOAD(w2 + k), a2), a3 = VFMA(va, VLOAD(w3 + k), a3);
            }
            float *ya = j->y + m * ldy;
            store(j, ya, n, F32_FINISH(vsum(a0), xa, w0, K8, K));
            store(j, ya, n + 1, F32_FINISH(vsum(a1), xa, w1, K8, K));
            store(j, ya, n + 2, F32_FINISH(vsum(a2), xa, w2, K8, K));
            store(j, ya, n + 3, F32_FINISH(vsum(a3), xa, w3, K8, K));
        }
    }
    for (; n < n1; n++) {
        const float *w0 = w + n * ldw;
        for (int64_t m = 0; m < M; m++) {
            const float *xa = x + m * ldx;
            vec a0 = VZERO();
            for (int64_t k = 0; k < K8; k += 8) a0 = VFMA(VLOAD(xa + k), VLOAD(w0 + k), a0);
            store(j, j->y + m * ldy, n, F32_FINISH(vsum(a0), xa, w0, K8, K));
        }
    }
}
