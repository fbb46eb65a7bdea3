/* forward_cpu.c: the decoder forward pass on the CPU kernels (forward_backend.h): activations
 * fp32 in host memory, the KV cache fp32. */
#include "forward_backend.h"
#include "../core/alloc.h"

#include <stdlib.h>
#include <string.h>

#include "../cpu/activation.h"
#include "../cpu/attention.h"
#include "../cpu/embedding.h"
#include "../cpu/kv_write.h"
#include "../cpu/linear.h"
#include "../cpu/norm.h"
#include "../cpu/rope.h"

static void gy_forward_cpu_ws_free(gy_forward_ws *ws) {
    float **buffers[] = {&ws->x, &ws->h, &ws->q, &ws->k, &ws->v, &ws->attn, &ws->o,
                         &ws->g, &ws->u, &ws->parts, &ws->sel};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) {
        free(*buffers[i]);
        *buffers[i] = NULL;
    }
    ws->capacity_tokens = 0;
}

static gy_status gy_forward_ws_reserve(gy_forward_ws *ws, const gy_model *m, int64_t n) {
    if (n <= ws->capacity_tokens) return GY_OK;
    gy_forward_cpu_ws_free(ws);
    const int64_t qd = m->n_heads * m->head_dim, kvd = m->n_kv_heads * m->head_dim;
    const struct { float **buf; int64_t width; } plan[] = {
        {&ws->x, m->hidden}, {&ws->h, m->hidden}, {&ws->q, qd}, {&ws->k, kvd}, {&ws->v, kvd},
        {&ws->attn, qd}, {&ws->o, m->hidden}, {&ws->g, m->shard_rows}, {&ws->u, m->shard_rows},
        {&ws->parts, m->max_tp * m->hidden}, {&ws->sel, m->hidden},
    };
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        *plan[i].buf = gy_malloc((size_t)(n * plan[i].width) * sizeof(float));
        if (*plan[i].buf == NULL) {
            gy_forward_cpu_ws_free(ws);
            return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a batch of %lld tokens", (long long)n);
        }
    }
    ws->capacity_tokens = n;
    return GY_OK;
}

static gy_status gy_forward_cpu_begin(const gy_model *m, const gy_tp_group *tp, gy_kv_cache *kv,
                                      const gy_forward_batch *b, gy_forward_ws *ws, int embed,
                                      int64_t max_len) {
    (void)max_len;
    if (tp->size > 1 && tp->device_buffers)
        return GY_FAIL(GY_ERR_INVALID, "the CPU forward pass all-reduces host buffers, but this TP "
                                       "group's all-reduce takes device buffers");
    if (gy_kv_layout_of(kv)->elem_size != 4)
        return GY_FAIL(GY_ERR_INVALID, "the CPU forward pass needs an fp32 KV cache (elem_size 4, "
                                       "not %lld)", (long long)gy_kv_layout_of(kv)->elem_size);
    GY_TRY(gy_forward_ws_reserve(ws, m, b->paged.n_tokens));
    if (!embed) return GY_OK;
    return gy_cpu_embedding(ws->x, m->embed, m->weight_dtype, b->tokens, b->paged.n_tokens,
                            m->vocab, m->hidden);
}

/* Rows [row0, row0 + paged->n_tokens) of the workspace: their K/V into the layer at
 * layer_base, then their attention over it. */
static gy_status gy_forward_cpu_attend(gy_forward_ws *ws, int64_t row0, const gy_cpu_paged_batch *paged,
                                       float *layer_base, const gy_kv_layout *layout,
                                       int64_t heads, gy_threadpool *pool) {
    const int64_t qd = heads * layout->head_dim, kvd = layout->n_heads * layout->head_dim;
    GY_TRY(gy_cpu_kv_write(layer_base, layout, ws->k + row0 * kvd, ws->v + row0 * kvd, paged));
    return gy_cpu_attention(ws->attn + row0 * qd, ws->q + row0 * qd, layer_base, layout, paged,
                            heads, pool);
}

/* Layer l's attention for the whole batch: here, except the remote parts whose KV for l is still
 * in another worker's cache (forward.h), which attend there on that worker's threads. A token's
 * attention depends on nothing but its own sequence (attention.h), so cutting the batch into
 * runs changes no bit. */
