/* model.c: shape checks and the rotary tables of a gy_model. */
#include "model.h"
#include "../core/alloc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../cpu/rope.h"

/* Bytes of the two rotary tables, refused before they are allocated: positions are int32, and a
 * table larger than the machine's memory would be overcommitted by Linux and then killed (or, for
 * a product that wraps around, overflow into a small buffer). */
static gy_status gy_model_rope_bytes(const gy_model *m, size_t *out) {
    if (m->max_pos > INT32_MAX)
        return GY_FAIL(GY_ERR_INVALID, "max_pos=%lld is beyond int32 positions (at most %d)",
                       (long long)m->max_pos, INT32_MAX);
    uint64_t bytes;
    const int wraps = __builtin_mul_overflow((uint64_t)m->max_pos, (uint64_t)(m->head_dim / 2),
                                             &bytes) ||
                      __builtin_mul_overflow(bytes, (uint64_t)(2 * sizeof(float)), &bytes);
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    const uint64_t memory = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : UINT64_MAX;
    if (wraps || bytes > memory || bytes > SIZE_MAX)
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY,
                       "the rotary tables of max_pos=%lld positions x head_dim=%lld need more "
                       "than the machine's %llu bytes of memory",
                       (long long)m->max_pos, (long long)m->head_dim, (unsigned long long)memory);
    *out = (size_t)bytes / 2;
    return GY_OK;
}

gy_status gy_model_init(gy_model *m, const double *inv_freq, double mscale,
                        const gy_model *tables_from) {
    if (m->vocab <= 0 || m->hidden <= 0 || m->intermediate <= 0 || m->n_layers <= 0 ||
        m->n_heads <= 0 || m->n_kv_heads <= 0 || m->head_dim <= 0 || m->max_pos <= 0)
        return GY_FAIL(GY_ERR_INVALID, "model sizes must be positive");
    if (m->n_heads % m->n_kv_heads != 0)
        return GY_FAIL(GY_ERR_INVALID, "%lld attention heads are not a multiple of %lld KV heads",
                       (long long)m->n_heads, (long long)m->n_kv_heads);
    if (m->head_dim % 2 != 0)
        return GY_FAIL(GY_ERR_INVALID, "head_dim %lld must be even for rotary embeddings",
                       (long long)m->head_dim);
    if (m->max_tp <= 0 || m->max_tp > GY_MODEL_MAX_TP || m->intermediate % m->max_tp != 0 ||
        m->n_heads % m->max_tp != 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "max_tp=%lld must be in [1, %d] and divide intermediate %lld and %lld heads",
                       (long long)m->max_tp, GY_MODEL_MAX_TP, (long long)m->intermediate,
                       (long long)m->n_heads);
    if (m->n_experts < 0 || m->n_experts > GY_MODEL_MAX_EXPERTS ||
        (m->n_experts > 0 &&
         (m->n_experts_used < 1 || m->n_experts_used > m->n_experts ||
          m->expert_intermediate <= 0 || m->expert_intermediate % m->max_tp != 0 ||
          m->shared_intermediate < 0 || m->shared_intermediate % m->max_tp != 0)))
        return GY_FAIL(GY_ERR_INVALID,
                       "%lld experts (at most %d), %lld used a token, of width %lld (shared: "
                       "%lld): the used must be in [1, experts] and max_tp=%lld must divide "
                       "the widths", (long long)m->n_experts, GY_MODEL_MAX_EXPERTS,
                       (long long)m->n_experts_used, (long long)m->expert_intermediate,
                       (long long)m->shared_intermediate, (long long)m->max_tp);
    const int64_t half = m->head_dim / 2;
    if (inv_freq == NULL) return GY_FAIL(GY_ERR_INVALID, "the model needs its rotary frequencies");
    for (int64_t i = 0; i < half; i++)
        if (!(inv_freq[i] > 0.0) || !isfinite(inv_freq[i]))
            return GY_FAIL(GY_ERR_INVALID, "rotary frequency %lld is %g; each must be finite and "
                           "positive", (long long)i, inv_freq[i]);
    if (!(mscale > 0.0) || !isfinite(mscale))
        return GY_FAIL(GY_ERR_INVALID, "rotary mscale %g must be finite and positive", mscale);
    GY_TRY(gy_dtype_check(m->weight_dtype, "weight dtype"));
    size_t table = 0;
    GY_TRY(gy_model_rope_bytes(m, &table));
    m->shard_rows = m->intermediate / m->max_tp;
    m->expert_rows = m->n_experts > 0 ? m->expert_intermediate / m->max_tp : 0;
    m->shared_rows = m->n_experts > 0 ? m->shared_intermediate / m->max_tp : 0;
    m->expert_begin = 0;
    m->expert_end = m->n_experts;
    m->layer_begin = 0;
    m->layer_end = m->n_layers;
    m->has_embed = m->has_head = 1;
    m->rope_mscale = mscale;
    m->rope_inv_freq_dev = NULL;
    m->layers = gy_calloc((size_t)m->n_layers, sizeof *m->layers);
    m->experts = m->n_experts > 0
                     ? gy_calloc((size_t)(m->n_layers * m->n_experts), sizeof *m->experts) : NULL;
    m->rope_inv_freq = gy_malloc((size_t)half * sizeof(double));
    m->rope_cos = gy_malloc(table);
    m->rope_sin = gy_malloc(table);
    if (m->layers == NULL || m->rope_inv_freq == NULL || m->rope_cos == NULL ||
        m->rope_sin == NULL || (m->n_experts > 0 && m->experts == NULL)) {
        gy_model_free(m);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the model tables (max_pos=%lld, "
                       "head_dim=%lld)", (long long)m->max_pos, (long long)m->head_dim);
    }
    if (m->experts != NULL)
        for (int64_t l = 0; l < m->n_layers; l++) m->layers[l].experts = m->experts + l * m->n_experts;
    memcpy(m->rope_inv_freq, inv_freq, (size_t)half * sizeof(double));
    const gy_model *from = tables_from;
    if (from != NULL && from->rope_cos != NULL && from->max_pos == m->max_pos &&
        from->head_dim == m->head_dim && from->rope_mscale == m->rope_mscale &&
        memcmp(from->rope_inv_freq, m->rope_inv_freq, (size_t)half * sizeof(double)) == 0) {
        memcpy(m->rope_cos, from->rope_cos, table);
        memcpy(m->rope_sin, from->rope_sin, table);
        return GY_OK;
    }
    gy_status s = gy_cpu_rope_table(m->rope_cos, m->rope_sin, m->max_pos, m->head_dim,
                                    m->rope_inv_freq, mscale);
    if (s != GY_OK) gy_model_free(m);
    return s;
}

