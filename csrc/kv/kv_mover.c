/* kv_mover.c: moving one layer's K/V between caches, read early beside a step, written later. */
#include "kv_mover.h"
#include "../core/alloc.h"
#include "../core/fault.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../core/grow.h"
#include "run_order.h"

/* One item as the mover keeps it. Planned items carry what their early read needs (a copy of the
 * source blocks, the layer's address and layout), so that the read touches no cache structure a
 * step may change meanwhile. */
typedef struct gy_kv_mover_item {
    gy_kv_move_item it;
    uint64_t src_gen, dst_gen;
    int64_t staged;     /* tokens [0, staged) are in the stage at stage_at (floats) */
    int64_t stage_at;
    int64_t late_from;  /* finish reads tokens [late_from, n_tokens) into `late` at late_at */
    int64_t late_at;
    int64_t blocks_at;  /* planned: the source block ids, in m->blocks */
    int64_t dst_blocks_at; /* planned: the destination block ids, in m->blocks */
    float *src_base, *dst_base; /* planned: both ends' layer */
    int64_t in_place;   /* floats of the staged tokens already where they go (not staged) */
    int64_t late_in_place; /* the same for the late tokens */
    int used;           /* planned: matched by finish already */
} gy_kv_mover_item;

struct gy_kv_mover {
    int64_t layer;      /* of the plan; -1 when there is none */
    int read_done;
    gy_kv_mover_item *planned;
    int64_t n_planned, planned_cap;
    int32_t *blocks;
    int64_t blocks_cap;
    gy_kv_layout *layouts;     /* planned: item i's source (2i) and destination (2i+1) layout */
    int64_t layouts_cap;
    float *stage;
    int64_t stage_cap;  /* floats */
    float *late;
    int64_t late_cap;
    gy_kv_mover_item *now;
    int64_t now_cap;
    gy_run *runs;              /* finish without an early read: the runs, copied once */
    int64_t runs_cap;
    gy_run_order *order;
};

static gy_status gy_kv_mover_reserve(void **buf, int64_t *cap, int64_t n, size_t size) {
    return gy_grow(buf, cap, n, size, "a KV move");
}

gy_status gy_kv_mover_init(gy_kv_mover **out) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_kv_mover_init: NULL argument");
    gy_kv_mover *m = gy_calloc(1, sizeof *m);
    if (m == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    const gy_status s = gy_run_order_init(&m->order);
    if (s != GY_OK) {
        free(m);
        return s;
    }
    m->layer = -1;
    *out = m;
    return GY_OK;
}

void gy_kv_mover_free(gy_kv_mover *m) {
    if (m == NULL) return;
    free(m->planned);
    free(m->blocks);
    free(m->layouts);
    free(m->stage);
    free(m->late);
    free(m->now);
    free(m->runs);
    gy_run_order_free(m->order);
    free(m);
}

static gy_status gy_kv_mover_check_side(const gy_kv_cache *kv, int64_t seq, int64_t head0,
                                        int64_t n_heads, int64_t n_tokens, int64_t layer,
                                        int64_t i, const char *side) {
    float *base;
    const gy_status s = gy_kv_host_access(kv, seq, layer, 0, n_tokens, &base);
    if (s != GY_OK)
        return GY_FAIL(s, "move item %lld, %s: %s", (long long)i, side, gy_error_message());
    const gy_kv_config *c = gy_kv_config_of(kv);
    if (n_heads <= 0 || head0 < 0 || head0 + n_heads > c->n_heads)
        return GY_FAIL(GY_ERR_INVALID, "move item %lld: %s heads [%lld, %lld) do not fit %lld heads",
                       (long long)i, side, (long long)head0, (long long)(head0 + n_heads),
                       (long long)c->n_heads);
    if (c->layout == GY_KV_LAYOUT_RAW)
        return GY_FAIL(GY_ERR_INVALID, "the raw layout moves V when it grows; moves need page or header");
    return GY_OK;
}

