/* comm_backend.h (private): the table of functions a communicator backend provides to comm.c,
 * and the part of a communicator every backend shares.
 *
 * comm.c has checked the rank (and, for the collectives, that sizes are not negative) before it
 * calls a backend. Every collective of a backend goes through the same number of host barriers
 * on every rank whatever fails, so a rank that hits an error never leaves the others waiting. */
#ifndef GY_COMM_COMM_BACKEND_H
#define GY_COMM_COMM_BACKEND_H

#include <pthread.h>

#include "comm.h"

typedef struct gy_comm_ops {
    const char *name;
    /* Makes comm->state (comm's size, devices and channel are set); streams too, for device
     * backends. On failure everything made so far is undone by destroy, which must accept a
     * half-made state. */
    gy_status (*init)(gy_comm *comm);
    void (*destroy)(gy_comm *comm);
    gy_status (*barrier)(gy_comm *comm, int32_t rank);
    gy_status (*all_reduce)(gy_comm *comm, int32_t rank, float *buf, int64_t n);
    gy_status (*all_gather)(gy_comm *comm, int32_t rank, void *out, const void *in, int64_t bytes);
    gy_status (*all_to_all)(gy_comm *comm, int32_t rank, void *const *recv,
                            const int64_t *recv_bytes, const void *const *send,
                            const int64_t *send_bytes);
    /* Point to point (comm.c has checked the ranks; `status` is its verdict on the size and
     * buffer, which the backend carries to the peer); both meet through gy_comm_post_*. */
    gy_status (*send)(gy_comm *comm, int32_t rank, int32_t peer, const void *buf, int64_t bytes,
                      gy_status status);
    gy_status (*recv)(gy_comm *comm, int32_t rank, int32_t peer, void *buf, int64_t bytes,
                      gy_status status);
    /* Optional, NULL for shm: the device calls behind gy_comm_set_stream,
     * gy_comm_stream_priority and gy_comm_synchronize. Without them a stream is stored only,
     * priority is 0, synchronize returns at once. set_stream orders the new stream after the
     * work already on the old one, then stores it. */
    gy_status (*set_stream)(gy_comm *comm, int32_t rank, void *stream);
    gy_status (*stream_priority)(gy_comm *comm, int32_t rank, int32_t *priority);
    gy_status (*synchronize)(gy_comm *comm, int32_t rank);
    /* Optional, NULL for shm and d2d (whose ranks meet on the host only): abort wakes ranks
     * stuck in the backend's own waits (nccl: ncclCommAbort on every rank's communicator); it
     * is called once, by gy_comm_abort, after the host side is aborted, possibly while other
     * ranks are inside a collective. reset makes the backend usable again and forgets what an
     * aborted call left apart between ranks (nccl: the all-to-all parities, new communicators),
     * called by gy_comm_reset, outside its lock, when no rank is inside a collective. */
    void (*abort)(gy_comm *comm);
    void (*reset)(gy_comm *comm);
} gy_comm_ops;

/* The mailbox of one ordered pair of ranks (sender, receiver) for gy_comm_send/recv. A message
 * is posted by the sender, taken by the receiver, and acknowledged by the sender once it has
 * done its part after the receiver's (a device backend: its stream waits for the receiver's
 * read). The receiver returns only after the acknowledgement, so neither rank can start its
 * next call while the other still uses the events of this one. Counters only grow; the fields
 * describe the message under way. */
typedef struct gy_comm_post {
    uint64_t posted, taken, acked;
    const void *buf;     /* the sender's */
    int64_t bytes;       /* what the sender sends */
    int64_t expected;    /* what the receiver expects */
    void *event;         /* device backends: recorded by the sender before posting */
    void *reply;         /* device backends: recorded by the receiver after its read */
    gy_status sender;    /* the sender's status when it posted */
    gy_status receiver;  /* the receiver's verdict on the message */
} gy_comm_post;

struct gy_comm {
    const gy_comm_ops *ops;
    gy_comm_backend_kind backend;
    gy_comm_channel channel;
    int32_t size;
    int32_t devices[GY_COMM_MAX_RANKS]; /* CUDA device of each rank; -1 for shm */
    void *streams[GY_COMM_MAX_RANKS];   /* the stream each rank's collectives go on */
    void *own_streams[GY_COMM_MAX_RANKS]; /* the ones the backend made (NULL for shm) */
    /* The host barrier every backend uses: a generation counter under a mutex. It sleeps on a
     * condition variable: on a machine with fewer cores than ranks, spinning ranks would steal
     * the core from the rank everyone waits for. */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int32_t waiting;
    uint64_t generation;
    int aborted;            /* gy_comm_abort: every barrier fails until gy_comm_reset */
    char abort_reason[256];
    gy_comm_stats stats;
    gy_comm_post posts[GY_COMM_MAX_RANKS][GY_COMM_MAX_RANKS]; /* [sender][receiver] */
    void *state; /* the backend's */
};

