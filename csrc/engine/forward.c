/* forward.c: the forward pass of forward.h: the checks every backend shares, then the model's
 * backend (forward_backend.h: forward_cpu.c, forward_cuda.c), which never call each other. */
#include "forward_backend.h"
#include "../core/tree.h"

#include <stdlib.h>

static const gy_forward_backend *gy_forward_backend_of(const gy_model *m) {
    return m->backend == GY_MODEL_BACKEND_CUDA ? &gy_forward_cuda_backend : &gy_forward_cpu_backend;
}

/* A backend left out of this build answers with its reason. */
static gy_status gy_forward_unavailable(const gy_forward_backend *be) {
    return GY_FAIL(GY_ERR_UNAVAILABLE, "%s", be->unavailable ? be->unavailable() : be->name);
}

void gy_forward_ws_free(gy_forward_ws *ws) {
    if (ws == NULL) return;
    gy_forward_cpu_backend.ws_free(ws);
    if (gy_forward_cuda_backend.ws_free) gy_forward_cuda_backend.ws_free(ws);
}

/* The paged batch of remote part p's rows in its own cache (sequence 0 of one). */
gy_cpu_paged_batch gy_forward_remote_paged(const gy_forward_batch *b, const gy_forward_remote *p) {
    return (gy_cpu_paged_batch){.n_tokens = p->n_rows, .token_seq = b->zeros,
                                .token_pos = b->paged.token_pos + p->row0, .n_seqs = 1,
                                .bt_indptr = p->indptr, .bt_indices = p->blocks};
}

/* Remote parts: in row order, each one sequence of the batch whose blocks in a cache of the same
 * KV heads cover its positions (the backends check where that cache is). */
static gy_status gy_forward_check_remote(const gy_model *m, const gy_kv_layout *L,
                                         const gy_forward_batch *b) {
    (void)m;
    if (b->n_remote == 0) return GY_OK;
    if (b->n_remote < 0 || b->remote == NULL || b->zeros == NULL)
        return GY_FAIL(GY_ERR_INVALID, "%lld remote attention parts without their lists",
                       (long long)b->n_remote);
    int64_t end = 0;
    for (int64_t i = 0; i < b->n_remote; i++) {
        const gy_forward_remote *p = &b->remote[i];
        if (p->kv == NULL || p->row0 < end || p->n_rows < 1 || p->row0 + p->n_rows > b->paged.n_tokens ||
            p->indptr[0] != 0 || p->indptr[1] < 0 || (p->indptr[1] > 0 && p->blocks == NULL))
            return GY_FAIL(GY_ERR_INVALID, "remote attention part %lld (rows [%lld, %lld)) is not "
                           "a run of the batch's rows after the part before, with a cache and blocks",
                           (long long)i, (long long)p->row0, (long long)(p->row0 + p->n_rows));
        const gy_kv_layout *R = gy_kv_layout_of(p->kv);
        if (R->n_heads != L->n_heads || R->head_dim != L->head_dim || R->elem_size != L->elem_size ||
            R->block_size != L->block_size)
            return GY_FAIL(GY_ERR_INVALID, "remote attention part %lld: its cache's layout (%lld "
                           "heads of %lld, blocks of %lld) is not this rank's", (long long)i,
                           (long long)R->n_heads, (long long)R->head_dim, (long long)R->block_size);
        const gy_kv_config *c = gy_kv_config_of(p->kv);
        if (p->first_layer < p->end_layer &&
            (p->first_layer < c->first_layer || p->end_layer > c->first_layer + c->n_layers))
            return GY_FAIL(GY_ERR_INVALID, "remote attention part %lld: layers [%lld, %lld) are "
                           "not all in its cache", (long long)i, (long long)p->first_layer,
                           (long long)p->end_layer);
        const gy_cpu_paged_batch pb = gy_forward_remote_paged(b, p);
        GY_TRY(gy_cpu_paged_batch_check(&pb, R, "remote attention part", NULL));
        for (int64_t t = p->row0; t < p->row0 + p->n_rows; t++)
            if (b->paged.token_seq[t] != b->paged.token_seq[p->row0] || b->zeros[t - p->row0] != 0)
                return GY_FAIL(GY_ERR_INVALID, "remote attention part %lld: its rows are not one "
                               "sequence's", (long long)i);
        end = p->row0 + p->n_rows;
    }
    return GY_OK;
}

