/* kv_move_stage.c: the host backend's OVERLAP moves (kv_move.h): every source read before any
 * destination is written, through a stage (early, beside a step, or late, by the run), or, with
 * nothing read early and header-centric caches, each run copied once in an order that reads it
 * first (run_order.h). */
#include "kv_move_backend.h"
#include "../core/alloc.h"
#include "../core/grow.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "run_order.h"

/* One item as the stage keeps it. A planned item carries what its early read needs (a copy of
 * its block lists, both ends' layer addresses and layouts), so that the read touches no cache
 * structure a step may change meanwhile. */
typedef struct gy_kv_stage_item {
    gy_kv_move_item it;
    uint64_t src_gen, dst_gen;
    int64_t staged;        /* tokens [0, staged) are in the stage at stage_at of each layer's part */
    int64_t stage_at;      /* bytes */
    int64_t late_from;     /* a run reads tokens [late_from, n_tokens) into `late` at late_at */
    int64_t late_at;
    int64_t blocks_at;     /* planned: the source's block ids at blocks[blocks_at], then the
                            * destination's */
    int64_t n_pairs;       /* planned */
    uint64_t in_place;     /* bytes of the staged tokens already where they go (every layer) */
    uint64_t late_in_place;
    int used;              /* planned: matched by a run already */
} gy_kv_stage_item;

struct gy_kv_move_stage {
    /* the plan (gy_kv_move_plan) */
    int planned, read_done;
    int64_t first_layer, end_layer;
    gy_kv_stage_item *planned_items;
    int64_t n_planned, planned_cap;
    int32_t *blocks;
    int64_t blocks_cap;
    char **bases;              /* (n_planned, layers, 2): the source's and destination's layer */
    int64_t bases_cap;
    gy_kv_layout *layouts;     /* (n_planned, 2): source, destination */
    int64_t layouts_cap;
    char *stage;               /* (layers, stage_layer) bytes */
    int64_t stage_cap, stage_layer;
    /* a run's scratch */
    gy_kv_stage_item *now;
    int64_t now_cap;
    char *late;                /* one layer's late reads */
    int64_t late_cap;
    gy_run *runs;
    int64_t runs_cap;
    gy_run_order *order;
};

static gy_status gy_kv_stage_reserve(void **buf, int64_t *cap, int64_t n, size_t size) {
    return gy_grow(buf, cap, n, size, "a KV move's stage");
}

gy_status gy_kv_move_stage_init(gy_kv_move_stage **out) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_kv_move_stage_init: NULL argument");
    *out = NULL;
    gy_kv_move_stage *s = gy_calloc(1, sizeof *s);
    if (s == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    const gy_status st = gy_run_order_init(&s->order);
    if (st != GY_OK) {
        free(s);
        return st;
    }
    *out = s;
    return GY_OK;
}

void gy_kv_move_stage_free(gy_kv_move_stage *s) {
    if (s == NULL) return;
    free(s->planned_items);
    free(s->blocks);
    free(s->bases);
    free(s->layouts);
    free(s->stage);
    free(s->now);
    free(s->late);
    free(s->runs);
    gy_run_order_free(s->order);
    free(s);
}

/* ---- reading and writing tokens of an item through a buffer ---- */

/* One end of an item in one layer. */
typedef struct gy_kv_stage_end {
    char *base;
    const gy_kv_layout *L;
    const int32_t *blocks;
    int64_t head0;
} gy_kv_stage_end;

typedef struct gy_kv_stage_cursor {
    char *buf;
    uint64_t in_place;
} gy_kv_stage_cursor;

/* A run whose address is the same at both ends is already where it goes: skipped both ways (its
 * place in the buffer is left as it is), so a merged rank's own heads stay (Gyges 4.1.2). */
static void gy_kv_stage_read_run(void *ctx, char *dst, const char *src, int64_t bytes) {
    gy_kv_stage_cursor *c = ctx;
    if (dst == src) c->in_place += (uint64_t)bytes;
    else memcpy(c->buf, src, (size_t)bytes);
    c->buf += bytes;
}

static void gy_kv_stage_write_run(void *ctx, char *dst, const char *src, int64_t bytes) {
    gy_kv_stage_cursor *c = ctx;
    if (dst != src) memcpy(dst, c->buf, (size_t)bytes);
    c->buf += bytes;
}

