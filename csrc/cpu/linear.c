/* linear.c: the two linear forms of linear.h, their k-split tree, and the TP combination. */
#include "linear.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/tree.h"
#include "dot.h"
#include "isa.h"
#include "simd.h"

#define GY_LINEAR_TREE_LEVELS 7 /* log2(GY_LINEAR_MAX_K_SPLITS) + 1 */
#define GY_LINEAR_PACKED_MIN_ROWS 2 /* batches from this size take the packed path (AVX-512) */
#define GY_LINEAR_LEAD_ROWS 16 /* rows of W a batched task fetches before it starts (dot.c) */

/* The tree of core/tree.h over chunks, built online: after chunk c, slot l (at slots + l * stride)
 * holds the sum of the 2^l chunks ending at c whenever bit l of c + 1 completes a subtree. */
static void gy_linear_tree_push(float *slots, int64_t stride, int64_t c, float *part, int64_t width) {
    int l = 0;
    for (; (c >> l) & 1; l++)
        for (int64_t i = 0; i < width; i++) part[i] = slots[l * stride + i] + part[i];
    memcpy(slots + l * stride, part, (size_t)width * sizeof(float));
}

/* After all k chunks, the complete subtrees wait in the slots of k's set bits; the tree adds them
 * from the last (lowest) up, each earlier one on the left: sum(first 2^a) + sum(rest). For k a
 * power of two that is the one top slot. Returns the slot holding the sum. */
static float *gy_linear_tree_finish(float *slots, int64_t stride, int64_t k, int64_t width) {
    int low = 0;
    while (!((k >> low) & 1)) low++;
    float *acc = slots + low * stride;
    for (int l = low + 1; (k >> l) != 0; l++)
        if ((k >> l) & 1)
            for (int64_t i = 0; i < width; i++) acc[i] = slots[l * stride + i] + acc[i];
    return acc;
}

/* any_k: whether k_splits may be any count (the transposed form) or only a power of two. */
static gy_status gy_linear_check(const char *name, const float *y, const float *x, const void *w,
                                 gy_dtype w_dtype, int64_t n, int64_t in, int64_t out,
                                 int32_t k_splits, int any_k) {
    GY_TRY(gy_dtype_check(w_dtype, name));
    if (n < 0 || out < 0 || in <= 0)
        return GY_FAIL(GY_ERR_INVALID, "%s: need n >= 0, in > 0, out >= 0 (n=%lld in=%lld out=%lld)",
                       name, (long long)n, (long long)in, (long long)out);
    if (k_splits < 1 || k_splits > GY_LINEAR_MAX_K_SPLITS ||
        (!any_k && !gy_tree_is_power_of_two(k_splits)))
        return GY_FAIL(GY_ERR_INVALID, "%s: k_splits=%d must be %s in [1, %d]", name,
                       (int)k_splits, any_k ? "an integer" : "a power of two", GY_LINEAR_MAX_K_SPLITS);
    if (in % k_splits != 0)
        return GY_FAIL(GY_ERR_INVALID, "%s: in=%lld is not a multiple of k_splits=%d", name,
                       (long long)in, (int)k_splits);
    if (n > 0 && out > 0 && (y == NULL || x == NULL || w == NULL))
        return GY_FAIL(GY_ERR_INVALID, "%s: NULL buffer", name);
    return GY_OK;
}

/* Static split of the output columns into tasks of whole `unit`s: up to `per_thread` per thread, so
 * that a thread that is descheduled can be covered by the others (results never depend on who runs
 * what). Batch 1 uses fewer, longer tasks: each task start waits on memory for its first tile. */
static int64_t gy_linear_tasks(int64_t cols, int64_t unit, int64_t per_thread, gy_threadpool *pool,
                               int64_t *per_task) {
    const int64_t units = (cols + unit - 1) / unit;
    int64_t tasks = (int64_t)gy_threadpool_size(pool) * per_thread;
    if (tasks > units) tasks = units;
    if (tasks < 1) tasks = 1;
    const int64_t units_per_task = (units + tasks - 1) / tasks;
    *per_task = units_per_task * unit;
    return (cols + *per_task - 1) / *per_task;
}

typedef struct gy_linear_ctx {
    float *y;
    const float *x;
    const char *w;
    gy_dtype dtype;
    int64_t esize;
    const float *bias;
    int64_t n, in, out, k_splits, chunk, per_task;
    float *scratch; /* linear_t: scratch_per_task floats per task */
    int64_t scratch_per_task;
} gy_linear_ctx;

