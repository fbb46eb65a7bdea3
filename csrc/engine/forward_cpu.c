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
#include "../cpu/moe.h"
#include "../cpu/norm.h"
#include "../cpu/rope.h"

/* The workspace's buffers (forward.h) and how many elements of what size each holds for a batch
 * of n tokens of model m (0: not needed by this model). */
#define GY_FORWARD_CPU_BUFFERS 20

typedef struct gy_forward_cpu_buffer {
    void **buf;
    int64_t elems;
    size_t size;
} gy_forward_cpu_buffer;

static int32_t gy_forward_cpu_buffers(gy_forward_cpu_buffer *out, gy_forward_ws *ws,
                                      const gy_model *m, int64_t n) {
    const int64_t qd = m->n_heads * m->head_dim, kvd = m->n_kv_heads * m->head_dim;
    int64_t rows = m->shard_rows;
    if (m->expert_rows > rows) rows = m->expert_rows;
    if (m->shared_rows > rows) rows = m->shared_rows;
    const int64_t E = m->n_experts, nk = n * m->n_experts_used;
    const int64_t outputs = m->expert_end - m->expert_begin < E ? m->max_tp : 1; /* ys's P */
    const size_t F = sizeof(float), I32 = sizeof(int32_t), I64 = sizeof(int64_t);
    const gy_forward_cpu_buffer plan[] = {
        {(void **)&ws->x, n * m->hidden, F}, {(void **)&ws->h, n * m->hidden, F},
        {(void **)&ws->q, n * qd, F}, {(void **)&ws->k, n * kvd, F}, {(void **)&ws->v, n * kvd, F},
        {(void **)&ws->attn, n * qd, F}, {(void **)&ws->o, n * m->hidden, F},
        {(void **)&ws->g, n * rows, F}, {(void **)&ws->u, n * rows, F},
        {(void **)&ws->parts, n * m->max_tp * m->hidden, F}, {(void **)&ws->sel, n * m->hidden, F},
        {(void **)&ws->logits, n * E, F}, {(void **)&ws->weight, nk, F},
        {(void **)&ws->xs, nk * m->hidden, F}, {(void **)&ws->ys, outputs * nk * m->hidden, F},
        {(void **)&ws->sg, E > 0 ? n : 0, F}, {(void **)&ws->choice, nk, I32},
        {(void **)&ws->token_of, nk, I32}, {(void **)&ws->slot_of, nk, I32},
        {(void **)&ws->offsets, E > 0 ? E + 1 : 0, I64},
    };
    _Static_assert(sizeof plan / sizeof plan[0] == GY_FORWARD_CPU_BUFFERS, "the buffers' count");
    for (int32_t i = 0; i < GY_FORWARD_CPU_BUFFERS; i++) out[i] = plan[i];
    return GY_FORWARD_CPU_BUFFERS;
}


static void gy_forward_cpu_ws_free(gy_forward_ws *ws) {
    void **buffers[] = {(void **)&ws->x, (void **)&ws->h, (void **)&ws->q, (void **)&ws->k,
                        (void **)&ws->v, (void **)&ws->attn, (void **)&ws->o, (void **)&ws->g,
                        (void **)&ws->u, (void **)&ws->parts, (void **)&ws->sel,
                        (void **)&ws->logits, (void **)&ws->weight, (void **)&ws->xs,
                        (void **)&ws->ys, (void **)&ws->sg, (void **)&ws->choice,
                        (void **)&ws->token_of, (void **)&ws->slot_of, (void **)&ws->offsets};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) {
        free(*buffers[i]);
        *buffers[i] = NULL;
    }
    ws->capacity_tokens = 0;
    ws->ys_parts = 0;
}

