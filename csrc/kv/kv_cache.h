/* kv_cache.h: the paged KV cache of one worker, stored in pages of its arena.
 *
 * Each layer owns a run of `slots_per_layer` virtual slots starting at
 *     first_slot + layer * slots_per_layer
 * of which the first `pages_per_layer` are mapped. A block holds `block_size` tokens of every
 * KV head of the worker, for K and V, laid out as the gy_kv_layout says; every layer has the same
 * number of blocks, `n_blocks = pages_per_layer * page_size / block_bytes`, and a block id means
 * the same block in every layer.
 *
 * Growing maps new pages at the end of each layer. With the page-friendly and header-centric
 * layouts that is all; with the raw layout the V half of the layer starts at n_blocks * half, so
 * it has to move right, and the bytes moved are counted (Gyges Figure 4).
 *
 * Layer stacking (PipeLive section 5.2, config.stack = k > 1, page or header layout): pages are
 * mapped per run of k consecutive layers (runs start at layers that are multiples of k), and in
 * a run block b of the run's layer j is k * block_bytes * b + j * block_bytes bytes in: a page
 * holds page_size / (k * block_bytes) blocks of each of the k layers, so a small block still
 * fills pages and the cache grows and shrinks by finer steps of blocks. The layout's block
 * stride says so (stride_block is k blocks), so every reader and writer is unchanged. Layer
 * ranges (gy_kv_set_layers) are then whole runs; reshape, shadows and views are refused.
 * `pages_per_layer` counts pages per run.
 *
 * Sequences own lists of blocks (their block tables). Block and sequence ids are small integers;
 * freed ones are reused, last freed first. */
#ifndef GY_KV_CACHE_H
#define GY_KV_CACHE_H

#include <stdint.h>

#include "../mem/arena.h"
#include "kv_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_kv_config {
    gy_kv_layout_kind layout;
    int64_t n_layers;        /* layers held: the model's [first_layer, first_layer + n_layers) */
    int64_t first_layer;     /* 0 unless the cache serves a stage of a plan (engine/stage.h) */
    int64_t n_heads;         /* KV heads held by this worker */
    int64_t head_dim;
    int64_t block_size;      /* tokens per block */
    int64_t elem_size;       /* bytes per value; 4 (fp32) for the CPU engine */
    int64_t first_slot;      /* arena slot where layer 0 starts */
    int64_t slots_per_layer; /* virtual slots reserved per layer (per run when stacked): the
                              * growth limit */
    int64_t stack;           /* layer stacking (PipeLive 5.2): 0 or 1 none; k > 1 puts block b
                              * of k consecutive layers side by side in one run of pages */
} gy_kv_config;

typedef struct gy_kv_stats {
    int64_t n_blocks;         /* blocks per layer now */
    int64_t free_blocks;
    int64_t pages_per_layer;  /* mapped pages per layer */
    int64_t n_sequences;      /* live sequences */
    uint64_t block_bytes;     /* bytes of one block of one layer (K and V) */
    uint64_t bytes_moved;     /* bytes shifted by growth and shrinking (raw layout only) */
    uint64_t grows;
    uint64_t shrinks;
} gy_kv_stats;

typedef struct gy_kv_cache gy_kv_cache;

/* The arena is borrowed and must outlive the cache. No pages are mapped until gy_kv_grow. */
gy_status gy_kv_init(gy_kv_cache **out, gy_arena *arena, const gy_kv_config *config);
/* Unmaps and releases the cache's pages. */
void gy_kv_free(gy_kv_cache *kv);

/* Maps `pages` more pages at the end of every layer (all layers or none). */
gy_status gy_kv_grow(gy_kv_cache *kv, int64_t pages);
/* Unmaps `pages` pages from the end of every layer; the blocks that no longer fit must be free. */
gy_status gy_kv_shrink(gy_kv_cache *kv, int64_t pages);

/* Pages per layer that gy_kv_shrink could give back now (the blocks past the kept ones free),
 * and the blocks `pages` more pages per layer would add (0 past the reserved slots). */
int64_t gy_kv_shrinkable_pages(const gy_kv_cache *kv);
int64_t gy_kv_blocks_if_grown(const gy_kv_cache *kv, int64_t pages);