/* ---- W [out, in]: tiles of 16 dot products ---------------------------------------------------- */

static void gy_linear_task(void *ctx, int64_t task, int64_t n_tasks) {
    const gy_linear_ctx *c = (const gy_linear_ctx *)ctx;
    const int64_t begin = task * c->per_task;
    const int64_t end = begin + c->per_task < c->out ? begin + c->per_task : c->out;
    const int64_t wrb = c->in * c->esize, n4 = c->n - c->n % 4;
    /* Each 16-row tile of W is streamed once per step for the whole batch: groups of 4 activation
     * rows against 4-row slices, the leftover rows as a pair (8-row slices) and alone (16). */
    for (int64_t o0 = begin; o0 < end; o0 += 16) {
        const int32_t valid = (int32_t)(end - o0 < 16 ? end - o0 : 16);
        const float *bias = c->bias ? c->bias + o0 : NULL;
        const char *w = c->w + o0 * wrb;
        gy_dot_rows16(c->y + o0, c->out, bias, w, wrb, c->dtype, 4, valid, c->x, c->in, n4, c->in,
                      (int32_t)c->k_splits);
        int64_t b = n4;
        if (c->n - b >= 2) {
            gy_dot_rows16(c->y + b * c->out + o0, c->out, bias, w, wrb, c->dtype, 8, valid,
                          c->x + b * c->in, c->in, 2, c->in, (int32_t)c->k_splits);
            b += 2;
        }
        if (c->n - b == 1)
            gy_dot_rows16(c->y + b * c->out + o0, c->out, bias, w, wrb, c->dtype, 16, valid,
                          c->x + b * c->in, c->in, 1, c->in, (int32_t)c->k_splits);
    }
}

/* Batches: 8-row tiles of W, each streamed once against all the packed rows of x (dot.h). */
static void gy_linear_packed_task(void *ctx, int64_t task, int64_t n_tasks) {
    const gy_linear_ctx *c = (const gy_linear_ctx *)ctx;
    const int64_t begin = task * c->per_task;
    const int64_t end = begin + c->per_task < c->out ? begin + c->per_task : c->out;
    const int64_t wrb = c->in * c->esize;
    /* The tiles the kernel's own prefetching does not reach in time: the first ones. */
    const int64_t lead = (end - begin < GY_LINEAR_LEAD_ROWS ? end - begin : GY_LINEAR_LEAD_ROWS) * wrb;
    for (int64_t i = 0; i < lead; i += 64) __builtin_prefetch(c->w + begin * wrb + i, 0, 2);
    for (int64_t o0 = begin; o0 < end; o0 += 8)
        gy_dot_rows8_packed(c->y + o0, c->out, c->bias ? c->bias + o0 : NULL, c->w + o0 * wrb, wrb,
                            c->dtype, (int32_t)(end - o0 < 8 ? end - o0 : 8), c->x, c->n, c->in,
                            (int32_t)c->k_splits);
}

gy_status gy_cpu_linear(float *y, const float *x, const void *w, gy_dtype w_dtype,
                        const float *bias, int64_t n, int64_t in, int64_t out, int32_t k_splits,
                        gy_threadpool *pool) {
    GY_TRY(gy_linear_check("gy_cpu_linear", y, x, w, w_dtype, n, in, out, k_splits, 0));
    if (n == 0 || out == 0) return GY_OK;
    gy_linear_ctx c = {y, x, (const char *)w, w_dtype, gy_dtype_size(w_dtype), bias, n, in, out,
                       k_splits, in / k_splits, 0, NULL, 0};
    if (n >= GY_LINEAR_PACKED_MIN_ROWS && gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        const int64_t ldp = gy_dot_packed_stride(w_dtype, in, k_splits);
        float *xp = aligned_alloc(64, (size_t)(n * ldp) * sizeof(float));
        if (xp == NULL)
            return GY_FAIL(GY_ERR_SYSTEM, "gy_cpu_linear: cannot allocate %lld floats of packed input",
                           (long long)(n * ldp));
        gy_dot_pack(xp, x, in, n, w_dtype, in, k_splits);
        c.x = xp;
        const int64_t tasks = gy_linear_tasks(out, 8, 4, pool, &c.per_task);
        const gy_status st = gy_threadpool_run(pool, gy_linear_packed_task, &c, tasks);
        free(xp);
        return st;
    }
    const int64_t tasks = gy_linear_tasks(out, 16, n == 1 ? 2 : 4, pool, &c.per_task);
    return gy_threadpool_run(pool, gy_linear_task, &c, tasks);
}

