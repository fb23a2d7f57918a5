/* The weight formats' block layout, shared by the fp32-activation kernels (linear.c) and the
 * int8-activation ones (qlinear.c): type ids, block sizes, the planar row layout, fp16. */
#ifndef PDSERVE_BLOCKS_H
#define PDSERVE_BLOCKS_H
#include <stdint.h>
#include <string.h>

enum { QT_F32 = 0, QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_I8_ROW = 1000, QT_I8_G32 = 1001 };
/* the block types whose blocks carry a minimum m after d (w = d q + m: sum w x = d sum q x + m sum x) */
#define HAS_MIN(qt) ((qt) == QT_Q4_1 || (qt) == QT_I8_G32)

#define QK 32

/* -- fp16 -> fp32 (portable, exact) -------------------------------------------------------- */

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                e++;
                mant <<= 1;
            } while (!(mant & 0x400u));
            mant &= 0x3ffu;
            bits = sign | ((uint32_t)(112 - e) << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline int block_bytes(int qt) {
    switch (qt) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q8_0: return 34;
    case QT_I8_G32: return 36;
    default: return 0;
    }
}

/* Bytes of one block's values (the rest of a block is its fp16 d, and m where it has one). */
static inline int quant_bytes(int qt) { return qt == QT_Q4_0 || qt == QT_Q4_1 ? 16 : 32; }

/* A row of nb blocks, planar: nb value groups (quant_bytes each), then nb fp16 d, then (types
 * with a minimum) nb fp16 m. The same bytes as GGUF's interleaved blocks, reordered so that the
 * kernels read sixteen blocks' scales with one load. */
static inline const uint8_t *row_d(int qt, const uint8_t *w, int64_t nb) {
    return w + nb * quant_bytes(qt);
}
static inline const uint8_t *row_m(int qt, const uint8_t *w, int64_t nb) {
    return w + nb * (quant_bytes(qt) + 2);
}

/* The rows of a 4-row group are one stretch of memory (4 x row_bytes), read in `steps` steps
 * (blocks, or pairs of blocks): each step asks for the cache lines PREFETCH_AHEAD bytes beyond
 * its place in that stretch (the hardware prefetcher does not follow four interleaved rows far
 * enough ahead on its own: at 8 KiB ahead a cold matrix streams about twice as fast as with
 * next-group prefetches). */
#define PREFETCH_AHEAD 8192
static inline int64_t prefetch_step(int64_t row_bytes, int64_t steps) {
    return 4 * row_bytes / steps; /* computed once per group, not per step */
}
static inline void prefetch_ahead(const uint8_t *w, int64_t step, int64_t b) {
    const uint8_t *p = w + PREFETCH_AHEAD + b * step;
    for (int64_t off = 0; off < step; off += 64) __builtin_prefetch(p + off, 0, 3);
}

#endif
