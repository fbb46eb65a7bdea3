/* kv_move_host.c: the host backend of KV moves (kv_move_backend.h): memmove, in the fewest runs
 * the two layouts allow (every address through gy_kv_layout_offset and the layouts' strides).
 * Its OVERLAP moves are kv_move_stage.c's. */
#include "kv_move_backend.h"

#include <string.h>

void gy_kv_move_runs_init(gy_kv_move_runs *r, const gy_kv_layout *src, const gy_kv_layout *dst,
                          int64_t n_heads, int64_t n_tokens) {
    const int64_t es = src->elem_size;
    int32_t order[GY_KV_DIM_COUNT];
    gy_kv_layout_stride_order((gy_kv_layout_kind)src->kind, order);
    /* the three dimensions a pair spans, in the source's storage order, outermost first */
    int64_t count[3], s[3], d[3], n = 0;
    for (int k = 0; k < GY_KV_DIM_COUNT; k++) {
        switch (order[k]) {
        case GY_KV_DIM_KV:
            count[n] = 2, s[n] = src->stride_kv, d[n] = dst->stride_kv;
            break;
        case GY_KV_DIM_TOKEN:
            count[n] = n_tokens, s[n] = src->stride_token, d[n] = dst->stride_token;
            break;
        case GY_KV_DIM_HEAD:
            count[n] = n_heads, s[n] = src->stride_head, d[n] = dst->stride_head;
            break;
        default: /* the block is the pair itself */
            continue;
        }
        n++;
    }
    int64_t run = src->head_dim; /* elements; d is contiguous at both ends */
    int merging = 1;
    for (int k = 2; k >= 0; k--) {
        r->count[k] = count[k];
        r->src_step[k] = s[k] * es;
        r->dst_step[k] = d[k] * es;
        if (!merging || count[k] == 1) {
            continue;
        } else if (s[k] == run && d[k] == run) {
            run *= count[k];
            r->count[k] = 1;
        } else {
            merging = 0;
        }
    }
    r->run = run * es;
}

void gy_kv_move_runs_each(const gy_kv_move_runs *r, char *dst, const char *src,
                          gy_kv_move_run_fn fn, void *ctx) {
    for (int64_t a = 0; a < r->count[0]; a++)
        for (int64_t b = 0; b < r->count[1]; b++)
            for (int64_t c = 0; c < r->count[2]; c++) {
                const int64_t so = a * r->src_step[0] + b * r->src_step[1] + c * r->src_step[2];
                const int64_t dof = a * r->dst_step[0] + b * r->dst_step[1] + c * r->dst_step[2];
                fn(ctx, dst + dof, src + so, r->run);
            }
}

/* A run already where it goes (the same address at both ends) is neither read nor written. */
static void gy_kv_move_host_run(void *ctx, char *dst, const char *src, int64_t bytes) {
    if (dst == src) {
        *(uint64_t *)ctx += (uint64_t)bytes;
        return;
    }
    memmove(dst, src, (size_t)bytes);
}

/* Slots [t0, t1) of pair (sb, db) of item `it` in one layer. */
static void gy_kv_move_host_piece(const gy_kv_move_item *it, char *dbase, const char *sbase,
                                  int32_t db, int32_t sb, int64_t t0, int64_t t1,
                                  const gy_kv_move_runs *full, uint64_t *in_place) {
    const gy_kv_layout *ls = gy_kv_layout_of(it->src), *ld = gy_kv_layout_of(it->dst);
    const int64_t es = ls->elem_size;
    gy_kv_move_runs part;
    if (full == NULL || t1 - t0 != ls->block_size) {
        gy_kv_move_runs_init(&part, ls, ld, it->n_heads, t1 - t0);
        full = &part;
    }
    gy_kv_move_runs_each(full, dbase + gy_kv_layout_offset(ld, 0, db, t0, it->dst_head) * es,
                         sbase + gy_kv_layout_offset(ls, 0, sb, t0, it->src_head) * es,
                         gy_kv_move_host_run, in_place);
}

static gy_status gy_kv_move_host_copy(const gy_kv_move *mv, gy_kv_move_stats *st) {
    uint64_t in_place = 0;
    for (int64_t l = mv->first_layer; l < mv->end_layer; l++)
        for (int64_t i = 0; i < mv->n_items; i++) {
            const gy_kv_move_item *it = &mv->items[i];
            if (it->n_heads == 0) continue;
            const int64_t B = gy_kv_config_of(it->src)->block_size;
            char *dbase = gy_kv_layer_ptr(it->dst, gy_kv_move_layer(it->dst, l));
            const char *sbase = gy_kv_layer_ptr(it->src, gy_kv_move_layer(it->src, l));
            gy_kv_move_runs full; /* a whole block's runs, the same for every pair */
            gy_kv_move_runs_init(&full, gy_kv_layout_of(it->src), gy_kv_layout_of(it->dst),
                                 it->n_heads, B);
            const int32_t *sb, *db;
            const int64_t n = gy_kv_move_item_pairs(it, &sb, &db);
            for (int64_t j = 0; j < n; j++) {
                const int64_t t = gy_kv_move_pair_tokens(it, j, B);
                if (mv->dirty == NULL) {
                    if (t > 0) gy_kv_move_host_piece(it, dbase, sbase, db[j], sb[j], 0, t, &full, &in_place);
                    continue;
                }
                /* each run of consecutive dirty slots at once */
                for (int64_t a = 0; a < t;) {
                    if (!gy_kv_move_dirty_at(mv->dirty, (int64_t)sb[j] * B + a)) {
                        a++;
                        continue;
                    }
                    int64_t b = a + 1;
                    while (b < t && gy_kv_move_dirty_at(mv->dirty, (int64_t)sb[j] * B + b)) b++;
                    gy_kv_move_host_piece(it, dbase, sbase, db[j], sb[j], a, b, &full, &in_place);
                    a = b;
                }
            }
        }
    st->bytes -= in_place;
    st->bytes_in_place = in_place;
    st->bytes_late = st->bytes;
    return GY_OK;
}

const gy_kv_move_backend gy_kv_move_host_backend = {
    .name = "host",
    .copy = gy_kv_move_host_copy,
    .copy_overlapping = gy_kv_move_stage_copy,
};