/* ---- W [in, out]: column strips, one sequential fma chain per output along `in` ----------------- */

#define GY_LINEAR_T_MAX_OV 6 /* widest batched register tile: 6 vectors (96 columns) of 4 rows */
#define GY_LINEAR_T_PASS 64  /* activation rows per pass over a strip: their accumulators (24 KB) */
#define GY_LINEAR_T_KB 64    /* rows of W per k-block: a 96-column strip's block is 24 KB (L1) */
#define GY_LINEAR_T_WIDE 1024 /* widest batch-1 strip, accumulated in memory */
/* A task's accumulators (scratch holds 1 + chunk-tree levels of them): a pass of batched rows over
 * a strip, or one batch-1 strip. */
#define GY_LINEAR_T_ACC (GY_LINEAR_T_PASS * 16 * GY_LINEAR_T_MAX_OV > GY_LINEAR_T_WIDE            \
                             ? GY_LINEAR_T_PASS * 16 * GY_LINEAR_T_MAX_OV                          \
                             : GY_LINEAR_T_WIDE)

/* acc[i * width + j] += the chain over rows k0..k0+len of x[b + i, k] * W[k, o + j], j < valid. */
static void gy_linear_t_acc_portable(float *acc, const gy_linear_ctx *c, int64_t k0, int64_t len,
                                     int64_t o, int64_t width, int64_t valid, int64_t b, int32_t B) {
    for (int32_t i = 0; i < B; i++) {
        float *a = acc + i * width;
        const float *xr = c->x + (b + i) * c->in;
        for (int64_t k = k0; k < k0 + len; k++) {
            const float xv = xr[k];
            const char *wr = c->w + (k * c->out + o) * c->esize;
            switch (c->dtype) {
            case GY_DTYPE_F32:
                for (int64_t j = 0; j < valid; j++) a[j] = fmaf(xv, ((const float *)wr)[j], a[j]);
                break;
            case GY_DTYPE_BF16:
                for (int64_t j = 0; j < valid; j++)
                    a[j] = fmaf(xv, gy_bf16_to_f32(((const uint16_t *)wr)[j]), a[j]);
                break;
            default:
                for (int64_t j = 0; j < valid; j++)
                    a[j] = fmaf(xv, gy_f16_to_f32(((const uint16_t *)wr)[j]), a[j]);
                break;
            }
        }
    }
}

#if GY_CPU_HAVE_AVX512
/* The same in registers: OV vectors of columns times B activation rows (B * OV <= 24).
 *
 * bf16 weights: each pair of vectors (32 columns) is one 64-byte load whose 32-bit words hold two
 * columns: the low halves (even columns) widen by one shift, the high halves (odd columns) by one
 * and, where widening 16 columns at a time costs a shuffle and a shift each. So the first vector of
 * a pair accumulates the pair's even columns and the second its odd ones (GY_LINEAR_T_PAIRED);
 * gy_linear_t_store puts them back in order. A last odd vector is widened in column order. Each
 * column keeps its own chain, so the bits are those of the column order. */
#define GY_LINEAR_T_PAIRED(dtype) ((dtype) == GY_DTYPE_BF16 && gy_cpu_isa_get() == GY_CPU_ISA_AVX512)

GY_INLINE __mmask32 gy_linear_t_mask32(int64_t n) {
    return n >= 32 ? (__mmask32)0xffffffffu : n <= 0 ? (__mmask32)0 : (__mmask32)((1u << n) - 1u);
}

