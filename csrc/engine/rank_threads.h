/* rank_threads.h (private to the engine): the threads that run an instance's ranks.
 *
 * A fixed crew of n threads, the caller's own being thread 0: gy_rank_threads_run wakes the
 * others, runs run(ctx, t) on each thread t at once (the ranks of one stage must run together:
 * their collectives wait for each other) and returns when every thread has finished. Inside run,
 * gy_rank_threads_barrier holds each thread until all n have reached it: the hand-off between
 * two stages of a plan. */
#ifndef GY_ENGINE_RANK_THREADS_H
#define GY_ENGINE_RANK_THREADS_H

#include <pthread.h>
#include <stdint.h>

#include "../core/status.h"

#define GY_RANK_THREADS_MAX 8

typedef struct gy_rank_threads {
    int32_t n;
    void (*run)(void *ctx, int32_t t);
    void *ctx;
    pthread_t threads[GY_RANK_THREADS_MAX];
    int32_t started;             /* threads 1..started are running */
    pthread_mutex_t lock;
    pthread_cond_t wake, done, gate;
    uint64_t generation;         /* of gy_rank_threads_run calls */
    int32_t n_done;
    int stopping;
    int32_t at_gate;             /* threads waiting in gy_rank_threads_barrier */
    uint64_t gate_generation;
} gy_rank_threads;

/* Starts threads 1..n-1 (n in [1, GY_RANK_THREADS_MAX]); on failure none is left running. */
gy_status gy_rank_threads_start(gy_rank_threads *rt, int32_t n, void (*run)(void *ctx, int32_t t),
                                void *ctx);
void gy_rank_threads_run(gy_rank_threads *rt);
void gy_rank_threads_barrier(gy_rank_threads *rt);
/* Joins the threads; a zeroed or stopped crew is accepted. */
void gy_rank_threads_stop(gy_rank_threads *rt);

#endif
