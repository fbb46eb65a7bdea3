/* kv_move.c: the one entry point of KV moves (kv_move.h): the checks every backend relies on,
 * the one copy event of fault injection, and the choice of backend by where the caches live. */
#include "kv_move.h"
#include "kv_move_backend.h"
#include "../core/fault.h"

#include <stdatomic.h>
#include <stdio.h>

/* ---- backends ---- */

static _Atomic(const gy_kv_move_backend *) gy_kv_move_backends[GY_KV_MOVE_BACKEND_COUNT];

static const gy_kv_move_backend *gy_kv_move_backend_of(gy_kv_move_backend_kind kind) {
    const gy_kv_move_backend *b = atomic_load_explicit(&gy_kv_move_backends[kind], memory_order_acquire);
    return b == NULL && kind == GY_KV_MOVE_BACKEND_HOST ? &gy_kv_move_host_backend : b;
}

gy_status gy_kv_move_set_backend(gy_kv_move_backend_kind kind, const gy_kv_move_backend *backend) {
    if ((int)kind < 0 || kind >= GY_KV_MOVE_BACKEND_COUNT)
        return GY_FAIL(GY_ERR_INVALID, "no KV move backend kind %d", (int)kind);
    if (backend != NULL && (backend->name == NULL || backend->copy == NULL))
        return GY_FAIL(GY_ERR_INVALID, "a KV move backend needs a name and a copy function");
    atomic_store_explicit(&gy_kv_move_backends[kind], backend, memory_order_release);
    return GY_OK;
}

const char *gy_kv_move_backend_name(gy_kv_move_backend_kind kind) {
    if ((int)kind < 0 || kind >= GY_KV_MOVE_BACKEND_COUNT) return "unknown";
    const gy_kv_move_backend *b = gy_kv_move_backend_of(kind);
    return b != NULL ? b->name : "none";
}

/* ---- reading a checked move (kv_move_backend.h) ---- */

int64_t gy_kv_move_item_pairs(const gy_kv_move_item *it, const int32_t **src, const int32_t **dst) {
    if (it->src_blocks != NULL) {
        *src = it->src_blocks;
        *dst = it->dst_blocks;
        return it->n_blocks;
    }
    *src = gy_kv_seq_blocks(it->src, it->src_seq);
    *dst = gy_kv_seq_blocks(it->dst, it->dst_seq);
    const int64_t B = gy_kv_config_of(it->src)->block_size;
    if (it->n_tokens >= 0) return (it->n_tokens + B - 1) / B;
    const int64_t n = gy_kv_seq_n_blocks(it->src, it->src_seq), m = gy_kv_seq_n_blocks(it->dst, it->dst_seq);
    return m < n ? m : n; /* every stage reserves the same tokens: equal unless a step failed */
}

int64_t gy_kv_move_item_tokens(const gy_kv_move_item *it) {
    if (it->n_tokens >= 0) return it->n_tokens;
    const int32_t *s, *d;
    return gy_kv_move_item_pairs(it, &s, &d) * gy_kv_config_of(it->src)->block_size;
}

int gy_kv_move_same_place(const gy_kv_move *mv, const gy_kv_move_item *it) {
    const gy_kv_layout *ls = gy_kv_layout_of(it->src), *ld = gy_kv_layout_of(it->dst);
    if (ls->stride_kv != ld->stride_kv || ls->stride_token != ld->stride_token ||
        ls->stride_head != ld->stride_head)
        return 0;
    for (int64_t l = mv->first_layer; l < mv->end_layer; l++)
        if (gy_kv_layer_address(it->src, gy_kv_move_layer(it->src, l)) !=
            gy_kv_layer_address(it->dst, gy_kv_move_layer(it->dst, l)))
            return 0;
    return 1;
}