GY_INLINE void gy_linear_t_acc_avx512(float *acc_io, const gy_linear_ctx *c, gy_dtype dtype,
                                      int64_t k0, int64_t len, int64_t o, int64_t valid,
                                      const int OV, int64_t b, const int B) {
    const int paired = dtype == GY_DTYPE_BF16, pairs = paired ? OV / 2 : 0;
    __mmask16 m[16];
    __mmask32 m2[8];
#pragma GCC unroll 16
    for (int v = 0; v < OV; v++) m[v] = gy_simd_mask(valid - 16 * v > 0 ? valid - 16 * v : 0);
#pragma GCC unroll 8
    for (int p = 0; p < pairs; p++) m2[p] = gy_linear_t_mask32(valid - 32 * p);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[24];
#pragma GCC unroll 24
    for (int j = 0; j < B * OV; j++) acc[j] = _mm512_loadu_ps(acc_io + 16 * j);
    const float *xr[16];
#pragma GCC unroll 16
    for (int i = 0; i < B; i++) xr[i] = c->x + (b + i) * c->in;
    const char *wr = c->w + (k0 * c->out + o) * c->esize;
    const int64_t ldw = c->out * c->esize;
    for (int64_t k = k0; k < k0 + len; k++, wr += ldw) {
        __m512 xb[16];
#pragma GCC unroll 16
        for (int i = 0; i < B; i++) xb[i] = _mm512_set1_ps(xr[i][k]);
#pragma GCC unroll 8
        for (int p = 0; p < pairs; p++) {
            const __m512i u = _mm512_maskz_loadu_epi16(m2[p], (const uint16_t *)wr + 32 * p);
            const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
            const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(u, high));
#pragma GCC unroll 16
            for (int i = 0; i < B; i++) {
                acc[i * OV + 2 * p] = _mm512_fmadd_ps(xb[i], we, acc[i * OV + 2 * p]);
                acc[i * OV + 2 * p + 1] = _mm512_fmadd_ps(xb[i], wo, acc[i * OV + 2 * p + 1]);
            }
        }
#pragma GCC unroll 16
        for (int v = 2 * pairs; v < OV; v++) {
            const __m512 wv = gy_simd_load_w_mask(wr, 16 * v, dtype, m[v]);
#pragma GCC unroll 16
            for (int i = 0; i < B; i++) acc[i * OV + v] = _mm512_fmadd_ps(xb[i], wv, acc[i * OV + v]);
        }
    }
#pragma GCC unroll 24
    for (int j = 0; j < B * OV; j++) _mm512_storeu_ps(acc_io + 16 * j, acc[j]);
}

/* Batch 1 over a wide strip: the accumulators live in memory (L1) and W is read row by row,
 * contiguously. acc holds ceil(valid / 16) * 16 floats (bf16: paired as above). */
GY_INLINE void gy_linear_t_axpy_avx512(float *acc, const gy_linear_ctx *c, gy_dtype dtype,
                                       int64_t k0, int64_t len, int64_t o, int64_t valid, int64_t b) {
    const int64_t nv = (valid + 15) / 16;
    const __mmask16 last = gy_simd_mask(valid - 16 * (nv - 1));
    const float *xr = c->x + b * c->in;
    const char *wr = c->w + (k0 * c->out + o) * c->esize;
    const int64_t ldw = c->out * c->esize;
    if (dtype == GY_DTYPE_BF16) {
        const int64_t pairs = nv / 2;
        const __mmask32 last2 = gy_linear_t_mask32(valid - 32 * (pairs - 1));
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        for (int64_t k = k0; k < k0 + len; k++, wr += ldw) {
            const __m512 xb = _mm512_set1_ps(xr[k]);
            for (int64_t p = 0; p < pairs; p++) {
                const __m512i u = _mm512_maskz_loadu_epi16(p + 1 < pairs ? (__mmask32)0xffffffffu : last2,
                                                           (const uint16_t *)wr + 32 * p);
                float *a = acc + 32 * p;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(xb, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)),
                                                    _mm512_loadu_ps(a)));
                _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(xb, _mm512_castsi512_ps(_mm512_and_si512(u, high)),
                                                         _mm512_loadu_ps(a + 16)));
            }
            if (nv % 2)
                _mm512_storeu_ps(acc + 16 * (nv - 1),
                                 _mm512_fmadd_ps(xb, gy_simd_load_w_mask(wr, 16 * (nv - 1), dtype, last),
                                                 _mm512_loadu_ps(acc + 16 * (nv - 1))));
        }
        return;
    }
    for (int64_t k = k0; k < k0 + len; k++, wr += ldw) {
        const __m512 xb = _mm512_set1_ps(xr[k]);
        int64_t v = 0;
        for (; v + 1 < nv; v++)
            _mm512_storeu_ps(acc + 16 * v, _mm512_fmadd_ps(xb, gy_simd_load_w(wr, 16 * v, dtype),
                                                           _mm512_loadu_ps(acc + 16 * v)));
        _mm512_storeu_ps(acc + 16 * v, _mm512_fmadd_ps(xb, gy_simd_load_w_mask(wr, 16 * v, dtype, last),
                                                       _mm512_loadu_ps(acc + 16 * v)));
    }
}
#else
#define GY_LINEAR_T_PAIRED(dtype) 0
#endif

