/* attention.c: two-pass softmax attention per (token, query head), in position order. */
#include "attention.h"

#include <math.h>
#include <stdlib.h>

#include "dot.h"
#include "isa.h"
#include "simd.h"
#include "vexp.h"

typedef struct gy_attn_ctx {
    float *out;
    const float *q;
    const float *kv;
    const gy_kv_layout *layout;
    const gy_cpu_paged_batch *batch;
    int64_t n_q_heads, group, pairs, per_task, scratch_stride;
    float scale;
    float *scratch; /* [n_tasks, scratch_stride]: the scores, then the weights, of one pair */
} gy_attn_ctx;

/* Walks positions 0, 1, 2, ... of one sequence's K or V rows for one KV head: the block base comes
 * from gy_kv_layout_offset once per block, slots step by the layout's token stride. */
typedef struct {
    const float *kv;
    const gy_kv_layout *layout;
    const int32_t *blocks; /* the sequence's block ids */
    int64_t kind, head, block, slot;
    const float *base;
} gy_attn_rows;

static void gy_attn_rows_init(gy_attn_rows *it, const gy_attn_ctx *c, int64_t seq, int64_t kind,
                              int64_t head) {
    it->kv = c->kv;
    it->layout = c->layout;
    it->blocks = c->batch->bt_indices + c->batch->bt_indptr[seq];
    it->kind = kind;
    it->head = head;
    it->block = 0;
    it->slot = 0;
    it->base = c->kv + gy_kv_layout_offset(c->layout, kind, it->blocks[0], 0, head);
}

/* The row of the current position; then moves to the next position. */
static inline const float *gy_attn_rows_next(gy_attn_rows *it) {
    const float *row = it->base + it->slot * it->layout->stride_token;
    if (++it->slot == it->layout->block_size) {
        it->slot = 0;
        it->block++;
        it->base = NULL; /* set lazily: the next block may not exist past the last position */
    }
    return row;
}

static inline void gy_attn_rows_fix(gy_attn_rows *it) {
    if (it->base == NULL)
        it->base = it->kv + gy_kv_layout_offset(it->layout, it->kind, it->blocks[it->block], 0, it->head);
}

/* e[j] = exp(s[j] - m) for j < len; returns their 16-lane sum. */
static float gy_attn_softmax_weights(float *s, int64_t len, float m) {
    float lanes[16] = {0};
    int64_t j0 = 0;
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        __m512 acc = _mm512_setzero_ps();
        const __m512 mv = _mm512_set1_ps(m);
        for (; j0 < len; j0 += 16) {
            const __mmask16 mask = gy_simd_mask(len - j0);
            const __m512 e = _mm512_maskz_mov_ps(
                mask, gy_simd_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j0), mv)));
            _mm512_mask_storeu_ps(s + j0, mask, e);
            acc = _mm512_add_ps(acc, e);
        }
        return gy_simd_lane_tree(acc);
    }
#endif
    for (; j0 < len; j0 += 16)
        for (int l = 0; l < 16; l++) {
            float e = 0.0f;
            if (j0 + l < len) {
                e = gy_exp_ref(s[j0 + l] - m);
                s[j0 + l] = e;
            }
            lanes[l] = lanes[l] + e;
        }
    return gy_dot_lane_tree(lanes);
}

/* acc[d] = fma chain over positions of e_j * v_j[d]; out = acc / sum. */
static void gy_attn_weighted_v(float *out, const gy_attn_ctx *c, const float *e, int64_t len,
                               int64_t seq, int64_t kvh, float sum) {
    const int64_t d = c->layout->head_dim;
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        for (int64_t d0 = 0; d0 < d; d0 += 64) { /* 4 vectors of the head at a time */
            __mmask16 m[4];
            for (int v = 0; v < 4; v++) m[v] = gy_simd_mask(d - d0 - 16 * v > 0 ? d - d0 - 16 * v : 0);
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                             _mm512_setzero_ps()};
            gy_attn_rows it;
            gy_attn_rows_init(&it, c, seq, 1, kvh);
            for (int64_t j = 0; j < len; j++) {
                gy_attn_rows_fix(&it);
                const float *vr = gy_attn_rows_next(&it) + d0;
                const __m512 ej = _mm512_set1_ps(e[j]);
                for (int v = 0; v < 4; v++)
                    acc[v] = _mm512_fmadd_ps(ej, _mm512_maskz_loadu_ps(m[v], vr + 16 * v), acc[v]);
            }
            const __m512 sv = _mm512_set1_ps(sum);
            for (int v = 0; v < 4; v++)
                _mm512_mask_storeu_ps(out + d0 + 16 * v, m[v], _mm512_div_ps(acc[v], sv));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    gy_attn_rows it;
    gy_attn_rows_init(&it, c, seq, 1, kvh);
    for (int64_t j = 0; j < len; j++) {
        gy_attn_rows_fix(&it);
        const float *vr = gy_attn_rows_next(&it);
        for (int64_t i = 0; i < d; i++) out[i] = fmaf(e[j], vr[i], out[i]);
    }
    for (int64_t i = 0; i < d; i++) out[i] = out[i] / sum;
}