int gy_kv_move_pair_moves(const gy_kv_move *mv, const gy_kv_move_item *it, int64_t j,
                          const int32_t *sb, const int32_t *db, int same_place, uint64_t *in_place) {
    const gy_kv_layout *ls = gy_kv_layout_of(it->src), *ld = gy_kv_layout_of(it->dst);
    const int64_t B = ls->block_size, t = gy_kv_move_pair_tokens(it, j, B);
    if (t <= 0 || it->n_heads <= 0) return 0;
    if (mv->dirty != NULL) {
        int any = 0;
        for (int64_t k = 0; k < t && !any; k++)
            any = gy_kv_move_dirty_at(mv->dirty, (int64_t)sb[j] * B + k);
        if (!any) return 0;
    }
    if (same_place && gy_kv_layout_offset(ls, 0, sb[j], 0, it->src_head) ==
                          gy_kv_layout_offset(ld, 0, db[j], 0, it->dst_head)) {
        *in_place += (uint64_t)(t * (mv->end_layer - mv->first_layer) *
                                gy_kv_move_token_bytes(it->src, it->n_heads));
        return 0;
    }
    return 1;
}

/* ---- checks ---- */

/* Where a cache's bytes are: -1 for host memory, else the CUDA device. */
static int32_t gy_kv_move_memory(const gy_kv_cache *kv) {
    const gy_arena *a = gy_kv_arena(kv);
    return gy_arena_backend(a) == GY_ARENA_BACKEND_CUDA ? gy_arena_device(a) : -1;
}

static const char *gy_kv_move_memory_name(int32_t memory, char *buf, size_t n) {
    if (memory < 0) return "host memory";
    snprintf(buf, n, "CUDA device %d", (int)memory);
    return buf;
}

static gy_status gy_kv_move_check_blocks(const gy_kv_cache *kv, const int32_t *blocks, int64_t n,
                                         int64_t item, const char *which) {
    gy_kv_stats st;
    gy_kv_stats_get(kv, &st);
    for (int64_t i = 0; i < n; i++)
        if (blocks[i] < 0 || blocks[i] >= st.n_blocks)
            return GY_FAIL(GY_ERR_INVALID,
                           "move item %lld: %s block %d (entry %lld) is not one of the cache's "
                           "%lld mapped blocks",
                           (long long)item, which, (int)blocks[i], (long long)i,
                           (long long)st.n_blocks);
    return GY_OK;
}

static gy_status gy_kv_move_check_seq(const gy_kv_cache *kv, int64_t seq, int64_t n_tokens,
                                      int64_t item, const char *which) {
    const int64_t n = gy_kv_seq_n_blocks(kv, seq);
    if (n < 0)
        return GY_FAIL(GY_ERR_STATE, "move item %lld: %s sequence %lld does not exist",
                       (long long)item, which, (long long)seq);
    const int64_t B = gy_kv_config_of(kv)->block_size;
    if (n_tokens > n * B)
        return GY_FAIL(GY_ERR_INVALID,
                       "move item %lld: the %s sequence %lld has room for %lld tokens, not %lld",
                       (long long)item, which, (long long)seq, (long long)(n * B),
                       (long long)n_tokens);
    return GY_OK;
}