gy_status gy_forward_check(const gy_model *m, const gy_tp_group *tp, const gy_kv_cache *kv,
                           const gy_forward_batch *b, int64_t *max_len_out) {
    if (tp->size <= 0 || tp->rank < 0 || tp->rank >= tp->size || m->n_kv_heads % tp->size != 0 ||
        !gy_tree_split_ok(m->max_tp, tp->size) || (tp->size > 1 && tp->all_reduce == NULL))
        return GY_FAIL(GY_ERR_INVALID,
                       "TP rank %d of %d does not fit %lld KV heads and %lld FFN shards (the "
                       "degree must divide both, with shards per rank a power of two or TP1)",
                       (int)tp->rank, (int)tp->size, (long long)m->n_kv_heads, (long long)m->max_tp);
    /* expert parallelism: each rank holds its block of experts, whole (model.h) */
    const int64_t E = m->n_experts, mine = tp->rank * E / tp->size;
    if (m->expert_end - m->expert_begin < E &&
        (tp->size == 1 || m->expert_begin != mine || m->expert_end != (tp->rank + 1) * E / tp->size))
        return GY_FAIL(GY_ERR_INVALID, "TP rank %d of %d holds experts [%lld, %lld) of %lld; "
                       "expert parallelism gives it [%lld, %lld)", (int)tp->rank, (int)tp->size,
                       (long long)m->expert_begin, (long long)m->expert_end, (long long)E,
                       (long long)mine, (long long)((tp->rank + 1) * E / tp->size));
    const gy_kv_layout *L = gy_kv_layout_of(kv);
    const gy_kv_config *c = gy_kv_config_of(kv);
    if (L->n_heads != m->n_kv_heads / tp->size || L->head_dim != m->head_dim ||
        c->first_layer + c->n_layers > m->n_layers)
        return GY_FAIL(GY_ERR_INVALID,
                       "the KV cache (layers [%lld, %lld), %lld heads of %lld) does not match the "
                       "model's %lld layers and %lld local KV heads of %lld",
                       (long long)c->first_layer, (long long)(c->first_layer + c->n_layers),
                       (long long)L->n_heads, (long long)L->head_dim, (long long)m->n_layers,
                       (long long)(m->n_kv_heads / tp->size), (long long)m->head_dim);
    if (b->paged.n_tokens <= 0) return GY_FAIL(GY_ERR_INVALID, "a forward pass needs at least one token");
    int64_t max_len = 0;
    GY_TRY(gy_cpu_paged_batch_check(&b->paged, L, "forward batch", &max_len));
    if (max_len > m->max_pos)
        return GY_FAIL(GY_ERR_INVALID, "position %lld is past the model's %lld positions",
                       (long long)max_len - 1, (long long)m->max_pos);
    if (b->n_logits < 0 || b->n_logits > b->paged.n_tokens)
        return GY_FAIL(GY_ERR_INVALID, "%lld logit rows for %lld tokens", (long long)b->n_logits,
                       (long long)b->paged.n_tokens);
    if (b->n_logits > 0 && b->logit_rows == NULL)
        return GY_FAIL(GY_ERR_INVALID, "%lld logit rows but no row list", (long long)b->n_logits);
    for (int64_t i = 0; i < b->n_logits; i++)
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= b->paged.n_tokens)
            return GY_FAIL(GY_ERR_INVALID, "logit row %d is not a token of the batch", (int)b->logit_rows[i]);
    GY_TRY(gy_forward_check_remote(m, L, b));
    if (max_len_out != NULL) *max_len_out = max_len;
    return GY_OK;
}

