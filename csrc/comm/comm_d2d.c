/* comm_d2d.c: the d2d backend: virtual workers sharing one GPU, each rank a thread with its own
 * arena and stream. Every rank can address every other rank's device memory (one device, one
 * context), so the collectives are device-to-device copies and one add kernel, ordered across
 * the ranks' streams by the event protocol of comm_stream.c (two host barriers per call).
 *
 *   all-reduce   rank r sums slice r of the vector from every rank's buffer, in the pairwise
 *                tree order, into a device scratch shared by the ranks (the reduce-scatter
 *                half); after B2 each rank copies the whole scratch into its buffer (the
 *                all-gather half). The same slices and the same adds as comm_shm.c: same bits.
 *   all-gather   rank r copies every rank's input into its own output.
 *   all-to-all   rank r copies what each rank sends it into its own receive buffers.
 *   send/recv    the receiver copies from the sender's buffer on its own stream (events below).
 * A rank reads the others' buffers (its pulls) on its own stream, so the work of a collective is
 * spread over all the ranks' streams. */
#include <stdlib.h>
#include "../core/alloc.h"
#include <string.h>

#include "comm_backend.h"

#ifndef GY_WITH_CUDA

static gy_status gy_d2d_init_unavailable(gy_comm *c) {
    (void)c;
    return GY_FAIL(GY_ERR_UNAVAILABLE,
                   "the d2d communicator is not available: gyges was not built with CUDA (nvcc "
                   "was not found at build time, or GYGES_CUDA=0)");
}

static void gy_d2d_destroy_nothing(gy_comm *c) { (void)c; }

/* Only init and destroy are ever called: gy_comm_init_config stops when init fails. */
const gy_comm_ops gy_comm_d2d_ops = {
    .name = "d2d",
    .init = gy_d2d_init_unavailable,
    .destroy = gy_d2d_destroy_nothing,
};

#else /* GY_WITH_CUDA */

#include "../kernels/comm_d2d.h"

typedef struct gy_comm_d2d {
    gy_comm_streams streams;
    /* Published by each rank before B1, read by all between B1 and B2. */
    const void *ptrs[GY_COMM_MAX_RANKS];
    int64_t counts[GY_COMM_MAX_RANKS];
    const void *const *send[GY_COMM_MAX_RANKS];
    const int64_t *send_bytes[GY_COMM_MAX_RANKS];
    /* The all-reduce result on the device; grown by rank 0 between B1 and an extra barrier, so
     * it changes only while every rank is inside the same call. */
    float *scratch;
    int64_t scratch_capacity; /* floats */
    gy_status grow_status;
} gy_comm_d2d;

static void gy_d2d_destroy(gy_comm *c) {
    gy_comm_d2d *d = c->state;
    if (d == NULL) return;
    gy_comm_streams_free(&d->streams, c);
    if (d->scratch != NULL) {
        int32_t previous = -1;
        if (gy_comm_device_enter(c, 0, &previous) == GY_OK) gy_cuda_comm_free(d->scratch);
        else gy_error_clear();
        gy_comm_device_leave(previous);
    }
    free(d);
    c->state = NULL;
}

