/* comm.c: the communicator interface: configuration checks, dispatch to a backend
 * (comm_shm.c, comm_d2d.c, comm_nccl.c), the host barrier and the statistics they share. */
#include "comm.h"
#include "../core/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_backend.h"
#include "../core/fault.h"

static const gy_comm_ops *gy_comm_ops_for(gy_comm_backend_kind kind) {
    switch (kind) {
    case GY_COMM_BACKEND_SHM: return &gy_comm_shm_ops;
    case GY_COMM_BACKEND_D2D: return &gy_comm_d2d_ops;
    case GY_COMM_BACKEND_NCCL: return &gy_comm_nccl_ops;
    default: return NULL;
    }
}

const char *gy_comm_backend_name(gy_comm_backend_kind kind) {
    const gy_comm_ops *ops = gy_comm_ops_for(kind);
    return ops ? ops->name : "?";
}

/* Everything that can be said about a configuration without a device. */
static gy_status gy_comm_check_config(const gy_comm_config *config, int32_t *devices) {
    const int32_t size = config->size;
    if (gy_comm_ops_for(config->backend) == NULL)
        return GY_FAIL(GY_ERR_INVALID,
                       "unknown communicator backend %d (expected 0=shm, 1=d2d, 2=nccl)",
                       (int)config->backend);
    if (size < 1 || size > GY_COMM_MAX_RANKS)
        return GY_FAIL(GY_ERR_INVALID, "a communicator has 1 to %d ranks, got %d",
                       GY_COMM_MAX_RANKS, (int)size);
    if ((unsigned)config->channel >= GY_COMM_CHANNEL_COUNT)
        return GY_FAIL(GY_ERR_INVALID,
                       "unknown communicator channel %d (expected 0=compute, 1=migration)",
                       (int)config->channel);
    for (int32_t r = 0; r < size; r++) {
        if (config->backend == GY_COMM_BACKEND_SHM) {
            devices[r] = -1;
            continue;
        }
        const int32_t d = config->devices ? config->devices[r]
                                          : (config->backend == GY_COMM_BACKEND_NCCL ? r : 0);
        if (d < 0)
            return GY_FAIL(GY_ERR_INVALID, "rank %d: CUDA device %d is negative", (int)r, (int)d);
        devices[r] = d;
        if (config->backend == GY_COMM_BACKEND_D2D && d != devices[0])
            return GY_FAIL(GY_ERR_INVALID,
                           "a d2d communicator joins virtual workers on one GPU, but rank 0 is "
                           "on device %d and rank %d on device %d (use nccl for one GPU per rank)",
                           (int)devices[0], (int)r, (int)d);
        if (config->backend == GY_COMM_BACKEND_NCCL)
            for (int32_t q = 0; q < r; q++)
                if (devices[q] == d)
                    return GY_FAIL(GY_ERR_INVALID,
                                   "an nccl communicator needs one GPU per rank, but ranks %d and "
                                   "%d are both on device %d (use d2d for virtual workers "
                                   "sharing one GPU)",
                                   (int)q, (int)r, (int)d);
    }
    return GY_OK;
}