/* Item i on its own: caches, heads, layers, blocks. */
static gy_status gy_kv_move_check_item(const gy_kv_move *mv, int64_t i) {
    const gy_kv_move_item *it = &mv->items[i];
    if (it->src == NULL || it->dst == NULL)
        return GY_FAIL(GY_ERR_INVALID, "move item %lld: NULL cache", (long long)i);
    const gy_kv_config *dc = gy_kv_config_of(it->dst), *sc = gy_kv_config_of(it->src);
    if (dc->block_size != sc->block_size || dc->head_dim != sc->head_dim ||
        dc->elem_size != sc->elem_size)
        return GY_FAIL(GY_ERR_INVALID,
                       "move item %lld: the caches differ in block_size (%lld vs %lld), head_dim "
                       "(%lld vs %lld) or value size (%lld vs %lld bytes)",
                       (long long)i, (long long)dc->block_size, (long long)sc->block_size,
                       (long long)dc->head_dim, (long long)sc->head_dim,
                       (long long)dc->elem_size, (long long)sc->elem_size);
    if (it->n_heads < 0 || it->src_head < 0 || it->src_head + it->n_heads > sc->n_heads ||
        it->dst_head < 0 || it->dst_head + it->n_heads > dc->n_heads)
        return GY_FAIL(GY_ERR_INVALID,
                       "move item %lld: heads [%lld, %lld) of %lld -> [%lld, %lld) of %lld are "
                       "out of range",
                       (long long)i, (long long)it->src_head, (long long)(it->src_head + it->n_heads),
                       (long long)sc->n_heads, (long long)it->dst_head,
                       (long long)(it->dst_head + it->n_heads), (long long)dc->n_heads);
    if (mv->first_layer < sc->first_layer || mv->first_layer < dc->first_layer ||
        mv->end_layer > sc->first_layer + sc->n_layers ||
        mv->end_layer > dc->first_layer + dc->n_layers)
        return GY_FAIL(GY_ERR_INVALID,
                       "move item %lld: layers [%lld, %lld) are not held by both caches ([%lld, "
                       "%lld) and [%lld, %lld))",
                       (long long)i, (long long)mv->first_layer, (long long)mv->end_layer,
                       (long long)sc->first_layer, (long long)(sc->first_layer + sc->n_layers),
                       (long long)dc->first_layer, (long long)(dc->first_layer + dc->n_layers));
    if ((it->src_blocks == NULL) != (it->dst_blocks == NULL))
        return GY_FAIL(GY_ERR_INVALID, "move item %lld: two block lists or none (sequences)",
                       (long long)i);
    const int64_t B = sc->block_size;
    if (it->src_blocks != NULL) {
        if (it->n_blocks < 0)
            return GY_FAIL(GY_ERR_INVALID, "move item %lld: negative block count", (long long)i);
        if (it->n_tokens > it->n_blocks * B)
            return GY_FAIL(GY_ERR_INVALID, "move item %lld: %lld tokens do not fit %lld blocks",
                           (long long)i, (long long)it->n_tokens, (long long)it->n_blocks);
        GY_TRY(gy_kv_move_check_blocks(it->dst, it->dst_blocks, it->n_blocks, i, "destination"));
        return gy_kv_move_check_blocks(it->src, it->src_blocks, it->n_blocks, i, "source");
    }
    GY_TRY(gy_kv_move_check_seq(it->src, it->src_seq, it->n_tokens, i, "source"));
    return gy_kv_move_check_seq(it->dst, it->dst_seq, it->n_tokens, i, "destination");
}

/* The bitmap covers the source blocks, of one cache. */
static gy_status gy_kv_move_check_dirty(const gy_kv_move *mv) {
    if (mv->flags & GY_KV_MOVE_OVERLAP)
        return GY_FAIL(GY_ERR_INVALID, "a dirty bitmap patches a plain move; an OVERLAP move "
                       "reads every slot");
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kv_move_item *it = &mv->items[i];
        if (it->src != mv->items[0].src)
            return GY_FAIL(GY_ERR_INVALID, "move item %lld: a dirty bitmap covers one source "
                           "cache, this item reads another", (long long)i);
        const int32_t *sb, *db;
        const int64_t n = gy_kv_move_item_pairs(it, &sb, &db);
        const int64_t B = gy_kv_config_of(it->src)->block_size;
        for (int64_t j = 0; j < n; j++)
            if (((int64_t)sb[j] + 1) * B > mv->dirty_slots)
                return GY_FAIL(GY_ERR_INVALID, "move item %lld: source block %d is past the "
                               "bitmap's %lld slots", (long long)i, (int)sb[j],
                               (long long)mv->dirty_slots);
    }
    return GY_OK;
}