/* Tokens [t0, t1) of `n_heads` heads between the ends and `buf` (reading when `to_buf`), block
 * piece by block piece, the same runs both ways. Returns the bytes in place. */
static uint64_t gy_kv_stage_xfer(const gy_kv_stage_end *src, const gy_kv_stage_end *dst,
                                 int64_t n_heads, int64_t t0, int64_t t1, char *buf, int to_buf) {
    const int64_t B = src->L->block_size, es = src->L->elem_size;
    gy_kv_stage_cursor c = {.buf = buf};
    for (int64_t t = t0; t < t1;) {
        const int64_t j = t / B, a = t - j * B, b = (t1 - j * B < B ? t1 - j * B : B);
        gy_kv_move_runs r;
        gy_kv_move_runs_init(&r, src->L, dst->L, n_heads, b - a);
        gy_kv_move_runs_each(&r, dst->base + gy_kv_layout_offset(dst->L, 0, dst->blocks[j], a, dst->head0) * es,
                             src->base + gy_kv_layout_offset(src->L, 0, src->blocks[j], a, src->head0) * es,
                             to_buf ? gy_kv_stage_read_run : gy_kv_stage_write_run, &c);
        t = j * B + b;
    }
    return c.in_place;
}

static int64_t gy_kv_stage_item_bytes(const gy_kv_move_item *it, int64_t tokens) {
    return tokens * gy_kv_move_token_bytes(it->src, it->n_heads);
}

/* ---- the early read ---- */

gy_status gy_kv_move_stage_plan(gy_kv_move_stage *s, const gy_kv_move *mv) {
    s->planned = s->read_done = 0;
    s->n_planned = 0;
    const int64_t layers = mv->end_layer - mv->first_layer, n = mv->n_items;
    int64_t bytes = 0, n_blocks = 0;
    for (int64_t i = 0; i < n; i++) {
        const int32_t *sb, *db;
        bytes += gy_kv_stage_item_bytes(&mv->items[i], mv->items[i].n_tokens);
        n_blocks += 2 * gy_kv_move_item_pairs(&mv->items[i], &sb, &db);
    }
    GY_TRY(gy_kv_stage_reserve((void **)&s->planned_items, &s->planned_cap, n, sizeof *s->planned_items));
    GY_TRY(gy_kv_stage_reserve((void **)&s->blocks, &s->blocks_cap, n_blocks, sizeof *s->blocks));
    GY_TRY(gy_kv_stage_reserve((void **)&s->bases, &s->bases_cap, 2 * n * layers, sizeof *s->bases));
    GY_TRY(gy_kv_stage_reserve((void **)&s->layouts, &s->layouts_cap, 2 * n, sizeof *s->layouts));
    GY_TRY(gy_kv_stage_reserve((void **)&s->stage, &s->stage_cap, bytes * layers, 1));
    bytes = n_blocks = 0;
    for (int64_t i = 0; i < n; i++) {
        const gy_kv_move_item *it = &mv->items[i];
        const int32_t *sb, *db;
        const int64_t np = gy_kv_move_item_pairs(it, &sb, &db);
        /* Block tables only append, but a step may move them in memory as they grow. */
        if (np > 0) {
            memcpy(s->blocks + n_blocks, sb, (size_t)np * sizeof(int32_t));
            memcpy(s->blocks + n_blocks + np, db, (size_t)np * sizeof(int32_t));
        }
        s->planned_items[i] = (gy_kv_stage_item){
            .it = *it, .src_gen = gy_kv_seq_generation(it->src, it->src_seq),
            .dst_gen = gy_kv_seq_generation(it->dst, it->dst_seq), .staged = it->n_tokens,
            .stage_at = bytes, .blocks_at = n_blocks, .n_pairs = np};
        /* The layers' addresses and layouts stay valid while the caches live: page and header
         * layouts only append when they grow, and a shadowed cache cannot shrink. */
        for (int64_t l = 0; l < layers; l++) {
            s->bases[(i * layers + l) * 2] = gy_kv_layer_ptr(it->src, gy_kv_move_layer(it->src, mv->first_layer + l));
            s->bases[(i * layers + l) * 2 + 1] = gy_kv_layer_ptr(it->dst, gy_kv_move_layer(it->dst, mv->first_layer + l));
        }
        s->layouts[2 * i] = *gy_kv_layout_of(it->src);
        s->layouts[2 * i + 1] = *gy_kv_layout_of(it->dst);
        bytes += gy_kv_stage_item_bytes(it, it->n_tokens);
        n_blocks += 2 * np;
    }
    s->stage_layer = bytes;
    s->n_planned = n;
    s->first_layer = mv->first_layer;
    s->end_layer = mv->end_layer;
    s->planned = 1;
    return GY_OK;
}

