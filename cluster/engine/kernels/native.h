/* What the sources of the one native library (libpdserve) share: the instruction-set levels
 * chosen at run time, the thread pool, and the functions one source calls in another. */
#ifndef PDSERVE_NATIVE_H
#define PDSERVE_NATIVE_H
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PD_X86 1
/* Per-function variants: the library is built for the architecture's baseline and these
 * functions for more; pd_isa() says which of them this CPU (or a test's cap) allows. */
#define PD_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#else
#define PD_X86 0
#endif
#define PD_INLINE inline __attribute__((always_inline))

enum { PD_ISA_PORTABLE = 0, PD_ISA_AVX2 = 1, PD_ISA_AVX512 = 2 };

/* The best level this CPU runs (cpuid, probed once), or the cap pdserve_set_isa set. */
int pd_isa(void);
/* pool.c's exports: the level in use, a cap on it (-1: none), the sources' hash */
int pdserve_isa(void);
int pdserve_set_isa(int level);
const char *pdserve_source_tag(void);

typedef void (*pd_task_fn)(const void *ctx, int64_t begin, int64_t end);
typedef void (*pd_hook_fn)(const void *ctx);

/* fn(ctx, b, e) over [0, total) split into up to n chunks (multiples of align) on the pool */
void pd_run_parallel(pd_task_fn fn, const void *ctx, int64_t total, int64_t align, int n);
/* The same, and the calling thread runs hook(hook_ctx) once the workers have been woken, before
 * it takes chunks itself (inline: before fn): work that overlaps the job, such as prefetches. */
void pd_run_parallel_hook(pd_task_fn fn, const void *ctx, int64_t total, int64_t align, int n,
                          pd_hook_fn hook, const void *hook_ctx);

/* linear.c. A weight type or'ed with PD_QT_FAST (Q4_0, Q4_1, Q8_0, I8_G32, I8_ROW) runs the
 * integer kernel of qlinear.c: activations quantized to int8 per 32 inputs, integer dot
 * products (model.numerics: fast). F32 ignores the flag. */
#define PD_QT_FAST 0x10000
int pdserve_linear(int qt, const uint8_t *w, const float *scales, int64_t rows, int64_t cols,
                   int64_t row_bytes, const float *x, int64_t n, int64_t ldx, float *y,
                   int64_t ldy, const float *bias, int accumulate, int num_threads);
/* pdserve_linear with pd_run_parallel_hook's hook */
int pd_linear_hook(int qt, const uint8_t *w, const float *scales, int64_t rows, int64_t cols,
                   int64_t row_bytes, const float *x, int64_t n, int64_t ldx, float *y,
                   int64_t ldy, const float *bias, int accumulate, int num_threads,
                   pd_hook_fn hook, const void *hook_ctx);

/* qlinear.c: pd_linear_hook's PD_QT_FAST path (qt without the flag): y (+)= x W^T + bias with
 * x quantized to int8 per 32 inputs; -1 for a type or shape it does not take, -2 no memory. */
int pd_qlinear(int qt, const uint8_t *w, const float *scales, int64_t rows, int64_t cols,
               int64_t row_bytes, const float *x, int64_t n, int64_t ldx, float *y, int64_t ldy,
               const float *bias, int accumulate, int num_threads, pd_hook_fn hook,
               const void *hook_ctx);
/* the integer kernels' variant in use (0 portable, 1 AVX2, 2 AVX-512 BW, 3 AVX-512 VNNI), and a
 * cap on it (-1: none; tests run each variant) */
int pdserve_qlinear_isa(void);
int pdserve_set_qlinear_isa(int level);

/* out[i, :cols] = W[row(i)] as fp32, row(i) = row_ids[i] or row0 + i (block formats, int8 rows) */
int pdserve_dequant_rows(int qt, const uint8_t *w, const float *scales, int64_t rows,
                         int64_t cols, int64_t row_bytes, const int64_t *row_ids, int64_t row0,
                         int64_t count, float *out, int64_t ldo, int num_threads);

/* ops.c */
int pdserve_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo,
                     int64_t n, int64_t h, float eps, int num_threads);
int pdserve_rope(float *x, int64_t ldx, int64_t n, int64_t num_heads, int64_t head_dim,
                 const float *cos_t, const float *sin_t, const int64_t *positions);
/* o[k] = silu(g[k]) * u[k] for k < count (pdserve_swiglu's rows, and the decode step's split) */
void pd_swiglu_span(const float *g, const float *u, float *o, int64_t count);
int pdserve_swiglu(const float *gu, int64_t ld, int64_t n, int64_t inter, float *out,
                   int64_t ldo);
int pdserve_write_kv(void *kv, const float *k, const float *v, int64_t ld, int64_t n,
                     const int64_t *slot_blocks, const int64_t *slot_offsets, int64_t num_layers,
                     int64_t layer, int64_t block_size, int64_t num_kv_heads, int64_t row_heads,
                     int64_t head_dim, int int8);

/* paged_decode.c: decode attention over a paged KV cache of fp32 rows or int8 rows and their
 * scales (kv_int8); the (request, kv head) items split between up to num_threads threads.
 * row_heads: the heads one token's row holds in memory (num_kv_heads, or more where kv points at
 * a tensor-parallel rank's first head in a cache holding every rank's: pdserve_write_kv too). */
int pdserve_paged_decode(const float *q, const void *kv, const int64_t *tables,
                         const int64_t *ctx_lens, float *out, int64_t batch, int64_t num_heads,
                         int64_t num_kv_heads, int64_t row_heads, int64_t head_dim,
                         int64_t max_blocks,
                         int64_t block_size, int64_t num_layers, int64_t layer, float scale,
                         int kv_int8, int num_threads);
#endif
