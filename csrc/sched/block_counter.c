/* block_counter.c: blocks per request in an id map; free = total - sum of held. */
#include "block_counter.h"
#include "../core/alloc.h"

#include <stdlib.h>

#include "idmap.h"

struct gy_sched_block_counter {
    int64_t total_blocks;
    int64_t block_size;
    int64_t free_blocks;
    gy_idmap held; /* request id -> blocks held (> 0; absent means 0) */
};

gy_status gy_sched_block_counter_init(gy_sched_block_counter **out, int64_t total_blocks,
                                      int64_t block_size) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_block_counter_init: NULL out");
    *out = NULL;
    if (total_blocks <= 0 || block_size <= 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "block counter needs total_blocks > 0 and block_size > 0 (got %lld, %lld)",
                       (long long)total_blocks, (long long)block_size);
    gy_sched_block_counter *c = gy_calloc(1, sizeof *c);
    if (c == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    c->total_blocks = total_blocks;
    c->block_size = block_size;
    c->free_blocks = total_blocks;
    *out = c;
    return GY_OK;
}

void gy_sched_block_counter_free(gy_sched_block_counter *c) {
    if (c == NULL) return;
    gy_idmap_free(&c->held);
    free(c);
}

int64_t gy_sched_block_counter_free_blocks(const gy_sched_block_counter *c) {
    return c->free_blocks;
}

int64_t gy_sched_block_counter_total_blocks(const gy_sched_block_counter *c) {
    return c->total_blocks;
}

int64_t gy_sched_block_counter_held(const gy_sched_block_counter *c, int64_t req) {
    int64_t held = 0;
    gy_idmap_get(&c->held, req, &held);
    return held;
}

int64_t gy_sched_block_counter_n_holders(const gy_sched_block_counter *c) { return c->held.count; }

int64_t gy_sched_block_counter_blocks_needed(const gy_sched_block_counter *c, int64_t req,
                                             int64_t n_tokens) {
    if (n_tokens <= 0) return 0;
    const int64_t want = n_tokens / c->block_size + (n_tokens % c->block_size != 0);
    const int64_t held = gy_sched_block_counter_held(c, req);
    return want > held ? want - held : 0;
}

gy_status gy_sched_block_counter_reserve(gy_sched_block_counter *c, int64_t req,
                                         int64_t n_tokens) {
    if (n_tokens < 0)
        return GY_FAIL(GY_ERR_INVALID, "cannot reserve %lld tokens", (long long)n_tokens);
    const int64_t need = gy_sched_block_counter_blocks_needed(c, req, n_tokens);
    if (need == 0) return GY_OK;
    if (need > c->free_blocks)
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY,
                       "request %lld needs %lld more blocks for %lld tokens but %lld are free",
                       (long long)req, (long long)need, (long long)n_tokens,
                       (long long)c->free_blocks);
    GY_TRY(gy_idmap_put(&c->held, req, gy_sched_block_counter_held(c, req) + need));
    c->free_blocks -= need;
    return GY_OK;
}

void gy_sched_block_counter_release(gy_sched_block_counter *c, int64_t req) {
    const int64_t held = gy_sched_block_counter_held(c, req);
    if (held == 0) return;
    gy_idmap_remove(&c->held, req);
    c->free_blocks += held;
}

static int64_t gy_sched_bc_free(void *ctx) { return gy_sched_block_counter_free_blocks(ctx); }
static int64_t gy_sched_bc_needed(void *ctx, int64_t req, int64_t n) {
    return gy_sched_block_counter_blocks_needed(ctx, req, n);
}
static gy_status gy_sched_bc_reserve(void *ctx, int64_t req, int64_t n) {
    return gy_sched_block_counter_reserve(ctx, req, n);
}
static void gy_sched_bc_release(void *ctx, int64_t req) { gy_sched_block_counter_release(ctx, req); }

gy_sched_kv_ops gy_sched_block_counter_ops(gy_sched_block_counter *c) {
    gy_sched_kv_ops ops = {
        .ctx = c,
        .free_blocks = gy_sched_bc_free,
        .blocks_needed = gy_sched_bc_needed,
        .reserve = gy_sched_bc_reserve,
        .release = gy_sched_bc_release,
    };
    return ops;
}