#if GY_CPU_HAVE_AVX512
#define GY_LINEAR_T_VARIANT(DT, DTYPE, OV, B)                                                      \
    static void gy_linear_t_##DT##_##OV##x##B(float *acc, const gy_linear_ctx *c, int64_t k0,      \
                                              int64_t len, int64_t o, int64_t valid, int64_t b) {  \
        gy_linear_t_acc_avx512(acc, c, DTYPE, k0, len, o, valid, OV, b, B);                        \
    }
#define GY_LINEAR_T_WIDTHS(DT, DTYPE, B)                                                           \
    GY_LINEAR_T_VARIANT(DT, DTYPE, 1, B) GY_LINEAR_T_VARIANT(DT, DTYPE, 2, B)                      \
    GY_LINEAR_T_VARIANT(DT, DTYPE, 3, B) GY_LINEAR_T_VARIANT(DT, DTYPE, 4, B)                      \
    GY_LINEAR_T_VARIANT(DT, DTYPE, 5, B) GY_LINEAR_T_VARIANT(DT, DTYPE, 6, B)
/* Batch 1: one variant per strip width (1 to 16 vectors), so that a thread's strip is one pass
 * over the rows with one FMA chain per vector. Batches: 1 to 6 vectors of 4, 2 or 1 rows. */
#define GY_LINEAR_T_DTYPE(DT, DTYPE)                                                               \
    GY_LINEAR_T_WIDTHS(DT, DTYPE, 1) GY_LINEAR_T_VARIANT(DT, DTYPE, 7, 1)                          \
    GY_LINEAR_T_VARIANT(DT, DTYPE, 8, 1) GY_LINEAR_T_VARIANT(DT, DTYPE, 9, 1)                      \
    GY_LINEAR_T_VARIANT(DT, DTYPE, 10, 1) GY_LINEAR_T_VARIANT(DT, DTYPE, 11, 1)                    \
    GY_LINEAR_T_VARIANT(DT, DTYPE, 12, 1) GY_LINEAR_T_VARIANT(DT, DTYPE, 13, 1)                    \
    GY_LINEAR_T_VARIANT(DT, DTYPE, 14, 1) GY_LINEAR_T_VARIANT(DT, DTYPE, 15, 1)                    \
    GY_LINEAR_T_VARIANT(DT, DTYPE, 16, 1) GY_LINEAR_T_WIDTHS(DT, DTYPE, 2)                         \
    GY_LINEAR_T_WIDTHS(DT, DTYPE, 4)                                                               \
    static void gy_linear_t_##DT##_axpy(float *acc, const gy_linear_ctx *c, int64_t k0,            \
                                        int64_t len, int64_t o, int64_t valid, int64_t b) {        \
        gy_linear_t_axpy_avx512(acc, c, DTYPE, k0, len, o, valid, b);                              \
    }
GY_LINEAR_T_DTYPE(f32, GY_DTYPE_F32)
GY_LINEAR_T_DTYPE(f16, GY_DTYPE_F16)
GY_LINEAR_T_DTYPE(bf16, GY_DTYPE_BF16)

typedef void (*gy_linear_t_fn)(float *acc, const gy_linear_ctx *c, int64_t k0, int64_t len,
                               int64_t o, int64_t valid, int64_t b);
#define GY_LINEAR_T_ROW_OF(DT, B)                                                                  \
    gy_linear_t_##DT##_1x##B, gy_linear_t_##DT##_2x##B, gy_linear_t_##DT##_3x##B,                  \
        gy_linear_t_##DT##_4x##B, gy_linear_t_##DT##_5x##B, gy_linear_t_##DT##_6x##B
