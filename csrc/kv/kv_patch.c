/* kv_patch.c: the dirty bitmap of KV patching and the token copy (kv_patch.h). */
#include "kv_patch.h"
#include "kv_copy.h"
#include "../core/alloc.h"
#include "../core/fault.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

struct gy_kv_dirty {
    int64_t n_slots, n_words;
    _Atomic uint64_t *words;  /* (n_words) bit s % 64 of word s / 64: slot s is dirty */
    _Atomic int64_t marked;   /* tokens marked since init */
};

gy_status gy_kv_dirty_init(gy_kv_dirty **out, int64_t n_slots) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_kv_dirty_init: NULL argument");
    *out = NULL;
    if (n_slots <= 0) return GY_FAIL(GY_ERR_INVALID, "a dirty bitmap needs slots, got %lld", (long long)n_slots);
    gy_kv_dirty *d = gy_calloc(1, sizeof *d);
    if (d == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    d->n_slots = n_slots;
    d->n_words = (n_slots + 63) / 64;
    d->words = gy_calloc((size_t)d->n_words, sizeof *d->words);
    if (d->words == NULL) {
        free(d);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a bitmap of %lld slots", (long long)n_slots);
    }
    atomic_init(&d->marked, 0);
    *out = d;
    return GY_OK;
}

void gy_kv_dirty_free(gy_kv_dirty *d) {
    if (d == NULL) return;
    free((void *)d->words);
    free(d);
}

int64_t gy_kv_dirty_slots(const gy_kv_dirty *d) { return d->n_slots; }
int64_t gy_kv_dirty_words(const gy_kv_dirty *d) { return d->n_words; }

static void gy_kv_dirty_set(gy_kv_dirty *d, int64_t slot) {
    atomic_fetch_or_explicit(&d->words[slot / 64], (uint64_t)1 << (slot % 64), memory_order_release);
}

