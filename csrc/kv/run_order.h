/* run_order.h: copies many runs of bytes, each once, when some runs' destinations are where
 * other runs' sources are.
 *
 * A layer move in the header-centric layout writes a merged rank's new blocks over the head runs
 * of its old blocks that other ranks still have to read (Gyges 4.1.2 reuses the space). Reading
 * everything into a stage before writing anything is always safe but copies each byte twice.
 * Ordering the copies instead copies it once: run r may be written only after the run whose
 * source lies at r's destination has been read. When destinations are distinct and sources are
 * distinct these waits form chains and cycles; a chain is copied from its free end back, a cycle
 * by first parking one run's source in a small buffer. Chains and cycles touch disjoint memory,
 * so two threads can take half of them each.
 *
 * The rule needs runs that either start at the same address or do not overlap at all: every
 * source and destination starts on a multiple of `grid` bytes and is at most `grid` long (one
 * head's tokens of one block, with the layer starting page-aligned). Runs that do not follow it,
 * or read a source twice, or write a place twice, are left to the caller (nothing is written). */
#ifndef GY_KV_RUN_ORDER_H
#define GY_KV_RUN_ORDER_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_run {
    const void *src;
    void *dst;
    int64_t bytes;
} gy_run;

typedef struct gy_run_order_stats {
    int64_t runs_copied;   /* each once */
    int64_t runs_parked;   /* one per cycle */
    int64_t longest_chain; /* the most runs that had to wait on each other */
} gy_run_order_stats;

/* Scratch kept between calls (the tables grow to the largest call). */
typedef struct gy_run_order gy_run_order;

gy_status gy_run_order_init(gy_run_order **out);
void gy_run_order_free(gy_run_order *o);

/* Copies the n runs in an order where no source is overwritten before it is read, on 1 or 2
 * threads, and sets *copied = 1. Sets *copied = 0 and writes nothing when the runs do not follow
 * the rule above. A run whose source is its destination counts as copied. `stats` may be NULL. */
gy_status gy_run_order_copy(gy_run_order *o, const gy_run *runs, int64_t n, int64_t grid,
                            int threads, int *copied, gy_run_order_stats *stats);

#ifdef __cplusplus
}
#endif
#endif