#define GY_LINEAR_T_ROW(DT)                                                                        \
    {GY_LINEAR_T_ROW_OF(DT, 1),  gy_linear_t_##DT##_7x1,  gy_linear_t_##DT##_8x1,                  \
     gy_linear_t_##DT##_9x1,     gy_linear_t_##DT##_10x1, gy_linear_t_##DT##_11x1,                 \
     gy_linear_t_##DT##_12x1,    gy_linear_t_##DT##_13x1, gy_linear_t_##DT##_14x1,                 \
     gy_linear_t_##DT##_15x1,    gy_linear_t_##DT##_16x1, GY_LINEAR_T_ROW_OF(DT, 2),               \
     GY_LINEAR_T_ROW_OF(DT, 4),  gy_linear_t_##DT##_axpy}
/* [dtype][OV - 1] for B = 1, then [16 + OV - 1] for B = 2, [22 + OV - 1] for B = 4, [28] the wide
 * batch-1 strip */
static const gy_linear_t_fn gy_linear_t_kernels[GY_DTYPE_COUNT][29] = {
    [GY_DTYPE_F32] = GY_LINEAR_T_ROW(f32),
    [GY_DTYPE_F16] = GY_LINEAR_T_ROW(f16),
    [GY_DTYPE_BF16] = GY_LINEAR_T_ROW(bf16),
};
#endif

/* Accumulates rows k0..k0+len into acc: B activation rows from b, columns o..o+valid of a tile
 * `width` wide (16 * OV for a register tile; any width for the wide batch-1 strip, OV = 0). */
static void gy_linear_t_acc(float *acc, const gy_linear_ctx *c, int64_t k0, int64_t len, int64_t o,
                            int64_t width, int64_t valid, int32_t OV, int32_t B, int64_t b) {
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        const int kernel = OV == 0 ? 28 : B == 1 ? OV - 1 : B == 2 ? 16 + OV - 1 : 22 + OV - 1;
        gy_linear_t_kernels[c->dtype][kernel](acc, c, k0, len, o, valid, b);
        return;
    }
#endif
    gy_linear_t_acc_portable(acc, c, k0, len, o, width, valid, b, B);
}

/* y[row, o..o+valid) = res (+ bias); res holds ceil(valid / 16) vectors, paired for bf16 on the
 * AVX-512 path (GY_LINEAR_T_PAIRED): those are put back in column order first. */
static void gy_linear_t_store(const gy_linear_ctx *c, const float *res, int64_t row, int64_t o,
                              int64_t valid) {
    float *yr = c->y + row * c->out + o;
#if GY_CPU_HAVE_AVX512
    if (GY_LINEAR_T_PAIRED(c->dtype)) {
        const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        const int64_t nv = (valid + 15) / 16;
        __m512 out[2];
        for (int64_t v = 0; v < nv; v += 2) { /* v even */
            const __m512 even = _mm512_loadu_ps(res + 16 * v);
            int n_out = 1;
            out[0] = even;
            if (v + 1 < nv) { /* a pair: v holds its even columns, v + 1 its odd ones */
                const __m512 odd = _mm512_loadu_ps(res + 16 * v + 16);
                out[0] = _mm512_permutex2var_ps(even, lo, odd);
                out[1] = _mm512_permutex2var_ps(even, hi, odd);
                n_out = 2;
            }
            for (int h = 0; h < n_out; h++) {
                const int64_t j = 16 * (v + h);
                const __mmask16 m = gy_simd_mask(valid - j);
                const __m512 b = c->bias ? _mm512_maskz_loadu_ps(m, c->bias + o + j) : _mm512_setzero_ps();
                _mm512_mask_storeu_ps(yr + j, m, c->bias ? _mm512_add_ps(out[h], b) : out[h]);
            }
        }
        return;
    }
#endif
    if (c->bias)
        for (int64_t j = 0; j < valid; j++) yr[j] = res[j] + c->bias[o + j];
    else
        memcpy(yr, res, (size_t)valid * sizeof(float));
}

/* Batches: columns o..o+valid of one strip (OV vectors wide) for activation rows b0..b0+rows
 * (rows <= GY_LINEAR_T_PASS), in register tiles of 4 rows (then 2, then 1). W is walked in k-blocks
 * small enough to stay in L1 while every tile of the pass reads them; the tiles' accumulators wait
 * in scratch between blocks. */
