/* The library's instruction-set choice and its thread pool: every native function of pdserve
 * runs its parallel work here.
 *
 * Instruction sets: AVX-512 (F, BW, VL), AVX2 + FMA + F16C, or portable C, probed once from
 * cpuid (__builtin_cpu_supports); each function picks the best variant it has at or below that
 * level, so one binary runs on any x86-64 (and the portable code anywhere). pdserve_set_isa caps
 * the level (tests run every variant the host has).
 *
 * Threads: a small pool owned by this library (the caller counts as one thread). A job is split
 * into chunks that the threads claim as they go (see pd_run_parallel). Workers spin briefly
 * after a job (decode issues one call after another) and then sleep on a condition variable.
 * A call that finds the pool busy (another engine thread in the process) runs inline.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "native.h"

#ifndef PD_SOURCE_TAG
#define PD_SOURCE_TAG "unknown"
#endif

/* The hash of the sources this binary was built from (kernels/build.py): the loader refuses a
 * prebuilt library whose sources differ from the package's. */
const char *pdserve_source_tag(void) { return PD_SOURCE_TAG; }

/* -- instruction sets --------------------------------------------------------------------- */

static int detect_isa(void) {
#if PD_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return PD_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return PD_ISA_AVX2;
#endif
    return PD_ISA_PORTABLE;
}

static int g_isa = -1;

int pd_isa(void) {
    if (g_isa < 0) g_isa = detect_isa();
    return g_isa;
}

/* The level in use (the best this CPU has unless capped). */
int pdserve_isa(void) { return pd_isa(); }

/* Cap the level at `level` (-1: no cap); returns the level now in use. */
int pdserve_set_isa(int level) {
    const int best = detect_isa();
    g_isa = level < 0 || level > best ? best : level;
    return g_isa;
}

/* -- the thread pool ---------------------------------------------------------------------- */

#define MAX_THREADS 256
#define SPIN_NS 100000 /* how long an idle worker spins before it sleeps */

typedef pd_task_fn task_fn;

/* A job is split into chunks that the caller and the workers claim one at a time, so a worker
 * that the OS has not scheduled (another process, or torch's OpenMP threads spinning on the
 * other core after their own work) leaves its share to whoever is running instead of making the
 * caller wait for it. Each output row is computed by one thread whatever the split, so results
 * do not depend on who took which chunk. */
#define CHUNKS_PER_THREAD 4

static struct {
    pthread_mutex_t run_mu; /* one job at a time; a caller that finds it taken runs inline */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int num_workers; /* started workers (the caller is thread 0) */
    pid_t pid;
    pthread_t threads[MAX_THREADS];
    uint64_t start_gen[MAX_THREADS]; /* the generation before a worker's first job */
    _Atomic uint64_t gen;            /* bumped to wake the workers for a job */
    _Atomic uint64_t claim;          /* (job id << 32) | the next unclaimed chunk */
    _Atomic int64_t done;            /* chunks of the current job finished */
    _Atomic int sleepers;
    task_fn fn;
    const void *ctx;
    int64_t total, chunk_size, num_chunks;
    int job_threads;
} P = {.run_mu = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
       .cv = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if PD_X86
    _mm_pause();
#endif
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim and run chunks of job `job` until none is left (or another job is current). The job's
 * fields are read between the load of `claim` and the compare-exchange that claims a chunk:
 * while that chunk is unclaimed the job cannot finish, so no other job can have replaced them. */
static void work_on(uint32_t job) {
    for (;;) {
        uint64_t c = atomic_load_explicit(&P.claim, memory_order_acquire);
        if ((uint32_t)(c >> 32) != job) return;
        const int64_t k = (int64_t)(uint32_t)c;
        if (k >= P.num_chunks) return;
        const task_fn fn = P.fn;
        const void *ctx = P.ctx;
        const int64_t size = P.chunk_size, total = P.total;
        if (!atomic_compare_exchange_weak_explicit(&P.claim, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        const int64_t b = k * size, e = b + size < total ? b + size : total;
        fn(ctx, b, e);
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    const int idx = (int)(intptr_t)arg;
    uint64_t seen = P.start_gen[idx];
    for (;;) {
        uint64_t g;
        const int64_t t0 = now_ns();
        int spins = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
            cpu_relax();
            if (++spins % 64 == 0 && now_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&P.mu);
                atomic_fetch_add(&P.sleepers, 1);
                while ((g = atomic_load(&P.gen)) == seen) pthread_cond_wait(&P.cv, &P.mu);
                atomic_fetch_sub(&P.sleepers, 1);
                pthread_mutex_unlock(&P.mu);
                break;
            }
        }
        seen = g;
        if (idx < P.job_threads) work_on((uint32_t)g); /* the generation is the job id */
    }
    return NULL;
}

/* Make sure `n - 1` workers run (the pool only grows; a forked child starts afresh). */
static int ensure_workers(int n) {
    if (P.pid != getpid()) { /* after fork(): the parent's workers do not exist here */
        P.num_workers = 0;
        P.pid = getpid();
        atomic_store(&P.sleepers, 0);
    }
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (P.num_workers < n - 1) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        const int idx = P.num_workers + 1;
        P.start_gen[idx] = atomic_load(&P.gen);
        const int rc = pthread_create(&P.threads[idx], &attr, worker_main, (void *)(intptr_t)idx);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pthread_detach(P.threads[idx]);
        P.num_workers++;
    }
    return P.num_workers + 1;
}

void pd_run_parallel(task_fn fn, const void *ctx, int64_t total, int64_t align, int n) {
    pd_run_parallel_hook(fn, ctx, total, align, n, NULL, NULL);
}

void pd_run_parallel_hook(task_fn fn, const void *ctx, int64_t total, int64_t align, int n,
                          pd_hook_fn hook, const void *hook_ctx) {
    if (n <= 1 || total <= align || pthread_mutex_trylock(&P.run_mu) != 0) {
        if (hook) hook(hook_ctx);
        fn(ctx, 0, total);
        return;
    }
    const int available = ensure_workers(n);
    if (available < n) n = available;
    const int64_t units = (total + align - 1) / align;
    if (units < n) n = (int)units;
    if (n <= 1) {
        pthread_mutex_unlock(&P.run_mu);
        if (hook) hook(hook_ctx);
        fn(ctx, 0, total);
        return;
    }
    int64_t per = (units + (int64_t)n * CHUNKS_PER_THREAD - 1) / ((int64_t)n * CHUNKS_PER_THREAD);
    P.fn = fn, P.ctx = ctx, P.total = total, P.chunk_size = per * align;
    P.num_chunks = (total + P.chunk_size - 1) / P.chunk_size, P.job_threads = n;
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    const uint32_t job = (uint32_t)(atomic_load(&P.gen) + 1);
    atomic_store_explicit(&P.claim, (uint64_t)job << 32, memory_order_release);
    atomic_fetch_add(&P.gen, 1); /* wakes the workers (seq_cst) */
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    if (hook) hook(hook_ctx); /* while the workers have started on the chunks */
    work_on(job);
    int spins = 0;
    while (atomic_load_explicit(&P.done, memory_order_acquire) < P.num_chunks) {
        cpu_relax();
        if (++spins % 4096 == 0) sched_yield(); /* a worker inside a chunk: let it run */
    }
    pthread_mutex_unlock(&P.run_mu);
}