gy_status gy_kv_move_read(gy_kv_move_stage *s) {
    if (s == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_kv_move_read: NULL stage");
    if (!s->planned || s->read_done) return GY_OK;
    const int64_t layers = s->end_layer - s->first_layer;
    for (int64_t i = 0; i < s->n_planned; i++) {
        gy_kv_stage_item *p = &s->planned_items[i];
        p->in_place = 0;
        for (int64_t l = 0; l < layers; l++) {
            const gy_kv_stage_end src = {s->bases[(i * layers + l) * 2], &s->layouts[2 * i],
                                         s->blocks + p->blocks_at, p->it.src_head};
            const gy_kv_stage_end dst = {s->bases[(i * layers + l) * 2 + 1], &s->layouts[2 * i + 1],
                                         s->blocks + p->blocks_at + p->n_pairs, p->it.dst_head};
            p->in_place += gy_kv_stage_xfer(&src, &dst, p->it.n_heads, 0, p->staged,
                                            s->stage + l * s->stage_layer + p->stage_at, 1);
        }
    }
    s->read_done = 1;
    return GY_OK;
}

/* The planned item `now` can reuse, or NULL. `hint` is where to look first: a run usually sees
 * the items in the order they were planned. */
static gy_kv_stage_item *gy_kv_stage_match(gy_kv_move_stage *s, const gy_kv_move_item *now, int64_t hint) {
    for (int64_t k = 0; k < s->n_planned; k++) {
        gy_kv_stage_item *p = &s->planned_items[(hint + k) % s->n_planned];
        const gy_kv_move_item *it = &p->it;
        if (!p->used && it->src == now->src && it->dst == now->dst && it->src_seq == now->src_seq &&
            it->dst_seq == now->dst_seq && it->src_head == now->src_head &&
            it->dst_head == now->dst_head && it->n_heads == now->n_heads &&
            now->src_blocks == NULL && now->n_tokens >= 0 &&
            p->src_gen == gy_kv_seq_generation(now->src, now->src_seq) &&
            p->dst_gen == gy_kv_seq_generation(now->dst, now->dst_seq) && p->staged <= now->n_tokens)
            return p;
    }
    return NULL;
}

/* ---- a run through the stage ---- */

/* One of a run's passes over items [first, end) of one layer: pass 0 reads the late tokens,
 * pass 1 writes the staged and the late tokens out. */
typedef struct gy_kv_stage_part {
    gy_kv_move_stage *s;
    int64_t first, end, layer, layer_index;
    int pass;
} gy_kv_stage_part;

static void *gy_kv_stage_pass(void *arg) {
    const gy_kv_stage_part *w = arg;
    gy_kv_move_stage *s = w->s;
    for (int64_t i = w->first; i < w->end; i++) {
        gy_kv_stage_item *x = &s->now[i];
        const gy_kv_move_item *it = &x->it;
        const int32_t *sb, *db;
        gy_kv_move_item_pairs(it, &sb, &db);
        const gy_kv_stage_end src = {gy_kv_layer_ptr(it->src, gy_kv_move_layer(it->src, w->layer)),
                                     gy_kv_layout_of(it->src), sb, it->src_head};
        const gy_kv_stage_end dst = {gy_kv_layer_ptr(it->dst, gy_kv_move_layer(it->dst, w->layer)),
                                     gy_kv_layout_of(it->dst), db, it->dst_head};
        const int64_t n = gy_kv_move_item_tokens(it);
        if (w->pass == 0) {
            x->late_in_place += gy_kv_stage_xfer(&src, &dst, it->n_heads, x->late_from, n,
                                                 s->late + x->late_at, 1);
            continue;
        }
        /* The write skips the same runs the reads did: a reused item's first blocks at both ends
         * are those planned (same generations, and tables only append). */
        if (x->staged > 0)
            gy_kv_stage_xfer(&src, &dst, it->n_heads, 0, x->staged,
                             s->stage + w->layer_index * s->stage_layer + x->stage_at, 0);
        gy_kv_stage_xfer(&src, &dst, it->n_heads, x->late_from, n, s->late + x->late_at, 0);
    }
    return NULL;
}

/* Every read of a layer before any write of it, on one or two threads. */
static void gy_kv_stage_layer(gy_kv_move_stage *s, int64_t n_items, int64_t layer,
                              int64_t layer_index, int threads) {
    const int64_t half = threads > 1 ? n_items / 2 : 0;
    for (int pass = 0; pass < 2; pass++) {
        gy_kv_stage_part parts[2] = {
            {.s = s, .first = 0, .end = half, .layer = layer, .layer_index = layer_index, .pass = pass},
            {.s = s, .first = half, .end = n_items, .layer = layer, .layer_index = layer_index, .pass = pass},
        };
        pthread_t helper;
        const int threaded = half > 0 && pthread_create(&helper, NULL, gy_kv_stage_pass, &parts[0]) == 0;
        if (!threaded) gy_kv_stage_pass(&parts[0]);
        gy_kv_stage_pass(&parts[1]);
        if (threaded) pthread_join(helper, NULL);
    }
}

/* Whether a move can go without the stage when nothing was read early: both ends of every item
 * header-centric with one block size, head size and value size (a head's tokens of a block are
 * then one run, and runs line up; the page layout's unit is a token of all heads). Returns the
 * runs of one layer, or -1. */
static int64_t gy_kv_stage_direct_runs(const gy_kv_move *mv) {
    int64_t n_runs = 0;
    const gy_kv_layout *first = mv->n_items > 0 ? gy_kv_layout_of(mv->items[0].src) : NULL;
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kv_move_item *it = &mv->items[i];
        const gy_kv_layout *ls = gy_kv_layout_of(it->src), *ld = gy_kv_layout_of(it->dst);
        if (ls->kind != GY_KV_LAYOUT_HEAD || ld->kind != GY_KV_LAYOUT_HEAD ||
            ls->block_size != first->block_size || ls->head_dim != first->head_dim ||
            ls->elem_size != first->elem_size)
            return -1;
        const int32_t *sb, *db;
        n_runs += 2 * it->n_heads * gy_kv_move_item_pairs(it, &sb, &db);
    }
    return n_runs;
}

