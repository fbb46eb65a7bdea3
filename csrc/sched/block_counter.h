/* block_counter.h: KV capacity as pure accounting, for the simulator and the tests: a request
 * holding room for t tokens holds ceil(t / block_size) blocks, out of `total_blocks`. No block
 * ids, no memory. */
#ifndef GY_SCHED_BLOCK_COUNTER_H
#define GY_SCHED_BLOCK_COUNTER_H

#include <stdint.h>

#include "../core/status.h"
#include "kv_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_sched_block_counter gy_sched_block_counter;

gy_status gy_sched_block_counter_init(gy_sched_block_counter **out, int64_t total_blocks,
                                      int64_t block_size);
void gy_sched_block_counter_free(gy_sched_block_counter *c);
/* The ops table over `c`; `c` must outlive every scheduler using it. */
gy_sched_kv_ops gy_sched_block_counter_ops(gy_sched_block_counter *c);

/* Queries (also the ops' implementations). */
int64_t gy_sched_block_counter_free_blocks(const gy_sched_block_counter *c);
int64_t gy_sched_block_counter_total_blocks(const gy_sched_block_counter *c);
/* Blocks `req` holds (0 when none). */
int64_t gy_sched_block_counter_held(const gy_sched_block_counter *c, int64_t req);
/* Requests holding at least one block. */
int64_t gy_sched_block_counter_n_holders(const gy_sched_block_counter *c);
int64_t gy_sched_block_counter_blocks_needed(const gy_sched_block_counter *c, int64_t req,
                                             int64_t n_tokens);
gy_status gy_sched_block_counter_reserve(gy_sched_block_counter *c, int64_t req,
                                         int64_t n_tokens);
void gy_sched_block_counter_release(gy_sched_block_counter *c, int64_t req);

#ifdef __cplusplus
}
#endif
#endif
