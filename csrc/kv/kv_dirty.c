/* kv_dirty.c: the dirty bitmap of KV patching (kv_dirty.h). */
#include "kv_dirty.h"
#include "../core/alloc.h"

#include <stdatomic.h>
#include <stdlib.h>

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
