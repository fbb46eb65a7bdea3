/* threadpool.c: persistent workers, one job at a time, claimed task by task.
 *
 * A job is published in one 64-bit word: generation (32 bits) | n_tasks (16) | next task (16).
 * A worker claims task i by a compare-and-swap of that word from (g, n, i) to (g, n, i + 1) with
 * i < n, so a worker that wakes late can never claim a task of a job it did not read: the word it
 * read names the job, and fn/ctx were read after it and before the claim, while the job (which
 * cannot finish before the claimed task runs) was still the current one. */
#include "threadpool.h"
#include "../core/alloc.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GY_TP_PAUSE() _mm_pause()
#else
#define GY_TP_PAUSE() ((void)0)
#endif

#define GY_TP_MAX_TASKS 0xffff
#define GY_TP_DEFAULT_SPIN_US 200

struct gy_threadpool {
    int32_t n_threads;
    int32_t n_workers;
    pthread_t *workers;
    pthread_mutex_t run_lock; /* one job at a time */
    pthread_mutex_t mu;       /* guards the sleeps below */
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    _Atomic uint64_t work; /* generation << 32 | n_tasks << 16 | next */
    _Atomic(gy_threadpool_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t done;
    _Atomic int32_t sleepers;
    _Atomic int32_t caller_sleeping;
    _Atomic int32_t stop;
    _Atomic int32_t spin_us;
};

/* Set while this thread runs tasks, so that a run issued from a task runs inline. */
static _Thread_local int gy_tp_in_task;

static inline uint32_t gy_tp_gen(uint64_t w) { return (uint32_t)(w >> 32); }
static inline uint32_t gy_tp_ntasks(uint64_t w) { return (uint32_t)((w >> 16) & 0xffffu); }
static inline uint32_t gy_tp_next(uint64_t w) { return (uint32_t)(w & 0xffffu); }

static int64_t gy_tp_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Claims and runs tasks of the job named by generation `gen` until none are left. */
static void gy_tp_work_on(gy_threadpool *pool, uint32_t gen) {
    gy_threadpool_fn fn = atomic_load_explicit(&pool->fn, memory_order_relaxed);
    void *ctx = atomic_load_explicit(&pool->ctx, memory_order_relaxed);
    uint64_t w = atomic_load_explicit(&pool->work, memory_order_acquire);
    while (gy_tp_gen(w) == gen && gy_tp_next(w) < gy_tp_ntasks(w)) {
        if (!atomic_compare_exchange_weak_explicit(&pool->work, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        const int64_t n = gy_tp_ntasks(w);
        fn(ctx, gy_tp_next(w), n);
        if (atomic_fetch_add_explicit(&pool->done, 1, memory_order_seq_cst) + 1 == n &&
            atomic_load_explicit(&pool->caller_sleeping, memory_order_seq_cst)) {
            pthread_mutex_lock(&pool->mu);
            pthread_cond_broadcast(&pool->cv_done);
            pthread_mutex_unlock(&pool->mu);
        }
        w = atomic_load_explicit(&pool->work, memory_order_acquire);
    }
}

static void *gy_tp_worker_main(void *arg) {
    gy_threadpool *pool = (gy_threadpool *)arg;
    gy_tp_in_task = 1;
    uint32_t seen = gy_tp_gen(atomic_load_explicit(&pool->work, memory_order_acquire));
    for (;;) {
        uint64_t w = atomic_load_explicit(&pool->work, memory_order_acquire);
        if (gy_tp_gen(w) == seen && !atomic_load_explicit(&pool->stop, memory_order_relaxed)) {
            const int64_t spin_ns =
                (int64_t)atomic_load_explicit(&pool->spin_us, memory_order_relaxed) * 1000;
            const int64_t start = gy_tp_now_ns();
            for (uint32_t i = 1;; i++) {
                GY_TP_PAUSE();
                w = atomic_load_explicit(&pool->work, memory_order_acquire);
                if (gy_tp_gen(w) != seen || atomic_load_explicit(&pool->stop, memory_order_relaxed))
                    break;
                if ((i & 63u) == 0 && gy_tp_now_ns() - start > spin_ns) {
                    atomic_fetch_add_explicit(&pool->sleepers, 1, memory_order_seq_cst);
                    pthread_mutex_lock(&pool->mu);
                    while (gy_tp_gen(atomic_load_explicit(&pool->work, memory_order_seq_cst)) == seen &&
                           !atomic_load_explicit(&pool->stop, memory_order_seq_cst))
                        pthread_cond_wait(&pool->cv_work, &pool->mu);
                    pthread_mutex_unlock(&pool->mu);
                    atomic_fetch_sub_explicit(&pool->sleepers, 1, memory_order_seq_cst);
                    w = atomic_load_explicit(&pool->work, memory_order_acquire);
                    break;
                }
            }
        }
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) return NULL;
        seen = gy_tp_gen(w);
        gy_tp_work_on(pool, seen);
    }
}

gy_status gy_threadpool_init(gy_threadpool **out, int32_t n_threads) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_threadpool_init: NULL output");
    *out = NULL;
    if (n_threads <= 0) n_threads = GY_THREADPOOL_DEFAULT_THREADS;
    if (n_threads > GY_THREADPOOL_MAX_THREADS)
        return GY_FAIL(GY_ERR_INVALID, "thread pool of %d threads exceeds the limit of %d",
                       (int)n_threads, GY_THREADPOOL_MAX_THREADS);
    gy_threadpool *pool = gy_calloc(1, sizeof *pool);
    if (pool == NULL) return GY_FAIL(GY_ERR_SYSTEM, "cannot allocate a thread pool");
    pool->n_threads = n_threads;
    pool->spin_us = GY_TP_DEFAULT_SPIN_US;
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->cv_work, NULL);
    pthread_cond_init(&pool->cv_done, NULL);
    if (n_threads > 1) {
        pool->workers = gy_calloc((size_t)n_threads - 1, sizeof *pool->workers);
        if (pool->workers == NULL) {
            gy_threadpool_free(pool);
            return GY_FAIL(GY_ERR_SYSTEM, "cannot allocate a thread pool");
        }
        for (int32_t i = 0; i < n_threads - 1; i++) {
            int rc = pthread_create(&pool->workers[i], NULL, gy_tp_worker_main, pool);
            if (rc != 0) {
                gy_threadpool_free(pool);
                return GY_FAIL(GY_ERR_SYSTEM, "pthread_create failed for worker %d of %d: %s",
                               (int)i + 1, (int)n_threads - 1, strerror(rc));
            }
            pool->n_workers++;
        }
    }
    *out = pool;
    return GY_OK;
}

