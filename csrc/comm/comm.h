/* comm.h: collectives among the ranks of one process (worker threads), over three backends.
 *
 * A communicator joins `size` ranks. Every collective is called by all ranks, each from its own
 * thread, in the same order and with the same sizes (each with its own buffers), like NCCL's.
 *
 *   shm   host memory; the CPU engine's worker threads. A collective has finished, and its result
 *         is in the caller's buffers, when the call returns. Streams are accepted and unused.
 *   d2d   several virtual workers sharing one GPU: buffers are device pointers on that GPU (any
 *         rank's arena), each rank has its own stream. Ranks meet on the host (a barrier) to
 *         exchange pointers, order their streams with CUDA events, and move data with
 *         device-to-device copies; the all-reduce adds with a kernel.
 *   nccl  one GPU per rank in this process: NCCL (libnccl.so.2 opened at run time, never
 *         linked), one NCCL communicator per rank made with ncclCommInitAll.
 *
 * Device backends (d2d, nccl) are asynchronous like NCCL: a call enqueues the collective on the
 * rank's stream and returns; its result is visible, and the rank's buffers may be reused, once
 * that stream has reached the point where the call left it (later work on the same stream sees
 * it; the host sees it after gy_comm_synchronize). A rank's inputs are not read after its stream
 * has passed the collective, so work enqueued after the call may overwrite them. The calling
 * thread's current CUDA device is left as it was. A device call that fails on one rank only is
 * reported by that rank; the others' results of that collective are then undefined (a CUDA error
 * breaks the context they share, so in practice they fail too).
 *
 * Sum order. shm and d2d add in one fixed order, the tree of core/tree.h ((r0 + r1) + (r2 + r3),
 * (r0 + r1) + r2), so partial sums split across TP ranks add up to the same bits as TP1's, and the
 * two backends give the same bits for the same inputs. nccl adds in NCCL's own order (ring or
 * tree, chosen by NCCL): close to the others, not bit-identical.
 *
 * Channels. A group of workers gets two communicators (gyges/comm.py's CommPool): a compute one
 * for the forward pass's all-reduces, and a migration one for KV and weight movement during a
 * TP transformation. Each device communicator creates one stream per rank at start-up, at the
 * device's greatest priority for the compute channel and its least for the migration channel
 * (cudaDeviceGetStreamPriorityRange), and, for nccl, its own NCCL communicators: migration
 * traffic is ordered on its own stream and communicator, so it never sits in front of an
 * all-reduce, and when both streams have kernels ready the GPU schedules the compute stream's
 * blocks first (priority orders kernel blocks; copies on copy engines are not reordered). An
 * engine uses gy_comm_stream(compute comm, rank) as its compute stream, or passes its own with
 * gy_comm_set_stream (create it at the greatest priority to keep that advantage).
 *
 * Two channels: the order that cannot deadlock. NCCL runs one GPU's operations in order and a
 * transfer holds both of its GPUs, so two communicators over the same GPUs deadlock when two
 * ranks post their collectives in opposite orders (PipeLive 6.1): rank 0 waits in a migration
 * all-to-all for rank 1, which waits in a compute all-reduce for rank 0. gyges keeps one order
 * on every GPU instead of a handshake: compute collectives are posted only by an engine's rank
 * threads inside a step, and the step has finished them when it returns (sampling reads the
 * logits they produced); migration collectives are posted only by KV moves between GPUs
 * (kv_move_comm.h), which a host runs between two steps, under its lock, from its own thread
 * (a rank thread each for the length of the move), and a move waits for its streams before it
 * returns. So on every GPU a step's collectives all come before a move's, and a move's all
 * before the next step's: no rank can hold one channel while waiting on the other.
 * tests/test_cuda_nccl.py shows the opposite orders hang and this order complete, and that a
 * host's moves run only between steps. (PipeLive's live migrations beside running steps would
 * need comm/handshake.h's protocol; none runs on NCCL yet.)
 *
 * Stats (every backend): calls (counted once per collective, by rank 0) and the bytes each rank
 * sent to and received from other ranks. An all-reduce of n floats counts what a ring would move,
 * 2 * (size - 1) / size * 4n bytes each way per rank; an all-gather of b bytes, (size - 1) * b;
 * an all-to-all, the bytes between distinct ranks; a send, its bytes (counted once a call, by
 * the receiver). Barriers are not counted. */
