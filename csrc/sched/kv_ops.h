/* kv_ops.h: how the batch scheduler sees KV capacity. The scheduler never touches real memory:
 * the CPU engine backs this table with its paged KV cache, the simulator and the tests with the
 * block counter (block_counter.h). `req` is always the caller's request id.
 *
 * Every entry is required. A request holds nothing until its first reserve and holds nothing
 * again after release. */
#ifndef GY_SCHED_KV_OPS_H
#define GY_SCHED_KV_OPS_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_sched_kv_ops {
    void *ctx;
    /* Blocks no request holds. */
    int64_t (*free_blocks)(void *ctx);
    /* More blocks `req` needs to hold `n_tokens` tokens in total (0 when it already has room). */
    int64_t (*blocks_needed)(void *ctx, int64_t req, int64_t n_tokens);
    /* Makes room for `n_tokens` tokens in total, all-or-nothing. GY_ERR_OUT_OF_MEMORY means "does
     * not fit" and the scheduler treats it like a failed blocks_needed check; any other failure
     * fails the schedule, which takes its own changes back (batch.h, "Failure"). */
    gy_status (*reserve)(void *ctx, int64_t req, int64_t n_tokens);
    /* Frees every block of `req`; a no-op when it holds none. */
    void (*release)(void *ctx, int64_t req);
} gy_sched_kv_ops;

#ifdef __cplusplus
}
#endif
#endif