/* A layer with nothing read early: every run copied once, straight to its destination, in an
 * order that reads each source before it is overwritten (run_order.h), instead of through the
 * stage (twice the memory traffic). Sets *done = 0, having moved nothing, when the runs do not
 * follow run_order's rule (a layer that does not start on its grid). */
static gy_status gy_kv_stage_direct(gy_kv_move_stage *s, const gy_kv_move *mv, int64_t layer,
                                    int threads, gy_kv_move_stats *st, int *done) {
    const gy_kv_layout *first = gy_kv_layout_of(mv->items[0].src);
    const int64_t B = first->block_size, D = first->head_dim, es = first->elem_size;
    uint64_t moved = 0, in_place = 0;
    int64_t k = 0, runs_in_place = 0;
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kv_move_item *it = &mv->items[i];
        const gy_kv_layout *ls = gy_kv_layout_of(it->src), *ld = gy_kv_layout_of(it->dst);
        char *sbase = gy_kv_layer_ptr(it->src, gy_kv_move_layer(it->src, layer));
        char *dbase = gy_kv_layer_ptr(it->dst, gy_kv_move_layer(it->dst, layer));
        const int32_t *sb, *db;
        const int64_t np = gy_kv_move_item_pairs(it, &sb, &db);
        for (int64_t h = 0; h < it->n_heads; h++)
            for (int64_t kvi = 0; kvi < 2; kvi++)
                for (int64_t j = 0; j < np; j++) {
                    const int64_t bytes = gy_kv_move_pair_tokens(it, j, B) * D * es;
                    char *src = sbase + gy_kv_layout_offset(ls, kvi, sb[j], 0, it->src_head + h) * es;
                    char *dst = dbase + gy_kv_layout_offset(ld, kvi, db[j], 0, it->dst_head + h) * es;
                    if (src == dst) {
                        in_place += (uint64_t)bytes;
                        runs_in_place++;
                    } else {
                        moved += (uint64_t)bytes;
                    }
                    s->runs[k++] = (gy_run){src, dst, bytes};
                }
    }
    gy_run_order_stats ost;
    GY_TRY(gy_run_order_copy(s->order, s->runs, k, B * D * es, threads, done, &ost));
    if (!*done) return GY_OK;
    st->bytes_in_place += in_place;
    st->bytes_late += moved;
    st->runs_direct += ost.runs_copied - runs_in_place;
    st->runs_parked += ost.runs_parked;
    return GY_OK;
}