/* Tensor-parallel transformation (Gyges 4.1.2), header-centric layout only: re-reads the same
 * memory as blocks of `n_heads` heads. With f = old_heads / new_heads (or its inverse), old block
 * b becomes new blocks f*b .. f*b+f-1, one per group of heads, and no byte moves. Every sequence
 * is dropped (the caller adopts the planned ones with gy_kv_seq_adopt); the pages stay. */
gy_status gy_kv_reshape(gy_kv_cache *kv, int64_t n_heads);
/* A new sequence owning exactly `blocks` (free ones), room for n_tokens. */
gy_status gy_kv_seq_adopt(gy_kv_cache *kv, const int32_t *blocks, int64_t n_blocks,
                          int64_t n_tokens, int64_t *seq_out);

/* Layer-staggered transformation: a shadow reads the owner's pages as blocks of `n_heads` heads
 * (page or header layout). Growing either grows the owner and both see the new blocks; neither
 * can shrink while they share. Each must only touch the layers in its own geometry.
 * gy_kv_take_pages ends the sharing: the shadow owns the pages, the owner is left empty (its
 * sequences freed). Freeing the owner first does the same. */
gy_status gy_kv_init_shadow(gy_kv_cache **out, gy_kv_cache *owner, int64_t n_heads);
void gy_kv_take_pages(gy_kv_cache *shadow);
/* The other way to end it (a transformation rolled back): the owner keeps the pages, grown ones
 * included; the shadow's sequences are freed and it is left empty. */
void gy_kv_unshare(gy_kv_cache *shadow);

/* Flying Serving's KV cache adaptor (section 4.2): a view reads the base's blocks as blocks of
 * block_size * factor tokens of n_heads / factor heads, which are the same bytes, and shares the
 * base's block pool, sequences and undo record: a block id is one physical block in every
 * geometry, and DP sequences (the base's) and TP sequences (a view's) live in one pool at once.
 * A sequence is read in the geometry of the cache it was made through; a block's bytes are the
 * same in all of them. Growing or shrinking either changes the base's pages, and every view sees
 * the new block count. Nothing is mapped or copied: a view costs its struct. The base cannot be
 * reshaped or shadowed while it has views, and must outlive them (freeing it first leaves them
 * unusable). */
#define GY_KV_MAX_VIEWS 4
gy_status gy_kv_init_view(gy_kv_cache **out, gy_kv_cache *base, int64_t factor);

/* Pipeline re-split (PipeLive, Algorithm 1). Refused, changing nothing, while the cache is
 * marked, viewed or shadowed.
 * gy_kv_set_page_cap caps the pages per layer growth may reach (ResizeKV's global block count;
 * < 0 lifts the cap to the reserved slots); it must not be below what is mapped.
 * gy_kv_set_layers makes the cache hold model layers [first_layer, first_layer + n_layers):
 * model layer l always lives at the same slots (first_slot - first_layer * slots_per_layer
 * + l * slots_per_layer, as placed at init), layers that join get as many pages as the others
 * (all or none), layers that leave are unmapped; sequences and block tables stay, and a block id
 * names the same block in every layer held.
 * gy_kv_compact moves every block in use at or past `keep` to a free block below it, copying
 * its bytes in every layer and rewriting the block tables, so that a shrink to `keep` blocks can
 * follow; refused (GY_ERR_OUT_OF_MEMORY) when too few blocks below `keep` are free. *moved gets
 * the blocks moved. */
gy_status gy_kv_set_page_cap(gy_kv_cache *kv, int64_t pages);
int64_t gy_kv_page_cap(const gy_kv_cache *kv);
/* Runs of pages (layers / stack) and layers per run. */
int64_t gy_kv_n_runs(const gy_kv_cache *kv);
int64_t gy_kv_stack(const gy_kv_cache *kv);
/* Pages per layer the cache could still grow by (the cap, or the reserved slots). */
int64_t gy_kv_page_room(const gy_kv_cache *kv);
gy_status gy_kv_set_layers(gy_kv_cache *kv, int64_t first_layer, int64_t n_layers);
gy_status gy_kv_compact(gy_kv_cache *kv, int64_t keep, int64_t *moved);

/* Undo, for a step that fails half-way (engine.c): from gy_kv_mark on, every sequence call
 * (new, reserve, free) first writes down what it changes, and gy_kv_undo takes all of it back,
 * in reverse order, leaving every sequence, block table and the free block stack exactly as at
 * the mark. Undo allocates nothing and cannot fail. The mark reserves room for `changes`
 * records (a call makes at most one), so within that many calls none can fail to write its
 * record; past it a record may fail, and the call then changes nothing. Ids of sequences freed
 * while marked are held back (their tables stay readable for an undo) and become reusable at
 * unmark, which keeps the changes. Growing is allowed meanwhile (the new blocks are free again
 * after an undo; the caller shrinks the pages back); adopt, shrink and reshape are refused with
 * GY_ERR_BUSY. Marking again forgets the older record. */
