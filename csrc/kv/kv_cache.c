/* kv_cache.c: blocks, block tables and growth of the paged KV cache. */
#include "kv_cache.h"
#include "kv_move.h"
#include "../core/alloc.h"
#include "../core/grow.h"

#include <stdlib.h>
#include <string.h>

/* One change gy_kv_undo can take back. */
typedef enum gy_kv_undo_kind {
    GY_KV_UNDO_NEW = 0,     /* a sequence id was handed out */
    GY_KV_UNDO_RESERVE = 1, /* blocks were appended to a sequence */
    GY_KV_UNDO_FREE = 2,    /* a sequence was freed (its id is held back until unmark) */
} gy_kv_undo_kind;

typedef struct gy_kv_undo_entry {
    gy_kv_undo_kind kind;
    int64_t seq;
    int64_t n_blocks;    /* RESERVE: before it; FREE: the blocks it had */
    int64_t n_tokens;    /* RESERVE, FREE: before it */
    uint64_t generation; /* NEW: the cache's counter before it */
} gy_kv_undo_entry;

typedef struct gy_kv_seq {
    int32_t live;
    uint64_t generation; /* changes each time the id is handed out (gy_kv_seq_generation) */
    int64_t n_tokens;   /* tokens the sequence has reserved room for */
    int64_t n_blocks;
    int64_t capacity;   /* of blocks[] */
    int32_t *blocks;    /* (n_blocks) block ids: the block table */
} gy_kv_seq;

/* What the caches reading one set of pages share: the block pool, the sequences and their block
 * tables, and the undo record. A cache owns one; a view (gy_kv_init_view) uses its base's. */
typedef struct gy_kv_pool {
    int64_t max_blocks;      /* blocks that fit in slots_per_layer */
    int64_t pages_per_layer;
    int64_t page_cap;        /* pages per layer growth may reach (gy_kv_set_page_cap) */
    uint8_t *block_used;     /* (max_blocks) */
    int32_t *free_blocks;    /* (max_blocks) stack of free block ids */
    int64_t n_free;
    gy_kv_seq *seqs;         /* (seq_capacity) */
    int64_t seq_capacity;
    int64_t *free_seqs;      /* (seq_capacity) stack of dead sequence ids */
    int64_t n_free_seqs;
    int64_t n_live_seqs;
    uint64_t generations; /* sequences ever handed out */
    gy_kv_stats stats;
    /* gy_kv_mark: while `marked`, what each sequence call changes is written down first, so
     * that gy_kv_undo can take it back in reverse order (see kv_cache.h). */
    int marked;
    gy_kv_undo_entry *undo;      /* (n_undo) */
    int64_t n_undo, undo_cap;
} gy_kv_pool;

struct gy_kv_cache {
    gy_kv_config config;     /* a view's n_heads and block_size are its own */
    gy_arena *arena;
    uint64_t page_size;
    uint64_t block_bytes;    /* one block of one layer */
    uint64_t row_bytes;      /* one block of every layer of a run: stack * block_bytes */
    int64_t stack;           /* layers per run of pages (layer stacking; 1: none) */
    gy_kv_layout layout;     /* for layout.n_blocks == the current block count */
    gy_kv_pool *p;           /* &own, or the base's for a view */
    gy_kv_pool own;
    /* A layer-staggered transformation reads the same pages in two geometries: the owner maps
     * them, the shadow borrows them (each only touches the layers in its geometry). */
    gy_kv_cache *owner;  /* set on a shadow */
    gy_kv_cache *shadow; /* set on the owner of a shadow */
    /* Flying Serving's adaptor: views read the same blocks in other geometries and share the
     * pool (gy_kv_init_view). */
    gy_kv_cache *base;                   /* set on a view */
    gy_kv_cache *views[GY_KV_MAX_VIEWS]; /* set on a base */
    int32_t n_views;
};

static gy_status gy_kv_set_layout(gy_kv_cache *kv, int64_t n_blocks) {
    GY_TRY(gy_kv_layout_init(&kv->layout, kv->config.layout, kv->config.block_size,
                             kv->config.n_heads, kv->config.head_dim, kv->config.elem_size,
                             n_blocks));
    /* stacked: block b of the run's layer j sits at row b, column j (kv_cache.h) */
    kv->layout.stride_block *= kv->stack;
    return GY_OK;
}

/* The block count changed: the cache's layout, and its views' (same blocks, other geometry). */
static gy_status gy_kv_set_blocks(gy_kv_cache *kv, int64_t n_blocks) {
    GY_TRY(gy_kv_set_layout(kv, n_blocks));
    for (int32_t i = 0; i < kv->n_views; i++) GY_TRY(gy_kv_set_layout(kv->views[i], n_blocks));
    kv->p->stats.n_blocks = n_blocks;
    return GY_OK;
}