void gy_model_free(gy_model *m) {
    if (m == NULL) return;
    free(m->layers);
    free(m->experts);
    free(m->rope_inv_freq);
    free(m->rope_cos);
    free(m->rope_sin);
    m->layers = NULL;
    m->experts = NULL;
    m->rope_inv_freq = NULL;
    m->rope_cos = m->rope_sin = NULL;
}

gy_status gy_model_check(const gy_model *m, uint32_t shards) {
    if (m->n_experts > 0 &&
        (m->expert_begin < 0 || m->expert_end > m->n_experts || m->expert_begin >= m->expert_end))
        return GY_FAIL(GY_ERR_INVALID, "the model holds experts [%lld, %lld) of %lld",
                       (long long)m->expert_begin, (long long)m->expert_end,
                       (long long)m->n_experts);
    if (m->layer_begin < 0 || m->layer_end > m->n_layers || m->layer_begin > m->layer_end)
        return GY_FAIL(GY_ERR_INVALID, "the model holds layers [%lld, %lld) of %lld",
                       (long long)m->layer_begin, (long long)m->layer_end, (long long)m->n_layers);
    if (m->has_embed && m->embed == NULL)
        return GY_FAIL(GY_ERR_INVALID, "the model is missing its embedding");
    if (m->has_head && (m->final_norm == NULL || m->lm_head == NULL))
        return GY_FAIL(GY_ERR_INVALID, "the model is missing its final norm or LM head");
    for (int64_t l = m->layer_begin; l < m->layer_end; l++) {
        const gy_layer_weights *w = &m->layers[l];
        if (!w->attn_norm || !w->ffn_norm || !w->wq || !w->wk || !w->wv || !w->wo_t)
            return GY_FAIL(GY_ERR_INVALID, "layer %lld is missing an attention tensor", (long long)l);
        if ((w->q_norm == NULL) != (w->k_norm == NULL))
            return GY_FAIL(GY_ERR_INVALID, "layer %lld has one of q_norm and k_norm", (long long)l);
        if (w->router != NULL && m->n_experts == 0)
            return GY_FAIL(GY_ERR_INVALID, "layer %lld has a router but the model no experts",
                           (long long)l);
        /* A dense layer's FFN, or an MoE layer's shared expert when the model has one; the
         * experts it holds: the shards in `shards`, or every shard when expert-parallel. */
        const int partitioned = m->expert_end - m->expert_begin < m->n_experts;
        const int dense = w->router == NULL || m->shared_rows > 0;
        for (int64_t s = 0; s < m->max_tp; s++) {
            if (!((shards >> s) & 1u)) continue;
            if (dense && (!w->gate[s] || !w->up[s] || !w->down_t[s]))
                return GY_FAIL(GY_ERR_INVALID, "layer %lld is missing %s shard %lld", (long long)l,
                               w->router ? "the shared expert's" : "FFN", (long long)s);
        }
        for (int64_t s = 0; w->router != NULL && s < m->max_tp; s++) {
            if (!partitioned && !((shards >> s) & 1u)) continue;
            for (int64_t e = m->expert_begin; e < m->expert_end; e++) {
                const gy_expert_weights *x = &w->experts[e];
                if (!x->gate[s] || !x->up[s] || !x->down_t[s])
                    return GY_FAIL(GY_ERR_INVALID, "layer %lld is missing expert %lld's shard %lld",
                                   (long long)l, (long long)e, (long long)s);
            }
        }
    }
    return GY_OK;
}
