/* attention.c: two-pass softmax attention per (token, query head), in position order. */
#include "attention.h"
#include "../core/alloc.h"

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
    float *scratch; /* [n_tasks, GY_ATTN_GROUP, scratch_stride]: scores, then weights, per pair */
} gy_attn_ctx;

/* Walks positions 0, 1, 2, ... of one sequence's K (kv = 0) or V (kv = 1) rows of one KV head:
 * the block's base comes from gy_kv_layout_offset when the walk enters it (never past the last
 * position, whose next block may not exist), slots step by the layout's token stride. */
typedef struct {
    const float *storage;
    const gy_kv_layout *layout;
    const int32_t *blocks; /* the sequence's block ids */
    int64_t kv, head, block, slot;
    const float *base; /* NULL until the walk enters `block` */
} gy_attn_rows;

static void gy_attn_rows_init(gy_attn_rows *it, const gy_attn_ctx *c, int64_t seq, int64_t kv,
                              int64_t head) {
    it->storage = c->kv;
    it->layout = c->layout;
    it->blocks = c->batch->bt_indices + c->batch->bt_indptr[seq];
    it->kv = kv;
    it->head = head;
    it->block = 0;
    it->slot = 0;
    it->base = NULL;
}

/* The row of the current position; then moves to the next position. */
static inline const float *gy_attn_rows_next(gy_attn_rows *it) {
    if (it->base == NULL)
        it->base = it->storage +
                   gy_kv_layout_offset(it->layout, it->kv, it->blocks[it->block], 0, it->head);
    const float *row = it->base + it->slot * it->layout->stride_token;
    if (++it->slot == it->layout->block_size) {
        it->slot = 0;
        it->block++;
        it->base = NULL;
    }
    return row;
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

#define GY_ATTN_GROUP 4 /* pairs of one token whose V passes run together */

#if GY_CPU_HAVE_AVX512
/* Block by block: within a block the rows of a head are base + slot * stride_token, so the walk
 * over positions is a pointer step; the pairs share the token's blocks (their heads differ). */
GY_INLINE void gy_attn_weighted_v_avx512(const gy_attn_ctx *c, int64_t pair0, const int NP,
                                         const float *e, int64_t stride, int64_t len, int64_t seq,
                                         const int64_t *kvh, const float *sum) {
    const gy_kv_layout *L = c->layout;
    const int64_t d = L->head_dim, bs = L->block_size, st = L->stride_token;
    const int32_t *blocks = c->batch->bt_indices + c->batch->bt_indptr[seq];
    for (int64_t d0 = 0; d0 < d; d0 += 64) { /* 4 vectors of each head at a time */
        __mmask16 m[4];
        for (int v = 0; v < 4; v++) m[v] = gy_simd_mask(d - d0 - 16 * v > 0 ? d - d0 - 16 * v : 0);
        const int nv = d - d0 >= 64 ? 4 : (int)((d - d0 + 15) / 16);
        __m512 acc[GY_ATTN_GROUP][4];
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) acc[p][v] = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < len; j0 += bs) {
            const int64_t n = len - j0 < bs ? len - j0 : bs;
            const float *vb[GY_ATTN_GROUP];
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++)
                vb[p] = c->kv + gy_kv_layout_offset(L, 1, blocks[j0 / bs], 0, kvh[p]) + d0;
            for (int64_t t = 0; t < n; t++) {
#pragma GCC unroll 4
                for (int p = 0; p < NP; p++) {
                    const float *vr = vb[p] + t * st;
                    const __m512 ej = _mm512_set1_ps(e[p * stride + j0 + t]);
#pragma GCC unroll 4
                    for (int v = 0; v < 4; v++)
                        if (v < nv)
                            acc[p][v] = _mm512_fmadd_ps(ej, _mm512_maskz_loadu_ps(m[v], vr + 16 * v),
                                                        acc[p][v]);
                }
            }
        }
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++) {
            const __m512 sv = _mm512_set1_ps(sum[p]);
            float *out = c->out + (pair0 + p) * d + d0;
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++)
                _mm512_mask_storeu_ps(out + 16 * v, m[v], _mm512_div_ps(acc[p][v], sv));
        }
    }
}

/* Scores of 16 rows base + r * stride (r < 16) against q [d] in dot.h's order (gy_dot_ref(row, q)),
 * times scale, into s[0..16). Row by row: each row's chain over its d / 16 blocks is short, the 16
 * rows are independent, and one running pointer walks them. NV > 0: d = 16 * NV, q held in
 * registers and every loop unrolled; NV = 0: any d. */