static void gy_attn_pair(const gy_attn_ctx *c, int64_t pair, float *s) {
    const gy_kv_layout *L = c->layout;
    (void)L;
    const int64_t t = pair / c->n_q_heads, h = pair % c->n_q_heads, kvh = h / c->group;
    const int64_t d = L->head_dim, seq = c->batch->token_seq[t], len = c->batch->token_pos[t] + 1;
    const float *q = c->q + pair * d;
    /* Scores, 16 positions per tile (a short last tile repeats the last position). */
    gy_attn_rows it;
    gy_attn_rows_init(&it, c, seq, 0, kvh);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const void *kp[16];
        for (int64_t l = 0; l < 16; l++) {
            if (j0 + l < len) {
                gy_attn_rows_fix(&it);
                kp[l] = gy_attn_rows_next(&it);
            } else {
                kp[l] = kp[l - 1];
            }
        }
        float tile[16];
        gy_dot_tile16(tile, kp, GY_DTYPE_F32, 16, &q, d);
        for (int64_t l = 0; l < 16 && j0 + l < len; l++) s[j0 + l] = tile[l] * c->scale;
    }
    float m = -INFINITY;
    for (int64_t j = 0; j < len; j++) m = s[j] > m ? s[j] : m;
    const float sum = gy_attn_softmax_weights(s, len, m);
    gy_attn_weighted_v(c->out + pair * d, c, s, len, seq, kvh, sum);
}

static void gy_attn_task(void *ctx, int64_t task, int64_t n_tasks) {
    const gy_attn_ctx *c = (const gy_attn_ctx *)ctx;
    float *s = c->scratch + task * c->scratch_stride;
    const int64_t begin = task * c->per_task;
    const int64_t end = begin + c->per_task < c->pairs ? begin + c->per_task : c->pairs;
    for (int64_t pair = begin; pair < end; pair++) gy_attn_pair(c, pair, s);
}

gy_status gy_cpu_attention(float *out, const float *q, const float *layer_base,
                           const gy_kv_layout *layout, const gy_cpu_paged_batch *batch,
                           int64_t n_q_heads, gy_threadpool *pool) {
    int64_t max_len = 0;
    GY_TRY(gy_cpu_paged_batch_check(batch, layout, "gy_cpu_attention", &max_len));
    if (layout->elem_size != 4)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_attention: the CPU cache holds fp32 (elem_size 4), "
                       "the layout says %lld", (long long)layout->elem_size);
    if (n_q_heads <= 0 || n_q_heads % layout->n_heads != 0)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_attention: n_q_heads=%lld must be a positive multiple "
                       "of the %lld KV heads", (long long)n_q_heads, (long long)layout->n_heads);
    if (batch->n_tokens == 0) return GY_OK;
    if (out == NULL || q == NULL || layer_base == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_attention: NULL buffer");
    gy_attn_ctx c = {out, q, layer_base, layout, batch, n_q_heads, n_q_heads / layout->n_heads,
                     batch->n_tokens * n_q_heads, 0, (max_len + 15) / 16 * 16,
                     1.0f / sqrtf((float)layout->head_dim), NULL};
    int64_t tasks = (int64_t)gy_threadpool_size(pool) * 8;
    if (tasks > c.pairs) tasks = c.pairs;
    c.per_task = (c.pairs + tasks - 1) / tasks;
    tasks = (c.pairs + c.per_task - 1) / c.per_task;
    c.scratch = malloc((size_t)(tasks * c.scratch_stride) * sizeof(float));
    if (c.scratch == NULL)
        return GY_FAIL(GY_ERR_SYSTEM, "gy_cpu_attention: cannot allocate %lld floats of scratch",
                       (long long)(tasks * c.scratch_stride));
    const gy_status st = gy_threadpool_run(pool, gy_attn_task, &c, tasks);
    free(c.scratch);
    return st;
}