static gy_status gy_d2d_init(gy_comm *c) {
    gy_comm_d2d *d = gy_calloc(1, sizeof *d);
    if (d == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    c->state = d;
    return gy_comm_streams_init(&d->streams, c, "d2d");
}

static gy_status gy_d2d_set_stream(gy_comm *c, int32_t rank, void *stream) {
    gy_comm_d2d *d = c->state;
    return gy_comm_streams_switch(c, &d->streams, rank, stream);
}

static gy_status gy_d2d_barrier(gy_comm *c, int32_t rank) {
    gy_comm_d2d *d = c->state;
    return gy_comm_stream_barrier(c, &d->streams, rank);
}

/* Rank 0, between B1 and the growth barrier: makes the scratch hold n floats. Nothing of a
 * previous call may still use the old one, so every rank's stream is waited for first (each
 * holds at most this call's ready record beyond the previous calls' work). */
static gy_status gy_d2d_grow(gy_comm *c, gy_comm_d2d *d, int64_t n) {
    for (int32_t r = 0; r < c->size; r++) GY_TRY(gy_cuda_comm_stream_synchronize(c->streams[r]));
    gy_cuda_comm_free(d->scratch);
    d->scratch = NULL;
    d->scratch_capacity = 0;
    void *p = NULL;
    GY_TRY(gy_cuda_comm_malloc(&p, (uint64_t)n * sizeof(float)));
    d->scratch = p;
    d->scratch_capacity = n;
    return GY_OK;
}

static gy_status gy_d2d_all_reduce(gy_comm *c, int32_t rank, float *buf, int64_t n) {
    gy_comm_d2d *d = c->state;
    if (c->size == 1 || n == 0) return GY_OK;
    int32_t previous = -1;
    gy_status s = gy_comm_device_enter(c, rank, &previous);
    if (s == GY_OK && buf == NULL) s = GY_FAIL(GY_ERR_INVALID, "all-reduce: NULL buffer");
    /* Read before B1: rank 0 changes it only between B1 and the growth barrier. */
    const int64_t capacity = d->scratch_capacity;
    d->ptrs[rank] = buf;
    d->counts[rank] = n;
    gy_comm_event_record(c, d->streams.ready, rank, &s);
    gy_comm_barrier_into(c, &s);
    int same = 1;
    for (int32_t r = 0; r < c->size; r++) same &= d->counts[r] == n && d->ptrs[r] != NULL;
    if (!same && s == GY_OK)
        s = GY_FAIL(GY_ERR_INVALID,
                    "all-reduce: the ranks disagree on the size (rank %d has %lld floats) or a "
                    "buffer is NULL",
                    (int)rank, (long long)n);
    if (same && n > capacity) { /* every rank sees the same n and capacity: all take this turn */
        if (rank == 0) d->grow_status = gy_d2d_grow(c, d, n);
        gy_comm_barrier_into(c, &s);
        if (d->grow_status != GY_OK && s == GY_OK)
            s = GY_FAIL(d->grow_status,
                        "all-reduce: no device scratch for %lld floats (see rank 0's error)",
                        (long long)n);
    }
    const int64_t per = (n + c->size - 1) / c->size;
    const int64_t lo = rank * per < n ? rank * per : n, hi = lo + per < n ? lo + per : n;
    gy_comm_event_wait_all(c, d->streams.ready, rank, &s);
    if (s == GY_OK && hi > lo) {
        const float *in[GY_COMM_MAX_RANKS];
        for (int32_t r = 0; r < c->size; r++) in[r] = (const float *)d->ptrs[r] + lo;
        s = gy_cuda_comm_sum_tree(d->scratch + lo, in, c->size, hi - lo, c->streams[rank]);
    }
    gy_comm_event_record(c, d->streams.done, rank, &s);
    gy_comm_barrier_into(c, &s);
    gy_comm_event_wait_all(c, d->streams.done, rank, &s);
    if (s == GY_OK)
        s = gy_cuda_comm_copy(buf, d->scratch, (uint64_t)n * sizeof(float), c->streams[rank]);
    if (s == GY_OK) gy_comm_count_all_reduce(c, rank, n);
    if (s == GY_OK) gy_comm_count_call(c, rank);
    gy_comm_device_leave(previous);
    return s;
}

static gy_status gy_d2d_all_gather(gy_comm *c, int32_t rank, void *out, const void *in,
                                   int64_t bytes) {
    gy_comm_d2d *d = c->state;
    int32_t previous = -1;
    gy_status s = gy_comm_device_enter(c, rank, &previous);
    if (s == GY_OK && bytes > 0 && (out == NULL || in == NULL))
        s = GY_FAIL(GY_ERR_INVALID, "all-gather: NULL out or in");
    d->ptrs[rank] = in;
    d->counts[rank] = bytes;
    gy_comm_event_record(c, d->streams.ready, rank, &s);
    gy_comm_barrier_into(c, &s);
    for (int32_t r = 0; r < c->size && s == GY_OK; r++)
        if (d->counts[r] != bytes || (bytes > 0 && d->ptrs[r] == NULL))
            s = GY_FAIL(GY_ERR_INVALID,
                        "all-gather: rank %d gathers %lld bytes a rank, rank %d %lld (or its "
                        "input is NULL)",
                        (int)rank, (long long)bytes, (int)r, (long long)d->counts[r]);
    gy_comm_event_wait_all(c, d->streams.ready, rank, &s);
    for (int32_t r = 0; r < c->size && s == GY_OK; r++)
        s = gy_cuda_comm_copy((char *)out + (int64_t)r * bytes, d->ptrs[r], (uint64_t)bytes,
                              c->streams[rank]);
    gy_comm_event_record(c, d->streams.done, rank, &s);
    gy_comm_barrier_into(c, &s);
    gy_comm_event_wait_all(c, d->streams.done, rank, &s);
    if (s == GY_OK) gy_comm_count_all_gather(c, rank, bytes);
    gy_comm_count_call(c, rank);
    gy_comm_device_leave(previous);
    return s;
}

static gy_status gy_d2d_all_to_all(gy_comm *c, int32_t rank, void *const *recv,
                                   const int64_t *recv_bytes, const void *const *send,
                                   const int64_t *send_bytes) {
    gy_comm_d2d *d = c->state;
    int32_t previous = -1;
    gy_status s = gy_comm_device_enter(c, rank, &previous);
    d->send[rank] = send;
    d->send_bytes[rank] = send_bytes;
    gy_comm_event_record(c, d->streams.ready, rank, &s);
    gy_comm_barrier_into(c, &s);
    gy_comm_event_wait_all(c, d->streams.ready, rank, &s);
    /* As comm_shm.c: a mismatched pair is refused on the receiver; the others still move. A
     * CUDA failure stops this rank's copies. */
    gy_status refused = GY_OK;
    for (int32_t src = 0; src < c->size && s == GY_OK; src++) {
        const int64_t n = d->send_bytes[src][rank];
        if (n != recv_bytes[src] || n < 0) {
            refused = GY_FAIL(GY_ERR_INVALID,
                              "rank %d expects %lld bytes from rank %d, which sends %lld",
                              (int)rank, (long long)recv_bytes[src], (int)src, (long long)n);
            continue;
        }
        s = gy_cuda_comm_copy(recv[src], d->send[src][rank], (uint64_t)n, c->streams[rank]);
        if (s == GY_OK) gy_comm_count_received(c, rank, src, n);
    }
    gy_comm_count_call(c, rank);
    gy_comm_event_record(c, d->streams.done, rank, &s);
    gy_comm_barrier_into(c, &s);
    gy_comm_event_wait_all(c, d->streams.done, rank, &s);
    gy_comm_device_leave(previous);
    return s != GY_OK ? s : refused;
}

/* The sender records `ready` on its stream and posts its pointer; the receiver's stream waits
 * for it, copies, and records `done`, which the sender's stream then waits for before anything
 * enqueued after the send may overwrite the buffer. The events are the rank's own: the sender
 * cannot record `ready` again before the receiver has waited on it (post_send returns after the
 * take), nor the receiver `done` before the sender has (post_finish returns after the ack). */
static gy_status gy_d2d_send(gy_comm *c, int32_t rank, int32_t peer, const void *buf,
                             int64_t bytes, gy_status status) {
    gy_comm_d2d *d = c->state;
    int32_t previous = -1;
    gy_status s = status;
    if (s == GY_OK) s = gy_comm_device_enter(c, rank, &previous);
    gy_comm_event_record(c, d->streams.ready, rank, &s);
    void *reply = NULL;
    s = gy_comm_post_send(c, rank, peer, buf, bytes, d->streams.ready[rank], s, &reply);
    if (s == GY_OK) s = gy_cuda_comm_stream_wait(c->streams[rank], reply);
    gy_comm_post_ack(c, rank, peer);
    gy_comm_device_leave(previous);
    return s;
}

static gy_status gy_d2d_recv(gy_comm *c, int32_t rank, int32_t peer, void *buf, int64_t bytes,
                             gy_status status) {
    gy_comm_d2d *d = c->state;
    int32_t previous = -1;
    gy_status s = status;
    if (s == GY_OK) s = gy_comm_device_enter(c, rank, &previous);
    gy_comm_post post;
    s = gy_comm_post_take(c, rank, peer, bytes, s, &post);
    if (s == GY_OK) s = gy_cuda_comm_stream_wait(c->streams[rank], post.event);
    if (s == GY_OK && bytes > 0)
        s = gy_cuda_comm_copy(buf, post.buf, (uint64_t)bytes, c->streams[rank]);
    gy_comm_event_record(c, d->streams.done, rank, &s);
    s = gy_comm_post_finish(c, rank, peer, s, d->streams.done[rank]);
    if (s == GY_OK) gy_comm_count_message(c, rank, peer, bytes);
    gy_comm_device_leave(previous);
    return s;
}

const gy_comm_ops gy_comm_d2d_ops = {
    .name = "d2d",
    .init = gy_d2d_init,
    .destroy = gy_d2d_destroy,
    .barrier = gy_d2d_barrier,
    .all_reduce = gy_d2d_all_reduce,
    .all_gather = gy_d2d_all_gather,
    .all_to_all = gy_d2d_all_to_all,
    .send = gy_d2d_send,
    .recv = gy_d2d_recv,
    .set_stream = gy_d2d_set_stream,
    .stream_priority = gy_comm_streams_priority,
    .synchronize = gy_comm_streams_synchronize,
};

#endif /* GY_WITH_CUDA */