gy_status gy_kv_mark(gy_kv_cache *kv, int64_t changes);
void gy_kv_undo(gy_kv_cache *kv);
void gy_kv_unmark(gy_kv_cache *kv);
/* Part of the way back: gy_kv_undo_point says where the record is now, gy_kv_undo_to takes back
 * what was recorded after that point and stays marked (an all-or-nothing call over several
 * caches undoes its own part this way). */
int64_t gy_kv_undo_point(const gy_kv_cache *kv);
void gy_kv_undo_to(gy_kv_cache *kv, int64_t point);

/* Sequences and their block tables. reserve makes room for `n_tokens` tokens in total (it only
 * adds blocks), all-or-nothing; it fails with GY_ERR_OUT_OF_MEMORY when too few blocks are free. */
gy_status gy_kv_seq_new(gy_kv_cache *kv, int64_t *seq_out);
gy_status gy_kv_seq_reserve(gy_kv_cache *kv, int64_t seq, int64_t n_tokens);
gy_status gy_kv_seq_free(gy_kv_cache *kv, int64_t seq);
/* Frees every live sequence (a reconfiguration that is rolled back drops a shadow's). */
void gy_kv_seq_free_all(gy_kv_cache *kv);
/* Number of blocks of `seq` (or -1 when it is not live) and a pointer to its block ids, valid
 * until the next call that changes the sequence. */
int64_t gy_kv_seq_n_blocks(const gy_kv_cache *kv, int64_t seq);
const int32_t *gy_kv_seq_blocks(const gy_kv_cache *kv, int64_t seq);
int64_t gy_kv_seq_n_tokens(const gy_kv_cache *kv, int64_t seq);
/* Non-zero and different for every sequence the cache ever handed out, even when an id is
 * reused (0 when `seq` is not live): lets a reader notice that a sequence was freed and made
 * again in between. */
uint64_t gy_kv_seq_generation(const gy_kv_cache *kv, int64_t seq);
/* Blocks needed for n_tokens more than the sequence holds (0 when it already has room). */
int64_t gy_kv_blocks_needed(const gy_kv_cache *kv, int64_t seq, int64_t n_tokens);

/* GY_OK when tokens [pos, pos+n) of live sequence `seq` in `layer` can be read and written from
 * the host (fp32 KV in host memory), with the layer's address in *base; else the refusal,
 * naming its cause. */
gy_status gy_kv_host_access(const gy_kv_cache *kv, int64_t seq, int64_t layer, int64_t pos,
                            int64_t n, float **base);
/* Values of tokens [pos, pos+n) of a sequence in one layer, in logical order
 * k, v: (n, n_heads, head_dim) float32. Host memory only. */
gy_status gy_kv_write(gy_kv_cache *kv, int64_t seq, int64_t layer, int64_t pos, int64_t n,
                      const float *k, const float *v);
gy_status gy_kv_gather(const gy_kv_cache *kv, int64_t seq, int64_t layer, int64_t pos, int64_t n,
                       float *k_out, float *v_out);

/* Layout and placement. */
const gy_kv_layout *gy_kv_layout_of(const gy_kv_cache *kv); /* for the current n_blocks */
const gy_kv_config *gy_kv_config_of(const gy_kv_cache *kv);
/* Arena byte offset where `layer` starts. */
uint64_t gy_kv_layer_offset(const gy_kv_cache *kv, int64_t layer);
/* Host pointer to the layer's storage, or NULL on a device arena. */
void *gy_kv_layer_ptr(const gy_kv_cache *kv, int64_t layer);
/* The layer's storage as an address in the arena's range whatever the backend: the host pointer's
 * value on cpu, a device address on cuda (for the device kernels; 0 for a layer out of range). */
uintptr_t gy_kv_layer_address(const gy_kv_cache *kv, int64_t layer);
void gy_kv_stats_get(const gy_kv_cache *kv, gy_kv_stats *out);
gy_arena *gy_kv_arena(const gy_kv_cache *kv);

#ifdef __cplusplus
}
#endif
#endif