GY_INLINE void gy_attn_scores16_body(float *s, const float *base, int64_t stride, const float *q,
                                     int64_t d, float scale, const int NV) {
    __m512 acc[16], qv[8];
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) qv[v] = _mm512_loadu_ps(q + 16 * v);
    const int64_t full = d / 16 * 16;
    const __mmask16 m = gy_simd_mask(d - full);
    const float *row = base;
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        __m512 a = _mm512_setzero_ps();
        if (NV > 0) {
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * v), qv[v], a);
        } else {
            for (int64_t k = 0; k < full; k += 16)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(row + k), _mm512_loadu_ps(q + k), a);
            if (full < d)
                a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, row + full),
                                    _mm512_maskz_loadu_ps(m, q + full), a);
        }
        acc[r] = a;
        row += stride;
        __asm__("" : "+r"(row)); /* one running pointer, not 16 */
    }
    _mm512_storeu_ps(s, _mm512_mul_ps(gy_simd_lane_tree16(acc), _mm512_set1_ps(scale)));
}

static void gy_attn_scores16_avx512(float *s, const float *base, int64_t stride, const float *q,
                                    int64_t d, float scale) {
    switch (d) { /* the common head sizes, as constants */
    case 32: gy_attn_scores16_body(s, base, stride, q, d, scale, 2); return;
    case 48: gy_attn_scores16_body(s, base, stride, q, d, scale, 3); return;
    case 64: gy_attn_scores16_body(s, base, stride, q, d, scale, 4); return;
    case 80: gy_attn_scores16_body(s, base, stride, q, d, scale, 5); return;
    case 96: gy_attn_scores16_body(s, base, stride, q, d, scale, 6); return;
    case 128: gy_attn_scores16_body(s, base, stride, q, d, scale, 8); return;
    default: gy_attn_scores16_body(s, base, stride, q, d, scale, 0); return;
    }
}
#endif

/* out_p[d] = (fma chain over positions j of e_p[j] * v_p,j[d]) / sum_p for the np pairs of one
 * token (np <= GY_ATTN_GROUP); pair p reads KV head kvh[p] and its weights at e + p * stride. Running
 * the pairs together gives the processor independent chains while each one stays sequential. */
static void gy_attn_weighted_v(const gy_attn_ctx *c, int64_t pair0, int64_t np, const float *e,
                               int64_t stride, int64_t len, int64_t seq, const int64_t *kvh,
                               const float *sum) {
    const int64_t d = c->layout->head_dim;
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        switch (np) { /* the pair count as a constant, so that the accumulators stay in registers */
        case 1: gy_attn_weighted_v_avx512(c, pair0, 1, e, stride, len, seq, kvh, sum); return;
        case 2: gy_attn_weighted_v_avx512(c, pair0, 2, e, stride, len, seq, kvh, sum); return;
        case 3: gy_attn_weighted_v_avx512(c, pair0, 3, e, stride, len, seq, kvh, sum); return;
        default: gy_attn_weighted_v_avx512(c, pair0, 4, e, stride, len, seq, kvh, sum); return;
        }
    }
#endif
    for (int64_t p = 0; p < np; p++) {
        float *out = c->out + (pair0 + p) * d;
        for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
        gy_attn_rows it;
        gy_attn_rows_init(&it, c, seq, 1, kvh[p]);
        for (int64_t j = 0; j < len; j++) {
            const float *vr = gy_attn_rows_next(&it);
            for (int64_t i = 0; i < d; i++) out[i] = fmaf(e[p * stride + j], vr[i], out[i]);
        }
        for (int64_t i = 0; i < d; i++) out[i] = out[i] / sum[p];
    }
}

/* The maximum of s[0..len) over 16 lanes (max is exact: any fixed order gives the same value; the
 * lanes keep both paths identical even for signed zeros and NaNs). */
static float gy_attn_max(const float *s, int64_t len) {
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < len; j += 16)
            m = _mm512_mask_max_ps(m, gy_simd_mask(len - j), _mm512_maskz_loadu_ps(gy_simd_mask(len - j), s + j), m);
        float lanes[16];
        _mm512_storeu_ps(lanes, m);
        float r = lanes[0];
        for (int l = 1; l < 16; l++) r = lanes[l] > r ? lanes[l] : r;
        return r;
    }