void gy_threadpool_free(gy_threadpool *pool) {
    if (pool == NULL) return;
    atomic_store_explicit(&pool->stop, 1, memory_order_seq_cst);
    pthread_mutex_lock(&pool->mu);
    pthread_cond_broadcast(&pool->cv_work);
    pthread_mutex_unlock(&pool->mu);
    for (int32_t i = 0; i < pool->n_workers; i++) pthread_join(pool->workers[i], NULL);
    free(pool->workers);
    pthread_cond_destroy(&pool->cv_work);
    pthread_cond_destroy(&pool->cv_done);
    pthread_mutex_destroy(&pool->mu);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool);
}

int32_t gy_threadpool_size(const gy_threadpool *pool) { return pool ? pool->n_threads : 1; }

void gy_threadpool_set_spin_us(gy_threadpool *pool, int32_t spin_us) {
    if (pool) atomic_store_explicit(&pool->spin_us, spin_us < 0 ? 0 : spin_us, memory_order_relaxed);
}

gy_status gy_threadpool_run(gy_threadpool *pool, gy_threadpool_fn fn, void *ctx, int64_t n_tasks) {
    if (fn == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_threadpool_run: NULL task function");
    if (n_tasks <= 0) return GY_OK;
    if (pool == NULL || pool->n_workers == 0 || n_tasks == 1 || gy_tp_in_task) {
        for (int64_t i = 0; i < n_tasks; i++) fn(ctx, i, n_tasks);
        return GY_OK;
    }
    if (n_tasks > GY_TP_MAX_TASKS)
        return GY_FAIL(GY_ERR_INVALID, "gy_threadpool_run: %lld tasks exceed the limit of %d",
                       (long long)n_tasks, GY_TP_MAX_TASKS);
    pthread_mutex_lock(&pool->run_lock);
    const uint64_t old = atomic_load_explicit(&pool->work, memory_order_relaxed);
    const uint32_t gen = gy_tp_gen(old) + 1u;
    atomic_store_explicit(&pool->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->work, ((uint64_t)gen << 32) | ((uint64_t)n_tasks << 16),
                          memory_order_seq_cst);
    if (atomic_load_explicit(&pool->sleepers, memory_order_seq_cst) > 0) {
        pthread_mutex_lock(&pool->mu);
        pthread_cond_broadcast(&pool->cv_work);
        pthread_mutex_unlock(&pool->mu);
    }
    gy_tp_in_task = 1;
    gy_tp_work_on(pool, gen);
    gy_tp_in_task = 0;
    /* Wait for tasks still running on workers: spin, then sleep. */
    const int64_t spin_ns = (int64_t)atomic_load_explicit(&pool->spin_us, memory_order_relaxed) * 1000;
    const int64_t start = gy_tp_now_ns();
    for (uint32_t i = 1; atomic_load_explicit(&pool->done, memory_order_acquire) < n_tasks; i++) {
        GY_TP_PAUSE();
        if ((i & 63u) == 0 && gy_tp_now_ns() - start > spin_ns) {
            atomic_store_explicit(&pool->caller_sleeping, 1, memory_order_seq_cst);
            pthread_mutex_lock(&pool->mu);
            while (atomic_load_explicit(&pool->done, memory_order_seq_cst) < n_tasks)
                pthread_cond_wait(&pool->cv_done, &pool->mu);
            pthread_mutex_unlock(&pool->mu);
            atomic_store_explicit(&pool->caller_sleeping, 0, memory_order_relaxed);
            break;
        }
    }
    pthread_mutex_unlock(&pool->run_lock);
    return GY_OK;
}
