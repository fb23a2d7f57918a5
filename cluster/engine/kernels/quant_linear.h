/* What quant_linear.c gives the other sources compiled into its library (decode_forward.c). */
#ifndef PDSERVE_QUANT_LINEAR_H
#define PDSERVE_QUANT_LINEAR_H
#include <stdint.h>

typedef void (*pd_task_fn)(const void *ctx, int64_t begin, int64_t end);

typedef void (*pd_hook_fn)(const void *ctx);

/* fn(ctx, b, e) over [0, total) split into up to n chunks (multiples of align) on the pool */
void pd_run_parallel(pd_task_fn fn, const void *ctx, int64_t total, int64_t align, int n);
/* The same, and the calling thread runs hook(hook_ctx) once the workers have been woken, before
 * it takes chunks itself (inline: before fn): work that overlaps the job, such as prefetches. */
void pd_run_parallel_hook(pd_task_fn fn, const void *ctx, int64_t total, int64_t align, int n,
                          pd_hook_fn hook, const void *hook_ctx);

int pdserve_quant_linear(int qt, const uint8_t *w, const float *scales, int64_t rows,
                         int64_t cols, int64_t row_bytes, const float *x, int64_t n, int64_t ldx,
                         float *y, int64_t ldy, const float *bias, int accumulate,
                         int num_threads);
/* pdserve_quant_linear with pd_run_parallel_hook's hook */
int pd_quant_linear_hook(int qt, const uint8_t *w, const float *scales, int64_t rows,
                         int64_t cols, int64_t row_bytes, const float *x, int64_t n, int64_t ldx,
                         float *y, int64_t ldy, const float *bias, int accumulate,
                         int num_threads, pd_hook_fn hook, const void *hook_ctx);
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
                     int64_t layer, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                     int int8);
#endif