#endif
    float lanes[16];
    for (int l = 0; l < 16; l++) lanes[l] = -INFINITY;
    for (int64_t j = 0; j < len; j++) lanes[j % 16] = s[j] > lanes[j % 16] ? s[j] : lanes[j % 16];
    float r = lanes[0];
    for (int l = 1; l < 16; l++) r = lanes[l] > r ? lanes[l] : r;
    return r;
}

/* Scores and softmax weights of one (token, query head) pair into s; returns their sum. */
static float gy_attn_weights(const gy_attn_ctx *c, int64_t pair, int64_t seq, int64_t len,
                             int64_t kvh, float *s) {
    const int64_t d = c->layout->head_dim;
    const float *q = c->q + pair * d;
    int64_t j0 = 0;
#if GY_CPU_HAVE_AVX512
    /* Whole tiles of 16 positions inside one block (blocks of a multiple of 16 positions): the
     * rows are at a fixed stride. */
    const int64_t bs = c->layout->block_size;
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512 && bs % 16 == 0) {
        const int32_t *blocks = c->batch->bt_indices + c->batch->bt_indptr[seq];
        for (; j0 + 16 <= len; j0 += 16) {
            const float *rows = c->kv + gy_kv_layout_offset(c->layout, 0, blocks[j0 / bs], j0 % bs, kvh);
            gy_attn_scores16_avx512(s + j0, rows, c->layout->stride_token, q, d, c->scale);
        }
    }
#endif
    /* Scores, 16 positions per tile (a short last tile repeats the last position). */
    gy_attn_rows it;
    gy_attn_rows_init(&it, c, seq, 0, kvh);
    it.block = j0 / c->layout->block_size; /* resume the walk at position j0 */
    it.slot = j0 % c->layout->block_size;
    for (; j0 < len; j0 += 16) {
        const void *kp[16];
        for (int64_t l = 0; l < 16; l++) {
            if (j0 + l < len) {
                    kp[l] = gy_attn_rows_next(&it);
            } else {
                kp[l] = kp[l - 1];
            }
        }
        float tile[16];
        gy_dot_tile16(tile, kp, GY_DTYPE_F32, 16, &q, d);
        for (int64_t l = 0; l < 16 && j0 + l < len; l++) s[j0 + l] = tile[l] * c->scale;
    }
    return gy_attn_softmax_weights(s, len, gy_attn_max(s, len));
}

static void gy_attn_task(void *ctx, int64_t task, int64_t n_tasks) {
    const gy_attn_ctx *c = (const gy_attn_ctx *)ctx;
    float *scratch = c->scratch + task * GY_ATTN_GROUP * c->scratch_stride;
    const int64_t begin = task * c->per_task;
    const int64_t end = begin + c->per_task < c->pairs ? begin + c->per_task : c->pairs;
    for (int64_t p0 = begin; p0 < end;) {
        const int64_t t = p0 / c->n_q_heads;
        const int64_t seq = c->batch->token_seq[t], len = c->batch->token_pos[t] + 1;
        int64_t np = 0, kvh[GY_ATTN_GROUP];
        float sum[GY_ATTN_GROUP];
        for (; np < GY_ATTN_GROUP && p0 + np < end && (p0 + np) / c->n_q_heads == t; np++) {
            kvh[np] = ((p0 + np) % c->n_q_heads) / c->group;
            sum[np] = gy_attn_weights(c, p0 + np, seq, len, kvh[np], scratch + np * c->scratch_stride);
        }
        gy_attn_weighted_v(c, p0, np, scratch, c->scratch_stride, len, seq, kvh, sum);
        p0 += np;
    }
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
    /* Up to 8 tasks per thread, but tasks of whole groups of pairs while every thread gets one. */
    const int64_t threads = gy_threadpool_size(pool);
    int64_t tasks = (c.pairs + GY_ATTN_GROUP - 1) / GY_ATTN_GROUP;
    if (tasks > threads * 8) tasks = threads * 8;
    if (tasks < threads) tasks = threads < c.pairs ? threads : c.pairs;
    c.per_task = (c.pairs + tasks - 1) / tasks;
    tasks = (c.pairs + c.per_task - 1) / c.per_task;
    c.scratch = gy_malloc((size_t)(tasks * GY_ATTN_GROUP * c.scratch_stride) * sizeof(float));
    if (c.scratch == NULL)
        return GY_FAIL(GY_ERR_SYSTEM, "gy_cpu_attention: cannot allocate %lld floats of scratch",
                       (long long)(tasks * GY_ATTN_GROUP * c.scratch_stride));
    const gy_status st = gy_threadpool_run(pool, gy_attn_task, &c, tasks);
    free(c.scratch);
    return st;
}