static gy_status gy_forward_cpu_attention(const gy_forward_batch *b, gy_forward_ws *ws,
                                          float *layer_base, const gy_kv_layout *layout, int64_t l,
                                          int64_t heads, gy_threadpool *pool) {
    int64_t row = 0; /* rows before it are done */
    for (int64_t i = 0; i <= b->n_remote; i++) {
        const gy_forward_remote *p = i < b->n_remote ? &b->remote[i] : NULL;
        if (p != NULL && (l < p->first_layer || l >= p->end_layer)) continue; /* attends here */
        const int64_t stop = p != NULL ? p->row0 : b->paged.n_tokens;
        if (stop > row) {
            gy_cpu_paged_batch here = b->paged;
            here.n_tokens = stop - row;
            here.token_seq += row;
            here.token_pos += row;
            GY_TRY(gy_forward_cpu_attend(ws, row, &here, layer_base, layout, heads, pool));
        }
        if (p == NULL) break;
        const gy_cpu_paged_batch there = gy_forward_remote_paged(b, p);
        float *remote_base = gy_kv_layer_ptr(p->kv, l - gy_kv_config_of(p->kv)->first_layer);
        if (remote_base == NULL) return GY_FAIL(GY_ERR_UNAVAILABLE, "the remote KV cache is not in host memory");
        GY_TRY(gy_forward_cpu_attend(ws, p->row0, &there, remote_base, gy_kv_layout_of(p->kv),
                                     heads, p->pool));
        row = p->row0 + p->n_rows;
    }
    return GY_OK;
}

static gy_status gy_forward_cpu_layers(const gy_model *m, const gy_tp_group *tp, gy_kv_cache *kv,
                                       const gy_forward_batch *b, gy_forward_ws *ws,
                                       gy_threadpool *pool, int64_t first_layer, int64_t end_layer) {
    const int64_t kv_first = gy_kv_config_of(kv)->first_layer;
    const int64_t n = b->paged.n_tokens, hid = m->hidden, D = m->head_dim;
    const int64_t esz = gy_dtype_size(m->weight_dtype);
    const int64_t heads = m->n_heads / tp->size, kv_heads = m->n_kv_heads / tp->size;
    const int64_t q_rows = heads * D, kv_rows = kv_heads * D;
    const int64_t shards_here = m->max_tp / tp->size, first_shard = tp->rank * shards_here;
    const gy_kv_layout *layout = gy_kv_layout_of(kv);
    const gy_dtype wt = m->weight_dtype;
#define GY_ROWS(ptr, row) ((const void *)((const char *)(ptr) + (row) * hid * esz))
    for (int64_t l = first_layer; l < end_layer; l++) {
        const gy_layer_weights *w = &m->layers[l];
        float *layer_base = gy_kv_layer_ptr(kv, l - kv_first);
        if (layer_base == NULL) return GY_FAIL(GY_ERR_UNAVAILABLE, "the KV cache is not in host memory");

        /* Attention: this rank's heads only. */
        GY_TRY(gy_cpu_rmsnorm(ws->h, ws->x, w->attn_norm, n, hid, m->rms_eps));
        GY_TRY(gy_cpu_linear(ws->q, ws->h, GY_ROWS(w->wq, tp->rank * q_rows), wt,
                             w->bq ? w->bq + tp->rank * q_rows : NULL, n, hid, q_rows, 1, pool));
        GY_TRY(gy_cpu_linear(ws->k, ws->h, GY_ROWS(w->wk, tp->rank * kv_rows), wt,
                             w->bk ? w->bk + tp->rank * kv_rows : NULL, n, hid, kv_rows, 1, pool));
        GY_TRY(gy_cpu_linear(ws->v, ws->h, GY_ROWS(w->wv, tp->rank * kv_rows), wt,
                             w->bv ? w->bv + tp->rank * kv_rows : NULL, n, hid, kv_rows, 1, pool));
        GY_TRY(gy_cpu_rope(ws->q, b->paged.token_pos, m->rope_cos, m->rope_sin, n, heads, D, m->max_pos));
        GY_TRY(gy_cpu_rope(ws->k, b->paged.token_pos, m->rope_cos, m->rope_sin, n, kv_heads, D, m->max_pos));
        GY_TRY(gy_forward_cpu_attention(b, ws, layer_base, layout, l, heads, pool));
        /* o_proj is row-parallel: a partial sum over this rank's heads, in max_tp chunks. */
        GY_TRY(gy_cpu_linear_t(ws->o, ws->attn, GY_ROWS(w->wo_t, tp->rank * q_rows), wt, NULL, n,
                               q_rows, hid, (int32_t)shards_here, pool));
        if (tp->size > 1) GY_TRY(tp->all_reduce(tp->ctx, ws->o, n * hid));
        GY_TRY(gy_cpu_add(ws->x, ws->x, ws->o, n * hid));

        /* FFN: each shard's partial sum, then the tree over shards and ranks. */
        GY_TRY(gy_cpu_rmsnorm(ws->h, ws->x, w->ffn_norm, n, hid, m->rms_eps));
        const float *parts[GY_MODEL_MAX_TP];
        for (int64_t j = 0; j < shards_here; j++) {
            const int64_t s = first_shard + j, R = m->shard_rows;
            float *part = ws->parts + j * n * hid;
            if (w->gate[s] == NULL || w->up[s] == NULL || w->down_t[s] == NULL)
                return GY_FAIL(GY_ERR_STATE, "layer %lld: FFN shard %lld is not held here",
                               (long long)l, (long long)s);
            GY_TRY(gy_cpu_linear(ws->g, ws->h, w->gate[s], wt, NULL, n, hid, R, 1, pool));
            GY_TRY(gy_cpu_linear(ws->u, ws->h, w->up[s], wt, NULL, n, hid, R, 1, pool));
            GY_TRY(gy_cpu_swiglu(ws->g, ws->g, ws->u, n * R));
            GY_TRY(gy_cpu_linear_t(part, ws->g, w->down_t[s], wt, NULL, n, R, hid, 1, pool));
            parts[j] = part;
        }
        GY_TRY(gy_cpu_add_tree(ws->o, parts, (int32_t)shards_here, n * hid));
        if (tp->size > 1) GY_TRY(tp->all_reduce(tp->ctx, ws->o, n * hid));
        GY_TRY(gy_cpu_add(ws->x, ws->x, ws->o, n * hid));
    }
#undef GY_ROWS
    return GY_OK;
}

