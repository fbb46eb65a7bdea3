/* comm.h: collectives among the worker threads of one process, over shared memory.
 *
 * A communicator joins `size` ranks (threads). Every collective is called by all ranks with the
 * same arguments (each with its own buffers) and returns once all have finished, like NCCL's.
 * The all-reduce sums in one fixed order, the pairwise tree ((r0 + r1) + (r2 + r3)) of
 * cpu/linear.h, so partial sums split across TP ranks add up to the same bits as TP1's.
 *
 * The CUDA backend puts an NCCL communicator behind the same calls (comm_nccl.c). */
#ifndef GY_COMM_COMM_H
#define GY_COMM_COMM_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_COMM_MAX_RANKS 16

typedef struct gy_comm gy_comm;

typedef struct gy_comm_stats {
    uint64_t calls;
    uint64_t bytes_sent[GY_COMM_MAX_RANKS];     /* bytes each rank sent to other ranks */
    uint64_t bytes_received[GY_COMM_MAX_RANKS]; /* bytes each rank received from other ranks */
} gy_comm_stats;

/* size: a power of two in [1, GY_COMM_MAX_RANKS]. */
gy_status gy_comm_init(gy_comm **out, int32_t size);
void gy_comm_free(gy_comm *comm);
int32_t gy_comm_size(const gy_comm *comm);

void gy_comm_barrier(gy_comm *comm, int32_t rank);
/* buf [n] on every rank becomes the tree sum over ranks. */
gy_status gy_comm_all_reduce(gy_comm *comm, int32_t rank, float *buf, int64_t n);
/* out [size * bytes] on every rank = the ranks' `in` [bytes] in rank order. */
gy_status gy_comm_all_gather(gy_comm *comm, int32_t rank, void *out, const void *in, int64_t bytes);
/* All-to-all with variable sizes: rank r sends send[d] (send_bytes[d] bytes) to rank d and
 * receives into recv[s] (recv_bytes[s], which must equal what s sends to r) from rank s. */
gy_status gy_comm_all_to_all(gy_comm *comm, int32_t rank, void *const *recv,
                             const int64_t *recv_bytes, const void *const *send,
                             const int64_t *send_bytes);
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