#ifndef GY_COMM_COMM_H
#define GY_COMM_COMM_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_COMM_MAX_RANKS 16

typedef struct gy_comm gy_comm;

typedef enum gy_comm_backend_kind {
    GY_COMM_BACKEND_SHM = 0,
    GY_COMM_BACKEND_D2D = 1,
    GY_COMM_BACKEND_NCCL = 2,
    GY_COMM_BACKEND_COUNT
} gy_comm_backend_kind;

typedef enum gy_comm_channel {
    GY_COMM_CHANNEL_COMPUTE = 0,   /* streams at the device's greatest priority */
    GY_COMM_CHANNEL_MIGRATION = 1, /* streams at the device's least priority */
    GY_COMM_CHANNEL_COUNT
} gy_comm_channel;

typedef struct gy_comm_config {
    gy_comm_backend_kind backend;
    int32_t size;            /* in [1, GY_COMM_MAX_RANKS] */
    /* [size] the CUDA device of each rank: d2d, one device for all; nccl, distinct devices.
     * NULL: device 0 for every rank (d2d), device r for rank r (nccl). Unused by shm. */
    const int32_t *devices;
    gy_comm_channel channel;
} gy_comm_config;

typedef struct gy_comm_stats {
    uint64_t calls;
    uint64_t bytes_sent[GY_COMM_MAX_RANKS];     /* bytes each rank sent to other ranks */
    uint64_t bytes_received[GY_COMM_MAX_RANKS]; /* bytes each rank received from other ranks */
} gy_comm_stats;

/* A shm communicator of `size` ranks (size in [1, GY_COMM_MAX_RANKS]). */
gy_status gy_comm_init(gy_comm **out, int32_t size);
/* Any backend. GY_ERR_INVALID for a bad size, backend, channel or device list (checked first),
 * GY_ERR_UNAVAILABLE naming the reason when the backend cannot run here (built without CUDA, no
 * driver or device, fewer devices than asked for, no libnccl.so.2). */
gy_status gy_comm_init_config(gy_comm **out, const gy_comm_config *config);
void gy_comm_free(gy_comm *comm);

int32_t gy_comm_size(const gy_comm *comm);
gy_comm_backend_kind gy_comm_backend(const gy_comm *comm);
gy_comm_channel gy_comm_channel_of(const gy_comm *comm);
/* "shm", "d2d", "nccl"; "?" for a value outside the enum. */
const char *gy_comm_backend_name(gy_comm_backend_kind kind);
/* The CUDA device of `rank`; -1 for shm or a rank outside the communicator. */
int32_t gy_comm_device(const gy_comm *comm, int32_t rank);

/* The stream (a cudaStream_t) `rank`'s collectives are enqueued on: the one the communicator
 * made for the rank until gy_comm_set_stream gives another (NULL = the legacy default stream,
 * allowed). The communicator never destroys a stream it did not make; the caller keeps a stream
 * it sets alive, and on the rank's device, until the communicator is freed or another is set.
 * Call it between collectives of that rank: from its own thread, or from any thread while none
 * is under way (an engine does it as it starts). shm stores the value and ignores it. */
gy_status gy_comm_set_stream(gy_comm *comm, int32_t rank, void *stream);
void *gy_comm_stream(const gy_comm *comm, int32_t rank);
/* The stream the communicator made for `rank` (NULL for shm): what a borrower of the rank's
 * stream sets back before its own stream goes away (an engine does it when it is freed). */
