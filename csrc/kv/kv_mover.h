/* kv_mover.h: moves one layer's K/V between caches of other geometries (a layer-staggered
 * transformation, Gyges 4.3), with most of the copying done beside a step.
 *
 * Item i copies heads [src_head, src_head + n_heads) of tokens [0, n_tokens) of sequence src_seq
 * in cache src to heads [dst_head, ...) of dst_seq in dst. New blocks may overlap old blocks of
 * the same layer (a shadow cache reads the same pages in another geometry), so no source may be
 * overwritten before it is read: the mover reads into its own stage, then writes the stage out;
 * or, when nothing was read early and both ends are header-centric, copies each run once in an
 * order that reads every source first (run_order.h), half the memory traffic.
 *
 * The read can start early (PipeLive's pre-copy, then a patch of what changed):
 *   gy_kv_mover_plan    between steps: remembers the items and each source sequence's blocks and
 *                       generation, and the tokens it holds now;
 *   gy_kv_mover_read    on any thread, while a step runs: copies those tokens into the stage. A
 *                       step only writes positions it has not computed yet, never the ones
 *                       planned, and frees no block before it ends, so this read races with
 *                       nothing it uses. It touches no cache structure, only the layer's memory;
 *   gy_kv_mover_finish  between steps, with the items as they are now: an item planned with the
 *                       same caches, sequences (same generations) and heads reuses its staged
 *                       tokens and reads only those added since; any other item is read whole.
 *                       Then everything is written. Without a plan, finish is a plain move.
 * A run whose source and destination addresses are the same is neither read nor written.
 * Every read and write goes through gy_kv_layout_offset. Host caches (fp32) with the page or
 * header layout only: the raw layout moves V when it grows, so a planned address could go stale. */
#ifndef GY_KV_MOVER_H
#define GY_KV_MOVER_H

#include <stdint.h>

#include "kv_cache.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_kv_move_item {
    gy_kv_cache *src, *dst;
    int64_t src_seq, dst_seq;
    int64_t src_head, n_heads, n_tokens;
    int64_t dst_head;
} gy_kv_move_item;

typedef struct gy_kv_move_stats {
    uint64_t bytes_moved;      /* written to the destinations by the last finish */
    uint64_t bytes_early;      /* of those, read by gy_kv_mover_read beside a step */
    uint64_t bytes_late;       /* read by finish itself */
    uint64_t bytes_in_place;   /* already where they go: neither read nor written (a rank's
                                  own heads, when its new blocks are its old ones' head runs) */
    int64_t items_reused;      /* items whose planned read was used */
    int64_t items_stale;       /* planned items finish found changed or gone (read again) */
    uint64_t stage_bytes;      /* host memory the mover holds for its stage */
    int64_t runs_direct;       /* runs copied once, straight to their destination (a finish
                                  with nothing read early, header layout); 0: through the stage */
    int64_t runs_parked;       /* of those, one per cycle of runs waiting on each other */
} gy_kv_move_stats;

typedef struct gy_kv_mover gy_kv_mover;

gy_status gy_kv_mover_init(gy_kv_mover **out);
void gy_kv_mover_free(gy_kv_mover *m);

/* Checks the items (live sequences, heads in range, room for the tokens, same head_dim) and
 * remembers them; replaces an earlier plan. */
gy_status gy_kv_mover_plan(gy_kv_mover *m, const gy_kv_move_item *items, int64_t n_items,
                           int64_t layer);
/* Reads the planned tokens into the stage (no-op without a plan; twice is harmless). */
gy_status gy_kv_mover_read(gy_kv_mover *m);
/* Moves `layer` for `items` as described above, on up to `threads` threads (1 or 2), and forgets
 * the plan. A plan of another layer is ignored. `stats` may be NULL. */
gy_status gy_kv_mover_finish(gy_kv_mover *m, const gy_kv_move_item *items, int64_t n_items,
                             int64_t layer, int threads, gy_kv_move_stats *stats);

#ifdef __cplusplus
}
#endif
#endif