gy_status gy_comm_init_config(gy_comm **out, const gy_comm_config *config) {
    if (out == NULL || config == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL out or config");
    *out = NULL;
    int32_t devices[GY_COMM_MAX_RANKS];
    GY_TRY(gy_comm_check_config(config, devices));
    gy_comm *c = gy_calloc(1, sizeof *c);
    if (c == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    c->ops = gy_comm_ops_for(config->backend);
    c->backend = config->backend;
    c->channel = config->channel;
    c->size = config->size;
    memcpy(c->devices, devices, sizeof(int32_t) * (size_t)c->size);
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    gy_status s = c->ops->init(c);
    if (s != GY_OK) {
        if (c->ops->destroy) c->ops->destroy(c);
        pthread_mutex_destroy(&c->lock);
        pthread_cond_destroy(&c->cond);
        free(c);
        return s;
    }
    *out = c;
    return GY_OK;
}

gy_status gy_comm_init(gy_comm **out, int32_t size) {
    const gy_comm_config config = {.backend = GY_COMM_BACKEND_SHM, .size = size};
    return gy_comm_init_config(out, &config);
}

void gy_comm_free(gy_comm *c) {
    if (c == NULL) return;
    c->ops->destroy(c);
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->cond);
    free(c);
}

int32_t gy_comm_size(const gy_comm *c) { return c->size; }
gy_comm_backend_kind gy_comm_backend(const gy_comm *c) { return c->backend; }
gy_comm_channel gy_comm_channel_of(const gy_comm *c) { return c->channel; }

int32_t gy_comm_device(const gy_comm *c, int32_t rank) {
    return c != NULL && rank >= 0 && rank < c->size ? c->devices[rank] : -1;
}

static gy_status gy_comm_aborted_status(const gy_comm *c) {
    return GY_FAIL(GY_ERR_STATE, "the communicator was aborted: %s", c->abort_reason);
}

gy_status gy_comm_host_barrier(gy_comm *c) {
    if (c->size == 1) return GY_OK;
    pthread_mutex_lock(&c->lock);
    gy_status s = GY_OK;
    const uint64_t generation = c->generation;
    if (c->aborted) {
        s = gy_comm_aborted_status(c);
    } else if (++c->waiting == c->size) {
        c->waiting = 0;
        c->generation++;
        pthread_cond_broadcast(&c->cond);
    } else {
        while (generation == c->generation && !c->aborted) pthread_cond_wait(&c->cond, &c->lock);
        if (generation == c->generation) s = gy_comm_aborted_status(c); /* woken by an abort */
    }
    pthread_mutex_unlock(&c->lock);
    return s;
}

void gy_comm_abort(gy_comm *c, int32_t rank, const char *reason) {
    if (c == NULL) return;
    pthread_mutex_lock(&c->lock);
    if (!c->aborted) {
        c->aborted = 1;
        snprintf(c->abort_reason, sizeof c->abort_reason, "rank %d failed: %s", (int)rank,
                 reason ? reason : "");
    }
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

void gy_comm_reset(gy_comm *c) {
    if (c == NULL) return;
    pthread_mutex_lock(&c->lock);
    c->aborted = 0;
    c->waiting = 0;
    c->generation++;
    c->abort_reason[0] = '\0';
    memset(c->posts, 0, sizeof c->posts); /* an abort may have left a message half-way */
    if (c->ops->reset) c->ops->reset(c);
    pthread_mutex_unlock(&c->lock);
}

int gy_comm_aborted(const gy_comm *c) {
    if (c == NULL) return 0;
    pthread_mutex_lock((pthread_mutex_t *)&c->lock);
    const int aborted = c->aborted;
    pthread_mutex_unlock((pthread_mutex_t *)&c->lock);
    return aborted;
}

/* Entry of every collective: an aborted communicator fails at once, and an injected fault
 * fails this rank's call and aborts the communicator, so its peers fail too. */
static gy_status gy_comm_enter(gy_comm *c, int32_t rank, const char *what) {
    if (gy_fault_hit(GY_FAULT_COMM)) {
        char reason[128];
        snprintf(reason, sizeof reason, "injected fault in its %s", what);
        gy_comm_abort(c, rank, reason);
        return GY_FAIL(GY_ERR_SYSTEM, "rank %d: injected fault in a collective (%s)", (int)rank, what);
    }
    if (c->size > 1 && gy_comm_aborted(c)) return gy_comm_aborted_status(c);
    return GY_OK;
}

static gy_status gy_comm_check_rank(const gy_comm *c, int32_t rank) {
    if (c == NULL || rank < 0 || rank >= c->size)
        return GY_FAIL(GY_ERR_INVALID, "rank %d is not in a communicator of %d", (int)rank,
                       c ? (int)c->size : 0);
    return GY_OK;
}

gy_status gy_comm_set_stream(gy_comm *c, int32_t rank, void *stream) {
    GY_TRY(gy_comm_check_rank(c, rank));
    if (c->ops->set_stream) return c->ops->set_stream(c, rank, stream);
    c->streams[rank] = stream;
    return GY_OK;
}

void *gy_comm_stream(const gy_comm *c, int32_t rank) {
    return c != NULL && rank >= 0 && rank < c->size ? c->streams[rank] : NULL;
}

void *gy_comm_own_stream(const gy_comm *c, int32_t rank) {
    return c != NULL && rank >= 0 && rank < c->size ? c->own_streams[rank] : NULL;
}

gy_status gy_comm_stream_priority(const gy_comm *c, int32_t rank, int32_t *priority) {
    GY_TRY(gy_comm_check_rank(c, rank));
    if (priority == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL priority");
    *priority = 0;
    /* The query does not change the communicator; the table takes it non-const like the rest. */
    return c->ops->stream_priority ? c->ops->stream_priority((gy_comm *)c, rank, priority) : GY_OK;
}

gy_status gy_comm_synchronize(gy_comm *c, int32_t rank) {
    GY_TRY(gy_comm_check_rank(c, rank));
    return c->ops->synchronize ? c->ops->synchronize(c, rank) : GY_OK;
}

gy_status gy_comm_barrier(gy_comm *c, int32_t rank) {
    GY_TRY(gy_comm_check_rank(c, rank));
    GY_TRY(gy_comm_enter(c, rank, "barrier"));
    return c->ops->barrier(c, rank);
}

gy_status gy_comm_all_reduce(gy_comm *c, int32_t rank, float *buf, int64_t n) {
    GY_TRY(gy_comm_check_rank(c, rank));
    if (n < 0) return GY_FAIL(GY_ERR_INVALID, "all-reduce of %lld floats", (long long)n);
    GY_TRY(gy_comm_enter(c, rank, "all-reduce"));
    return c->ops->all_reduce(c, rank, buf, n);
}

gy_status gy_comm_all_gather(gy_comm *c, int32_t rank, void *out, const void *in, int64_t bytes) {
    GY_TRY(gy_comm_check_rank(c, rank));
    if (bytes < 0) return GY_FAIL(GY_ERR_INVALID, "all-gather of %lld bytes", (long long)bytes);
    GY_TRY(gy_comm_enter(c, rank, "all-gather"));
    return c->ops->all_gather(c, rank, out, in, bytes);
}

gy_status gy_comm_all_to_all(gy_comm *c, int32_t rank, void *const *recv, const int64_t *recv_bytes,
                             const void *const *send, const int64_t *send_bytes) {
    GY_TRY(gy_comm_check_rank(c, rank));
    if (recv == NULL || recv_bytes == NULL || send == NULL || send_bytes == NULL)
        return GY_FAIL(GY_ERR_INVALID, "all-to-all: NULL buffer or size list");
    GY_TRY(gy_comm_enter(c, rank, "all-to-all"));
    /* Negative sizes are refused by the backends after the ranks have met: a rank that left
     * here alone would leave the others waiting for it. */
    return c->ops->all_to_all(c, rank, recv, recv_bytes, send, send_bytes);
}

/* The peer of a send or receive: another rank of the communicator. Refused on the caller only:
 * no rank waits for a pairing that names a rank which does not exist. */
static gy_status gy_comm_check_peer(const gy_comm *c, int32_t rank, int32_t peer, const char *what) {
    if (peer < 0 || peer >= c->size || peer == rank)
        return GY_FAIL(GY_ERR_INVALID, "%s: rank %d cannot exchange with rank %d in a "
                       "communicator of %d", what, (int)rank, (int)peer, (int)c->size);
    return GY_OK;
}

/* A size or buffer the caller got wrong is carried to the peer, so both fail. */
static gy_status gy_comm_check_message(const void *buf, int64_t bytes, const char *what) {
    if (bytes < 0) return GY_FAIL(GY_ERR_INVALID, "%s of %lld bytes", what, (long long)bytes);
    if (bytes > 0 && buf == NULL) return GY_FAIL(GY_ERR_INVALID, "%s: NULL buffer", what);
    return GY_OK;
}

gy_status gy_comm_send(gy_comm *c, int32_t rank, int32_t peer, const void *buf, int64_t bytes) {
    GY_TRY(gy_comm_check_rank(c, rank));
    GY_TRY(gy_comm_check_peer(c, rank, peer, "send"));
    GY_TRY(gy_comm_enter(c, rank, "send"));
    return c->ops->send(c, rank, peer, buf, bytes, gy_comm_check_message(buf, bytes, "send"));
}

gy_status gy_comm_recv(gy_comm *c, int32_t rank, int32_t peer, void *buf, int64_t bytes) {
    GY_TRY(gy_comm_check_rank(c, rank));
    GY_TRY(gy_comm_check_peer(c, rank, peer, "receive"));
    GY_TRY(gy_comm_enter(c, rank, "receive"));
    return c->ops->recv(c, rank, peer, buf, bytes, gy_comm_check_message(buf, bytes, "receive"));
}

/* ---- the host side of a message (comm_backend.h) ---- */

gy_status gy_comm_post_send(gy_comm *c, int32_t rank, int32_t peer, const void *buf,
                            int64_t bytes, void *event, gy_status status, void **reply) {
    gy_comm_post *p = &c->posts[rank][peer];
    if (reply != NULL) *reply = NULL;
    pthread_mutex_lock(&c->lock);
    gy_status s = status;
    if (c->aborted) {
        if (s == GY_OK) s = gy_comm_aborted_status(c);
        pthread_mutex_unlock(&c->lock);
        return s;
    }
    p->buf = buf;
    p->bytes = bytes;
    p->event = event;
    p->sender = status;
    const uint64_t n = ++p->posted;
    pthread_cond_broadcast(&c->cond);
    while (p->taken < n && !c->aborted) pthread_cond_wait(&c->cond, &c->lock);
    if (s != GY_OK) {
        /* our own failure, already described */
    } else if (p->taken < n) {
        s = gy_comm_aborted_status(c);
    } else if (p->receiver != GY_OK && p->expected != bytes) {
        s = GY_FAIL(GY_ERR_INVALID,
                    "rank %d sends %lld bytes to rank %d, which expects %lld (nothing was moved)",
                    (int)rank, (long long)bytes, (int)peer, (long long)p->expected);
    } else if (p->receiver != GY_OK) {
        s = GY_FAIL(p->receiver, "rank %d's receive of this send from rank %d failed (see its "
                    "error)", (int)peer, (int)rank);
    } else if (reply != NULL) {
        *reply = p->reply;
    }
    pthread_mutex_unlock(&c->lock);
    return s;
}

void gy_comm_post_ack(gy_comm *c, int32_t rank, int32_t peer) {
    gy_comm_post *p = &c->posts[rank][peer];
    pthread_mutex_lock(&c->lock);
    if (p->acked < p->taken) p->acked++;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

gy_status gy_comm_post_take(gy_comm *c, int32_t rank, int32_t peer, int64_t bytes,
                            gy_status status, gy_comm_post *post) {
    gy_comm_post *p = &c->posts[peer][rank];
    pthread_mutex_lock(&c->lock);
    while (p->posted == p->taken && !c->aborted) pthread_cond_wait(&c->cond, &c->lock);
    gy_status s = status;
    if (p->posted == p->taken) {
        if (s == GY_OK) s = gy_comm_aborted_status(c);
        pthread_mutex_unlock(&c->lock);
        return s;
    }
    p->expected = bytes;
    *post = *p;
    pthread_mutex_unlock(&c->lock);
    if (s != GY_OK) return s;
    if (post->sender != GY_OK)
        return GY_FAIL(post->sender, "rank %d's send to rank %d failed (see its error)",
                       (int)peer, (int)rank);
    if (post->bytes != bytes)
        return GY_FAIL(GY_ERR_INVALID,
                       "rank %d expects %lld bytes from rank %d, which sends %lld (nothing was "
                       "moved)",
                       (int)rank, (long long)bytes, (int)peer, (long long)post->bytes);
    return GY_OK;
}

gy_status gy_comm_post_finish(gy_comm *c, int32_t rank, int32_t peer, gy_status verdict,
                              void *reply) {
    gy_comm_post *p = &c->posts[peer][rank];
    pthread_mutex_lock(&c->lock);
    gy_status s = verdict;
    if (p->posted == p->taken) { /* take found nothing: aborted */
        if (s == GY_OK) s = gy_comm_aborted_status(c);
        pthread_mutex_unlock(&c->lock);
        return s;
    }
    p->receiver = verdict;
    p->reply = reply;
    const uint64_t n = ++p->taken;
    pthread_cond_broadcast(&c->cond);
    while (p->acked < n && !c->aborted) pthread_cond_wait(&c->cond, &c->lock);
    if (s == GY_OK && p->acked < n) s = gy_comm_aborted_status(c);
    pthread_mutex_unlock(&c->lock);
    return s;
}

gy_status gy_comm_rank_all_reduce(void *ctx, float *buf, int64_t n) {
    gy_comm_rank *r = ctx;
    return gy_comm_all_reduce(r->comm, r->rank, buf, n);
}

/* Atomic: with no host barrier between two calls (nccl), one rank may count its all-gather
 * while another credits it for an all-to-all. */
static void gy_comm_count(uint64_t *counter, uint64_t bytes) {
    __atomic_fetch_add(counter, bytes, __ATOMIC_RELAXED);
}

void gy_comm_count_all_reduce(gy_comm *c, int32_t rank, int64_t n) {
    /* As a ring all-reduce would: reduce-scatter then all-gather, (size-1)/size of it each. */
    const uint64_t moved = (uint64_t)n * sizeof(float) * 2 * (uint64_t)(c->size - 1) / (uint64_t)c->size;
    gy_comm_count(&c->stats.bytes_sent[rank], moved);
    gy_comm_count(&c->stats.bytes_received[rank], moved);
}

void gy_comm_count_all_gather(gy_comm *c, int32_t rank, int64_t bytes) {
    gy_comm_count(&c->stats.bytes_sent[rank], (uint64_t)bytes * (uint64_t)(c->size - 1));
    gy_comm_count(&c->stats.bytes_received[rank], (uint64_t)bytes * (uint64_t)(c->size - 1));
}

void gy_comm_count_received(gy_comm *c, int32_t rank, int32_t src, int64_t bytes) {
    if (src == rank) return;
    gy_comm_count(&c->stats.bytes_received[rank], (uint64_t)bytes);
    gy_comm_count(&c->stats.bytes_sent[src], (uint64_t)bytes);
}

void gy_comm_count_call(gy_comm *c, int32_t rank) {
    if (rank == 0) gy_comm_count(&c->stats.calls, 1);
}

void gy_comm_count_message(gy_comm *c, int32_t rank, int32_t src, int64_t bytes) {
    gy_comm_count_received(c, rank, src, bytes);
    gy_comm_count(&c->stats.calls, 1);
}

void gy_comm_stats_get(const gy_comm *c, gy_comm_stats *out) { *out = c->stats; }

void gy_comm_stats_reset(gy_comm *c) { memset(&c->stats, 0, sizeof c->stats); }
