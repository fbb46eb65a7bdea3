/* comm.c: shared-memory collectives for worker threads.
 *
 * Every collective publishes the ranks' buffer pointers, waits at a barrier, lets each rank read
 * what it needs from the others, and waits again before anyone may reuse a buffer. The barrier
 * sleeps on a condition variable: on a machine with fewer cores than workers, spinning ranks
 * would steal the core from the rank everyone waits for. */
#include "comm.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct gy_comm {
    int32_t size;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int32_t waiting;
    uint64_t generation;
    const void *ptrs[GY_COMM_MAX_RANKS];
    const void *const *send[GY_COMM_MAX_RANKS];
    const int64_t *send_bytes[GY_COMM_MAX_RANKS];
    float *scratch;          /* all-reduce result, grown by rank 0 */
    int64_t scratch_capacity;
    gy_status failure;       /* a rank's argument error, seen by all ranks of that call */
    gy_comm_stats stats;
};

gy_status gy_comm_init(gy_comm **out, int32_t size) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL out");
    *out = NULL;
    if (size < 1 || size > GY_COMM_MAX_RANKS || (size & (size - 1)) != 0)
        return GY_FAIL(GY_ERR_INVALID, "a communicator has a power-of-two size up to %d, got %d",
                       GY_COMM_MAX_RANKS, (int)size);
    gy_comm *c = calloc(1, sizeof *c);
    if (c == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    c->size = size;
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    *out = c;
    return GY_OK;
}

void gy_comm_free(gy_comm *c) {
    if (c == NULL) return;
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->cond);
    free(c->scratch);
    free(c);
}

int32_t gy_comm_size(const gy_comm *c) { return c->size; }

void gy_comm_barrier(gy_comm *c, int32_t rank) {
    (void)rank;
    if (c->size == 1) return;
    pthread_mutex_lock(&c->lock);
    const uint64_t generation = c->generation;
    if (++c->waiting == c->size) {
        c->waiting = 0;
        c->generation++;
        pthread_cond_broadcast(&c->cond);
    } else {
        while (generation == c->generation) pthread_cond_wait(&c->cond, &c->lock);
    }
    pthread_mutex_unlock(&c->lock);
}

static gy_status gy_comm_check_rank(const gy_comm *c, int32_t rank) {
    if (c == NULL || rank < 0 || rank >= c->size)
        return GY_FAIL(GY_ERR_INVALID, "rank %d is not in a communicator of %d", (int)rank,
                       c ? (int)c->size : 0);
    return GY_OK;
}

gy_status gy_comm_all_reduce(gy_comm *c, int32_t rank, float *buf, int64_t n) {
    GY_TRY(gy_comm_check_rank(c, rank));
    if (c->size == 1 || n == 0) return GY_OK;
    c->ptrs[rank] = buf;
    if (rank == 0 && n > c->scratch_capacity) {
        free(c->scratch);
        c->scratch = malloc((size_t)n * sizeof(float));
        c->scratch_capacity = c->scratch ? n : 0;
        c->failure = c->scratch ? GY_OK : GY_ERR_SYSTEM;
    }
    gy_comm_barrier(c, rank);
    if (c->failure != GY_OK) {
        gy_comm_barrier(c, rank);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for an all-reduce of %lld floats", (long long)n);
    }
    /* Each rank sums one slice of the vector, in the pairwise tree order. */
    const int64_t per = (n + c->size - 1) / c->size;
    const int64_t lo = rank * per, hi = lo + per < n ? lo + per : n;
    float v[GY_COMM_MAX_RANKS];
    for (int64_t i = lo; i < hi; i++) {
        for (int32_t r = 0; r < c->size; r++) v[r] = ((const float *)c->ptrs[r])[i];
        for (int32_t m = c->size; m > 1; m /= 2)
            for (int32_t j = 0; j < m / 2; j++) v[j] = v[2 * j] + v[2 * j + 1];
        c->scratch[i] = v[0];
    }
    gy_comm_barrier(c, rank);
    memcpy(buf, c->scratch, (size_t)n * sizeof(float));
    /* As a ring all-reduce would: reduce-scatter then all-gather, (size-1)/size of it each. */
    const uint64_t moved = (uint64_t)n * sizeof(float) * 2 * (uint64_t)(c->size - 1) / (uint64_t)c->size;
    c->stats.bytes_sent[rank] += moved;
    c->stats.bytes_received[rank] += moved;
    if (rank == 0) c->stats.calls++;
    gy_comm_barrier(c, rank);
    return GY_OK;
}

gy_status gy_comm_all_gather(gy_comm *c, int32_t rank, void *out, const void *in, int64_t bytes) {
    GY_TRY(gy_comm_check_rank(c, rank));
    c->ptrs[rank] = in;
    gy_comm_barrier(c, rank);
    for (int32_t r = 0; r < c->size; r++)
        memcpy((char *)out + r * bytes, c->ptrs[r], (size_t)bytes);
    c->stats.bytes_sent[rank] += (uint64_t)bytes * (uint64_t)(c->size - 1);
    c->stats.bytes_received[rank] += (uint64_t)bytes * (uint64_t)(c->size - 1);
    if (rank == 0) c->stats.calls++;
    gy_comm_barrier(c, rank);
    return GY_OK;
}

gy_status gy_comm_all_to_all(gy_comm *c, int32_t rank, void *const *recv, const int64_t *recv_bytes,
                             const void *const *send, const int64_t *send_bytes) {
    GY_TRY(gy_comm_check_rank(c, rank));
    c->send[rank] = send;
    c->send_bytes[rank] = send_bytes;
    gy_comm_barrier(c, rank);
    gy_status s = GY_OK;
    for (int32_t src = 0; src < c->size; src++) {
        const int64_t n = c->send_bytes[src][rank];
        if (n != recv_bytes[src]) {
            s = GY_FAIL(GY_ERR_INVALID, "rank %d expects %lld bytes from rank %d, which sends %lld",
                        (int)rank, (long long)recv_bytes[src], (int)src, (long long)n);
            continue;
        }
        if (n > 0) memcpy(recv[src], c->send[src][rank], (size_t)n);
        if (src != rank) {
            c->stats.bytes_received[rank] += (uint64_t)n;
            __atomic_fetch_add(&c->stats.bytes_sent[src], (uint64_t)n, __ATOMIC_RELAXED);
        }
    }
    if (rank == 0) c->stats.calls++;
    gy_comm_barrier(c, rank);
    return s;
}

gy_status gy_comm_rank_all_reduce(void *ctx, float *buf, int64_t n) {
    gy_comm_rank *r = ctx;
    return gy_comm_all_reduce(r->comm, r->rank, buf, n);
}

void gy_comm_stats_get(const gy_comm *c, gy_comm_stats *out) { *out = c->stats; }

void gy_comm_stats_reset(gy_comm *c) { memset(&c->stats, 0, sizeof c->stats); }
