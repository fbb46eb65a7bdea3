/* comm_shm.c: the shm backend: collectives among worker threads over host memory.
 *
 * Every collective publishes the ranks' buffer pointers, waits at a barrier, lets each rank read
 * what it needs from the others, and waits again before anyone may reuse a buffer. */
#include <stdlib.h>
#include "../core/alloc.h"
#include <string.h>

#include "comm_backend.h"
#include "../core/tree.h"

typedef struct gy_comm_shm {
    const void *ptrs[GY_COMM_MAX_RANKS];
    const void *const *send[GY_COMM_MAX_RANKS];
    const int64_t *send_bytes[GY_COMM_MAX_RANKS];
    float *scratch;          /* all-reduce result, grown by rank 0 */
    int64_t scratch_capacity;
    gy_status failure;       /* a rank's argument error, seen by all ranks of that call */
} gy_comm_shm;

static gy_status gy_shm_init(gy_comm *c) {
    c->state = gy_calloc(1, sizeof(gy_comm_shm));
    if (c->state == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    return GY_OK;
}

static void gy_shm_destroy(gy_comm *c) {
    gy_comm_shm *m = c->state;
    if (m == NULL) return;
    free(m->scratch);
    free(m);
    c->state = NULL;
}

static gy_status gy_shm_barrier(gy_comm *c, int32_t rank) {
    (void)rank;
    return gy_comm_host_barrier(c);
}

static gy_status gy_shm_all_reduce(gy_comm *c, int32_t rank, float *buf, int64_t n) {
    gy_comm_shm *m = c->state;
    if (c->size == 1 || n == 0) return GY_OK;
    m->ptrs[rank] = buf;
    if (rank == 0 && n > m->scratch_capacity) {
        free(m->scratch);
        m->scratch = gy_malloc((size_t)n * sizeof(float));
        m->scratch_capacity = m->scratch ? n : 0;
        m->failure = m->scratch ? GY_OK : GY_ERR_SYSTEM;
    }
    GY_TRY(gy_comm_host_barrier(c));
    if (m->failure != GY_OK) {
        GY_TRY(gy_comm_host_barrier(c));
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for an all-reduce of %lld floats", (long long)n);
    }
    /* Each rank sums one slice of the vector, in the tree order of core/tree.h. */
    const int64_t per = (n + c->size - 1) / c->size;
    const int64_t lo = rank * per, hi = lo + per < n ? lo + per : n;
    float v[GY_COMM_MAX_RANKS];
    for (int64_t i = lo; i < hi; i++) {
        for (int32_t r = 0; r < c->size; r++) v[r] = ((const float *)m->ptrs[r])[i];
        int32_t w = c->size;
        while (w > 1) w = gy_tree_level(v, w);
        m->scratch[i] = v[0];
    }
    GY_TRY(gy_comm_host_barrier(c));
    memcpy(buf, m->scratch, (size_t)n * sizeof(float));
    gy_comm_count_all_reduce(c, rank, n);
    gy_comm_count_call(c, rank);
    return gy_comm_host_barrier(c);
}

static gy_status gy_shm_all_gather(gy_comm *c, int32_t rank, void *out, const void *in,
                                   int64_t bytes) {
    gy_comm_shm *m = c->state;
    m->ptrs[rank] = in;
    GY_TRY(gy_comm_host_barrier(c));
    for (int32_t r = 0; r < c->size; r++)
        memcpy((char *)out + r * bytes, m->ptrs[r], (size_t)bytes);
    gy_comm_count_all_gather(c, rank, bytes);
    gy_comm_count_call(c, rank);
    return gy_comm_host_barrier(c);
}

static gy_status gy_shm_all_to_all(gy_comm *c, int32_t rank, void *const *recv,
                                   const int64_t *recv_bytes, const void *const *send,
                                   const int64_t *send_bytes) {
    gy_comm_shm *m = c->state;
    m->send[rank] = send;
    m->send_bytes[rank] = send_bytes;
    GY_TRY(gy_comm_host_barrier(c));
    gy_status s = GY_OK;
    for (int32_t src = 0; src < c->size; src++) {
        const int64_t n = m->send_bytes[src][rank];
        if (n != recv_bytes[src] || n < 0) {
            s = GY_FAIL(GY_ERR_INVALID, "rank %d expects %lld bytes from rank %d, which sends %lld",
                        (int)rank, (long long)recv_bytes[src], (int)src, (long long)n);
            continue;
        }
        if (n > 0) memcpy(recv[src], m->send[src][rank], (size_t)n);
        gy_comm_count_received(c, rank, src, n);
    }
    gy_comm_count_call(c, rank);
    const gy_status b = gy_comm_host_barrier(c);
    return s != GY_OK ? s : b;
}

/* The receiver copies straight from the sender's buffer, which the sender keeps until the
 * receiver is done with it (gy_comm_post_send waits for that). */
static gy_status gy_shm_send(gy_comm *c, int32_t rank, int32_t peer, const void *buf,
                             int64_t bytes, gy_status status) {
    const gy_status s = gy_comm_post_send(c, rank, peer, buf, bytes, NULL, status, NULL);
    gy_comm_post_ack(c, rank, peer);
    return s;
}

static gy_status gy_shm_recv(gy_comm *c, int32_t rank, int32_t peer, void *buf, int64_t bytes,
                             gy_status status) {
    gy_comm_post post;
    gy_status s = gy_comm_post_take(c, rank, peer, bytes, status, &post);
    if (s == GY_OK && bytes > 0) memcpy(buf, post.buf, (size_t)bytes);
    s = gy_comm_post_finish(c, rank, peer, s, NULL);
    if (s == GY_OK) gy_comm_count_message(c, rank, peer, bytes);
    return s;
}

const gy_comm_ops gy_comm_shm_ops = {
    .name = "shm",
    .init = gy_shm_init,
    .destroy = gy_shm_destroy,
    .barrier = gy_shm_barrier,
    .all_reduce = gy_shm_all_reduce,
    .all_gather = gy_shm_all_gather,
    .all_to_all = gy_shm_all_to_all,
    .send = gy_shm_send,
    .recv = gy_shm_recv,
};