extern const gy_comm_ops gy_comm_shm_ops;
/* When built without CUDA, tables whose init answers GY_ERR_UNAVAILABLE. */
extern const gy_comm_ops gy_comm_d2d_ops;
extern const gy_comm_ops gy_comm_nccl_ops;

/* Returns once all `size` ranks have called it (immediately for size 1), or at once with
 * GY_ERR_STATE naming the reason when the communicator is or gets aborted: a backend returns
 * that failure and touches no peer's buffer after it. */
gy_status gy_comm_host_barrier(gy_comm *comm);
/* The same for backends that carry on with a status: a failed barrier becomes *s (when *s is
 * GY_OK), and the caller does no more work with its peers' buffers once *s failed. */
static inline void gy_comm_barrier_into(gy_comm *comm, gy_status *s) {
    const gy_status b = gy_comm_host_barrier(comm);
    if (*s == GY_OK) *s = b;
}

/* The host side of a send and a receive, under the communicator's lock; each wait fails with
 * GY_ERR_STATE when the communicator is or gets aborted.
 *   sender:   gy_comm_post_send (publishes buf, bytes, event and its own status, waits until
 *             taken; returns the receiver's verdict and its reply event, when not NULL), its
 *             part, then gy_comm_post_ack;
 *   receiver: gy_comm_post_take (waits for the post, checks it against what it expects, fills
 *             *post), its part when that returned GY_OK, then gy_comm_post_finish with its
 *             verdict and reply event (waits for the acknowledgement).
 * The sender acknowledges even after a failure; a status already failed goes through unchanged,
 * so the two always meet as many times whatever fails. */
gy_status gy_comm_post_send(gy_comm *comm, int32_t rank, int32_t peer, const void *buf,
                            int64_t bytes, void *event, gy_status status, void **reply);
void gy_comm_post_ack(gy_comm *comm, int32_t rank, int32_t peer);
gy_status gy_comm_post_take(gy_comm *comm, int32_t rank, int32_t peer, int64_t bytes,
                            gy_status status, gy_comm_post *post);
gy_status gy_comm_post_finish(gy_comm *comm, int32_t rank, int32_t peer, gy_status verdict,
                              void *reply);

/* Stats of one rank's part of a collective, with the formulas of comm.h; rank 0 counts the
 * call. All-to-all counts are the receiver's: it adds what it received and credits each
 * sender (atomically: senders are counted by other ranks' threads). */
void gy_comm_count_all_reduce(gy_comm *comm, int32_t rank, int64_t n);
void gy_comm_count_all_gather(gy_comm *comm, int32_t rank, int64_t bytes);
void gy_comm_count_received(gy_comm *comm, int32_t rank, int32_t src, int64_t bytes);
void gy_comm_count_call(gy_comm *comm, int32_t rank);
/* A received message: its bytes, and one call. */
void gy_comm_count_message(gy_comm *comm, int32_t rank, int32_t src, int64_t bytes);

#ifdef GY_WITH_CUDA
/* comm_stream.c: what the device backends share. */

/* One stream per rank on the rank's device, non-blocking with the legacy default stream, at
 * the priority of comm->channel; an event pair per rank for the barrier protocol below. */
typedef struct gy_comm_streams {
    void *own[GY_COMM_MAX_RANKS];   /* streams made here (comm->streams starts as these) */
    void *ready[GY_COMM_MAX_RANKS]; /* events, recorded before a collective's first barrier */
    void *done[GY_COMM_MAX_RANKS];  /* events, recorded before its second barrier */
    void *handoff[GY_COMM_MAX_RANKS]; /* events, old stream -> new one in gy_comm_set_stream */
} gy_comm_streams;

gy_status gy_comm_streams_init(gy_comm_streams *s, gy_comm *comm, const char *backend_name);
/* Waits for the streams it made and destroys them and the events; accepts a half-made set. */
void gy_comm_streams_free(gy_comm_streams *s, gy_comm *comm);
/* Makes `rank`'s device current on the calling thread; *previous receives the device to
 * restore with gy_comm_device_leave. */
gy_status gy_comm_device_enter(gy_comm *comm, int32_t rank, int32_t *previous);
void gy_comm_device_leave(int32_t previous);
/* Records events[rank] on rank's stream (when *s is GY_OK; else records nothing). */
void gy_comm_event_record(gy_comm *comm, void *const *events, int32_t rank, gy_status *s);
/* rank's stream waits for every rank's events[r] (when *s is GY_OK). */
void gy_comm_event_wait_all(gy_comm *comm, void *const *events, int32_t rank, gy_status *s);
/* The barrier of comm.h for device backends: ready events, host barrier, waits, host barrier. */
gy_status gy_comm_stream_barrier(gy_comm *comm, gy_comm_streams *s, int32_t rank);
gy_status gy_comm_streams_switch(gy_comm *comm, gy_comm_streams *s, int32_t rank, void *stream);
gy_status gy_comm_streams_priority(gy_comm *comm, int32_t rank, int32_t *priority);
gy_status gy_comm_streams_synchronize(gy_comm *comm, int32_t rank);
#endif

#endif