gy_status gy_kv_dirty_mark_slot(gy_kv_dirty *d, int64_t slot) {
    if (d == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL dirty bitmap");
    if (slot < 0 || slot >= d->n_slots)
        return GY_FAIL(GY_ERR_INVALID, "slot %lld is outside the bitmap's %lld", (long long)slot,
                       (long long)d->n_slots);
    gy_kv_dirty_set(d, slot);
    atomic_fetch_add_explicit(&d->marked, 1, memory_order_relaxed);
    return GY_OK;
}

gy_status gy_kv_dirty_mark(gy_kv_dirty *d, const gy_kv_cache *kv, int64_t seq, int64_t pos,
                           int64_t n) {
    if (d == NULL || kv == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_kv_dirty_mark: NULL argument");
    const int64_t n_blocks = gy_kv_seq_n_blocks(kv, seq);
    if (n_blocks < 0) return GY_FAIL(GY_ERR_STATE, "sequence %lld is not live", (long long)seq);
    const int64_t B = gy_kv_config_of(kv)->block_size;
    if (pos < 0 || n < 0 || pos + n > n_blocks * B)
        return GY_FAIL(GY_ERR_INVALID, "tokens [%lld, %lld) are outside the %lld sequence %lld has "
                       "room for", (long long)pos, (long long)(pos + n), (long long)(n_blocks * B),
                       (long long)seq);
    const int32_t *blocks = gy_kv_seq_blocks(kv, seq);
    for (int64_t t = pos; t < pos + n; t++)
        if ((int64_t)blocks[t / B] * B + t % B >= d->n_slots)
            return GY_FAIL(GY_ERR_INVALID, "block %d is past the bitmap's %lld slots",
                           (int)blocks[t / B], (long long)d->n_slots);
    for (int64_t t = pos; t < pos + n; t++) gy_kv_dirty_set(d, (int64_t)blocks[t / B] * B + t % B);
    atomic_fetch_add_explicit(&d->marked, n, memory_order_relaxed);
    return GY_OK;
}

int64_t gy_kv_dirty_take(gy_kv_dirty *d, uint64_t *out) {
    int64_t n = 0;
    for (int64_t w = 0; w < d->n_words; w++) {
        /* a load first, so that clean words cost no write */
        const uint64_t seen = atomic_load_explicit(&d->words[w], memory_order_relaxed);
        out[w] = seen ? atomic_exchange_explicit(&d->words[w], 0, memory_order_acq_rel) : 0;
        n += __builtin_popcountll(out[w]);
    }
    return n;
}

int64_t gy_kv_dirty_count(const gy_kv_dirty *d) {
    int64_t n = 0;
    for (int64_t w = 0; w < d->n_words; w++)
        n += __builtin_popcountll(atomic_load_explicit(&d->words[w], memory_order_relaxed));
    return n;
}

int64_t gy_kv_dirty_marked(const gy_kv_dirty *d) {
    return atomic_load_explicit(&d->marked, memory_order_relaxed);
}

/* ---- the copy ---- */

static gy_status gy_kv_copy_tokens_check(const gy_kv_cache *dst, const int32_t *dst_blocks,
                                         const gy_kv_cache *src, const int32_t *src_blocks,
                                         int64_t n_blocks, int64_t first_layer, int64_t end_layer) {
    if (dst == NULL || src == NULL || (n_blocks > 0 && (dst_blocks == NULL || src_blocks == NULL)))
        return GY_FAIL(GY_ERR_INVALID, "copy_tokens: NULL cache or block list");
    const gy_kv_config *dc = gy_kv_config_of(dst), *sc = gy_kv_config_of(src);
    if (dc->block_size != sc->block_size || dc->n_heads != sc->n_heads ||
        dc->head_dim != sc->head_dim || dc->elem_size != sc->elem_size)
        return GY_FAIL(GY_ERR_INVALID, "copy_tokens: the caches differ in block size, heads, head "
                       "size or value size");
    if (first_layer > end_layer || first_layer < dc->first_layer || first_layer < sc->first_layer ||
        end_layer > dc->first_layer + dc->n_layers || end_layer > sc->first_layer + sc->n_layers)
        return GY_FAIL(GY_ERR_INVALID, "copy_tokens: layers [%lld, %lld) are not held by both "
                       "caches ([%lld, %lld) and [%lld, %lld))", (long long)first_layer,
                       (long long)end_layer, (long long)sc->first_layer,
                       (long long)(sc->first_layer + sc->n_layers), (long long)dc->first_layer,
                       (long long)(dc->first_layer + dc->n_layers));
    GY_TRY(gy_kv_copy_check_arenas(dst, src, "copy_tokens"));
    gy_kv_stats ds, ss;
    gy_kv_stats_get(dst, &ds);
    gy_kv_stats_get(src, &ss);
    for (int64_t i = 0; i < n_blocks; i++)
        if (dst_blocks[i] < 0 || dst_blocks[i] >= ds.n_blocks || src_blocks[i] < 0 ||
            src_blocks[i] >= ss.n_blocks)
            return GY_FAIL(GY_ERR_INVALID, "copy_tokens: entry %lld names block %d -> %d, not "
                           "mapped blocks of both caches", (long long)i, (int)src_blocks[i],
                           (int)dst_blocks[i]);
    return GY_OK;
}

/* Whether slot is set in words taken from a bitmap (gy_kv_dirty_take's layout). */
static int gy_kv_taken(const uint64_t *words, int64_t slot) {
    return (int)(words[slot / 64] >> (slot % 64) & 1);
}

/* The device twin: the blocks that hold a slot to copy (all listed ones without a bitmap) are
 * copied whole, every head, with one kernel per layer (gy_kv_copy_heads_device). Copying a
 * block's clean slots too is harmless: they hold what the destination has already or what no
 * one reads yet. *copied counts the slots asked for, as on the host. */
static gy_status gy_kv_copy_tokens_device(gy_kv_cache *dst, const int32_t *dst_blocks,
                                          const gy_kv_cache *src, const int32_t *src_blocks,
                                          int64_t n_blocks, int64_t dst_layer0,
                                          int64_t src_layer0, int64_t n_layers,
                                          const uint64_t *dirty, int64_t *copied) {
    const int64_t B = gy_kv_config_of(src)->block_size;
    int32_t *lists = gy_malloc((size_t)(2 * n_blocks) * sizeof *lists); /* (2, n_blocks) dst, src */
    if (lists == NULL)
        return GY_FAIL(GY_ERR_SYSTEM, "copy_tokens: out of host memory for %lld blocks",
                       (long long)n_blocks);
    int64_t m = 0, slots = 0;
    for (int64_t i = 0; i < n_blocks; i++) {
        int64_t in_block = B;
        if (dirty != NULL) {
            in_block = 0;
            for (int64_t t = 0; t < B; t++) {
                const int64_t slot = (int64_t)src_blocks[i] * B + t;
                in_block += gy_kv_taken(dirty, slot);
            }
        }
        if (in_block == 0) continue;
        slots += in_block;
        lists[m] = dst_blocks[i];
        lists[n_blocks + m++] = src_blocks[i];
    }
    gy_status s = m == 0 ? GY_OK
                         : gy_kv_copy_heads_device(dst, lists, 0, dst_layer0, src,
                                                   lists + n_blocks, 0, src_layer0,
                                                   gy_kv_config_of(dst)->n_heads, m, n_layers);
    free(lists);
    if (s == GY_OK && copied) *copied = slots;
    return s;
}

gy_status gy_kv_copy_tokens(gy_kv_cache *dst, const int32_t *dst_blocks, const gy_kv_cache *src,
                            const int32_t *src_blocks, int64_t n_blocks, int64_t first_layer,
                            int64_t end_layer, const uint64_t *dirty, int64_t dirty_slots,
                            int64_t *copied) {
    if (copied) *copied = 0;
    GY_TRY(gy_kv_copy_tokens_check(dst, dst_blocks, src, src_blocks, n_blocks, first_layer, end_layer));
    const int64_t B = gy_kv_config_of(src)->block_size;
    for (int64_t i = 0; dirty != NULL && i < n_blocks; i++)
        if (((int64_t)src_blocks[i] + 1) * B > dirty_slots)
            return GY_FAIL(GY_ERR_INVALID, "copy_tokens: source block %d is past the bitmap's %lld "
                           "slots", (int)src_blocks[i], (long long)dirty_slots);
    if (n_blocks == 0 || first_layer == end_layer) return GY_OK;
    if (gy_fault_hit(GY_FAULT_COPY))
        return GY_FAIL(GY_ERR_SYSTEM, "injected fault: copying KV tokens of %lld blocks failed",
                       (long long)n_blocks);
    const gy_kv_config *dc = gy_kv_config_of(dst), *sc = gy_kv_config_of(src);
    if (gy_arena_backend(gy_kv_arena(dst)) == GY_ARENA_BACKEND_CUDA)
        return gy_kv_copy_tokens_device(dst, dst_blocks, src, src_blocks, n_blocks,
                                        first_layer - dc->first_layer,
                                        first_layer - sc->first_layer, end_layer - first_layer,
                                        dirty, copied);
    const gy_kv_layout *dl = gy_kv_layout_of(dst), *sl = gy_kv_layout_of(src);
    const int64_t H = dl->n_heads, es = dl->elem_size, row = dl->head_dim * es;
    int64_t n = 0;
    for (int64_t l = first_layer; l < end_layer; l++) {
        char *dbase = gy_kv_layer_ptr(dst, l - dc->first_layer);
        const char *sbase = gy_kv_layer_ptr(src, l - sc->first_layer);
        n = 0;
        for (int64_t i = 0; i < n_blocks; i++)
            for (int64_t t = 0; t < B; t++) {
                const int64_t slot = (int64_t)src_blocks[i] * B + t;
                if (dirty && !gy_kv_taken(dirty, slot)) continue;
                n++;
                for (int64_t kv = 0; kv < 2; kv++)
                    for (int64_t h = 0; h < H; h++)
                        memcpy(dbase + gy_kv_layout_offset(dl, kv, dst_blocks[i], t, h) * es,
                               sbase + gy_kv_layout_offset(sl, kv, src_blocks[i], t, h) * es,
                               (size_t)row);
            }
    }
    if (copied) *copied = n;
    return GY_OK;
}
