/* kv_move.h: the one way KV bytes move between paged KV caches (or inside one): a TP
 * transformation's head ranges (Gyges 4.1.2), a layer-staggered transformation's layer moves
 * (Gyges 4.3), PipeLive's bulk copies and dirty patches (section 6.2), KunServe's exchange
 * between buddies and a cache's own compaction are all one description, gy_kv_move, run by one
 * entry point, gy_kv_move_run.
 *
 * A move is a list of items over a range of model layers. Item i pairs blocks of its source
 * cache with blocks of its destination cache, either two block lists or the block tables of two
 * live sequences, and copies, for each pair and each layer, heads [src_head, src_head + n_heads)
 * of token slots [0, t) of the source block (K and V) to heads [dst_head, ...) of the same slots
 * of the destination block, as each cache's layout says (gy_kv_layout_offset). t is block_size,
 * or less in the block that holds the item's last token when the item sets a token limit.
 * Options of the same call:
 *   dirty     a bitmap taken from a gy_kv_dirty (kv_dirty.h) over the source cache's slots
 *             (block * block_size + token): only the slots set there are copied (a patch);
 *   OVERLAP   destinations may lie over other items' sources (a shadow cache reads the owner's
 *             pages in another geometry, kv_cache.h): every source is read before anything is
 *             written, through a stage or, when every item is header-centric, by copying each
 *             run once in an order that reads it first (run_order.h). Without it, the regions
 *             read and written must not overlap (the same cache is allowed).
 *
 * The early read (PipeLive's pre-copy) is the second phase of the same description, for OVERLAP
 * moves of host caches: gy_kv_move_plan (between steps) remembers the move's blocks and
 * sequence generations in a stage, gy_kv_move_read (any thread, while a step runs) copies them
 * into it, and a later gy_kv_move_run of the move as it is then, given the stage, reuses what it
 * read and reads only what changed (items planned with the same caches, sequences and heads;
 * tokens added since; anything else read whole).
 *
 * Where the bytes go is the backends' business (kv_move_backend.h), chosen by where the caches
 * live: host memory (memmove, kv_move_host.c, always there), one CUDA device (the kernels,
 * kernels/kv_move_device.c, registered at start-up with gy_kv_move_set_backend), or several
 * devices joined by the move's communicator (`comm`: a group's migration communicator; the
 * comm backend, comm/kv_move_comm.c, packs, exchanges with one all-to-all per layer and
 * unpacks). kv/ only carries the communicator: it never calls into comm/. */
#ifndef GY_KV_MOVE_H
#define GY_KV_MOVE_H

#include <stdint.h>

#include "kv_cache.h"

struct gy_comm; /* comm/comm.h: only the comm backend of moves looks inside */

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gy_kv_move_backend_kind {
    GY_KV_MOVE_BACKEND_HOST = 0,   /* every cache in host memory */
    GY_KV_MOVE_BACKEND_DEVICE = 1, /* every cache on one CUDA device (virtual workers) */
    GY_KV_MOVE_BACKEND_COMM = 2,   /* caches on several CUDA devices, the ranks of the move's comm */
    GY_KV_MOVE_BACKEND_COUNT
} gy_kv_move_backend_kind;

/* A token limit meaning every slot of every paired block. */
#define GY_KV_MOVE_ALL_TOKENS (-1)

typedef struct gy_kv_move_item {
    const gy_kv_cache *src;
    gy_kv_cache *dst;
    /* The block pairs: two lists of n_blocks ids each, or, when both are NULL, the block tables
     * of the live sequences src_seq and dst_seq (as many pairs as the token limit needs, or,
     * without one, as both tables have). */
    const int32_t *src_blocks, *dst_blocks; /* (n_blocks) int32 each */
    int64_t n_blocks;
    int64_t src_seq, dst_seq;
    int64_t src_head, dst_head, n_heads;    /* heads of each cache's blocks */
    int64_t n_tokens; /* token slots [0, n_tokens) of the paired blocks in order (pair j holds
                       * tokens [j * block_size, (j + 1) * block_size)); GY_KV_MOVE_ALL_TOKENS:
                       * every slot */
} gy_kv_move_item;

enum {
    GY_KV_MOVE_OVERLAP = 1u << 0, /* sources may lie under destinations: read all, then write */
};

