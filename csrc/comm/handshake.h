/* handshake.h: PipeLive's two-phase handshake (section 6.1), which lets KV migration share a GPU
 * with pipeline inference without deadlock.
 *
 * NCCL runs the operations of one GPU one at a time, across all its communicators. PipeLive has
 * two communicator groups on every GPU: the activation group (hidden states between pipeline
 * stages, which must never wait) and the KV-migration group. Model "one at a time" as a device
 * lock per worker (gy_dev_lock) that every operation on that GPU holds while it is in flight; a
 * point-to-point transfer holds the sender's lock on the sender's side and the receiver's lock on
 * the receiver's side, and completes only once both sides have entered. Taken naively, two locks
 * per transfer can form a cycle: A's inference thread holds A and sends to B, whose receive
 * waits for B's lock; B's migration thread holds B and sends to A, whose receive waits for A's.
 *
 * Asymmetric entry breaks every such cycle:
 *   1. An activation send or receive takes its worker's lock directly (waiting if needed): the
 *      inference path pays nothing but the lock.
 *   2. A migration sender takes its own lock and sends ACK to the receiver over a side channel
 *      (TCP in the paper; a per-pair mailbox here).
 *   3. The receiver, on the ACK, tries its own lock without waiting: held, it answers REJECT;
 *      free, it takes it and answers ACCEPT.
 *   4. On REJECT the sender releases its lock and retries after a back-off of tau (jittered, so
 *      two senders rejected by each other do not retry in step forever); on ACCEPT both hold
 *      their locks and the transfer runs, then both release.
 * A migration sender holds its lock without an ACCEPT for at most tau: an ACK not answered by then
 * is withdrawn (the receiver has not called yet) and counts as a REJECT. So a migration never
 * waits on a lock while holding one, and an activation waits only for transfers that need nothing
 * more to finish. Activations among themselves are the caller's to order, as with NCCL (two
 * stages that both send to each other before receiving wait on each other with or without this).
 *
 * Naive mode (config.two_phase = 0) enters a migration like an activation; it exists to show the
 * deadlock. Every wait (a lock, a peer, an answer) gives up at the call's deadline, timeout_ms
 * after it began (for an accepted migration's transfer, after the ACCEPT), with GY_ERR_BUSY
 * naming what it waited for: a deadlock is reported, not hung on. The call that gives up leaves
 * nothing behind (its lock released, its buffer or ACK withdrawn), which breaks the cycle: the
 * others give up too or go on.
 *
 * In-process model: workers are threads of one process, a transfer is a memcpy done by the
 * receiver while both locks are held. Per ordered pair of workers and per group, one send and one
 * receive may be in flight at a time (a NCCL communicator is not called from two threads at
 * once either); a second is refused with GY_ERR_STATE. Sends and receives of a pair and group
 * match in order; a receiver expecting another size refuses both sides with GY_ERR_INVALID. */
#ifndef GY_COMM_HANDSHAKE_H
#define GY_COMM_HANDSHAKE_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_HS_MAX_WORKERS 16
#define GY_HS_MAX_TIMEOUT_MS 86400000LL /* a day: deadlines in nanoseconds stay far from overflow */

/* ---- The device lock: one per GPU, held by every communicator operation on it. ---- */

typedef struct gy_dev_lock gy_dev_lock;

gy_status gy_dev_lock_init(gy_dev_lock **out);
/* Only once nobody holds or waits for it. */
void gy_dev_lock_free(gy_dev_lock *lock);
/* Waits until the lock is free and takes it, for `who` (a string that outlives the hold, shown
 * to those who wait); GY_ERR_BUSY naming the holder after timeout_ms (in [0,
 * GY_HS_MAX_TIMEOUT_MS]). */
gy_status gy_dev_lock_acquire(gy_dev_lock *lock, const char *who, int64_t timeout_ms);
/* Takes the lock if it is free, without waiting; GY_ERR_BUSY naming the holder otherwise. */
gy_status gy_dev_lock_try(gy_dev_lock *lock, const char *who);
/* Any thread may release (the holder is an operation, not a thread); releasing a free lock is a
 * no-op. */