static gy_status gy_forward_ws_reserve(gy_forward_ws *ws, const gy_model *m, int64_t n) {
    const int64_t parts = m->expert_end - m->expert_begin < m->n_experts ? m->max_tp : 1;
    if (n <= ws->capacity_tokens && parts <= ws->ys_parts) return GY_OK;
    gy_forward_cpu_ws_free(ws);
    gy_forward_cpu_buffer plan[GY_FORWARD_CPU_BUFFERS];
    const int32_t count = gy_forward_cpu_buffers(plan, ws, m, n);
    for (int32_t i = 0; i < count; i++) {
        if (plan[i].elems == 0) continue; /* a dense model's expert buffers stay NULL */
        *plan[i].buf = gy_malloc((size_t)plan[i].elems * plan[i].size);
        if (*plan[i].buf == NULL) {
            gy_forward_cpu_ws_free(ws);
            return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a batch of %lld tokens", (long long)n);
        }
    }
    ws->capacity_tokens = n;
    ws->ys_parts = parts;
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

/* y [n, hidden] = one shard of a SwiGLU FFN (R rows of gate, up and down_t) on x [n, hidden];
 * ws->g and ws->u hold its gate and up. */
static gy_status gy_forward_cpu_ffn(float *y, gy_forward_ws *ws, const float *x, const void *gate,
                                    const void *up, const void *down_t, gy_dtype wt, int64_t n,
                                    int64_t hid, int64_t R, gy_threadpool *pool) {
    GY_TRY(gy_cpu_linear(ws->g, x, gate, wt, NULL, n, hid, R, 1, pool));
    GY_TRY(gy_cpu_linear(ws->u, x, up, wt, NULL, n, hid, R, 1, pool));
    GY_TRY(gy_cpu_swiglu(ws->g, ws->g, ws->u, n * R));
    return gy_cpu_linear_t(y, ws->g, down_t, wt, NULL, n, R, hid, 1, pool);
}

/* Layer l's mixture of experts on ws->h: ws->parts gets the partial sum of each FFN shard this
 * rank holds, as a dense layer's (expert-parallel: after the exchange above). The router runs on every rank (its weight is replicated, so
 * every rank routes alike); each expert's tokens are gathered into a run of rows (cpu/moe.h) and
 * go through the expert's shard in one GEMM each; each token's rows are combined in its rank
 * order, and the shared expert's shard, gated, added after them. A shard's partial is what TP1
 * computes for that shard, so the tree over shards and ranks gives TP1's bits. */
/* ys [n*k, hidden]: the grouped rows of experts [e_begin, e_end) through their shard s, one GEMM
 * an expert (the other experts' rows are left as they are). */
static gy_status gy_forward_cpu_experts(float *ys, const gy_model *m, const gy_layer_weights *w,
                                        gy_forward_ws *ws, int64_t s, int64_t e_begin,
                                        int64_t e_end, int64_t l, gy_threadpool *pool) {
    const int64_t hid = m->hidden;
    for (int64_t e = e_begin; e < e_end; e++) {
        const int64_t first = ws->offsets[e], rows = ws->offsets[e + 1] - first;
        const gy_expert_weights *x = &w->experts[e];
        if (rows == 0) continue;
        if (x->gate[s] == NULL || x->up[s] == NULL || x->down_t[s] == NULL)
            return GY_FAIL(GY_ERR_STATE, "layer %lld: expert %lld's shard %lld is not held here",
                           (long long)l, (long long)e, (long long)s);
        GY_TRY(gy_forward_cpu_ffn(ys + first * hid, ws, ws->xs + first * hid, x->gate[s], x->up[s],
                                  x->down_t[s], m->weight_dtype, rows, hid, m->expert_rows, pool));
    }
    return GY_OK;
}

/* Expert parallelism's half of it: this rank's experts, every shard, into ys [max_tp, n*k,
 * hidden] (zeros in the other ranks' slots), then the all-reduce that gives every rank every
 * slot; each value comes from one rank, so the sum over ranks is exact. */
static gy_status gy_forward_cpu_moe_exchange(const gy_model *m, const gy_layer_weights *w,
                                             const gy_tp_group *tp, gy_forward_ws *ws, int64_t n,
                                             int64_t l, gy_threadpool *pool) {
    const int64_t nk = n * m->n_experts_used, hid = m->hidden;
    memset(ws->ys, 0, (size_t)(m->max_tp * nk * hid) * sizeof(float));
    for (int64_t s = 0; s < m->max_tp; s++)
        GY_TRY(gy_forward_cpu_experts(ws->ys + s * nk * hid, m, w, ws, s, m->expert_begin,
                                      m->expert_end, l, pool));
    return tp->all_reduce(tp->ctx, ws->ys, m->max_tp * nk * hid);
}

static gy_status gy_forward_cpu_moe(const gy_model *m, const gy_layer_weights *w,
                                    const gy_tp_group *tp, gy_forward_ws *ws, int64_t n,
                                    int64_t first_shard, int64_t shards_here, int64_t l,
                                    gy_threadpool *pool) {
    const int64_t E = m->n_experts, k = m->n_experts_used, hid = m->hidden;
    const gy_dtype wt = m->weight_dtype;
    const int partitioned = m->expert_end - m->expert_begin < E;
    GY_TRY(gy_cpu_linear(ws->logits, ws->h, w->router, GY_DTYPE_F32, NULL, n, hid, E, 1, pool));
    GY_TRY(gy_cpu_moe_route(ws->choice, ws->weight, ws->logits, n, E, k, m->norm_topk_prob));
    GY_TRY(gy_cpu_moe_group(ws->offsets, ws->token_of, ws->slot_of, ws->choice, n, E, k));
    GY_TRY(gy_cpu_moe_gather(ws->xs, ws->h, ws->token_of, n * k, hid));
    if (m->shared_rows > 0 && w->shared_gate != NULL)
        GY_TRY(gy_cpu_linear(ws->sg, ws->h, w->shared_gate, GY_DTYPE_F32, NULL, n, hid, 1, 1, pool));
    if (partitioned) GY_TRY(gy_forward_cpu_moe_exchange(m, w, tp, ws, n, l, pool));
    for (int64_t j = 0; j < shards_here; j++) {
        const int64_t s = first_shard + j;
        float *part = ws->parts + j * n * hid;
        /* the experts' outputs of shard s: exchanged (expert-parallel), or computed here */
        const float *ys = partitioned ? ws->ys + s * n * k * hid : ws->ys;
        float *spare = partitioned ? ws->xs : ws->ys; /* n rows free for the shared expert */
        if (!partitioned) GY_TRY(gy_forward_cpu_experts(ws->ys, m, w, ws, s, 0, E, l, pool));
        GY_TRY(gy_cpu_moe_combine(part, ys, ws->weight, ws->slot_of, n, k, hid));
        if (m->shared_rows == 0) continue;
        if (w->gate[s] == NULL || w->up[s] == NULL || w->down_t[s] == NULL)
            return GY_FAIL(GY_ERR_STATE, "layer %lld: the shared expert's shard %lld is not held "
                           "here", (long long)l, (long long)s);
        GY_TRY(gy_forward_cpu_ffn(spare, ws, ws->h, w->gate[s], w->up[s], w->down_t[s], wt, n,
                                  hid, m->shared_rows, pool));
        GY_TRY(gy_cpu_moe_add_gated(part, spare, w->shared_gate ? ws->sg : NULL, n, hid));
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
        if (w->q_norm != NULL) { /* Qwen3: each head RMS-normed before the rotation */
            GY_TRY(gy_cpu_rmsnorm(ws->q, ws->q, w->q_norm, n * heads, D, m->rms_eps));
            GY_TRY(gy_cpu_rmsnorm(ws->k, ws->k, w->k_norm, n * kv_heads, D, m->rms_eps));
        }
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
        for (int64_t j = 0; j < shards_here; j++) parts[j] = ws->parts + j * n * hid;
        if (w->router != NULL)
            GY_TRY(gy_forward_cpu_moe(m, w, tp, ws, n, first_shard, shards_here, l, pool));
        else
            for (int64_t j = 0; j < shards_here; j++) {
                const int64_t s = first_shard + j;
                if (w->gate[s] == NULL || w->up[s] == NULL || w->down_t[s] == NULL)
                    return GY_FAIL(GY_ERR_STATE, "layer %lld: FFN shard %lld is not held here",
                                   (long long)l, (long long)s);
                GY_TRY(gy_forward_cpu_ffn(ws->parts + j * n * hid, ws, ws->h, w->gate[s], w->up[s],
                                          w->down_t[s], wt, n, hid, m->shard_rows, pool));
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