typedef struct gy_kv_move {
    const gy_kv_move_item *items; /* (n_items) */
    int64_t n_items;
    int64_t first_layer, end_layer; /* model layers [first_layer, end_layer), held by every cache
                                     * named (each keeps them from its own first_layer) */
    const uint64_t *dirty; /* NULL, or (ceil(dirty_slots / 64)) words as gy_kv_dirty_take fills
                            * them, over the slots of the one source cache of every item */
    int64_t dirty_slots;
    uint32_t flags;        /* GY_KV_MOVE_* */
    int32_t threads;       /* host OVERLAP moves: threads to copy on (1 or 2; 0 means 1) */
    /* NULL, or the communicator whose ranks' devices hold the caches (a group's migration
     * communicator): needed when the items' caches live on more than one CUDA device, and then
     * every cache must be on the device of one of its ranks; ignored when they share one memory.
     * Its ranks must be in no other collective while the move runs (comm.h, "Two channels"). */
    struct gy_comm *comm;
} gy_kv_move;

typedef struct gy_kv_move_stats {
    int64_t slots;            /* token slots asked for in each layer (with a bitmap: those set) */
    uint64_t bytes;           /* written to destinations, every layer, in-place runs excluded
                               * (the device backend copies whole blocks: it counts the slots
                               * asked for) */
    uint64_t bytes_in_place;  /* runs already where they go, neither read nor written (a rank's
                               * own heads, when its new blocks are its old ones' head runs) */
    uint64_t bytes_early;     /* of `bytes`, read beside a step by gy_kv_move_read */
    uint64_t bytes_late;      /* of `bytes`, read by the run itself */
    int64_t items_reused;     /* items whose early read was used */
    int64_t items_stale;      /* planned items the run found changed or gone (read again) */
    uint64_t stage_bytes;     /* host memory the stage holds */
    int64_t runs_direct;      /* OVERLAP on header-centric caches without an early read: runs
                               * copied once, straight to their destination (0: through a stage) */
    int64_t runs_parked;      /* of those, one per cycle of runs waiting on each other */
    int32_t backend;          /* gy_kv_move_backend_kind that ran it */
    uint64_t comm_bytes;      /* the comm backend: bytes sent between devices, every layer (whole
                               * blocks of the items' heads) */
    uint64_t staging_bytes;   /* the comm backend: the most device memory one rank staged at once
                               * (its send and receive buffers of one layer, and the block lists):
                               * the extra memory of the move beyond the caches */
} gy_kv_move_stats;

/* A stage: the host memory an OVERLAP move reads into, kept between moves (it grows to the
 * largest), and the plan of an early read. One thread at a time. */
typedef struct gy_kv_move_stage gy_kv_move_stage;

/* Checks the whole move (refused, nothing written, on any error: caches that differ in block
 * size, head size or value size, heads, layers or blocks out of range, sequences not live or
 * without room for the token limit, a bitmap that does not cover the source blocks, caches in
 * memories no registered backend serves), then, when there is anything to copy, counts one
 * copy event (gy_fault_hit(GY_FAULT_COPY)) and copies. `stage` may be NULL (an OVERLAP move then
 * uses scratch of its own); given, an early read planned in it for these layers is used and
 * then forgotten. Returns when the bytes have landed. `stats` may be NULL. */
gy_status gy_kv_move_run(const gy_kv_move *move, gy_kv_move_stage *stage, gy_kv_move_stats *stats);

gy_status gy_kv_move_stage_init(gy_kv_move_stage **out);
void gy_kv_move_stage_free(gy_kv_move_stage *stage);
/* The early read's first half, between steps: checks `move` as gy_kv_move_run does (an OVERLAP
 * move of host caches whose items name sequences, page or header layout: the raw layout moves V
 * when it grows, so a planned address could go stale) and remembers its blocks, generations and
 * token counts; replaces an earlier plan. */
gy_status gy_kv_move_plan(gy_kv_move_stage *stage, const gy_kv_move *move);
/* The second half, on any thread while a step runs: copies the planned tokens into the stage. A
 * step only writes positions it has not computed yet, never the ones planned, and frees no block
 * before it ends, so this races with nothing it reads; it touches no cache structure. No-op
 * without a plan; twice is harmless. */
gy_status gy_kv_move_read(gy_kv_move_stage *stage);

/* Registers the backend of `kind` (kv_move_backend.h); NULL restores the default (the host's
 * memmove for HOST, none for the others). Called at start-up, before any move. */
struct gy_kv_move_backend;
gy_status gy_kv_move_set_backend(gy_kv_move_backend_kind kind,
                                 const struct gy_kv_move_backend *backend);
const char *gy_kv_move_backend_name(gy_kv_move_backend_kind kind);

#ifdef __cplusplus
}
#endif
#endif
