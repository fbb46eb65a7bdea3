/* kv_move_backend.h (private): the table of functions a KV move backend provides to kv_move.c,
 * and the helpers every backend reads a checked move with.
 *
 * kv_move.c has checked the whole move and found something to copy when it calls these; it has
 * filled stats->slots, and stats->bytes with the bytes of the slots asked for (a backend takes
 * off what it did not have to write, e.g. runs already in place). A backend only copies and
 * reports what its memory refused. */
#ifndef GY_KV_MOVE_BACKEND_H
#define GY_KV_MOVE_BACKEND_H

#include "kv_move.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_kv_move_backend {
    const char *name;
    /* Copies a move without GY_KV_MOVE_OVERLAP. Required. */
    gy_status (*copy)(const gy_kv_move *move, gy_kv_move_stats *stats);
    /* Optional (NULL: GY_KV_MOVE_OVERLAP moves, and early reads, are refused on this backend
     * with GY_ERR_UNAVAILABLE naming it): a move whose destinations may lie over its sources,
     * each source read before anything is written, using `stage`'s early read when it planned
     * these layers (stage may be NULL). */
    gy_status (*copy_overlapping)(const gy_kv_move *move, gy_kv_move_stage *stage,
                                  gy_kv_move_stats *stats);
    /* Optional (NULL: nothing more to check): what only this backend can check (the comm
     * backend: every cache on a device of the move's communicator), called by kv_move.c's checks
     * before the copy event, so a refusal copies nothing and counts no fault event. */
    gy_status (*check)(const gy_kv_move *move);
} gy_kv_move_backend;

extern const gy_kv_move_backend gy_kv_move_host_backend; /* kv_move_host.c */

/* ---- reading a checked move ---- */

/* The block pairs of item `it`: *src and *dst point at its two lists (a sequence's table, valid
 * until the sequence changes); returns how many pairs there are. */
int64_t gy_kv_move_item_pairs(const gy_kv_move_item *it, const int32_t **src, const int32_t **dst);

/* Token slots [0, t) of pair j of an item copy; t = block_size but in the pair holding the
 * item's last token. */
static inline int64_t gy_kv_move_pair_tokens(const gy_kv_move_item *it, int64_t j,
                                             int64_t block_size) {
    if (it->n_tokens < 0) return block_size;
    const int64_t left = it->n_tokens - j * block_size;
    return left < block_size ? (left > 0 ? left : 0) : block_size;
}

/* Tokens the item copies in each layer (its token limit, or every slot of its pairs). */
int64_t gy_kv_move_item_tokens(const gy_kv_move_item *it);

/* The cache's own index of model layer `layer`. */
static inline int64_t gy_kv_move_layer(const gy_kv_cache *kv, int64_t layer) {
    return layer - gy_kv_config_of(kv)->first_layer;
}

/* Whether `slot` is set in words taken from a bitmap (gy_kv_dirty_take's layout). */
static inline int gy_kv_move_dirty_at(const uint64_t *words, int64_t slot) {
    return (int)(words[slot / 64] >> (slot % 64) & 1);
}

/* Bytes of one token of n_heads heads, K and V. */
static inline int64_t gy_kv_move_token_bytes(const gy_kv_cache *kv, int64_t n_heads) {
    const gy_kv_config *c = gy_kv_config_of(kv);
    return 2 * n_heads * c->head_dim * c->elem_size;
}

/* ---- which pairs a device move writes (kernels/kv_move_device.c, comm/kv_move_comm.c) ---- */

/* Whether item `it`'s caches lay a head run out alike and place every layer of the move at the
 * same address (a shadow over its owner's pages), so that a pair can already be in place. */
int gy_kv_move_same_place(const gy_kv_move *move, const gy_kv_move_item *it);

/* Whether a device move copies pair j (sb[j] -> db[j]) of item `it`: it holds tokens; with a
 * dirty bitmap, its source block holds a dirty slot (the block is then moved whole: its clean
 * slots hold the same bytes at both ends); with `same_place` (gy_kv_move_same_place, OVERLAP
 * moves only) it is not already where it goes, whose bytes of every layer are added to
 * *in_place instead. */
int gy_kv_move_pair_moves(const gy_kv_move *move, const gy_kv_move_item *it, int64_t j,
                          const int32_t *sb, const int32_t *db, int same_place, uint64_t *in_place);

/* ---- the host's runs (kv_move_host.c; the stage reads and writes through them too) ----
 *
 * Token slots [t0, t0 + n_tokens) of heads [src_head, src_head + n_heads) of one block pair,
 * K and V, in one layer, as the fewest contiguous runs the two layouts allow: d is contiguous
 * at both ends, and each dimension (token, K/V, head, innermost first in the source's order)
 * whose stride at both ends is the run so far joins the run. A header-centric block pair whose
 * whole token range moves is one run; the page layout's full blocks of every head are too. */
typedef struct gy_kv_move_runs {
    int64_t run;                      /* bytes of one run, at both ends */
    int64_t count[3];                 /* the loops left, outermost first (1: merged or none) */
    int64_t src_step[3], dst_step[3]; /* bytes between their iterations */
} gy_kv_move_runs;

void gy_kv_move_runs_init(gy_kv_move_runs *r, const gy_kv_layout *src, const gy_kv_layout *dst,
                          int64_t n_heads, int64_t n_tokens);

/* Calls fn(ctx, dst + ..., src + ..., run) for every run, in storage order of the source. */
typedef void (*gy_kv_move_run_fn)(void *ctx, char *dst, const char *src, int64_t bytes);
void gy_kv_move_runs_each(const gy_kv_move_runs *r, char *dst, const char *src,
                          gy_kv_move_run_fn fn, void *ctx);

/* ---- the host's OVERLAP moves (kv_move_stage.c) ---- */
gy_status gy_kv_move_stage_copy(const gy_kv_move *move, gy_kv_move_stage *stage,
                                gy_kv_move_stats *stats);
/* gy_kv_move_plan after kv_move.c's checks. */
gy_status gy_kv_move_stage_plan(gy_kv_move_stage *stage, const gy_kv_move *move);

#ifdef __cplusplus
}
#endif
#endif