static gy_status gy_kv_mover_check(const gy_kv_move_item *items, int64_t n_items, int64_t layer) {
    if (items == NULL && n_items > 0) return GY_FAIL(GY_ERR_INVALID, "NULL items");
    if (n_items < 0) return GY_FAIL(GY_ERR_INVALID, "negative item count");
    for (int64_t i = 0; i < n_items; i++) {
        const gy_kv_move_item *it = &items[i];
        GY_TRY(gy_kv_mover_check_side(it->src, it->src_seq, it->src_head, it->n_heads, it->n_tokens,
                                      layer, i, "source"));
        GY_TRY(gy_kv_mover_check_side(it->dst, it->dst_seq, it->dst_head, it->n_heads, it->n_tokens,
                                      layer, i, "destination"));
        if (gy_kv_config_of(it->src)->head_dim != gy_kv_config_of(it->dst)->head_dim)
            return GY_FAIL(GY_ERR_INVALID, "move item %lld: head_dim differs", (long long)i);
    }
    return GY_OK;
}

/* One end of an item in one layer: where its heads' tokens are. */
typedef struct gy_kv_mover_end {
    float *base;               /* the layer */
    const gy_kv_layout *L;
    const int32_t *blocks;
    int64_t head0;
} gy_kv_mover_end;

/* Copies tokens [t0, t1) of heads [head0, head0 + n_heads) between the layer `at` and `buf`,
 * which holds them as (head, K/V, token, head_dim) from token t0; where the layout keeps a head's
 * tokens of a block together (header-centric) a block's run is one copy. A run whose address is
 * the same at `other`, the item's other end, is already where it goes and is skipped (its place
 * in `buf` is left as it is): a merged rank's own heads stay in place (Gyges 4.1.2). Returns the
 * floats skipped. */
static int64_t gy_kv_mover_xfer(const gy_kv_mover_end *at, const gy_kv_mover_end *other,
                                int64_t n_heads, int64_t t0, int64_t t1, float *buf, int to_buf) {
    const gy_kv_layout *L = at->L;
    const int64_t D = L->head_dim, B = L->block_size, n = t1 - t0;
    const int runs = L->stride_token == D;
    /* Runs line up at both ends only when their layouts cut tokens the same way. */
    const int same_cut = other->L->kind == L->kind && other->L->block_size == B &&
                         other->L->stride_token == L->stride_token;
    int64_t skipped = 0;
    for (int64_t h = 0; h < n_heads; h++)
        for (int64_t kvi = 0; kvi < 2; kvi++) {
            float *p = buf + (h * 2 + kvi) * n * D;
            for (int64_t t = t0; t < t1;) {
                const int64_t slot = t % B;
                const int64_t count = runs ? (B - slot < t1 - t ? B - slot : t1 - t) : 1;
                float *here = at->base + gy_kv_layout_offset(L, kvi, at->blocks[t / B], slot, at->head0 + h);
                const float *there = same_cut ? other->base + gy_kv_layout_offset(
                    other->L, kvi, other->blocks[t / B], slot, other->head0 + h) : NULL;
                if (here == there) skipped += count * D;
                else if (to_buf) memcpy(p, here, (size_t)(count * D) * sizeof(float));
                else memcpy(here, p, (size_t)(count * D) * sizeof(float));
                p += count * D;
                t += count;
            }
        }
    return skipped;
}

/* Blocks that hold n_tokens in a cache. */
static int64_t gy_kv_item_blocks(const gy_kv_cache *kv, int64_t n_tokens) {
    const int64_t B = gy_kv_config_of(kv)->block_size;
    return (n_tokens + B - 1) / B;
}

static int64_t gy_kv_item_floats(const gy_kv_move_item *it, int64_t tokens) {
    return 2 * it->n_heads * tokens * gy_kv_config_of(it->src)->head_dim;
}