/* Checks everything, picks the backend; *work gets whether there is anything to copy. */
static gy_status gy_kv_move_check(const gy_kv_move *mv, gy_kv_move_backend_kind *kind, int *work) {
    *work = 0;
    if (mv == NULL || (mv->n_items > 0 && mv->items == NULL))
        return GY_FAIL(GY_ERR_INVALID, "gy_kv_move_run: NULL move or items");
    if (mv->n_items < 0 || mv->first_layer < 0 || mv->end_layer < mv->first_layer)
        return GY_FAIL(GY_ERR_INVALID, "a KV move of %lld items over layers [%lld, %lld)",
                       (long long)mv->n_items, (long long)mv->first_layer, (long long)mv->end_layer);
    if (mv->threads < 0 || mv->threads > 2)
        return GY_FAIL(GY_ERR_INVALID, "a KV move runs on 1 or 2 threads, not %d", (int)mv->threads);
    int32_t mem_a = 0, mem_b = 0;
    int several = 0, any_host = 0; /* caches in more than one memory; some in host memory */
    for (int64_t i = 0; i < mv->n_items; i++) {
        GY_TRY(gy_kv_move_check_item(mv, i));
        const int32_t a = gy_kv_move_memory(mv->items[i].src), b = gy_kv_move_memory(mv->items[i].dst);
        if (i == 0) mem_a = a, mem_b = b;
        several |= a != mem_a || b != mem_a;
        any_host |= a < 0 || b < 0;
        /* With a communicator the comm backend's check places every cache on one of its ranks. */
        if (mv->comm == NULL && (a != mem_a || b != mem_b) && (a != mem_b || b != mem_a)) {
            char x[32], y[32], u[32], v[32];
            return GY_FAIL(GY_ERR_INVALID,
                           "move item %lld copies from %s to %s, item 0 between %s and %s: a "
                           "move's caches live in one memory (or two, for the communicator)",
                           (long long)i, gy_kv_move_memory_name(a, x, sizeof x),
                           gy_kv_move_memory_name(b, y, sizeof y),
                           gy_kv_move_memory_name(mem_a, u, sizeof u),
                           gy_kv_move_memory_name(mem_b, v, sizeof v));
        }
        const int32_t *sb, *db;
        *work |= mv->items[i].n_heads > 0 && gy_kv_move_item_pairs(&mv->items[i], &sb, &db) > 0 &&
                 gy_kv_move_item_tokens(&mv->items[i]) > 0;
    }
    *work &= mv->end_layer > mv->first_layer;
    if (mv->dirty != NULL) GY_TRY(gy_kv_move_check_dirty(mv));
    *kind = several        ? GY_KV_MOVE_BACKEND_COMM
            : mem_a < 0    ? GY_KV_MOVE_BACKEND_HOST
                           : GY_KV_MOVE_BACKEND_DEVICE;
    if (mv->n_items == 0) *kind = GY_KV_MOVE_BACKEND_HOST;
    const gy_kv_move_backend *b = gy_kv_move_backend_of(*kind);
    if (*kind == GY_KV_MOVE_BACKEND_COMM && (b == NULL || mv->comm == NULL || any_host)) {
        char x[32], y[32];
        const char *why = b == NULL ? "which is not registered (gyges built without CUDA)"
                          : any_host
                              ? "which joins CUDA devices only: host memory is not a rank"
                              : "over the group's migration communicator, and this move was given none";
        return GY_FAIL(any_host || b == NULL ? GY_ERR_UNAVAILABLE : GY_ERR_INVALID,
                       "KV moves between %s and %s need the NCCL migration backend (a "
                       "communicator whose ranks hold the caches), %s; KV moves work within host "
                       "memory, within one CUDA device, and between the devices of one "
                       "communicator",
                       gy_kv_move_memory_name(mem_a, x, sizeof x),
                       gy_kv_move_memory_name(mem_b, y, sizeof y), why);
    }
    if (b == NULL)
        return GY_FAIL(GY_ERR_UNAVAILABLE,
                       "KV moves on CUDA device %d need the device backend "
                       "(kernels/kv_move_device.c), which is not registered: gyges was built "
                       "without CUDA, or gy_kv_move_device_register was not called",
                       (int)mem_a);
    if ((mv->flags & GY_KV_MOVE_OVERLAP) && b->copy_overlapping == NULL)
        return GY_FAIL(GY_ERR_UNAVAILABLE, "the %s KV move backend cannot move KV over its own "
                       "sources (GY_KV_MOVE_OVERLAP): host caches only", b->name);
    if (*work && b->check != NULL) GY_TRY(b->check(mv));
    return GY_OK;
}

