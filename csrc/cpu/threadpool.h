/* threadpool.h: a small persistent pool of threads that runs one data-parallel job at a time.
 *
 * gy_threadpool_run(pool, fn, ctx, n_tasks) calls fn(ctx, i, n_tasks) once for every i in
 * [0, n_tasks) and returns when all have returned. The caller's thread takes part, so a pool of
 * n_threads has n_threads - 1 workers. What task i computes is fixed by the kernel (a static
 * partition of its output); which thread runs it is not, so a task must write only its own part
 * of the output and must not depend on a thread identity: then results never depend on timing.
 *
 * Workers spin for a short while after a job (the engine issues kernels back to back), then sleep
 * on a condition variable. Runs on one pool are serialised by a mutex; a run issued from inside a
 * task runs inline on the calling thread. A NULL pool runs everything inline. */
#ifndef GY_CPU_THREADPOOL_H
#define GY_CPU_THREADPOOL_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_THREADPOOL_DEFAULT_THREADS 2
#define GY_THREADPOOL_MAX_THREADS 256

typedef struct gy_threadpool gy_threadpool;

/* One task of a job; task_index in [0, n_tasks). */
typedef void (*gy_threadpool_fn)(void *ctx, int64_t task_index, int64_t n_tasks);

/* Starts n_threads - 1 workers (n_threads <= 0 means GY_THREADPOOL_DEFAULT_THREADS). */
gy_status gy_threadpool_init(gy_threadpool **out, int32_t n_threads);
/* Joins the workers and frees the pool; NULL is accepted. No run may be in progress. */
void gy_threadpool_free(gy_threadpool *pool);
/* Threads that run tasks, the caller included (1 for a NULL pool). */
int32_t gy_threadpool_size(const gy_threadpool *pool);
/* How long idle workers spin before sleeping, in microseconds (default 200). */
void gy_threadpool_set_spin_us(gy_threadpool *pool, int32_t spin_us);
/* Runs fn for every task index and waits for all of them. n_tasks <= 0 does nothing. */
gy_status gy_threadpool_run(gy_threadpool *pool, gy_threadpool_fn fn, void *ctx, int64_t n_tasks);

#ifdef __cplusplus
}
#endif
#endif