/* Forgets the plan and reports the stage's size. */
static void gy_kv_stage_done(gy_kv_move_stage *s, gy_kv_move_stats *st) {
    st->stage_bytes = (uint64_t)(s->stage_cap + s->late_cap);
    s->planned = s->read_done = 0;
    s->n_planned = 0;
}

static gy_status gy_kv_stage_copy(gy_kv_move_stage *s, const gy_kv_move *mv, gy_kv_move_stats *st) {
    const int threads = mv->threads > 1 ? 2 : 1;
    const int planned = s->planned && s->read_done && s->first_layer == mv->first_layer &&
                        s->end_layer == mv->end_layer;
    const int64_t direct_runs = planned ? -1 : gy_kv_stage_direct_runs(mv);
    if (direct_runs >= 0)
        GY_TRY(gy_kv_stage_reserve((void **)&s->runs, &s->runs_cap, direct_runs, sizeof *s->runs));
    GY_TRY(gy_kv_stage_reserve((void **)&s->now, &s->now_cap, mv->n_items, sizeof *s->now));
    const int64_t layers = mv->end_layer - mv->first_layer;
    int64_t late = 0, reused = 0;
    uint64_t early = 0;
    for (int64_t i = 0; i < s->n_planned; i++) s->planned_items[i].used = 0;
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kv_move_item *it = &mv->items[i];
        gy_kv_stage_item *p = planned ? gy_kv_stage_match(s, it, i) : NULL;
        gy_kv_stage_item *x = &s->now[i];
        *x = (gy_kv_stage_item){.it = *it};
        if (p != NULL) {
            p->used = 1;
            x->staged = p->staged;
            x->stage_at = p->stage_at;
            x->in_place = p->in_place;
            reused++;
            early += (uint64_t)(gy_kv_stage_item_bytes(it, p->staged) * layers) - p->in_place;
        }
        x->late_from = x->staged;
        x->late_at = late;
        late += gy_kv_stage_item_bytes(it, gy_kv_move_item_tokens(it) - x->staged);
    }
    st->bytes_in_place = st->bytes_late = 0;
    int64_t staged_layers = 0;
    for (int64_t l = mv->first_layer; l < mv->end_layer; l++) {
        int done = 0;
        if (direct_runs >= 0) GY_TRY(gy_kv_stage_direct(s, mv, l, threads, st, &done));
        if (done) continue;
        /* Every read of the layer before any write of it. */
        GY_TRY(gy_kv_stage_reserve((void **)&s->late, &s->late_cap, late, 1));
        gy_kv_stage_layer(s, mv->n_items, l, l - mv->first_layer, threads);
        staged_layers++;
    }
    uint64_t late_in_place = 0;
    for (int64_t i = 0; i < mv->n_items; i++) {
        st->bytes_in_place += s->now[i].in_place + s->now[i].late_in_place;
        late_in_place += s->now[i].late_in_place;
    }
    st->items_reused = reused;
    st->items_stale = planned ? s->n_planned - reused : 0;
    st->bytes_early = early;
    st->bytes_late += (uint64_t)(late * staged_layers) - late_in_place;
    st->bytes = st->bytes_early + st->bytes_late;
    gy_kv_stage_done(s, st);
    return GY_OK;
}

gy_status gy_kv_move_stage_copy(const gy_kv_move *mv, gy_kv_move_stage *stage, gy_kv_move_stats *st) {
    if (stage != NULL) return gy_kv_stage_copy(stage, mv, st);
    gy_kv_move_stage *own;
    GY_TRY(gy_kv_move_stage_init(&own));
    const gy_status s = gy_kv_stage_copy(own, mv, st);
    gy_kv_move_stage_free(own);
    return s;
}