/* The slots asked for in each layer and their bytes in all of them. */
static void gy_kv_move_asked(const gy_kv_move *mv, gy_kv_move_stats *st) {
    const int64_t layers = mv->end_layer - mv->first_layer;
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kv_move_item *it = &mv->items[i];
        int64_t slots = 0;
        if (mv->dirty == NULL) {
            slots = gy_kv_move_item_tokens(it);
        } else {
            const int32_t *sb, *db;
            const int64_t n = gy_kv_move_item_pairs(it, &sb, &db);
            const int64_t B = gy_kv_config_of(it->src)->block_size;
            for (int64_t j = 0; j < n; j++)
                for (int64_t t = 0; t < gy_kv_move_pair_tokens(it, j, B); t++)
                    slots += gy_kv_move_dirty_at(mv->dirty, (int64_t)sb[j] * B + t);
        }
        st->slots += slots;
        st->bytes += (uint64_t)(slots * layers * gy_kv_move_token_bytes(it->src, it->n_heads));
    }
}

gy_status gy_kv_move_run(const gy_kv_move *mv, gy_kv_move_stage *stage, gy_kv_move_stats *stats) {
    gy_kv_move_stats st = {0};
    if (stats) *stats = st;
    gy_kv_move_backend_kind kind = GY_KV_MOVE_BACKEND_HOST;
    int work;
    GY_TRY(gy_kv_move_check(mv, &kind, &work));
    st.backend = (int32_t)kind;
    if (work) {
        if (gy_fault_hit(GY_FAULT_COPY))
            return GY_FAIL(GY_ERR_SYSTEM, "injected fault: a KV move of %lld items over layers "
                           "[%lld, %lld) failed", (long long)mv->n_items,
                           (long long)mv->first_layer, (long long)mv->end_layer);
        gy_kv_move_asked(mv, &st);
        const gy_kv_move_backend *b = gy_kv_move_backend_of(kind);
        GY_TRY(mv->flags & GY_KV_MOVE_OVERLAP ? b->copy_overlapping(mv, stage, &st)
                                              : b->copy(mv, &st));
    }
    if (stats) *stats = st;
    return GY_OK;
}

gy_status gy_kv_move_plan(gy_kv_move_stage *stage, const gy_kv_move *mv) {
    if (stage == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_kv_move_plan: NULL stage");
    gy_kv_move_backend_kind kind = GY_KV_MOVE_BACKEND_HOST;
    int work;
    GY_TRY(gy_kv_move_check(mv, &kind, &work));
    if (!(mv->flags & GY_KV_MOVE_OVERLAP) || kind != GY_KV_MOVE_BACKEND_HOST)
        return GY_FAIL(GY_ERR_INVALID, "an early read is the first phase of an OVERLAP move of "
                       "host caches");
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kv_move_item *it = &mv->items[i];
        if (it->src_blocks != NULL || it->n_tokens < 0)
            return GY_FAIL(GY_ERR_INVALID, "move item %lld: an early read needs sequences and a "
                           "token count (a sequence's generation tells a remade one)", (long long)i);
        if (gy_kv_config_of(it->src)->layout == GY_KV_LAYOUT_RAW ||
            gy_kv_config_of(it->dst)->layout == GY_KV_LAYOUT_RAW)
            return GY_FAIL(GY_ERR_INVALID, "move item %lld: the raw layout moves V when it "
                           "grows, so an early read's addresses could go stale; moves read "
                           "early need page or header", (long long)i);
    }
    return gy_kv_move_stage_plan(stage, mv);
}
