/* rank_threads.c: the crew of threads that runs an instance's ranks (rank_threads.h). */
#include "rank_threads.h"
#include "../core/alloc.h"

#include <stdlib.h>
#include <string.h>

typedef struct gy_rank_thread_arg {
    gy_rank_threads *rt;
    int32_t t;
} gy_rank_thread_arg;

static void *gy_rank_thread_main(void *p) {
    gy_rank_thread_arg arg = *(gy_rank_thread_arg *)p;
    free(p);
    gy_rank_threads *rt = arg.rt;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&rt->lock);
        while (rt->generation == seen && !rt->stopping) pthread_cond_wait(&rt->wake, &rt->lock);
        if (rt->stopping) {
            pthread_mutex_unlock(&rt->lock);
            return NULL;
        }
        seen = rt->generation;
        pthread_mutex_unlock(&rt->lock);
        rt->run(rt->ctx, arg.t);
        pthread_mutex_lock(&rt->lock);
        rt->n_done++;
        pthread_cond_signal(&rt->done);
        pthread_mutex_unlock(&rt->lock);
    }
}

gy_status gy_rank_threads_start(gy_rank_threads *rt, int32_t n, void (*run)(void *ctx, int32_t t),
                                void *ctx) {
    memset(rt, 0, sizeof *rt);
    if (n < 1 || n > GY_RANK_THREADS_MAX)
        return GY_FAIL(GY_ERR_INVALID, "a crew of %d threads (1 to %d)", (int)n, GY_RANK_THREADS_MAX);
    rt->n = n;
    rt->run = run;
    rt->ctx = ctx;
    pthread_mutex_init(&rt->lock, NULL);
    pthread_cond_init(&rt->wake, NULL);
    pthread_cond_init(&rt->done, NULL);
    pthread_cond_init(&rt->gate, NULL);
    for (int32_t t = 1; t < n; t++) {
        gy_rank_thread_arg *arg = gy_malloc(sizeof *arg);
        if (arg == NULL) {
            gy_rank_threads_stop(rt);
            return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
        }
        *arg = (gy_rank_thread_arg){.rt = rt, .t = t};
        if (pthread_create(&rt->threads[t], NULL, gy_rank_thread_main, arg) != 0) {
            free(arg);
            gy_rank_threads_stop(rt);
            return GY_FAIL(GY_ERR_SYSTEM, "could not start the thread of rank %d", (int)t);
        }
        rt->started = t;
    }
    return GY_OK;
}

void gy_rank_threads_run(gy_rank_threads *rt) {
    if (rt->n > 1) {
        pthread_mutex_lock(&rt->lock);
        rt->n_done = 0;
        rt->generation++;
        pthread_cond_broadcast(&rt->wake);
        pthread_mutex_unlock(&rt->lock);
    }
    rt->run(rt->ctx, 0);
    if (rt->n > 1) {
        pthread_mutex_lock(&rt->lock);
        while (rt->n_done < rt->n - 1) pthread_cond_wait(&rt->done, &rt->lock);
        pthread_mutex_unlock(&rt->lock);
    }
}

void gy_rank_threads_barrier(gy_rank_threads *rt) {
    if (rt->n == 1) return;
    pthread_mutex_lock(&rt->lock);
    const uint64_t generation = rt->gate_generation;
    if (++rt->at_gate == rt->n) {
        rt->at_gate = 0;
        rt->gate_generation++;
        pthread_cond_broadcast(&rt->gate);
    } else {
        while (generation == rt->gate_generation) pthread_cond_wait(&rt->gate, &rt->lock);
    }
    pthread_mutex_unlock(&rt->lock);
}

void gy_rank_threads_stop(gy_rank_threads *rt) {
    if (rt->n == 0) return;
    pthread_mutex_lock(&rt->lock);
    rt->stopping = 1;
    pthread_cond_broadcast(&rt->wake);
    pthread_mutex_unlock(&rt->lock);
    for (int32_t t = 1; t <= rt->started; t++) pthread_join(rt->threads[t], NULL);
    pthread_mutex_destroy(&rt->lock);
    pthread_cond_destroy(&rt->wake);
    pthread_cond_destroy(&rt->done);
    pthread_cond_destroy(&rt->gate);
    memset(rt, 0, sizeof *rt);
}
