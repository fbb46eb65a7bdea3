/* comm_stream.c: what the device backends (d2d, nccl) share: one stream per rank at the
 * channel's priority, a pair of events per rank, and the protocol that orders the ranks'
 * streams with them.
 *
 * The protocol, for a collective (every rank, each on its own thread):
 *   1. publish its arguments on the host; record ready[rank] on its stream
 *   2. host barrier B1
 *   3. its stream waits for ready[r] of every rank r (every rank's inputs are in place); enqueue
 *      its part of the work, which reads the others' buffers; record done[rank]
 *   4. host barrier B2
 *   5. its stream waits for done[r] of every rank (nobody reads its buffers any more); enqueue
 *      what comes after (the d2d all-reduce copies its result out here)
 * Published arguments are read only between B1 and B2, while every owner is inside the call.
 * An event is re-recorded only when every wait on its previous record has been enqueued
 * (cudaStreamWaitEvent waits for the record that precedes it on the host): rank s records
 * ready[s] again before B1 of the next call, which it reaches only after B2 of this one, i.e.
 * after every rank's step-3 waits; it records done[s] again after B1 of the next call, which
 * every rank reaches only after its step-5 waits. A wait that caught a later record would not
 * be too weak but too strong: it would hold a rank's stream behind work a peer enqueued after
 * the collective, and when that work is an NCCL kernel waiting for this very rank, neither
 * stream moves again. Hence two host barriers per call (the barrier too), whatever fails.
 *
 * tests/gpu_emu/ runs this protocol on a pretend GPU whose streams are threads that overtake
 * each other; dropping any one wait or barrier above makes its tests fail or hang. */
#include "comm_backend.h"

#ifdef GY_WITH_CUDA

#include <stdio.h>
#include <string.h>

#include "../kernels/comm_d2d.h"

gy_status gy_comm_device_enter(gy_comm *c, int32_t rank, int32_t *previous) {
    return gy_cuda_comm_device_swap(c->devices[rank], previous);
}

void gy_comm_device_leave(int32_t previous) {
    int32_t ignored;
    if (previous >= 0 && gy_cuda_comm_device_swap(previous, &ignored) != GY_OK) gy_error_clear();
}

gy_status gy_comm_streams_init(gy_comm_streams *s, gy_comm *c, const char *backend_name) {
    int32_t count = 0;
    gy_status st = gy_cuda_comm_device_count(&count);
    if (st != GY_OK) {
        /* The runtime's words without their [file:line]: ours follows. */
        char reason[768];
        snprintf(reason, sizeof reason, "%s", gy_error_message());
        char *tag = strrchr(reason, '[');
        if (tag != NULL && tag > reason && tag[-1] == ' ') tag[-1] = '\0';
        return GY_FAIL(st, "the %s communicator is not available: %s", backend_name, reason);
    }
    for (int32_t r = 0; r < c->size; r++)
        if (c->devices[r] >= count)
            return GY_FAIL(GY_ERR_UNAVAILABLE,
                           "the %s communicator is not available: rank %d wants CUDA device %d, "
                           "this machine has %d",
                           backend_name, (int)r, (int)c->devices[r], (int)count);
    for (int32_t r = 0; r < c->size; r++) {
        int32_t previous = -1;
        GY_TRY(gy_comm_device_enter(c, r, &previous));
        gy_cuda_stream stream = NULL;
        gy_cuda_event ready = NULL, done = NULL, handoff = NULL;
        st = gy_cuda_comm_stream_create(&stream, c->channel == GY_COMM_CHANNEL_MIGRATION);
        s->own[r] = stream;
        if (st == GY_OK) st = gy_cuda_comm_event_create(&ready);
        s->ready[r] = ready;
        if (st == GY_OK) st = gy_cuda_comm_event_create(&done);
        s->done[r] = done;
        if (st == GY_OK) st = gy_cuda_comm_event_create(&handoff);
        s->handoff[r] = handoff;
        gy_comm_device_leave(previous);
        if (st != GY_OK) return st;
        c->streams[r] = c->own_streams[r] = stream;
    }
    return GY_OK;
}

void gy_comm_streams_free(gy_comm_streams *s, gy_comm *c) {
    for (int32_t r = 0; r < c->size; r++) {
        if (!s->own[r] && !s->ready[r] && !s->done[r] && !s->handoff[r]) continue;
        int32_t previous = -1;
        if (gy_comm_device_enter(c, r, &previous) != GY_OK) {
            gy_error_clear();
            continue;
        }
        gy_cuda_comm_stream_destroy(s->own[r]);
        gy_cuda_comm_event_destroy(s->ready[r]);
        gy_cuda_comm_event_destroy(s->done[r]);
        gy_cuda_comm_event_destroy(s->handoff[r]);
        s->own[r] = s->ready[r] = s->done[r] = s->handoff[r] = NULL;
        gy_comm_device_leave(previous);
    }
}

void gy_comm_event_record(gy_comm *c, void *const *events, int32_t rank, gy_status *s) {
    if (*s == GY_OK) *s = gy_cuda_comm_event_record(events[rank], c->streams[rank]);
}

void gy_comm_event_wait_all(gy_comm *c, void *const *events, int32_t rank, gy_status *s) {
    for (int32_t r = 0; r < c->size && *s == GY_OK; r++)
        if (r != rank) *s = gy_cuda_comm_stream_wait(c->streams[rank], events[r]);
}

gy_status gy_comm_stream_barrier(gy_comm *c, gy_comm_streams *s, int32_t rank) {
    if (c->size == 1) return GY_OK;
    int32_t previous = -1;
    gy_status st = gy_comm_device_enter(c, rank, &previous);
    gy_comm_event_record(c, s->ready, rank, &st);
    gy_comm_barrier_into(c, &st);
    gy_comm_event_wait_all(c, s->ready, rank, &st);
    gy_comm_barrier_into(c, &st);
    gy_comm_device_leave(previous);
    return st;
}

gy_status gy_comm_streams_switch(gy_comm *c, gy_comm_streams *s, int32_t rank, void *stream) {
    if (stream == c->streams[rank]) return GY_OK;
    int32_t previous = -1;
    GY_TRY(gy_comm_device_enter(c, rank, &previous));
    /* The collectives' events assume one stream per rank carries all its work; the new stream
     * starts where the old one stands, so nothing enqueued before the switch is overtaken. */
    gy_status st = gy_cuda_comm_event_record(s->handoff[rank], c->streams[rank]);
    if (st == GY_OK) st = gy_cuda_comm_stream_wait(stream, s->handoff[rank]);
    if (st == GY_OK) c->streams[rank] = stream;
    gy_comm_device_leave(previous);
    return st;
}

gy_status gy_comm_streams_priority(gy_comm *c, int32_t rank, int32_t *priority) {
    int32_t previous = -1;
    GY_TRY(gy_comm_device_enter(c, rank, &previous));
    gy_status st = gy_cuda_comm_stream_priority(c->streams[rank], priority);
    gy_comm_device_leave(previous);
    return st;
}

gy_status gy_comm_streams_synchronize(gy_comm *c, int32_t rank) {
    int32_t previous = -1;
    GY_TRY(gy_comm_device_enter(c, rank, &previous));
    gy_status st = gy_cuda_comm_stream_synchronize(c->streams[rank]);
    gy_comm_device_leave(previous);
    return st;
}

#endif /* GY_WITH_CUDA */