gy_status gy_forward_check_layers(const gy_model *m, const gy_kv_cache *kv, int64_t first_layer,
                                  int64_t end_layer) {
    if (first_layer < 0 || end_layer > m->n_layers || first_layer > end_layer)
        return GY_FAIL(GY_ERR_INVALID, "layers [%lld, %lld) are not within [0, %lld)",
                       (long long)first_layer, (long long)end_layer, (long long)m->n_layers);
    if (first_layer < end_layer && (first_layer < m->layer_begin || end_layer > m->layer_end))
        return GY_FAIL(GY_ERR_INVALID, "layers [%lld, %lld) are not all held by the model, which "
                       "holds [%lld, %lld)", (long long)first_layer, (long long)end_layer,
                       (long long)m->layer_begin, (long long)m->layer_end);
    const gy_kv_config *c = gy_kv_config_of(kv);
    if (first_layer < end_layer &&
        (first_layer < c->first_layer || end_layer > c->first_layer + c->n_layers))
        return GY_FAIL(GY_ERR_INVALID, "layers [%lld, %lld) are not all in the KV cache, which "
                       "holds [%lld, %lld)", (long long)first_layer, (long long)end_layer,
                       (long long)c->first_layer, (long long)(c->first_layer + c->n_layers));
    return GY_OK;
}

gy_status gy_forward_begin(const gy_model *m, const gy_tp_group *tp, gy_kv_cache *kv,
                           const gy_forward_batch *b, gy_forward_ws *ws, int embed) {
    if (embed && !m->has_embed)
        return GY_FAIL(GY_ERR_INVALID, "the model does not hold the embedding (a later pipeline "
                                       "stage): its hidden states come from the stage before");
    const gy_forward_backend *be = gy_forward_backend_of(m);
    if (be->begin == NULL) return gy_forward_unavailable(be);
    int64_t max_len = 0;
    GY_TRY(gy_forward_check(m, tp, kv, b, &max_len));
    return be->begin(m, tp, kv, b, ws, embed, max_len);
}

gy_status gy_forward_layers(const gy_model *m, const gy_tp_group *tp, gy_kv_cache *kv,
                            const gy_forward_batch *b, gy_forward_ws *ws, gy_threadpool *pool,
                            int64_t first_layer, int64_t end_layer) {
    const gy_forward_backend *be = gy_forward_backend_of(m);
    if (be->layers == NULL) return gy_forward_unavailable(be);
    GY_TRY(gy_forward_check_layers(m, kv, first_layer, end_layer));
    return be->layers(m, tp, kv, b, ws, pool, first_layer, end_layer);
}

gy_status gy_forward_end(float *logits, const gy_model *m, const gy_forward_batch *b,
                         gy_forward_ws *ws, gy_threadpool *pool) {
    if (b->n_logits > 0 && !m->has_head)
        return GY_FAIL(GY_ERR_INVALID, "the model does not hold the final norm and LM head (an "
                                       "earlier pipeline stage): the last stage computes logits");
    const gy_forward_backend *be = gy_forward_backend_of(m);
    if (be->end == NULL) return gy_forward_unavailable(be);
    if (b->n_logits > 0 && logits == NULL)
        return GY_FAIL(GY_ERR_INVALID, "logits requested but no output buffer given");
    return be->end(logits, m, b, ws, pool);
}

gy_status gy_forward_x_in(const gy_model *m, gy_forward_ws *ws, const void *host, size_t row_bytes,
                          const int32_t *map, int64_t n) {
    const gy_forward_backend *be = gy_forward_backend_of(m);
    if (be->x_in == NULL) return gy_forward_unavailable(be);
    return be->x_in(m, ws, host, row_bytes, map, n);
}

gy_status gy_forward_x_out(const gy_model *m, gy_forward_ws *ws, void *host, size_t row_bytes,
                           const int32_t *map, int64_t n) {
    const gy_forward_backend *be = gy_forward_backend_of(m);
    if (be->x_out == NULL) return gy_forward_unavailable(be);
    return be->x_out(m, ws, host, row_bytes, map, n);
}

gy_status gy_forward(float *logits, const gy_model *m, const gy_tp_group *tp, gy_kv_cache *kv,
                     const gy_forward_batch *b, gy_forward_ws *ws, gy_threadpool *pool) {
    GY_TRY(gy_forward_begin(m, tp, kv, b, ws, 1));
    GY_TRY(gy_forward_layers(m, tp, kv, b, ws, pool, 0, m->n_layers));
    return gy_forward_end(logits, m, b, ws, pool);
}