static gy_status gy_forward_cpu_end(float *logits, const gy_model *m, const gy_forward_batch *b,
                                    gy_forward_ws *ws, gy_threadpool *pool) {
    const int64_t hid = m->hidden;
    if (b->n_logits == 0) return GY_OK;
    for (int64_t i = 0; i < b->n_logits; i++)
        memcpy(ws->sel + i * hid, ws->x + (int64_t)b->logit_rows[i] * hid, (size_t)hid * sizeof(float));
    GY_TRY(gy_cpu_rmsnorm(ws->sel, ws->sel, m->final_norm, b->n_logits, hid, m->rms_eps));
    return gy_cpu_linear(logits, ws->sel, m->lm_head, m->weight_dtype, NULL, b->n_logits, hid,
                         m->vocab, 1, pool);
}

/* x is fp32 in host memory: the hand-off is a copy of each row. */
static gy_status gy_forward_cpu_x_in(const gy_model *m, gy_forward_ws *ws, const void *host,
                                     size_t row_bytes, const int32_t *map, int64_t n) {
    const size_t bytes = (size_t)m->hidden * sizeof(float);
    if (n > ws->capacity_tokens || row_bytes < bytes)
        return GY_FAIL(GY_ERR_INVALID, "x_in: %lld rows of %zu bytes into a workspace of %lld "
                       "rows of %zu", (long long)n, row_bytes, (long long)ws->capacity_tokens, bytes);
    for (int64_t i = 0; i < n; i++)
        memcpy(ws->x + i * m->hidden, (const char *)host + (map ? map[i] : i) * row_bytes, bytes);
    return GY_OK;
}

static gy_status gy_forward_cpu_x_out(const gy_model *m, gy_forward_ws *ws, void *host,
                                      size_t row_bytes, const int32_t *map, int64_t n) {
    const size_t bytes = (size_t)m->hidden * sizeof(float);
    if (n > ws->capacity_tokens || row_bytes < bytes)
        return GY_FAIL(GY_ERR_INVALID, "x_out: %lld rows of %zu bytes from a workspace of %lld "
                       "rows of %zu", (long long)n, row_bytes, (long long)ws->capacity_tokens, bytes);
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)host + (map ? map[i] : i) * row_bytes, ws->x + i * m->hidden, bytes);
    return GY_OK;
}

const gy_forward_backend gy_forward_cpu_backend = {
    .name = "cpu",
    .begin = gy_forward_cpu_begin,
    .layers = gy_forward_cpu_layers,
    .end = gy_forward_cpu_end,
    .x_in = gy_forward_cpu_x_in,
    .x_out = gy_forward_cpu_x_out,
    .ws_free = gy_forward_cpu_ws_free,
};