void gy_dev_lock_release(gy_dev_lock *lock);
/* `who` of the holder, NULL when free (a snapshot). */
const char *gy_dev_lock_holder(gy_dev_lock *lock);

/* ---- Workers with two communicator groups and a side channel per pair. ---- */

typedef struct gy_hs gy_hs;

typedef enum gy_hs_op {
    GY_HS_ACTIVATION_SEND = 0,
    GY_HS_ACTIVATION_RECV = 1,
    GY_HS_MIGRATION_SEND = 2,
    GY_HS_MIGRATION_RECV = 3,
    GY_HS_OP_COUNT
} gy_hs_op;

typedef struct gy_hs_config {
    int32_t n_workers;  /* in [2, GY_HS_MAX_WORKERS] */
    int32_t two_phase;  /* 1: migrations enter with the handshake; 0: naive (can deadlock) */
    int64_t timeout_ms; /* in [1, GY_HS_MAX_TIMEOUT_MS]: a call gives up this long after it
                         * began (a deadlock, detected) */
    int64_t tau_ms;     /* in [1, timeout_ms]: a sender's wait for an answer, and its back-off
                         * after a REJECT (drawn from [tau, 2 tau)) */
    /* Optional, NULL for none: called by an operation once it holds its worker's device lock
     * (a two-phase sender: at each attempt, before its ACK), before it waits for its peer, from
     * the operation's thread and outside the group's own mutex. Tests use it to force an
     * interleaving. */
    void (*on_hold)(void *ctx, int32_t worker, gy_hs_op op);
    void *on_hold_ctx;
} gy_hs_config;

typedef struct gy_hs_stats {
    uint64_t activations;  /* activation transfers completed */
    uint64_t migrations;   /* migration transfers completed */
    uint64_t bytes;        /* payload bytes of those */
    uint64_t acks;         /* ACKs sent (phase-one entries) */
    uint64_t rejects;      /* REJECT answers */
    uint64_t unanswered;   /* ACKs withdrawn after tau without an answer */
    uint64_t retries;      /* phase-one entries after a sender's first */
    uint64_t timeouts;     /* calls that gave up at their deadline */
} gy_hs_stats;

/* GY_ERR_INVALID naming the field for a bad config; GY_ERR_SYSTEM when memory or a pthread
 * object cannot be had (nothing is left allocated). */
gy_status gy_hs_init(gy_hs **out, const gy_hs_config *config);
/* Once every call has returned. */
void gy_hs_free(gy_hs *hs);
int32_t gy_hs_size(const gy_hs *hs);
/* The worker's device lock, for the other operations on that GPU (a compute all-reduce) to take
 * as well; NULL for a worker outside the group. */
gy_dev_lock *gy_hs_dev_lock(gy_hs *hs, int32_t worker);

/* `worker` sends `bytes` bytes of `buf` to `peer`, which receives them into its own buffer with
 * the matching call (activation with activation, migration with migration). On return the bytes
 * have arrived (GY_OK) or nothing moved. GY_ERR_INVALID for a worker or peer outside the group or
 * equal, bytes < 0, a NULL buffer with bytes > 0, or the two sides' sizes differing; GY_ERR_STATE
 * for a second call of the same side, pair and group while one is in flight; GY_ERR_BUSY at the
 * deadline. */
gy_status gy_hs_activation_send(gy_hs *hs, int32_t worker, int32_t peer, const void *buf,
                                int64_t bytes);
gy_status gy_hs_activation_recv(gy_hs *hs, int32_t worker, int32_t peer, void *buf, int64_t bytes);
gy_status gy_hs_migration_send(gy_hs *hs, int32_t worker, int32_t peer, const void *buf,
                               int64_t bytes);
gy_status gy_hs_migration_recv(gy_hs *hs, int32_t worker, int32_t peer, void *buf, int64_t bytes);

void gy_hs_stats_get(gy_hs *hs, gy_hs_stats *out);
void gy_hs_stats_reset(gy_hs *hs);

#ifdef __cplusplus
}
#endif
#endif