gy_status gy_kv_init(gy_kv_cache **out, gy_arena *arena, const gy_kv_config *c) {
    if (out == NULL || arena == NULL || c == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_kv_init: NULL argument");
    *out = NULL;
    if (c->first_layer < 0)
        return GY_FAIL(GY_ERR_INVALID, "KV cache first_layer must not be negative, got %lld",
                       (long long)c->first_layer);
    if (c->n_layers <= 0 || c->slots_per_layer <= 0 || c->first_slot < 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "KV cache needs n_layers > 0, slots_per_layer > 0 and first_slot >= 0 "
                       "(got %lld, %lld, %lld)",
                       (long long)c->n_layers, (long long)c->slots_per_layer,
                       (long long)c->first_slot);
    const int64_t stack = c->stack > 1 ? c->stack : 1;
    if (stack > 1 && (c->layout == GY_KV_LAYOUT_RAW || c->n_layers % stack || c->first_layer % stack))
        return GY_FAIL(GY_ERR_INVALID, "stacking %lld layers needs the page or header layout and "
                       "a layer range [%lld, %lld) in whole runs of %lld", (long long)stack,
                       (long long)c->first_layer, (long long)(c->first_layer + c->n_layers),
                       (long long)stack);
    gy_kv_layout probe;
    GY_TRY(gy_kv_layout_init(&probe, c->layout, c->block_size, c->n_heads, c->head_dim,
                             c->elem_size, 0));
    const uint64_t n_slots = gy_arena_n_slots(arena);
    if ((uint64_t)c->first_slot > n_slots ||
        (uint64_t)(c->n_layers / stack) > (n_slots - (uint64_t)c->first_slot) / (uint64_t)c->slots_per_layer)
        return GY_FAIL(GY_ERR_INVALID,
                       "%lld runs of layers of %lld slots from slot %lld do not fit the arena's %llu "
                       "slots", (long long)(c->n_layers / stack), (long long)c->slots_per_layer,
                       (long long)c->first_slot, (unsigned long long)n_slots);
    const uint64_t page_size = gy_arena_page_size(arena);
    const uint64_t block_bytes = (uint64_t)probe.block_elems * (uint64_t)c->elem_size;
    const int64_t max_blocks = (int64_t)((uint64_t)c->slots_per_layer * page_size /
                                         (block_bytes * (uint64_t)stack));
    if (max_blocks == 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "a block of %llu bytes does not fit in %lld slots of %llu bytes per layer",
                       (unsigned long long)block_bytes, (long long)c->slots_per_layer,
                       (unsigned long long)page_size);
    if (max_blocks > INT32_MAX)
        return GY_FAIL(GY_ERR_INVALID, "%lld blocks per layer is more than block ids can name",
                       (long long)max_blocks);

    gy_kv_cache *kv = gy_calloc(1, sizeof *kv);
    if (kv == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    kv->p = &kv->own;
    kv->config = *c;
    kv->arena = arena;
    kv->page_size = page_size;
    kv->block_bytes = block_bytes;
    kv->stack = stack;
    kv->row_bytes = block_bytes * (uint64_t)stack;
    kv->p->max_blocks = max_blocks;
    kv->p->block_used = gy_calloc((size_t)max_blocks, 1);
    kv->p->free_blocks = gy_malloc((size_t)max_blocks * sizeof *kv->p->free_blocks);
    if (kv->p->block_used == NULL || kv->p->free_blocks == NULL) {
        gy_kv_free(kv);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for %lld blocks", (long long)max_blocks);
    }
    kv->p->stats.block_bytes = block_bytes;
    kv->p->page_cap = c->slots_per_layer;
    gy_status s = gy_kv_set_blocks(kv, 0);
    if (s != GY_OK) {
        gy_kv_free(kv);
        return s;
    }
    *out = kv;
    return GY_OK;
}

void gy_kv_free(gy_kv_cache *kv) {
    if (kv == NULL) return;
    if (kv->base != NULL) { /* a view: the pool and its pages are the base's */
        gy_kv_cache *base = kv->base;
        int32_t k = 0;
        for (int32_t i = 0; i < base->n_views; i++)
            if (base->views[i] != kv) base->views[k++] = base->views[i];
        base->n_views = k;
        free(kv);
        return;
    }
    for (int32_t i = 0; i < kv->n_views; i++) kv->views[i]->base = NULL, kv->views[i]->p = NULL;
    if (kv->owner != NULL) {
        kv->owner->shadow = NULL; /* a shadow never unmaps borrowed pages */
        kv->p->pages_per_layer = 0;
    } else if (kv->shadow != NULL) {
        gy_kv_take_pages(kv->shadow); /* the shadow keeps the pages it reads */
    }
    if (kv->p->pages_per_layer > 0)
        for (int64_t r = 0; r < gy_kv_n_runs(kv); r++)
            gy_arena_shrink(kv->arena, kv->config.first_slot + r * kv->config.slots_per_layer,
                            kv->p->pages_per_layer);
    for (int64_t i = 0; i < kv->p->seq_capacity; i++) free(kv->p->seqs[i].blocks);
    free(kv->p->seqs);
    free(kv->p->free_seqs);
    free(kv->p->block_used);
    free(kv->p->free_blocks);
    free(kv->p->undo);
    free(kv);
}

/* ---- undo (kv_cache.h) ---- */

static gy_status gy_kv_refuse_if_viewed(const gy_kv_cache *kv, const char *what) {
    if (kv->base != NULL || kv->n_views > 0)
        return GY_FAIL(GY_ERR_BUSY, "cannot %s: the cache's blocks are read in %s geometry "
                                    "(gy_kv_init_view)", what, kv->base ? "its base's" : "a view's");
    return GY_OK;
}

static gy_status gy_kv_refuse_if_marked(const gy_kv_cache *kv, const char *what) {
    if (kv->p->marked)
        return GY_FAIL(GY_ERR_BUSY, "cannot %s while a step's changes to this KV cache are being "
                                    "recorded", what);
    return GY_OK;
}

/* Writes an entry down before the change it describes (so a failure here changes nothing).
 * Within the room gy_kv_mark reserved it cannot fail. */
static gy_status gy_kv_record(gy_kv_cache *kv, gy_kv_undo_entry e) {
    if (!kv->p->marked) return GY_OK;
    GY_TRY(gy_grow((void **)&kv->p->undo, &kv->p->undo_cap, kv->p->n_undo + 1, sizeof *kv->p->undo,
                   "a KV undo record"));
    kv->p->undo[kv->p->n_undo++] = e;
    return GY_OK;
}

gy_status gy_kv_mark(gy_kv_cache *kv, int64_t changes) {
    if (kv == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL KV cache");
    if (kv->p->marked) gy_kv_unmark(kv);
    GY_TRY(gy_grow((void **)&kv->p->undo, &kv->p->undo_cap, changes > 0 ? changes : 1, sizeof *kv->p->undo,
                   "a KV undo record"));
    kv->p->marked = 1;
    kv->p->n_undo = 0;
    return GY_OK;
}

/* The ids of sequences freed while marked go back now, in the order they were freed. */
void gy_kv_unmark(gy_kv_cache *kv) {
    if (kv == NULL || !kv->p->marked) return;
    for (int64_t i = 0; i < kv->p->n_undo; i++)
        if (kv->p->undo[i].kind == GY_KV_UNDO_FREE) kv->p->free_seqs[kv->p->n_free_seqs++] = kv->p->undo[i].seq;
    kv->p->marked = 0;
    kv->p->n_undo = 0;
}

/* Every change is taken back in reverse order, so each one finds the free stacks exactly as it
 * left them: the blocks a reserve took are back on top once later changes are undone, and so
 * are the blocks and the id a free gave back. Nothing is allocated. */
int64_t gy_kv_undo_point(const gy_kv_cache *kv) { return kv != NULL && kv->p->marked ? kv->p->n_undo : 0; }

void gy_kv_undo(gy_kv_cache *kv) {
    if (kv == NULL || !kv->p->marked) return;
    gy_kv_undo_to(kv, 0);
    kv->p->marked = 0;
}

void gy_kv_undo_to(gy_kv_cache *kv, int64_t point) {
    if (kv == NULL || !kv->p->marked || point < 0) return;
    for (int64_t i = kv->p->n_undo - 1; i >= point; i--) {
        const gy_kv_undo_entry *e = &kv->p->undo[i];
        gy_kv_seq *s = &kv->p->seqs[e->seq];
        switch (e->kind) {
        case GY_KV_UNDO_RESERVE:
            for (int64_t b = s->n_blocks - 1; b >= e->n_blocks; b--) {
                kv->p->block_used[s->blocks[b]] = 0;
                kv->p->free_blocks[kv->p->n_free++] = s->blocks[b];
            }
            s->n_blocks = e->n_blocks;
            s->n_tokens = e->n_tokens;
            break;
        case GY_KV_UNDO_NEW:
            s->live = 0;
            s->n_blocks = s->n_tokens = 0;
            kv->p->free_seqs[kv->p->n_free_seqs++] = e->seq;
            kv->p->n_live_seqs--;
            kv->p->generations = e->generation;
            break;
        case GY_KV_UNDO_FREE:
            /* Its id was held back, so its table is intact; its blocks are on top of the free
             * stack, pushed from the last to the first. */
            kv->p->n_free -= e->n_blocks;
            for (int64_t b = 0; b < e->n_blocks; b++) kv->p->block_used[s->blocks[b]] = 1;
            s->live = 1;
            s->n_blocks = e->n_blocks;
            s->n_tokens = e->n_tokens;
            kv->p->n_live_seqs++;
            break;
        }
    }
    kv->p->stats.n_sequences = kv->p->n_live_seqs;
    if (point < kv->p->n_undo) kv->p->n_undo = point;
}

/* Pages are mapped per run of `stack` layers (one layer without stacking): run r starts at
 * slot first_slot + r * slots_per_layer, and cache layer l is column l % stack of run
 * l / stack (the first layer of a cache starts a run). */
int64_t gy_kv_n_runs(const gy_kv_cache *kv) { return kv->config.n_layers / kv->stack; }
int64_t gy_kv_stack(const gy_kv_cache *kv) { return kv->stack; }

static int64_t gy_kv_run_slot(const gy_kv_cache *kv, int64_t run) {
    return kv->config.first_slot + run * kv->config.slots_per_layer;
}

uint64_t gy_kv_layer_offset(const gy_kv_cache *kv, int64_t layer) {
    return (uint64_t)gy_kv_run_slot(kv, layer / kv->stack) * kv->page_size +
           (uint64_t)(layer % kv->stack) * kv->block_bytes;
}

static int64_t gy_kv_blocks_for_pages(const gy_kv_cache *kv, int64_t pages) {
    return (int64_t)((uint64_t)pages * kv->page_size / kv->row_bytes);
}

/* Moves the V half of every layer from capacity old_n to new_n (raw layout only). */
static gy_status gy_kv_move_values(gy_kv_cache *kv, int64_t old_n, int64_t new_n) {
    if (kv->config.layout != GY_KV_LAYOUT_RAW || old_n == 0 || old_n == new_n) return GY_OK;
    const uint64_t half = kv->block_bytes / 2;
    const int64_t kept = old_n < new_n ? old_n : new_n; /* blocks whose V survives */
    for (int64_t l = 0; l < kv->config.n_layers; l++) {
        const uint64_t base = gy_kv_layer_offset(kv, l);
        GY_TRY(gy_arena_copy(kv->arena, base + (uint64_t)new_n * half, base + (uint64_t)old_n * half,
                             (uint64_t)kept * half));
        kv->p->stats.bytes_moved += (uint64_t)kept * half;
    }
    return GY_OK;
}

static gy_status gy_kv_check_not_viewed(const gy_kv_cache *kv) {
    for (int64_t l = 0; l < gy_kv_n_runs(kv); l++)
        if (gy_arena_any_pinned(kv->arena, gy_kv_run_slot(kv, l), kv->p->pages_per_layer))
            return GY_FAIL(GY_ERR_BUSY,
                           "layer %lld is under a live NumPy view and the raw layout must move its "
                           "V blocks; delete the view first",
                           (long long)l);
    return GY_OK;
}

/* Blocks appear when the pages they need are mapped (a shadow's pages are its owner's). */
static gy_status gy_kv_refresh_blocks(gy_kv_cache *kv, int64_t pages) {
    kv->p->pages_per_layer = pages;
    const int64_t old_n = kv->p->stats.n_blocks, new_n = gy_kv_blocks_for_pages(kv, pages);
    if (new_n <= old_n) return GY_OK;
    GY_TRY(gy_kv_set_blocks(kv, new_n));
    for (int64_t b = new_n - 1; b >= old_n; b--) kv->p->free_blocks[kv->p->n_free++] = (int32_t)b;
    return GY_OK;
}

gy_status gy_kv_grow(gy_kv_cache *kv, int64_t pages) {
    if (kv == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL KV cache");
    if (kv->owner != NULL) return gy_kv_grow(kv->owner, pages);
    if (kv->base != NULL) return gy_kv_grow(kv->base, pages);
    if (pages <= 0) return GY_FAIL(GY_ERR_INVALID, "grow needs a positive page count, got %lld", (long long)pages);
    if (pages > gy_kv_page_room(kv))
        return GY_FAIL(GY_ERR_LIMIT,
                       "growing by %lld pages passes the %lld pages per layer the cache may reach "
                       "(%lld used)",
                       (long long)pages, (long long)kv->p->page_cap, (long long)kv->p->pages_per_layer);
    gy_arena_stats as;
    gy_arena_stats_get(kv->arena, &as);
    const uint64_t needed = (uint64_t)pages * (uint64_t)gy_kv_n_runs(kv);
    if (as.bytes_in_use / as.page_size + needed > as.max_pages)
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY,
                       "growing the KV cache by %lld pages per layer needs %llu pages (%llu bytes) "
                       "but only %llu are free",
                       (long long)pages, (unsigned long long)needed,
                       (unsigned long long)(needed * as.page_size),
                       (unsigned long long)(as.max_pages - as.bytes_in_use / as.page_size));
    if (kv->config.layout == GY_KV_LAYOUT_RAW) GY_TRY(gy_kv_check_not_viewed(kv));

    for (int64_t l = 0; l < gy_kv_n_runs(kv); l++) {
        gy_status s = gy_arena_grow(kv->arena, gy_kv_run_slot(kv, l) + kv->p->pages_per_layer,
                                    pages, GY_PAGE_TAG_KV);
        if (s != GY_OK) {
            for (int64_t j = 0; j < l; j++)
                gy_arena_shrink(kv->arena, gy_kv_run_slot(kv, j) + kv->p->pages_per_layer, pages);
            return s;
        }
    }
    const int64_t old_n = kv->p->stats.n_blocks;
    const int64_t new_n = gy_kv_blocks_for_pages(kv, kv->p->pages_per_layer + pages);
    kv->p->pages_per_layer += pages;
    GY_TRY(gy_kv_move_values(kv, old_n, new_n));
    GY_TRY(gy_kv_set_blocks(kv, new_n));
    for (int64_t b = new_n - 1; b >= old_n; b--) kv->p->free_blocks[kv->p->n_free++] = (int32_t)b;
    kv->p->stats.grows++;
    if (kv->shadow != NULL) GY_TRY(gy_kv_refresh_blocks(kv->shadow, kv->p->pages_per_layer));
    return GY_OK;
}

gy_status gy_kv_shrink(gy_kv_cache *kv, int64_t pages) {
    if (kv == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL KV cache");
    if (kv->base != NULL) return gy_kv_shrink(kv->base, pages);
    if (kv->owner != NULL || kv->shadow != NULL)
        return GY_FAIL(GY_ERR_BUSY, "a transformation reads these pages in two geometries; "
                                    "they cannot shrink until it ends");
    GY_TRY(gy_kv_refuse_if_marked(kv, "shrink"));
    if (pages <= 0 || pages > kv->p->pages_per_layer)
        return GY_FAIL(GY_ERR_INVALID, "cannot shrink by %lld pages: %lld are mapped per layer",
                       (long long)pages, (long long)kv->p->pages_per_layer);
    const int64_t old_n = kv->p->stats.n_blocks;
    const int64_t new_n = gy_kv_blocks_for_pages(kv, kv->p->pages_per_layer - pages);
    for (int64_t b = new_n; b < old_n; b++)
        if (kv->p->block_used[b])
            return GY_FAIL(GY_ERR_BUSY,
                           "cannot shrink: block %lld (beyond the %lld blocks that would remain) is "
                           "in use",
                           (long long)b, (long long)new_n);
    for (int64_t l = 0; l < gy_kv_n_runs(kv); l++)
        if (gy_arena_any_pinned(kv->arena, gy_kv_run_slot(kv, l), kv->p->pages_per_layer))
            return GY_FAIL(GY_ERR_BUSY, "layer %lld is under a live NumPy view", (long long)l);
    GY_TRY(gy_kv_move_values(kv, old_n, new_n));
    for (int64_t l = 0; l < gy_kv_n_runs(kv); l++)
        GY_TRY(gy_arena_shrink(kv->arena, gy_kv_run_slot(kv, l) + kv->p->pages_per_layer - pages,
                               pages));
    kv->p->pages_per_layer -= pages;
    /* Drop the vanished blocks from the free stack, keeping the order of the rest. */
    int64_t kept = 0;
    for (int64_t i = 0; i < kv->p->n_free; i++)
        if (kv->p->free_blocks[i] < new_n) kv->p->free_blocks[kept++] = kv->p->free_blocks[i];
    kv->p->n_free = kept;
    GY_TRY(gy_kv_set_blocks(kv, new_n));
    kv->p->stats.shrinks++;
    return GY_OK;
}

int64_t gy_kv_shrinkable_pages(const gy_kv_cache *kv) {
    if (kv->owner != NULL || kv->shadow != NULL) return 0;
    int64_t used_end = kv->p->stats.n_blocks; /* one past the highest block in use */
    while (used_end > 0 && !kv->p->block_used[used_end - 1]) used_end--;
    const uint64_t needed = ((uint64_t)used_end * kv->row_bytes + kv->page_size - 1) / kv->page_size;
    return kv->p->pages_per_layer - (int64_t)needed;
}

int64_t gy_kv_page_room(const gy_kv_cache *kv) { return kv->p->page_cap - kv->p->pages_per_layer; }

int64_t gy_kv_blocks_if_grown(const gy_kv_cache *kv, int64_t pages) {
    if (pages <= 0 || pages > gy_kv_page_room(kv)) return 0;
    return gy_kv_blocks_for_pages(kv, kv->p->pages_per_layer + pages) - kv->p->stats.n_blocks;
}

gy_status gy_kv_reshape(gy_kv_cache *kv, int64_t n_heads) {
    if (kv == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL KV cache");
    GY_TRY(gy_kv_refuse_if_marked(kv, "reshape"));
    GY_TRY(gy_kv_refuse_if_viewed(kv, "reshape"));
    if (kv->stack > 1)
        return GY_FAIL(GY_ERR_INVALID, "a cache stacking %lld layers a run cannot be reshaped",
                       (long long)kv->stack);
    if (kv->config.layout != GY_KV_LAYOUT_HEAD)
        return GY_FAIL(GY_ERR_INVALID,
                       "only the header-centric layout can be reshaped in place (this cache is %s)",
                       gy_kv_layout_name(kv->config.layout));
    const int64_t old_heads = kv->config.n_heads;
    if (n_heads <= 0 || (old_heads % n_heads != 0 && n_heads % old_heads != 0))
        return GY_FAIL(GY_ERR_INVALID, "cannot reshape blocks of %lld heads into blocks of %lld",
                       (long long)old_heads, (long long)n_heads);
    const uint64_t block_bytes = kv->block_bytes / (uint64_t)old_heads * (uint64_t)n_heads;
    const int64_t max_blocks = (int64_t)((uint64_t)kv->config.slots_per_layer * kv->page_size / block_bytes);
    if (max_blocks > INT32_MAX)
        return GY_FAIL(GY_ERR_INVALID, "%lld blocks per layer is more than block ids can name",
                       (long long)max_blocks);
    uint8_t *used = gy_calloc((size_t)max_blocks, 1);
    int32_t *free_blocks = gy_malloc((size_t)max_blocks * sizeof *free_blocks);
    if (used == NULL || free_blocks == NULL) {
        free(used);
        free(free_blocks);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for %lld blocks", (long long)max_blocks);
    }
    gy_kv_seq_free_all(kv);
    free(kv->p->block_used);
    free(kv->p->free_blocks);
    kv->p->block_used = used;
    kv->p->free_blocks = free_blocks;
    kv->config.n_heads = n_heads;
    kv->block_bytes = kv->row_bytes = block_bytes; /* (never stacked) */
    kv->p->stats.block_bytes = block_bytes;
    kv->p->max_blocks = max_blocks;
    const int64_t n = gy_kv_blocks_for_pages(kv, kv->p->pages_per_layer);
    GY_TRY(gy_kv_set_blocks(kv, n));
    kv->p->n_free = 0;
    for (int64_t b = n - 1; b >= 0; b--) kv->p->free_blocks[kv->p->n_free++] = (int32_t)b;
    return GY_OK;
}

gy_status gy_kv_init_shadow(gy_kv_cache **out, gy_kv_cache *owner, int64_t n_heads) {
    if (out == NULL || owner == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_kv_init_shadow: NULL argument");
    *out = NULL;
    if (owner->shadow != NULL || owner->owner != NULL)
        return GY_FAIL(GY_ERR_BUSY, "this KV cache already takes part in a transformation");
    GY_TRY(gy_kv_refuse_if_viewed(owner, "share its pages with a shadow"));
    if (owner->stack > 1)
        return GY_FAIL(GY_ERR_INVALID, "a cache stacking layers cannot be shadowed");
    if (owner->config.layout == GY_KV_LAYOUT_RAW)
        return GY_FAIL(GY_ERR_INVALID, "the raw layout moves its V blocks when it grows, so two "
                                       "geometries cannot share its pages; use page or header");
    gy_kv_config c = owner->config;
    c.n_heads = n_heads;
    gy_kv_cache *kv;
    GY_TRY(gy_kv_init(&kv, owner->arena, &c));
    kv->owner = owner;
    owner->shadow = kv;
    gy_status s = gy_kv_refresh_blocks(kv, owner->p->pages_per_layer);
    if (s != GY_OK) {
        gy_kv_free(kv);
        return s;
    }
    *out = kv;
    return GY_OK;
}

gy_status gy_kv_init_view(gy_kv_cache **out, gy_kv_cache *base, int64_t factor) {
    if (out == NULL || base == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_kv_init_view: NULL argument");
    *out = NULL;
    if (base->base != NULL || base->owner != NULL || base->shadow != NULL)
        return GY_FAIL(GY_ERR_BUSY, "a view needs a plain cache as its base (this one is a view "
                                    "or takes part in a transformation)");
    if (base->stack > 1)
        return GY_FAIL(GY_ERR_INVALID, "a cache stacking layers cannot be viewed in another "
                                       "geometry");
    if (factor < 1 || base->config.n_heads % factor != 0)
        return GY_FAIL(GY_ERR_INVALID, "a view of factor %lld must divide the cache's %lld KV "
                       "heads", (long long)factor, (long long)base->config.n_heads);
    if (base->n_views >= GY_KV_MAX_VIEWS)
        return GY_FAIL(GY_ERR_LIMIT, "a cache has at most %d views", GY_KV_MAX_VIEWS);
    gy_kv_cache *kv = gy_calloc(1, sizeof *kv);
    if (kv == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    kv->config = base->config;
    kv->config.n_heads = base->config.n_heads / factor;
    kv->config.block_size = base->config.block_size * factor;
    kv->arena = base->arena;
    kv->page_size = base->page_size;
    kv->block_bytes = base->block_bytes;
    kv->stack = base->stack;
    kv->row_bytes = base->row_bytes;
    kv->base = base;
    kv->p = base->p;
    gy_status s = gy_kv_set_layout(kv, base->p->stats.n_blocks);
    if (s != GY_OK) {
        free(kv);
        return s;
    }
    base->views[base->n_views++] = kv;
    *out = kv;
    return GY_OK;
}

void gy_kv_take_pages(gy_kv_cache *shadow) {
    if (shadow == NULL || shadow->owner == NULL) return;
    gy_kv_cache *owner = shadow->owner;
    gy_kv_unmark(owner);
    for (int64_t i = 0; i < owner->p->seq_capacity; i++)
        if (owner->p->seqs[i].live) gy_kv_seq_free(owner, i);
    owner->p->pages_per_layer = 0;
    owner->p->n_free = 0;
    gy_kv_set_blocks(owner, 0);
    owner->shadow = NULL;
    shadow->owner = NULL;
}

void gy_kv_unshare(gy_kv_cache *shadow) {
    if (shadow == NULL || shadow->owner == NULL) return;
    gy_kv_unmark(shadow);
    gy_kv_seq_free_all(shadow);
    shadow->owner->shadow = NULL;
    shadow->owner = NULL;
    shadow->p->pages_per_layer = 0;
    shadow->p->n_free = 0;
    gy_kv_set_blocks(shadow, 0);
}

/* ---- sequences ---- */

static gy_kv_seq *gy_kv_live_seq(const gy_kv_cache *kv, int64_t seq) {
    if (seq < 0 || seq >= kv->p->seq_capacity || !kv->p->seqs[seq].live) return NULL;
    return &kv->p->seqs[seq];
}

static gy_status gy_kv_check_seq(const gy_kv_cache *kv, int64_t seq) {
    if (gy_kv_live_seq(kv, seq) == NULL)
        return GY_FAIL(GY_ERR_STATE, "sequence %lld does not exist (never created or already freed)",
                       (long long)seq);
    return GY_OK;
}

gy_status gy_kv_seq_new(gy_kv_cache *kv, int64_t *seq_out) {
    if (kv == NULL || seq_out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_kv_seq_new: NULL argument");
    if (kv->p->n_free_seqs == 0) {
        const int64_t cap = kv->p->seq_capacity ? kv->p->seq_capacity * 2 : 64;
        gy_kv_seq *seqs = gy_realloc(kv->p->seqs, (size_t)cap * sizeof *seqs);
        if (seqs == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for sequences");
        kv->p->seqs = seqs;
        int64_t *free_seqs = gy_realloc(kv->p->free_seqs, (size_t)cap * sizeof *free_seqs);
        if (free_seqs == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for sequences");
        kv->p->free_seqs = free_seqs;
        memset(kv->p->seqs + kv->p->seq_capacity, 0, (size_t)(cap - kv->p->seq_capacity) * sizeof *seqs);
        for (int64_t i = cap - 1; i >= kv->p->seq_capacity; i--) kv->p->free_seqs[kv->p->n_free_seqs++] = i;
        kv->p->seq_capacity = cap;
    }
    const int64_t id = kv->p->free_seqs[kv->p->n_free_seqs - 1];
    GY_TRY(gy_kv_record(kv, (gy_kv_undo_entry){.kind = GY_KV_UNDO_NEW, .seq = id,
                                               .generation = kv->p->generations}));
    kv->p->n_free_seqs--;
    gy_kv_seq *s = &kv->p->seqs[id];
    s->live = 1;
    s->generation = ++kv->p->generations;
    s->n_tokens = 0;
    s->n_blocks = 0;
    kv->p->n_live_seqs++;
    kv->p->stats.n_sequences = kv->p->n_live_seqs;
    *seq_out = id;
    return GY_OK;
}

int64_t gy_kv_blocks_needed(const gy_kv_cache *kv, int64_t seq, int64_t n_tokens) {
    const gy_kv_seq *s = gy_kv_live_seq(kv, seq);
    const int64_t have = s ? s->n_blocks : 0;
    const int64_t want = (n_tokens + kv->config.block_size - 1) / kv->config.block_size;
    return want > have ? want - have : 0;
}

gy_status gy_kv_seq_reserve(gy_kv_cache *kv, int64_t seq, int64_t n_tokens) {
    if (kv == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL KV cache");
    GY_TRY(gy_kv_check_seq(kv, seq));
    if (n_tokens < 0) return GY_FAIL(GY_ERR_INVALID, "token count %lld is negative", (long long)n_tokens);
    gy_kv_seq *s = &kv->p->seqs[seq];
    const int64_t extra = gy_kv_blocks_needed(kv, seq, n_tokens);
    if (extra > kv->p->n_free)
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY,
                       "sequence %lld needs %lld more blocks for %lld tokens but only %lld of %lld "
                       "are free",
                       (long long)seq, (long long)extra, (long long)n_tokens, (long long)kv->p->n_free,
                       (long long)kv->p->stats.n_blocks);
    if (extra > 0 || n_tokens > s->n_tokens)
        GY_TRY(gy_kv_record(kv, (gy_kv_undo_entry){.kind = GY_KV_UNDO_RESERVE, .seq = seq,
                                                   .n_blocks = s->n_blocks, .n_tokens = s->n_tokens}));
    if (s->n_blocks + extra > s->capacity) {
        int64_t cap = s->capacity ? s->capacity : 4;
        while (cap < s->n_blocks + extra) cap *= 2;
        int32_t *blocks = gy_realloc(s->blocks, (size_t)cap * sizeof *blocks);
        if (blocks == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a block table");
        s->blocks = blocks;
        s->capacity = cap;
    }
    for (int64_t i = 0; i < extra; i++) {
        const int32_t b = kv->p->free_blocks[--kv->p->n_free];
        kv->p->block_used[b] = 1;
        s->blocks[s->n_blocks++] = b;
    }
    if (n_tokens > s->n_tokens) s->n_tokens = n_tokens;
    return GY_OK;
}

void gy_kv_seq_free_all(gy_kv_cache *kv) {
    if (kv == NULL) return;
    for (int64_t i = 0; i < kv->p->seq_capacity; i++)
        if (kv->p->seqs[i].live) gy_kv_seq_free(kv, i);
}

gy_status gy_kv_seq_free(gy_kv_cache *kv, int64_t seq) {
    if (kv == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL KV cache");
    GY_TRY(gy_kv_check_seq(kv, seq));
    gy_kv_seq *s = &kv->p->seqs[seq];
    GY_TRY(gy_kv_record(kv, (gy_kv_undo_entry){.kind = GY_KV_UNDO_FREE, .seq = seq,
                                               .n_blocks = s->n_blocks, .n_tokens = s->n_tokens}));
    /* Push in reverse so the sequence's first block is the next one handed out. */
    for (int64_t i = s->n_blocks - 1; i >= 0; i--) {
        kv->p->block_used[s->blocks[i]] = 0;
        kv->p->free_blocks[kv->p->n_free++] = s->blocks[i];
    }
    s->live = 0;
    s->n_blocks = 0;
    s->n_tokens = 0;
    if (!kv->p->marked) kv->p->free_seqs[kv->p->n_free_seqs++] = seq; /* else at unmark */
    kv->p->n_live_seqs--;
    kv->p->stats.n_sequences = kv->p->n_live_seqs;
    return GY_OK;
}

gy_status gy_kv_seq_adopt(gy_kv_cache *kv, const int32_t *blocks, int64_t n_blocks,
                          int64_t n_tokens, int64_t *seq_out) {
    if (kv == NULL || seq_out == NULL || (blocks == NULL && n_blocks > 0))
        return GY_FAIL(GY_ERR_INVALID, "gy_kv_seq_adopt: NULL argument");
    GY_TRY(gy_kv_refuse_if_marked(kv, "adopt blocks"));
    if (n_blocks < 0 || n_tokens < 0 || n_tokens > n_blocks * kv->config.block_size)
        return GY_FAIL(GY_ERR_INVALID, "%lld tokens do not fit %lld blocks", (long long)n_tokens,
                       (long long)n_blocks);
    for (int64_t i = 0; i < n_blocks; i++) {
        if (blocks[i] < 0 || blocks[i] >= kv->p->stats.n_blocks)
            return GY_FAIL(GY_ERR_INVALID, "block %d is out of range [0, %lld)", (int)blocks[i],
                           (long long)kv->p->stats.n_blocks);
        if (kv->p->block_used[blocks[i]])
            return GY_FAIL(GY_ERR_STATE, "block %d is already in use", (int)blocks[i]);
        for (int64_t j = 0; j < i; j++)
            if (blocks[j] == blocks[i]) return GY_FAIL(GY_ERR_INVALID, "block %d is listed twice", (int)blocks[i]);
    }
    int64_t seq;
    GY_TRY(gy_kv_seq_new(kv, &seq));
    gy_kv_seq *s = &kv->p->seqs[seq];
    if (n_blocks > s->capacity) {
        int32_t *table = gy_realloc(s->blocks, (size_t)n_blocks * sizeof *table);
        if (table == NULL) {
            gy_kv_seq_free(kv, seq);
            return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a block table");
        }
        s->blocks = table;
        s->capacity = n_blocks;
    }
    for (int64_t i = 0; i < n_blocks; i++) {
        s->blocks[i] = blocks[i];
        kv->p->block_used[blocks[i]] = 1;
    }
    s->n_blocks = n_blocks;
    s->n_tokens = n_tokens;
    /* Take the adopted blocks out of the free stack, keeping the order of the rest. */
    int64_t kept = 0;
    for (int64_t i = 0; i < kv->p->n_free; i++)
        if (!kv->p->block_used[kv->p->free_blocks[i]]) kv->p->free_blocks[kept++] = kv->p->free_blocks[i];
    kv->p->n_free = kept;
    *seq_out = seq;
    return GY_OK;
}

int64_t gy_kv_seq_n_blocks(const gy_kv_cache *kv, int64_t seq) {
    const gy_kv_seq *s = gy_kv_live_seq(kv, seq);
    return s ? s->n_blocks : -1;
}

const int32_t *gy_kv_seq_blocks(const gy_kv_cache *kv, int64_t seq) {
    const gy_kv_seq *s = gy_kv_live_seq(kv, seq);
    return s ? s->blocks : NULL;
}

uint64_t gy_kv_seq_generation(const gy_kv_cache *kv, int64_t seq) {
    const gy_kv_seq *s = gy_kv_live_seq(kv, seq);
    return s ? s->generation : 0;
}

int64_t gy_kv_seq_n_tokens(const gy_kv_cache *kv, int64_t seq) {
    const gy_kv_seq *s = gy_kv_live_seq(kv, seq);
    return s ? s->n_tokens : -1;
}

/* ---- values ---- */

gy_status gy_kv_host_access(const gy_kv_cache *kv, int64_t seq, int64_t layer, int64_t pos,
                            int64_t n, float **base) {
    if (kv == NULL || base == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    GY_TRY(gy_kv_check_seq(kv, seq));
    if (layer < 0 || layer >= kv->config.n_layers)
        return GY_FAIL(GY_ERR_INVALID, "layer %lld is out of range [0, %lld)", (long long)layer,
                       (long long)kv->config.n_layers);
    const int64_t room = kv->p->seqs[seq].n_blocks * kv->config.block_size;
    if (pos < 0 || n < 0 || pos > room || n > room - pos)
        return GY_FAIL(GY_ERR_INVALID,
                       "tokens [%lld, %lld) are outside the %lld tokens sequence %lld has room for",
                       (long long)pos, (long long)(pos + n), (long long)room, (long long)seq);
    if (kv->config.elem_size != (int64_t)sizeof(float))
        return GY_FAIL(GY_ERR_UNAVAILABLE, "host reads and writes support fp32 KV only (elem_size %lld)",
                       (long long)kv->config.elem_size);
    *base = gy_kv_layer_ptr(kv, layer);
    if (*base == NULL)
        return GY_FAIL(GY_ERR_UNAVAILABLE, "the KV cache lives in device memory; use the device kernels");
    return GY_OK;
}

static gy_status gy_kv_check_access(const gy_kv_cache *kv, int64_t seq, int64_t layer, int64_t pos,
                                    int64_t n, const void *a, const void *b, float **base) {
    if (a == NULL || b == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    return gy_kv_host_access(kv, seq, layer, pos, n, base);
}

gy_status gy_kv_write(gy_kv_cache *kv, int64_t seq, int64_t layer, int64_t pos, int64_t n,
                      const float *k, const float *v) {
    float *base;
    GY_TRY(gy_kv_check_access(kv, seq, layer, pos, n, k, v, &base));
    const gy_kv_layout *L = &kv->layout;
    const int64_t H = L->n_heads, D = L->head_dim, B = L->block_size;
    const int32_t *blocks = kv->p->seqs[seq].blocks;
    for (int64_t i = 0; i < n; i++) {
        const int64_t block = blocks[(pos + i) / B], t = (pos + i) % B;
        for (int64_t h = 0; h < H; h++) {
            memcpy(base + gy_kv_layout_offset(L, 0, block, t, h), k + (i * H + h) * D, (size_t)D * sizeof(float));
            memcpy(base + gy_kv_layout_offset(L, 1, block, t, h), v + (i * H + h) * D, (size_t)D * sizeof(float));
        }
    }
    return GY_OK;
}

gy_status gy_kv_gather(const gy_kv_cache *kv, int64_t seq, int64_t layer, int64_t pos, int64_t n,
                       float *k_out, float *v_out) {
    float *base;
    GY_TRY(gy_kv_check_access(kv, seq, layer, pos, n, k_out, v_out, &base));
    const gy_kv_layout *L = &kv->layout;
    const int64_t H = L->n_heads, D = L->head_dim, B = L->block_size;
    const int32_t *blocks = kv->p->seqs[seq].blocks;
    for (int64_t i = 0; i < n; i++) {
        const int64_t block = blocks[(pos + i) / B], t = (pos + i) % B;
        for (int64_t h = 0; h < H; h++) {
            memcpy(k_out + (i * H + h) * D, base + gy_kv_layout_offset(L, 0, block, t, h), (size_t)D * sizeof(float));
            memcpy(v_out + (i * H + h) * D, base + gy_kv_layout_offset(L, 1, block, t, h), (size_t)D * sizeof(float));
        }
    }
    return GY_OK;
}

/* ---- resizing for a pipeline re-split (PipeLive, kv_cache.h) ---- */

static gy_status gy_kv_refuse_if_shared(const gy_kv_cache *kv, const char *what) {
    GY_TRY(gy_kv_refuse_if_marked(kv, what));
    GY_TRY(gy_kv_refuse_if_viewed(kv, what));
    if (kv->owner != NULL || kv->shadow != NULL)
        return GY_FAIL(GY_ERR_BUSY, "cannot %s: a transformation reads these pages in two "
                                    "geometries", what);
    return GY_OK;
}

gy_status gy_kv_set_page_cap(gy_kv_cache *kv, int64_t pages) {
    if (kv == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL KV cache");
    if (kv->base != NULL) return gy_kv_set_page_cap(kv->base, pages);
    if (pages < 0) pages = kv->config.slots_per_layer;
    if (pages < kv->p->pages_per_layer || pages > kv->config.slots_per_layer)
        return GY_FAIL(GY_ERR_INVALID, "a page cap of %lld per layer must lie between the %lld "
                       "pages mapped and the %lld slots reserved (shrink first)", (long long)pages,
                       (long long)kv->p->pages_per_layer, (long long)kv->config.slots_per_layer);
    kv->p->page_cap = pages;
    return GY_OK;
}

int64_t gy_kv_page_cap(const gy_kv_cache *kv) { return kv->p->page_cap; }

gy_status gy_kv_set_layers(gy_kv_cache *kv, int64_t first_layer, int64_t n_layers) {
    if (kv == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL KV cache");
    GY_TRY(gy_kv_refuse_if_shared(kv, "change its layers"));
    const gy_kv_config *c = &kv->config;
    const int64_t spl = c->slots_per_layer, k = kv->stack;
    /* run R of the model (its layers [R k, R k + k)) lives at slot0 + R * spl whatever the range */
    const int64_t slot0 = c->first_slot - c->first_layer / k * spl;
    if (first_layer < 0 || n_layers <= 0 || first_layer % k || n_layers % k ||
        slot0 + first_layer / k * spl < 0 ||
        (uint64_t)(slot0 + (first_layer + n_layers) / k * spl) > gy_arena_n_slots(kv->arena))
        return GY_FAIL(GY_ERR_INVALID, "layers [%lld, %lld) are not whole runs of %lld layers on "
                       "the slots this cache's layers are placed on (run R at slot %lld + R * %lld)",
                       (long long)first_layer, (long long)(first_layer + n_layers), (long long)k,
                       (long long)slot0, (long long)spl);
    const int64_t old_lo = c->first_layer / k, old_hi = (c->first_layer + c->n_layers) / k;
    const int64_t lo = first_layer / k, hi = (first_layer + n_layers) / k;
    const int64_t pages = kv->p->pages_per_layer;
    gy_arena_stats as;
    gy_arena_stats_get(kv->arena, &as);
    int64_t added = 0;
    for (int64_t r = lo; r < hi; r++) added += r < old_lo || r >= old_hi;
    if (pages > 0 && as.bytes_in_use / as.page_size + (uint64_t)(added * pages) > as.max_pages)
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY, "adding %lld runs of layers of %lld KV pages needs "
                       "%lld pages but only %llu are free", (long long)added, (long long)pages,
                       (long long)(added * pages),
                       (unsigned long long)(as.max_pages - as.bytes_in_use / as.page_size));
    for (int64_t r = old_lo; r < old_hi; r++)
        if ((r < lo || r >= hi) && pages > 0 && gy_arena_any_pinned(kv->arena, slot0 + r * spl, pages))
            return GY_FAIL(GY_ERR_BUSY, "layer %lld is under a live NumPy view", (long long)(r * k));
    /* Map the new runs first (all or none), then let the dropped ones go. */
    if (pages > 0)
        for (int64_t r = lo; r < hi; r++) {
            if (r >= old_lo && r < old_hi) continue;
            gy_status s = gy_arena_grow(kv->arena, slot0 + r * spl, pages, GY_PAGE_TAG_KV);
            if (s != GY_OK) {
                for (int64_t j = lo; j < r; j++)
                    if (j < old_lo || j >= old_hi) gy_arena_shrink(kv->arena, slot0 + j * spl, pages);
                return s;
            }
        }
    if (pages > 0)
        for (int64_t r = old_lo; r < old_hi; r++)
            if (r < lo || r >= hi) gy_arena_shrink(kv->arena, slot0 + r * spl, pages);
    kv->config.first_layer = first_layer;
    kv->config.n_layers = n_layers;
    kv->config.first_slot = slot0 + lo * spl;
    return GY_OK;
}

/* Whole blocks within one cache, every layer held: one KV move (a block of the page and header
 * layouts is one run of bytes, the raw layout's K and V halves two). */
static gy_status gy_kv_copy_blocks(gy_kv_cache *kv, const int32_t *to, const int32_t *from, int64_t n) {
    const gy_kv_move_item item = {.src = kv, .dst = kv, .src_blocks = from, .dst_blocks = to,
                                  .n_blocks = n, .n_heads = kv->config.n_heads,
                                  .n_tokens = GY_KV_MOVE_ALL_TOKENS};
    const gy_kv_move move = {.items = &item, .n_items = 1, .first_layer = kv->config.first_layer,
                             .end_layer = kv->config.first_layer + kv->config.n_layers};
    return gy_kv_move_run(&move, NULL, NULL);
}

gy_status gy_kv_compact(gy_kv_cache *kv, int64_t keep, int64_t *moved) {
    if (kv == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL KV cache");
    GY_TRY(gy_kv_refuse_if_shared(kv, "compact"));
    gy_kv_pool *p = kv->p;
    if (keep < 0 || keep > p->stats.n_blocks) keep = p->stats.n_blocks;
    int64_t above = 0, free_below = 0;
    for (int64_t b = 0; b < p->stats.n_blocks; b++) {
        if (b >= keep) above += p->block_used[b];
        else free_below += !p->block_used[b];
    }
    if (moved) *moved = 0;
    if (above > free_below)
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY, "%lld blocks in use lie at or past block %lld but only "
                       "%lld below it are free", (long long)above, (long long)keep,
                       (long long)free_below);
    if (above == 0) return GY_OK;
    int32_t *from = gy_malloc((size_t)above * sizeof *from), *to = gy_malloc((size_t)above * sizeof *to);
    if (from == NULL || to == NULL) {
        free(from);
        free(to);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a compaction of %lld blocks", (long long)above);
    }
    /* Pair each block past `keep` with the lowest free block below it. */
    int64_t n = 0, next = 0;
    for (int64_t b = keep; b < p->stats.n_blocks; b++) {
        if (!p->block_used[b]) continue;
        while (p->block_used[next]) next++;
        from[n] = (int32_t)b;
        to[n++] = (int32_t)next++;
    }
    /* Copy every layer's bytes first: a failure leaves the tables as they were. */
    gy_status s = gy_kv_copy_blocks(kv, to, from, n);
    if (s == GY_OK) {
        for (int64_t i = 0; i < p->seq_capacity; i++) {
            gy_kv_seq *q = &p->seqs[i];
            if (!q->live) continue;
            for (int64_t j = 0; j < q->n_blocks; j++)
                if (q->blocks[j] >= keep)
                    for (int64_t k = 0; k < n; k++)
                        if (from[k] == q->blocks[j]) {
                            q->blocks[j] = to[k];
                            break;
                        }
        }
        for (int64_t k = 0; k < n; k++) p->block_used[from[k]] = 0, p->block_used[to[k]] = 1;
        /* The free stack loses the taken blocks and gets the vacated ones at its bottom, the
         * highest lowest, so that they are handed out last (a shrink usually follows). */
        int64_t kept = 0;
        for (int64_t i = 0; i < p->n_free; i++)
            if (!p->block_used[p->free_blocks[i]]) p->free_blocks[kept++] = p->free_blocks[i];
        memmove(p->free_blocks + n, p->free_blocks, (size_t)kept * sizeof *p->free_blocks);
        for (int64_t k = 0; k < n; k++) p->free_blocks[k] = from[n - 1 - k];
        p->n_free = kept + n;
        if (moved) *moved = n;
    }
    free(from);
    free(to);
    return s;
}

/* ---- queries ---- */

const gy_kv_layout *gy_kv_layout_of(const gy_kv_cache *kv) { return &kv->layout; }
const gy_kv_config *gy_kv_config_of(const gy_kv_cache *kv) { return &kv->config; }
gy_arena *gy_kv_arena(const gy_kv_cache *kv) { return kv->arena; }

void *gy_kv_layer_ptr(const gy_kv_cache *kv, int64_t layer) {
    if (layer < 0 || layer >= kv->config.n_layers) return NULL;
    return gy_arena_host_ptr(kv->arena, gy_kv_layer_offset(kv, layer));
}

uintptr_t gy_kv_layer_address(const gy_kv_cache *kv, int64_t layer) {
    if (layer < 0 || layer >= kv->config.n_layers) return 0;
    return gy_arena_base_address(kv->arena) + (uintptr_t)gy_kv_layer_offset(kv, layer);
}

void gy_kv_stats_get(const gy_kv_cache *kv, gy_kv_stats *out) {
    *out = kv->p->stats;
    out->free_blocks = kv->p->n_free;
    out->pages_per_layer = kv->p->pages_per_layer;
}