static void gy_linear_t_strip(const gy_linear_ctx *c, float *scratch, int64_t o, int32_t OV,
                              int64_t valid, int64_t b0, int64_t rows) {
    const int64_t width = 16 * (int64_t)OV;
    float *acc = scratch, *slots = scratch + GY_LINEAR_T_ACC;
    const float *res = acc;
    for (int64_t k = 0; k < c->k_splits; k++) {
        memset(acc, 0, (size_t)(rows * width) * sizeof(float));
        for (int64_t k0 = k * c->chunk; k0 < (k + 1) * c->chunk; k0 += GY_LINEAR_T_KB) {
            const int64_t len = (k + 1) * c->chunk - k0 < GY_LINEAR_T_KB ? (k + 1) * c->chunk - k0
                                                                         : GY_LINEAR_T_KB;
            int64_t b = 0;
            for (; b + 4 <= rows; b += 4)
                gy_linear_t_acc(acc + b * width, c, k0, len, o, width, valid, OV, 4, b0 + b);
            if (rows - b >= 2) {
                gy_linear_t_acc(acc + b * width, c, k0, len, o, width, valid, OV, 2, b0 + b);
                b += 2;
            }
            if (rows - b == 1) gy_linear_t_acc(acc + b * width, c, k0, len, o, width, valid, OV, 1, b0 + b);
        }
        if (c->k_splits > 1) gy_linear_tree_push(slots, GY_LINEAR_T_ACC, k, acc, rows * width);
    }
    if (c->k_splits > 1) res = gy_linear_tree_finish(slots, GY_LINEAR_T_ACC, c->k_splits, rows * width);
    for (int64_t i = 0; i < rows; i++) gy_linear_t_store(c, res + i * width, b0 + i, o, valid);
}

/* One activation row over columns s0..s_end: a register tile when it fits, else the wide strip
 * accumulated in memory, GY_LINEAR_T_WIDE columns at a time. */
static void gy_linear_t_single(const gy_linear_ctx *c, float *scratch, int64_t s0, int64_t s_end,
                               int64_t b) {
    for (int64_t o = s0; o < s_end; o += GY_LINEAR_T_WIDE) {
        const int64_t valid = s_end - o < GY_LINEAR_T_WIDE ? s_end - o : GY_LINEAR_T_WIDE;
        const int32_t OV = valid <= 256 ? (int32_t)((valid + 15) / 16) : 0;
        const int64_t width = (valid + 15) / 16 * 16;
        float *acc = scratch, *slots = scratch + GY_LINEAR_T_WIDE;
        const float *res = acc;
        for (int64_t k = 0; k < c->k_splits; k++) {
            memset(acc, 0, (size_t)width * sizeof(float));
            gy_linear_t_acc(acc, c, k * c->chunk, c->chunk, o, width, valid, OV, 1, b);
            if (c->k_splits > 1) gy_linear_tree_push(slots, GY_LINEAR_T_WIDE, k, acc, width);
        }
        if (c->k_splits > 1) res = gy_linear_tree_finish(slots, GY_LINEAR_T_WIDE, c->k_splits, width);
        gy_linear_t_store(c, res, b, o, valid);
    }
}

static void gy_linear_t_task(void *ctx, int64_t task, int64_t n_tasks) {
    const gy_linear_ctx *c = (const gy_linear_ctx *)ctx;
    float *scratch = c->scratch + task * c->scratch_per_task;
    const int64_t begin = task * c->per_task;
    const int64_t end = begin + c->per_task < c->out ? begin + c->per_task : c->out;
    if (c->n == 1) {
        gy_linear_t_single(c, scratch, begin, end, 0);
        return;
    }
    /* The task's columns as even strips of at most GY_LINEAR_T_MAX_OV vectors. */
    const int64_t units = (end - begin + 15) / 16;
    const int64_t strips = (units + GY_LINEAR_T_MAX_OV - 1) / GY_LINEAR_T_MAX_OV;
    for (int64_t s = 0; s < strips; s++) {
        const int64_t u0 = units * s / strips, u1 = units * (s + 1) / strips;
        const int64_t o = begin + 16 * u0, o_end = begin + 16 * u1 < end ? begin + 16 * u1 : end;
        for (int64_t b0 = 0; b0 < c->n; b0 += GY_LINEAR_T_PASS)
            gy_linear_t_strip(c, scratch, o, (int32_t)(u1 - u0), o_end - o, b0,
                              c->n - b0 < GY_LINEAR_T_PASS ? c->n - b0 : GY_LINEAR_T_PASS);
    }
}