void *gy_comm_own_stream(const gy_comm *comm, int32_t rank);
/* The priority of `rank`'s current stream (lower numbers run first; 0 for shm). */
gy_status gy_comm_stream_priority(const gy_comm *comm, int32_t rank, int32_t *priority);
/* Waits on the host until `rank`'s stream has finished what was enqueued on it, and reports an
 * error a kernel or copy hit; immediate for shm. */
gy_status gy_comm_synchronize(gy_comm *comm, int32_t rank);

/* No rank gets past it (shm: returns; device backends: its stream) before every rank has
 * reached it. */
gy_status gy_comm_barrier(gy_comm *comm, int32_t rank);
/* buf [n] float32 on every rank becomes the sum over ranks (see "Sum order"). */
gy_status gy_comm_all_reduce(gy_comm *comm, int32_t rank, float *buf, int64_t n);
/* out [size * bytes] on every rank = the ranks' `in` [bytes] in rank order. */
gy_status gy_comm_all_gather(gy_comm *comm, int32_t rank, void *out, const void *in, int64_t bytes);
/* All-to-all with variable sizes: rank r sends send[d] (send_bytes[d] bytes) to rank d and
 * receives into recv[s] (recv_bytes[s], which must equal what s sends to r) from rank s.
 * A mismatch is GY_ERR_INVALID: shm and d2d refuse it on the receiving rank only (the other
 * pairs still move), nccl on every rank before anything moves (NCCL would hang on it). */
gy_status gy_comm_all_to_all(gy_comm *comm, int32_t rank, void *const *recv,
                             const int64_t *recv_bytes, const void *const *send,
                             const int64_t *send_bytes);

/* Point to point, for hidden states between pipeline stages: `rank` sends `bytes` bytes of
 * `buf` to `peer`, which calls gy_comm_recv(comm, peer, rank, out, bytes). Only the two ranks
 * meet (the others carry on with their own work); the messages of one pair arrive in the order
 * they were sent. Like a collective, a call has finished on shm when it returns; on a device
 * backend it is enqueued on both ranks' streams: the receiver's stream sees the bytes after the
 * call, and the sender's stream does not pass the send before they were read, so later work may
 * overwrite `buf`. A receiver expecting another size refuses on both ranks with GY_ERR_INVALID
 * and nothing moves (NCCL would wait forever on it); so does a peer outside the communicator or
 * equal to `rank`. A failed send fails the matching receive, and the reverse. */
gy_status gy_comm_send(gy_comm *comm, int32_t rank, int32_t peer, const void *buf, int64_t bytes);
gy_status gy_comm_recv(gy_comm *comm, int32_t rank, int32_t peer, void *buf, int64_t bytes);

/* Failure of one rank. A rank whose work fails half-way (its forward pass, an injected fault)
 * aborts the communicator: every collective under way and every later one then fails on every
 * rank with GY_ERR_STATE naming `reason`, so no peer waits forever for a rank that will not
 * come (NCCL's ncclCommAbort, for the host side: shm, and d2d's meetings on the host; the nccl
 * backend also calls ncclCommAbort itself, waking a rank stuck in an NCCL kernel). Once no
 * rank is inside a collective, gy_comm_reset makes it usable again (nccl: new communicators). */
void gy_comm_abort(gy_comm *comm, int32_t rank, const char *reason);
void gy_comm_reset(gy_comm *comm);
int gy_comm_aborted(const gy_comm *comm);

/* The adapter gy_tp_group (engine/forward.h) uses: ctx is a gy_comm_rank. */
typedef struct gy_comm_rank {
    gy_comm *comm;
    int32_t rank;
} gy_comm_rank;
gy_status gy_comm_rank_all_reduce(void *ctx, float *buf, int64_t n);

void gy_comm_stats_get(const gy_comm *comm, gy_comm_stats *out);
void gy_comm_stats_reset(gy_comm *comm);

#ifdef __cplusplus
}
#endif
#endif