gy_status gy_kv_mover_plan(gy_kv_mover *m, const gy_kv_move_item *items, int64_t n_items,
                           int64_t layer) {
    if (m == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL mover");
    m->layer = -1;
    m->n_planned = 0;
    m->read_done = 0;
    GY_TRY(gy_kv_mover_check(items, n_items, layer));
    GY_TRY(gy_kv_mover_reserve((void **)&m->planned, &m->planned_cap, n_items, sizeof *m->planned));
    int64_t floats = 0, n_blocks = 0;
    for (int64_t i = 0; i < n_items; i++) {
        floats += gy_kv_item_floats(&items[i], items[i].n_tokens);
        n_blocks += gy_kv_item_blocks(items[i].src, items[i].n_tokens) +
                    gy_kv_item_blocks(items[i].dst, items[i].n_tokens);
    }
    GY_TRY(gy_kv_mover_reserve((void **)&m->blocks, &m->blocks_cap, n_blocks, sizeof *m->blocks));
    GY_TRY(gy_kv_mover_reserve((void **)&m->stage, &m->stage_cap, floats, sizeof *m->stage));
    GY_TRY(gy_kv_mover_reserve((void **)&m->layouts, &m->layouts_cap, 2 * n_items, sizeof *m->layouts));
    floats = 0;
    n_blocks = 0;
    for (int64_t i = 0; i < n_items; i++) {
        const gy_kv_move_item *it = &items[i];
        const int64_t nb = gy_kv_item_blocks(it->src, it->n_tokens);
        const int64_t nd = gy_kv_item_blocks(it->dst, it->n_tokens);
        /* Block tables only append, but a step may move them in memory as they grow. */
        if (nb > 0) memcpy(m->blocks + n_blocks, gy_kv_seq_blocks(it->src, it->src_seq), (size_t)nb * sizeof(int32_t));
        if (nd > 0) memcpy(m->blocks + n_blocks + nb, gy_kv_seq_blocks(it->dst, it->dst_seq), (size_t)nd * sizeof(int32_t));
        m->planned[i] = (gy_kv_mover_item){
            .it = *it, .src_gen = gy_kv_seq_generation(it->src, it->src_seq),
            .dst_gen = gy_kv_seq_generation(it->dst, it->dst_seq), .staged = it->n_tokens,
            .stage_at = floats, .blocks_at = n_blocks, .dst_blocks_at = n_blocks + nb,
            .src_base = gy_kv_layer_ptr(it->src, layer), .dst_base = gy_kv_layer_ptr(it->dst, layer)};
        /* The layer's address and layout stay valid while the caches live: page and header
         * layouts only append when they grow, and a shadowed cache cannot shrink. */
        m->layouts[2 * i] = *gy_kv_layout_of(it->src);
        m->layouts[2 * i + 1] = *gy_kv_layout_of(it->dst);
        floats += gy_kv_item_floats(it, it->n_tokens);
        n_blocks += nb + nd;
    }
    m->n_planned = n_items;
    m->layer = layer;
    return GY_OK;
}

gy_status gy_kv_mover_read(gy_kv_mover *m) {
    if (m == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL mover");
    if (m->layer < 0 || m->read_done) return GY_OK;
    for (int64_t i = 0; i < m->n_planned; i++) {
        gy_kv_mover_item *p = &m->planned[i];
        const gy_kv_mover_end src = {p->src_base, &m->layouts[2 * i], m->blocks + p->blocks_at,
                                     p->it.src_head};
        const gy_kv_mover_end dst = {p->dst_base, &m->layouts[2 * i + 1],
                                     m->blocks + p->dst_blocks_at, p->it.dst_head};
        p->in_place = gy_kv_mover_xfer(&src, &dst, p->it.n_heads, 0, p->staged,
                                       m->stage + p->stage_at, 1);
    }
    m->read_done = 1;
    return GY_OK;
}

/* The planned item `now` can reuse, or NULL. `hint` is where to look first: finish usually sees
 * the items in the order they were planned. */
static gy_kv_mover_item *gy_kv_mover_match(gy_kv_mover *m, const gy_kv_move_item *now, int64_t hint) {
    for (int64_t k = 0; k < m->n_planned; k++) {
        gy_kv_mover_item *p = &m->planned[(hint + k) % m->n_planned];
        const gy_kv_move_item *it = &p->it;
        if (!p->used && it->src == now->src && it->dst == now->dst && it->src_seq == now->src_seq &&
            it->dst_seq == now->dst_seq && it->src_head == now->src_head &&
            it->dst_head == now->dst_head && it->n_heads == now->n_heads &&
            p->src_gen == gy_kv_seq_generation(now->src, now->src_seq) &&
            p->dst_gen == gy_kv_seq_generation(now->dst, now->dst_seq) && p->staged <= now->n_tokens)
            return p;
    }
    return NULL;
}

/* One of finish's passes over items [first, end): pass 0 reads the late tokens, pass 1 writes
 * the staged and the late tokens out. */
typedef struct gy_kv_mover_part {
    gy_kv_mover *m;
    int64_t first, end, layer;
    int pass;
} gy_kv_mover_part;

static void *gy_kv_mover_pass(void *arg) {
    const gy_kv_mover_part *w = arg;
    gy_kv_mover *m = w->m;
    for (int64_t i = w->first; i < w->end; i++) {
        gy_kv_mover_item *x = &m->now[i];
        const gy_kv_move_item *it = &x->it;
        const gy_kv_mover_end src = {gy_kv_layer_ptr(it->src, w->layer), gy_kv_layout_of(it->src),
                                     gy_kv_seq_blocks(it->src, it->src_seq), it->src_head};
        const gy_kv_mover_end dst = {gy_kv_layer_ptr(it->dst, w->layer), gy_kv_layout_of(it->dst),
                                     gy_kv_seq_blocks(it->dst, it->dst_seq), it->dst_head};
        if (w->pass == 0) {
            x->late_in_place = gy_kv_mover_xfer(&src, &dst, it->n_heads, x->late_from, it->n_tokens,
                                                m->late + x->late_at, 1);
            continue;
        }
        /* The write skips the same runs the reads did: a reused item's first blocks at both ends
         * are those planned (same generations, and tables only append). */
        if (x->staged > 0)
            gy_kv_mover_xfer(&dst, &src, it->n_heads, 0, x->staged, m->stage + x->stage_at, 0);
        gy_kv_mover_xfer(&dst, &src, it->n_heads, x->late_from, it->n_tokens, m->late + x->late_at, 0);
    }
    return NULL;
}

/* finish with nothing read early: every run copied once, straight to its destination, in an
 * order that reads each source before it is overwritten (run_order.h), instead of through the
 * stage (twice the memory traffic). Sets *done = 0, having moved nothing, unless both ends of
 * every item are header-centric with the same block size (a head's tokens of a block are then
 * one run, and runs line up); the page layout's unit is a token of all heads. */
static gy_status gy_kv_mover_direct(gy_kv_mover *m, const gy_kv_move_item *items, int64_t n_items,
                                    int64_t layer, int threads, gy_kv_move_stats *st, int *done) {
    *done = 0;
    if (n_items == 0) { /* nothing to copy: done (the grid below would be 0) */
        *done = 1;
        return GY_OK;
    }
    int64_t n_runs = 0, B = 0, D = 0;
    for (int64_t i = 0; i < n_items; i++) {
        const gy_kv_layout *s = gy_kv_layout_of(items[i].src), *d = gy_kv_layout_of(items[i].dst);
        if (i == 0) B = s->block_size, D = s->head_dim;
        if (s->kind != GY_KV_LAYOUT_HEAD || d->kind != GY_KV_LAYOUT_HEAD || s->block_size != B ||
            d->block_size != B || s->head_dim != D || d->head_dim != D)
            return GY_OK;
        n_runs += 2 * items[i].n_heads * gy_kv_item_blocks(items[i].src, items[i].n_tokens);
    }
    GY_TRY(gy_kv_mover_reserve((void **)&m->runs, &m->runs_cap, n_runs, sizeof *m->runs));
    int64_t k = 0, moved = 0, in_place = 0, runs_in_place = 0;
    for (int64_t i = 0; i < n_items; i++) {
        const gy_kv_move_item *it = &items[i];
        const gy_kv_layout *ls = gy_kv_layout_of(it->src), *ld = gy_kv_layout_of(it->dst);
        float *sb = gy_kv_layer_ptr(it->src, layer), *db = gy_kv_layer_ptr(it->dst, layer);
        const int32_t *sbl = gy_kv_seq_blocks(it->src, it->src_seq);
        const int32_t *dbl = gy_kv_seq_blocks(it->dst, it->dst_seq);
        for (int64_t h = 0; h < it->n_heads; h++)
            for (int64_t kvi = 0; kvi < 2; kvi++)
                for (int64_t t = 0; t < it->n_tokens; t += B) {
                    const int64_t count = it->n_tokens - t < B ? it->n_tokens - t : B;
                    float *src = sb + gy_kv_layout_offset(ls, kvi, sbl[t / B], 0, it->src_head + h);
                    float *dst = db + gy_kv_layout_offset(ld, kvi, dbl[t / B], 0, it->dst_head + h);
                    if (src == dst) {
                        in_place += count * D;
                        runs_in_place++;
                    } else {
                        moved += count * D;
                    }
                    m->runs[k++] = (gy_run){src, dst, count * D * (int64_t)sizeof(float)};
                }
    }
    gy_run_order_stats ost;
    GY_TRY(gy_run_order_copy(m->order, m->runs, k, B * D * (int64_t)sizeof(float), threads, done,
                             &ost));
    if (!*done) return GY_OK;
    st->bytes_in_place = (uint64_t)in_place * sizeof(float);
    st->bytes_late = st->bytes_moved = (uint64_t)moved * sizeof(float);
    st->runs_direct = ost.runs_copied - runs_in_place;
    st->runs_parked = ost.runs_parked;
    return GY_OK;
}

/* The end of a finish, either way: the plan is forgotten and the stats reported. */
static gy_status gy_kv_mover_done(gy_kv_mover *m, gy_kv_move_stats *st, gy_kv_move_stats *stats) {
    st->stage_bytes = (uint64_t)(m->stage_cap + m->late_cap) * sizeof(float);
    m->layer = -1;
    m->n_planned = 0;
    m->read_done = 0;
    if (stats) *stats = *st;
    return GY_OK;
}

gy_status gy_kv_mover_finish(gy_kv_mover *m, const gy_kv_move_item *items, int64_t n_items,
                             int64_t layer, int threads, gy_kv_move_stats *stats) {
    if (m == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL mover");
    GY_TRY(gy_kv_mover_check(items, n_items, layer));
    GY_TRY(gy_kv_mover_reserve((void **)&m->now, &m->now_cap, n_items, sizeof *m->now));
    if (n_items > 0 && gy_fault_hit(GY_FAULT_COPY))
        return GY_FAIL(GY_ERR_SYSTEM, "injected fault: moving layer %lld's KV failed", (long long)layer);
    const int planned = m->layer == layer && m->read_done;
    gy_kv_move_stats st = {0};
    if (!planned) {
        int done;
        GY_TRY(gy_kv_mover_direct(m, items, n_items, layer, threads, &st, &done));
        if (done) return gy_kv_mover_done(m, &st, stats);
    }
    int64_t late = 0;
    for (int64_t i = 0; i < m->n_planned; i++) m->planned[i].used = 0;
    for (int64_t i = 0; i < n_items; i++) {
        gy_kv_mover_item *p = planned ? gy_kv_mover_match(m, &items[i], i) : NULL;
        gy_kv_mover_item *x = &m->now[i];
        *x = (gy_kv_mover_item){.it = items[i]};
        if (p != NULL) {
            p->used = 1;
            x->staged = p->staged;
            x->stage_at = p->stage_at;
            x->in_place = p->in_place;
            st.items_reused++;
            st.bytes_early += (uint64_t)(gy_kv_item_floats(&items[i], p->staged) - p->in_place) *
                              sizeof(float);
        }
        x->late_from = x->staged;
        x->late_at = late;
        late += gy_kv_item_floats(&items[i], items[i].n_tokens - x->staged);
    }
    if (planned) st.items_stale = m->n_planned - st.items_reused;
    gy_status s = gy_kv_mover_reserve((void **)&m->late, &m->late_cap, late, sizeof *m->late);
    if (s != GY_OK) return s;
    /* Every read before any write: new blocks may overlap old ones of the same layer. */
    const int64_t half = threads > 1 ? n_items / 2 : 0;
    for (int pass = 0; pass < 2; pass++) {
        gy_kv_mover_part parts[2] = {
            {.m = m, .first = 0, .end = half, .layer = layer, .pass = pass},
            {.m = m, .first = half, .end = n_items, .layer = layer, .pass = pass},
        };
        pthread_t helper;
        const int threaded = half > 0 && pthread_create(&helper, NULL, gy_kv_mover_pass, &parts[0]) == 0;
        if (!threaded) gy_kv_mover_pass(&parts[0]);
        gy_kv_mover_pass(&parts[1]);
        if (threaded) pthread_join(helper, NULL);
    }
    int64_t in_place = 0, late_in_place = 0;
    for (int64_t i = 0; i < n_items; i++) {
        in_place += m->now[i].in_place + m->now[i].late_in_place;
        late_in_place += m->now[i].late_in_place;
    }
    st.bytes_in_place = (uint64_t)in_place * sizeof(float);
    st.bytes_late = (uint64_t)(late - late_in_place) * sizeof(float);
    st.bytes_moved = st.bytes_early + st.bytes_late;
    return gy_kv_mover_done(m, &st, stats);
}