gy_status gy_cpu_linear_t(float *y, const float *x, const void *wt, gy_dtype w_dtype,
                          const float *bias, int64_t n, int64_t in, int64_t out, int32_t k_splits,
                          gy_threadpool *pool) {
    GY_TRY(gy_linear_check("gy_cpu_linear_t", y, x, wt, w_dtype, n, in, out, k_splits, 1));
    if (n == 0 || out == 0) return GY_OK;
    gy_linear_ctx c = {y, x, (const char *)wt, w_dtype, gy_dtype_size(w_dtype), bias, n, in, out,
                       k_splits, in / k_splits, 0, NULL, 0};
    /* Wide contiguous column ranges keep W's rows read in long runs and, at batch 1, give one FMA
     * chain per vector of the range: two ranges per thread, so that a thread that is descheduled
     * can be covered. */
    const int64_t units = (out + 15) / 16;
    int64_t tasks = 2 * (int64_t)gy_threadpool_size(pool);
    if (tasks > units) tasks = units;
    c.per_task = (units + tasks - 1) / tasks * 16;
    tasks = (out + c.per_task - 1) / c.per_task;
    int levels = 0;
    while ((1 << levels) < k_splits) levels++;
    c.scratch_per_task = (int64_t)GY_LINEAR_T_ACC * (k_splits > 1 ? 2 + levels : 1);
    c.scratch = aligned_alloc(64, (size_t)(tasks * c.scratch_per_task) * sizeof(float));
    if (c.scratch == NULL)
        return GY_FAIL(GY_ERR_SYSTEM, "gy_cpu_linear_t: cannot allocate %lld floats of scratch",
                       (long long)(tasks * c.scratch_per_task));
    const gy_status st = gy_threadpool_run(pool, gy_linear_t_task, &c, tasks);
    free(c.scratch);
    return st;
}

/* ---- combining partial results ------------------------------------------------------------------ */

gy_status gy_cpu_add_tree(float *out, const float *const *parts, int32_t n_parts, int64_t n) {
    if (n_parts < 1 || n_parts > GY_LINEAR_MAX_K_SPLITS)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_add_tree: n_parts=%d must be in [1, %d]",
                       (int)n_parts, GY_LINEAR_MAX_K_SPLITS);
    if (n < 0) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_add_tree: negative length %lld", (long long)n);
    if (n == 0) return GY_OK;
    if (out == NULL || parts == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_add_tree: NULL buffer");
    for (int32_t p = 0; p < n_parts; p++)
        if (parts[p] == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_add_tree: part %d is NULL", (int)p);
    int64_t i0 = 0;
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) { /* the same additions, 16 elements at a time */
        __m512 t[GY_LINEAR_MAX_K_SPLITS];
        for (; i0 + 16 <= n; i0 += 16) {
            for (int32_t p = 0; p < n_parts; p++) t[p] = _mm512_loadu_ps(parts[p] + i0);
            for (int32_t width = n_parts; width > 1; width = (width + 1) / 2) { /* core/tree.h */
                for (int32_t p = 0; p < width / 2; p++) t[p] = _mm512_add_ps(t[2 * p], t[2 * p + 1]);
                if (width & 1) t[width / 2] = t[width - 1];
            }
            _mm512_storeu_ps(out + i0, t[0]);
        }
    }
#endif
    float v[GY_LINEAR_MAX_K_SPLITS][16];
    for (; i0 < n; i0 += 16) {
        const int64_t m = n - i0 < 16 ? n - i0 : 16;
        for (int32_t p = 0; p < n_parts; p++)
            for (int64_t j = 0; j < m; j++) v[p][j] = parts[p][i0 + j];
        for (int32_t width = n_parts; width > 1; width = (width + 1) / 2) { /* core/tree.h */
            for (int32_t p = 0; p < width / 2; p++)
                for (int64_t j = 0; j < m; j++) v[p][j] = v[2 * p][j] + v[2 * p + 1][j];
            if (width & 1) memcpy(v[width / 2], v[width - 1], (size_t)m * sizeof(float));
        }
        for (int64_t j = 0; j < m; j++) out[i0 + j] = v[0][j];
    }
    return GY_OK;
}

gy_status gy_cpu_add_bias(float *y, const float *bias, int64_t n, int64_t out) {
    if (n < 0 || out < 0)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_add_bias: negative size n=%lld out=%lld",
                       (long long)n, (long long)out);
    if (n == 0 || out == 0) return GY_OK;
    if (y == NULL || bias == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_add_bias: NULL buffer");
    for (int64_t r = 0; r < n; r++)
        for (int64_t o = 0; o < out; o++) y[r * out + o] += bias[o];
    return GY_OK;
}
