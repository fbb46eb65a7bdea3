/* dot.c: the fixed-order dot product (definition in dot.h) and its 16-wide tiles. */
#include "dot.h"

#include <math.h>
#include <string.h>

#include "isa.h"
#include "simd.h"

#define GY_DOT_TREE_LEVELS 7 /* log2(64 k-splits) + 1 */
/* W is read once per call, from L3 or memory. At batch 1 each 16-row tile requests the next tile's
 * lines into L1 as it reads its own; the batched kernels request the tile GY_DOT_PF_TILES ahead
 * into L2, spread over their groups. A prefetch never faults, past the weights included. */
#define GY_DOT_PF_TILES 2

static inline float gy_dot_load(const void *w, gy_dtype dtype, int64_t k) {
    switch (dtype) {
    case GY_DTYPE_F16: return gy_f16_to_f32(((const uint16_t *)w)[k]);
    case GY_DTYPE_BF16: return gy_bf16_to_f32(((const uint16_t *)w)[k]);
    default: return ((const float *)w)[k];
    }
}

/* Whole lane blocks as plain loops over the 16 lanes, one dtype each, that the compiler turns
 * into vector FMAs (each lane's chain is unchanged, so the bits are the definition's); the last
 * partial block element by element. */
float gy_dot_ref(const void *w, gy_dtype w_dtype, const float *x, int64_t len) {
    float acc[GY_DOT_LANES] = {0};
    int64_t k0 = 0;
    if (w_dtype == GY_DTYPE_BF16) {
        /* Blocks of 32: lane l takes element 2l, then 2l + 1 (the two halves of one 32-bit word). */
        const uint16_t *h = (const uint16_t *)w;
        for (; k0 + 2 * GY_DOT_LANES <= len; k0 += 2 * GY_DOT_LANES) {
            float we[GY_DOT_LANES], xe[GY_DOT_LANES], wo[GY_DOT_LANES], xo[GY_DOT_LANES];
            for (int l = 0; l < GY_DOT_LANES; l++) {
                we[l] = gy_bf16_to_f32(h[k0 + 2 * l]);
                wo[l] = gy_bf16_to_f32(h[k0 + 2 * l + 1]);
                xe[l] = x[k0 + 2 * l];
                xo[l] = x[k0 + 2 * l + 1];
            }
            for (int l = 0; l < GY_DOT_LANES; l++) acc[l] = fmaf(we[l], xe[l], acc[l]);
            for (int l = 0; l < GY_DOT_LANES; l++) acc[l] = fmaf(wo[l], xo[l], acc[l]);
        }
        if (k0 < len)
            for (int l = 0; l < GY_DOT_LANES; l++)
                for (int64_t k = k0 + 2 * l; k < k0 + 2 * l + 2; k++)
                    acc[l] = k < len ? fmaf(gy_bf16_to_f32(h[k]), x[k], acc[l])
                                     : fmaf(0.0f, 0.0f, acc[l]);
        return gy_dot_lane_tree(acc);
    }
    if (w_dtype == GY_DTYPE_F16) {
        const uint16_t *h = (const uint16_t *)w;
        for (; k0 + GY_DOT_LANES <= len; k0 += GY_DOT_LANES) {
            float wf[GY_DOT_LANES];
            for (int l = 0; l < GY_DOT_LANES; l++) wf[l] = gy_f16_to_f32(h[k0 + l]);
            for (int l = 0; l < GY_DOT_LANES; l++) acc[l] = fmaf(wf[l], x[k0 + l], acc[l]);
        }
    } else {
        const float *wf = (const float *)w;
        for (; k0 + GY_DOT_LANES <= len; k0 += GY_DOT_LANES)
            for (int l = 0; l < GY_DOT_LANES; l++) acc[l] = fmaf(wf[k0 + l], x[k0 + l], acc[l]);
    }
    if (k0 < len) /* the zero padding is part of the definition: fma(0, 0, -0) is +0 */
        for (int l = 0; l < GY_DOT_LANES; l++)
            acc[l] = k0 + l < len ? fmaf(gy_dot_load(w, w_dtype, k0 + l), x[k0 + l], acc[l])
                                  : fmaf(0.0f, 0.0f, acc[l]);
    return gy_dot_lane_tree(acc);
}

static void gy_dot_tile16_portable(float out[16], const void *const *w, gy_dtype w_dtype,
                                   int32_t n_w, const float *const *x, int64_t len) {
    const int32_t n_x = 16 / n_w;
    for (int32_t r = 0; r < n_w; r++)
        for (int32_t b = 0; b < n_x; b++) out[r * n_x + b] = gy_dot_ref(w[r], w_dtype, x[b], len);
}

static void gy_dot_rows16_portable(float *y, int64_t ldy, const float *bias, const void *w,
                                   int64_t w_row_bytes, gy_dtype dtype, int32_t valid,
                                   const float *x, int64_t ldx, int64_t n_rows, int64_t len,
                                   int32_t k_splits) {
    const int64_t L = len / k_splits, esize = gy_dtype_size(dtype);
    float parts[64];
    for (int64_t i = 0; i < n_rows; i++)
        for (int32_t r = 0; r < valid; r++) {
            const char *wr = (const char *)w + r * w_row_bytes;
            for (int32_t c = 0; c < k_splits; c++)
                parts[c] = gy_dot_ref(wr + c * L * esize, dtype, x + i * ldx + c * L, L);
            for (int32_t width = k_splits; width > 1; width /= 2)
                for (int32_t p = 0; p < width / 2; p++) parts[p] = parts[2 * p] + parts[2 * p + 1];
            y[i * ldy + r] = bias ? parts[0] + bias[r] : parts[0];
        }
}

#if GY_CPU_HAVE_AVX512
/* acc[r * B + b] (B = 16 / R) accumulates the dot.h order of rows w[r] and x[b] over elements
 * k0..k0+len (a chunk: the lane blocks start at k0, the padding is zeros): R * B independent FMA
 * chains, each weight vector loaded (and widened) once for the B activation rows. */
GY_INLINE void gy_dot_accumulate(__m512 acc[16], const char *const *w, gy_dtype dtype, const int R,
                                 const float *const *x, int64_t k0, int64_t len, int64_t pf) {
    const int B = 16 / R;
    const int64_t end = k0 + len;
    if (dtype == GY_DTYPE_BF16) {
        /* 32 bf16 per 64-byte load: the low halves of its words are the even elements, the high
         * halves the odd ones, each widened by one instruction; x is split the same way. */
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        int64_t k = k0;
        for (; k + 32 <= end; k += 32) {
            __m512 xe[16], xo[16];
#pragma GCC unroll 16
            for (int b = 0; b < B; b++) {
                const __m512 lo = _mm512_loadu_ps(x[b] + k), hi = _mm512_loadu_ps(x[b] + k + 16);
                xe[b] = _mm512_permutex2var_ps(lo, even, hi);
                xo[b] = _mm512_permutex2var_ps(lo, odd, hi);
            }
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const __m512i u = _mm512_loadu_si512((const uint16_t *)w[r] + k);
                if (pf) _mm_prefetch((const char *)((const uint16_t *)w[r] + k) + pf, _MM_HINT_T0);
                const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
                const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(u, high));
#pragma GCC unroll 16
                for (int b = 0; b < B; b++) {
                    acc[r * B + b] = _mm512_fmadd_ps(we, xe[b], acc[r * B + b]);
                    acc[r * B + b] = _mm512_fmadd_ps(wo, xo[b], acc[r * B + b]);
                }
            }
        }
        if (k < end) {
            const int64_t n = end - k;
            const __mmask16 m0 = gy_simd_mask(n), m1 = gy_simd_mask(n > 16 ? n - 16 : 0);
            const __mmask32 mw = (__mmask32)((1u << n) - 1u); /* n < 32 */
            __m512 xe[16], xo[16];
#pragma GCC unroll 16
            for (int b = 0; b < B; b++) {
                const __m512 lo = _mm512_maskz_loadu_ps(m0, x[b] + k);
                const __m512 hi = _mm512_maskz_loadu_ps(m1, x[b] + k + 16);
                xe[b] = _mm512_permutex2var_ps(lo, even, hi);
                xo[b] = _mm512_permutex2var_ps(lo, odd, hi);
            }
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const __m512i u = _mm512_maskz_loadu_epi16(mw, (const uint16_t *)w[r] + k);
                const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
                const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(u, high));
#pragma GCC unroll 16
                for (int b = 0; b < B; b++) {
                    acc[r * B + b] = _mm512_fmadd_ps(we, xe[b], acc[r * B + b]);
                    acc[r * B + b] = _mm512_fmadd_ps(wo, xo[b], acc[r * B + b]);
                }
            }
        }
        return;
    }
    int64_t k = k0;
    for (; k + 16 <= end; k += 16) {
        __m512 xv[16];
        /* With several activation rows, x streams from L2: fetch ahead. */
        if (B > 1)
#pragma GCC unroll 16
            for (int b = 0; b < B; b++) _mm_prefetch((const char *)(x[b] + k) + 256, _MM_HINT_T0);
#pragma GCC unroll 16
        for (int b = 0; b < B; b++) xv[b] = _mm512_loadu_ps(x[b] + k);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __m512 wv = gy_simd_load_w(w[r], k, dtype);
            if (pf && (dtype == GY_DTYPE_F32 || k % 32 == 0)) /* one line per prefetch */
                _mm_prefetch(w[r] + k * (dtype == GY_DTYPE_F32 ? 4 : 2) + pf, _MM_HINT_T0);
#pragma GCC unroll 16
            for (int b = 0; b < B; b++) acc[r * B + b] = _mm512_fmadd_ps(wv, xv[b], acc[r * B + b]);
        }
    }
    if (k < end) {
        const __mmask16 m = gy_simd_mask(end - k);
        __m512 xv[16];
#pragma GCC unroll 16
        for (int b = 0; b < B; b++) xv[b] = _mm512_maskz_loadu_ps(m, x[b] + k);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __m512 wv = gy_simd_load_w_mask(w[r], k, dtype, m);
#pragma GCC unroll 16
            for (int b = 0; b < B; b++) acc[r * B + b] = _mm512_fmadd_ps(wv, xv[b], acc[r * B + b]);
        }
    }
}

GY_INLINE void gy_dot_tile16_avx512(float out[16], const void *const *w, gy_dtype dtype,
                                    const int R, const float *const *x, int64_t len) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    gy_dot_accumulate(acc, (const char *const *)w, dtype, R, x, 0, len, 0);
    _mm512_storeu_ps(out, gy_simd_lane_tree16(acc));
}

#define GY_DOT_TILE_VARIANT(NAME, DTYPE, R)                                                        \
    static void NAME(float out[16], const void *const *w, const float *const *x, int64_t len) {    \
        gy_dot_tile16_avx512(out, w, DTYPE, R, x, len);                                            \
    }
GY_DOT_TILE_VARIANT(gy_dot_tile_f32_16, GY_DTYPE_F32, 16)
GY_DOT_TILE_VARIANT(gy_dot_tile_f32_8, GY_DTYPE_F32, 8)
GY_DOT_TILE_VARIANT(gy_dot_tile_f32_4, GY_DTYPE_F32, 4)
GY_DOT_TILE_VARIANT(gy_dot_tile_f16_16, GY_DTYPE_F16, 16)
GY_DOT_TILE_VARIANT(gy_dot_tile_f16_8, GY_DTYPE_F16, 8)
GY_DOT_TILE_VARIANT(gy_dot_tile_f16_4, GY_DTYPE_F16, 4)
GY_DOT_TILE_VARIANT(gy_dot_tile_bf16_16, GY_DTYPE_BF16, 16)
GY_DOT_TILE_VARIANT(gy_dot_tile_bf16_8, GY_DTYPE_BF16, 8)
GY_DOT_TILE_VARIANT(gy_dot_tile_bf16_4, GY_DTYPE_BF16, 4)

typedef void (*gy_dot_tile_fn)(float out[16], const void *const *w, const float *const *x,
                               int64_t len);
/* [dtype][0: R=16, 1: R=8, 2: R=4] */
static const gy_dot_tile_fn gy_dot_tiles[GY_DTYPE_COUNT][3] = {
    [GY_DTYPE_F32] = {gy_dot_tile_f32_16, gy_dot_tile_f32_8, gy_dot_tile_f32_4},
    [GY_DTYPE_F16] = {gy_dot_tile_f16_16, gy_dot_tile_f16_8, gy_dot_tile_f16_4},
    [GY_DTYPE_BF16] = {gy_dot_tile_bf16_16, gy_dot_tile_bf16_8, gy_dot_tile_bf16_4},
};

/* One group of B = 16 / R activation rows against one slice of R weight rows: the chunk partials
 * stay in registers (acc over a chunk, lane tree to one vector, the chunk tree on vectors), then
 * the bias and stores of R values per activation row. */
GY_INLINE void gy_dot_slice_avx512(float *y, int64_t ldy, __m512 bias_v, const char *const *wp,
                                   gy_dtype dtype, const int R, int32_t valid, const float *xg,
                                   int64_t ldx, int64_t L, int32_t k_splits, __m512i to_rows,
                                   int64_t pf) {
    const int B = 16 / R;
    const float *xp[16];
#pragma GCC unroll 16
    for (int b = 0; b < B; b++) xp[b] = xg + b * ldx;
    __m512 stack[7];
    __m512 res = _mm512_setzero_ps();
    for (int32_t c = 0; c < k_splits; c++) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        gy_dot_accumulate(acc, wp, dtype, R, xp, c * L, L, pf);
        res = gy_simd_lane_tree16(acc);
        int l = 0;
        for (; (c >> l) & 1; l++) res = _mm512_add_ps(stack[l], res);
        stack[l] = res;
    }
    res = _mm512_add_ps(_mm512_permutexvar_ps(to_rows, res), bias_v);
    if (R == 16) {
        _mm512_mask_storeu_ps(y, gy_simd_mask(valid), res);
    } else if (R == 8) {
        const __mmask8 m = (__mmask8)gy_simd_mask(valid);
        _mm256_mask_storeu_ps(y, m, _mm512_castps512_ps256(res));
        _mm256_mask_storeu_ps(y + ldy, m, _mm512_extractf32x8_ps(res, 1));
    } else {
        const __mmask8 m = (__mmask8)gy_simd_mask(valid);
        _mm_mask_storeu_ps(y, m, _mm512_castps512_ps128(res));
        _mm_mask_storeu_ps(y + ldy, m, _mm512_extractf32x4_ps(res, 1));
        _mm_mask_storeu_ps(y + 2 * ldy, m, _mm512_extractf32x4_ps(res, 2));
        _mm_mask_storeu_ps(y + 3 * ldy, m, _mm512_extractf32x4_ps(res, 3));
    }
}

/* A 16-row tile of W against n_rows activation rows, in groups of B = 16 / R: for each group, the
 * tile's 16 / R slices in turn, so the tile stays in L1 while each group of x is read once. */
GY_INLINE void gy_dot_rows16_avx512(float *y, int64_t ldy, const float *bias, const void *w,
                                    int64_t w_row_bytes, gy_dtype dtype, const int R, int32_t valid,
                                    const float *x, int64_t ldx, int64_t n_rows, int64_t len,
                                    int32_t k_splits) {
    const int B = 16 / R, S = 16 / R;
    /* A single activation row streams W at the memory's pace: the next tile's lines are requested
     * as this tile's are read (the hardware prefetchers lose track of 16 interleaved rows). */
    const int64_t pf = n_rows == B ? 16 * w_row_bytes : 0;
    const char *wp[16];
    for (int r = 0; r < 16; r++) wp[r] = (const char *)w + (r < valid ? r : valid - 1) * w_row_bytes;
    /* Lane order of a result vector is r * B + b; rows of y want b * R + r. */
    int32_t order[16];
    for (int b = 0; b < B; b++)
        for (int r = 0; r < R; r++) order[b * R + r] = r * B + b;
    const __m512i to_rows = _mm512_loadu_si512(order);
    __m512 bias_v[16];
    for (int sl = 0; sl < S; sl++) {
        float bias16[16] = {0};
        if (bias)
            for (int b = 0; b < B; b++)
                for (int r = 0; r < R && sl * R + r < valid; r++) bias16[b * R + r] = bias[sl * R + r];
        bias_v[sl] = _mm512_loadu_ps(bias16);
    }
    for (int64_t g = 0; g + B <= n_rows; g += B)
        for (int sl = 0; sl < S && sl * R < valid; sl++)
            gy_dot_slice_avx512(y + g * ldy + sl * R, ldy, bias_v[sl], wp + sl * R, dtype, R,
                                valid - sl * R, x + g * ldx, ldx, len / k_splits, k_splits, to_rows,
                                pf);
}

#define GY_DOT_ROWS_VARIANT(NAME, DTYPE, R)                                                        \
    static void NAME(float *y, int64_t ldy, const float *bias, const void *w, int64_t wrb,         \
                     int32_t valid, const float *x, int64_t ldx, int64_t n_rows, int64_t len,      \
                     int32_t ks) {                                                                 \
        gy_dot_rows16_avx512(y, ldy, bias, w, wrb, DTYPE, R, valid, x, ldx, n_rows, len, ks);      \
    }
GY_DOT_ROWS_VARIANT(gy_dot_rows_f32_16, GY_DTYPE_F32, 16)
GY_DOT_ROWS_VARIANT(gy_dot_rows_f32_8, GY_DTYPE_F32, 8)
GY_DOT_ROWS_VARIANT(gy_dot_rows_f32_4, GY_DTYPE_F32, 4)
GY_DOT_ROWS_VARIANT(gy_dot_rows_f16_16, GY_DTYPE_F16, 16)
GY_DOT_ROWS_VARIANT(gy_dot_rows_f16_8, GY_DTYPE_F16, 8)
GY_DOT_ROWS_VARIANT(gy_dot_rows_f16_4, GY_DTYPE_F16, 4)
GY_DOT_ROWS_VARIANT(gy_dot_rows_bf16_16, GY_DTYPE_BF16, 16)
GY_DOT_ROWS_VARIANT(gy_dot_rows_bf16_8, GY_DTYPE_BF16, 8)
GY_DOT_ROWS_VARIANT(gy_dot_rows_bf16_4, GY_DTYPE_BF16, 4)

typedef void (*gy_dot_rows_fn)(float *y, int64_t ldy, const float *bias, const void *w,
                               int64_t wrb, int32_t valid, const float *x, int64_t ldx,
                               int64_t n_rows, int64_t len, int32_t ks);
static const gy_dot_rows_fn gy_dot_rows[GY_DTYPE_COUNT][3] = {
    [GY_DTYPE_F32] = {gy_dot_rows_f32_16, gy_dot_rows_f32_8, gy_dot_rows_f32_4},
    [GY_DTYPE_F16] = {gy_dot_rows_f16_16, gy_dot_rows_f16_8, gy_dot_rows_f16_4},
    [GY_DTYPE_BF16] = {gy_dot_rows_bf16_16, gy_dot_rows_bf16_8, gy_dot_rows_bf16_4},
};
#endif

void gy_dot_rows16(float *y, int64_t ldy, const float *bias, const void *w, int64_t w_row_bytes,
                   gy_dtype w_dtype, int32_t n_w, int32_t valid_rows, const float *x, int64_t ldx,
                   int64_t n_rows, int64_t len, int32_t k_splits) {
    n_rows -= n_rows % (16 / n_w);
    if (n_rows <= 0 || valid_rows <= 0) return;
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        const int shape = n_w == 16 ? 0 : n_w == 8 ? 1 : 2;
        gy_dot_rows[w_dtype][shape](y, ldy, bias, w, w_row_bytes, valid_rows, x, ldx, n_rows, len,
                                    k_splits);
        return;
    }
#endif
    gy_dot_rows16_portable(y, ldy, bias, w, w_row_bytes, w_dtype, valid_rows, x, ldx, n_rows, len,
                           k_splits);
}

void gy_dot_tile16(float out[16], const void *const *w, gy_dtype w_dtype, int32_t n_w,
                   const float *const *x, int64_t len) {
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        const int shape = n_w == 16 ? 0 : n_w == 8 ? 1 : 2;
        gy_dot_tiles[w_dtype][shape](out, w, x, len);
        return;
    }
#endif
    gy_dot_tile16_portable(out, w, w_dtype, n_w, x, len);
}

/* ---- batched kernels over packed activations ------------------------------------------------ */

static int64_t gy_dot_block(gy_dtype dtype) { return dtype == GY_DTYPE_BF16 ? 32 : 16; }

int64_t gy_dot_packed_stride(gy_dtype w_dtype, int64_t len, int32_t k_splits) {
    const int64_t blk = gy_dot_block(w_dtype), L = len / k_splits;
    return (L + blk - 1) / blk * blk * k_splits;
}

void gy_dot_pack(float *xp, const float *x, int64_t ldx, int64_t n_rows, gy_dtype w_dtype,
                 int64_t len, int32_t k_splits) {
    const int64_t blk = gy_dot_block(w_dtype), L = len / k_splits, Lp = (L + blk - 1) / blk * blk;
    const int64_t ldp = Lp * k_splits;
    for (int64_t i = 0; i < n_rows; i++)
        for (int32_t c = 0; c < k_splits; c++) {
            const float *src = x + i * ldx + c * L;
            float *dst = xp + i * ldp + c * Lp;
            if (w_dtype != GY_DTYPE_BF16) {
                memcpy(dst, src, (size_t)L * sizeof(float));
                memset(dst + L, 0, (size_t)(Lp - L) * sizeof(float));
                continue;
            }
            int64_t k = 0;
#if GY_CPU_HAVE_AVX512
            const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            for (; k + 32 <= L; k += 32) {
                const __m512 lo = _mm512_loadu_ps(src + k), hi = _mm512_loadu_ps(src + k + 16);
                _mm512_store_ps(dst + k, _mm512_permutex2var_ps(lo, even, hi));
                _mm512_store_ps(dst + k + 16, _mm512_permutex2var_ps(lo, odd, hi));
            }
#endif
            for (; k < Lp; k += 32)
                for (int q = 0; q < 16; q++) {
                    dst[k + q] = k + 2 * q < L ? src[k + 2 * q] : 0.0f;
                    dst[k + 16 + q] = k + 2 * q + 1 < L ? src[k + 2 * q + 1] : 0.0f;
                }
        }
}

#if GY_CPU_HAVE_AVX512
/* acc[c * 8 + r] accumulates the dot.h order of weight row r (wp[r], elements kw..kw+L) and packed
 * row c (xp + c * ldp, floats kx..kx+Lp): 8 * C independent FMA chains, each weight vector loaded
 * (and widened) once for the C rows, each x vector once for the 8 weight rows. */
GY_INLINE void gy_dot_block8_acc(__m512 acc[24], const char *const *wp, gy_dtype dtype, const int C,
                                 const float *xp, int64_t ldp, int64_t kw, int64_t kx, int64_t L,
                                 const char *pf) {
    if (dtype == GY_DTYPE_BF16) {
        /* Per block of 32: the even elements of every row (the low halves of the weight words),
         * then the odd ones (the high halves), so each lane's chain takes 2l before 2l + 1. */
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        int64_t k = 0;
        for (; k + 32 <= L; k += 32) {
            __m512 xv[3];
            _mm_prefetch(pf + k * 2, _MM_HINT_T1);
#pragma GCC unroll 3
            for (int c = 0; c < C; c++) xv[c] = _mm512_load_ps(xp + c * ldp + kx + k);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                const __m512 we = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_loadu_si512((const uint16_t *)wp[r] + kw + k), 16));
#pragma GCC unroll 3
                for (int c = 0; c < C; c++) acc[c * 8 + r] = _mm512_fmadd_ps(we, xv[c], acc[c * 8 + r]);
            }
#pragma GCC unroll 3
            for (int c = 0; c < C; c++) xv[c] = _mm512_load_ps(xp + c * ldp + kx + k + 16);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                const __m512 wo = _mm512_castsi512_ps(
                    _mm512_and_si512(_mm512_loadu_si512((const uint16_t *)wp[r] + kw + k), high));
#pragma GCC unroll 3
                for (int c = 0; c < C; c++) acc[c * 8 + r] = _mm512_fmadd_ps(wo, xv[c], acc[c * 8 + r]);
            }
        }
        if (k < L) {
            const __mmask32 mw = (__mmask32)((1u << (L - k)) - 1u); /* L - k < 32 */
            __m512 xv[3];
#pragma GCC unroll 3
            for (int c = 0; c < C; c++) xv[c] = _mm512_load_ps(xp + c * ldp + kx + k);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                const __m512i u = _mm512_maskz_loadu_epi16(mw, (const uint16_t *)wp[r] + kw + k);
                const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
#pragma GCC unroll 3
                for (int c = 0; c < C; c++) acc[c * 8 + r] = _mm512_fmadd_ps(we, xv[c], acc[c * 8 + r]);
            }
#pragma GCC unroll 3
            for (int c = 0; c < C; c++) xv[c] = _mm512_load_ps(xp + c * ldp + kx + k + 16);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                const __m512i u = _mm512_maskz_loadu_epi16(mw, (const uint16_t *)wp[r] + kw + k);
                const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(u, high));
#pragma GCC unroll 3
                for (int c = 0; c < C; c++) acc[c * 8 + r] = _mm512_fmadd_ps(wo, xv[c], acc[c * 8 + r]);
            }
        }
        return;
    }
    int64_t k = 0;
    for (; k + 16 <= L; k += 16) {
        __m512 xv[3];
        _mm_prefetch(pf + k * (dtype == GY_DTYPE_F32 ? 4 : 2), _MM_HINT_T1);
#pragma GCC unroll 3
        for (int c = 0; c < C; c++) xv[c] = _mm512_load_ps(xp + c * ldp + kx + k);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            __m512 wv = gy_simd_load_w(wp[r], kw + k, dtype);
            GY_SIMD_IN_REGISTER(wv);
#pragma GCC unroll 3
            for (int c = 0; c < C; c++) acc[c * 8 + r] = _mm512_fmadd_ps(wv, xv[c], acc[c * 8 + r]);
        }
    }
    if (k < L) { /* the packed rows hold zeros past L */
        const __mmask16 m = gy_simd_mask(L - k);
        __m512 xv[3];
#pragma GCC unroll 3
        for (int c = 0; c < C; c++) xv[c] = _mm512_load_ps(xp + c * ldp + kx + k);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            const __m512 wv = gy_simd_load_w_mask(wp[r], kw + k, dtype, m);
#pragma GCC unroll 3
            for (int c = 0; c < C; c++) acc[c * 8 + r] = _mm512_fmadd_ps(wv, xv[c], acc[c * 8 + r]);
        }
    }
}

/* One group of C packed rows against the 8 weight rows: per chunk the accumulators, their lane
 * trees (lanes c * 8 + r of r16 for rows 0-1, r8 for row 2, or r8 alone when C = 1), the chunk
 * tree on those vectors; then the bias and one 8-wide store per row. */
GY_INLINE void gy_dot_group8_avx512(float *y, int64_t ldy, const float *bias, const char *const *wp,
                                    gy_dtype dtype, const int C, int32_t valid, const float *xp,
                                    int64_t ldp, int64_t L, int64_t Lp, int32_t k_splits,
                                    const char *pf) {
    __m512 st16[GY_DOT_TREE_LEVELS], r16 = _mm512_setzero_ps();
    __m256 st8[GY_DOT_TREE_LEVELS], r8 = _mm256_setzero_ps();
    for (int32_t c = 0; c < k_splits; c++) {
        __m512 acc[24];
#pragma GCC unroll 24
        for (int i = 0; i < 8 * C; i++) acc[i] = _mm512_setzero_ps();
        gy_dot_block8_acc(acc, wp, dtype, C, xp, ldp, c * L, c * Lp, L, pf);
        pf += L * gy_dtype_size(dtype);
        if (C >= 2) r16 = gy_simd_lane_tree16(acc);
        if (C != 2) r8 = gy_simd_lane_tree8(acc + (C == 3 ? 16 : 0));
        int l = 0;
        for (; (c >> l) & 1; l++) {
            if (C >= 2) r16 = _mm512_add_ps(st16[l], r16);
            if (C != 2) r8 = _mm256_add_ps(st8[l], r8);
        }
        if (C >= 2) st16[l] = r16;
        if (C != 2) st8[l] = r8;
    }
    const __mmask8 m = (__mmask8)gy_simd_mask(valid);
    __m256 rows[3];
    if (C >= 2) {
        rows[0] = _mm512_castps512_ps256(r16);
        rows[1] = _mm512_extractf32x8_ps(r16, 1);
    }
    if (C != 2) rows[C - 1] = r8;
    const __m256 b8 = bias ? _mm256_maskz_loadu_ps(m, bias) : _mm256_setzero_ps();
#pragma GCC unroll 3
    for (int i = 0; i < C; i++)
        _mm256_mask_storeu_ps(y + i * ldy, m, bias ? _mm256_add_ps(rows[i], b8) : rows[i]);
}

#define GY_DOT_GROUP_VARIANT(NAME, DTYPE, C)                                                       \
    static void NAME(float *y, int64_t ldy, const float *bias, const char *const *wp,             \
                     int32_t valid, const float *xp, int64_t ldp, int64_t L, int64_t Lp, int32_t ks, \
                     const char *pf) {                                                             \
        gy_dot_group8_avx512(y, ldy, bias, wp, DTYPE, C, valid, xp, ldp, L, Lp, ks, pf);           \
    }
GY_DOT_GROUP_VARIANT(gy_dot_group_f32_1, GY_DTYPE_F32, 1)
GY_DOT_GROUP_VARIANT(gy_dot_group_f32_2, GY_DTYPE_F32, 2)
GY_DOT_GROUP_VARIANT(gy_dot_group_f32_3, GY_DTYPE_F32, 3)
GY_DOT_GROUP_VARIANT(gy_dot_group_f16_1, GY_DTYPE_F16, 1)
GY_DOT_GROUP_VARIANT(gy_dot_group_f16_2, GY_DTYPE_F16, 2)
GY_DOT_GROUP_VARIANT(gy_dot_group_f16_3, GY_DTYPE_F16, 3)
GY_DOT_GROUP_VARIANT(gy_dot_group_bf16_1, GY_DTYPE_BF16, 1)
GY_DOT_GROUP_VARIANT(gy_dot_group_bf16_2, GY_DTYPE_BF16, 2)
GY_DOT_GROUP_VARIANT(gy_dot_group_bf16_3, GY_DTYPE_BF16, 3)

typedef void (*gy_dot_group_fn)(float *y, int64_t ldy, const float *bias, const char *const *wp,
                                int32_t valid, const float *xp, int64_t ldp, int64_t L, int64_t Lp,
                                int32_t ks, const char *pf);
/* [dtype][C - 1] */
static const gy_dot_group_fn gy_dot_groups[GY_DTYPE_COUNT][3] = {
    [GY_DTYPE_F32] = {gy_dot_group_f32_1, gy_dot_group_f32_2, gy_dot_group_f32_3},
    [GY_DTYPE_F16] = {gy_dot_group_f16_1, gy_dot_group_f16_2, gy_dot_group_f16_3},
    [GY_DTYPE_BF16] = {gy_dot_group_bf16_1, gy_dot_group_bf16_2, gy_dot_group_bf16_3},
};
#endif

/* The definition on packed rows: gy_dot_ref's chains, reading x where the packing put it. */
static void gy_dot_rows8_packed_portable(float *y, int64_t ldy, const float *bias, const void *w,
                                         int64_t w_row_bytes, gy_dtype dtype, int32_t valid,
                                         const float *xp, int64_t n_rows, int64_t len,
                                         int32_t k_splits) {
    const int64_t blk = gy_dot_block(dtype), L = len / k_splits, Lp = (L + blk - 1) / blk * blk;
    const int64_t ldp = Lp * k_splits, esize = gy_dtype_size(dtype);
    float parts[64];
    for (int64_t i = 0; i < n_rows; i++)
        for (int32_t r = 0; r < valid; r++) {
            for (int32_t c = 0; c < k_splits; c++) {
                const char *wc = (const char *)w + r * w_row_bytes + c * L * esize;
                const float *xc = xp + i * ldp + c * Lp;
                if (dtype != GY_DTYPE_BF16) {
                    parts[c] = gy_dot_ref(wc, dtype, xc, L);
                    continue;
                }
                float acc[GY_DOT_LANES] = {0};
                for (int64_t k0 = 0; k0 < Lp; k0 += 32)
                    for (int l = 0; l < GY_DOT_LANES; l++)
                        for (int h = 0; h < 2; h++) { /* element k0 + 2l + h sits at k0 + 16h + l */
                            const int64_t k = k0 + 2 * l + h;
                            const float wv = k < L ? gy_bf16_to_f32(((const uint16_t *)wc)[k]) : 0.0f;
                            acc[l] = fmaf(wv, xc[k0 + 16 * h + l], acc[l]);
                        }
                parts[c] = gy_dot_lane_tree(acc);
            }
            for (int32_t width = k_splits; width > 1; width /= 2)
                for (int32_t p = 0; p < width / 2; p++) parts[p] = parts[2 * p] + parts[2 * p + 1];
            y[i * ldy + r] = bias ? parts[0] + bias[r] : parts[0];
        }
}

void gy_dot_rows8_packed(float *y, int64_t ldy, const float *bias, const void *w,
                         int64_t w_row_bytes, gy_dtype w_dtype, int32_t valid_rows, const float *xp,
                         int64_t n_rows, int64_t len, int32_t k_splits) {
    if (n_rows <= 0 || valid_rows <= 0) return;
    if (gy_cpu_isa_get() != GY_CPU_ISA_AVX512) {
        gy_dot_rows8_packed_portable(y, ldy, bias, w, w_row_bytes, w_dtype, valid_rows, xp, n_rows,
                                     len, k_splits);
        return;
    }
#if GY_CPU_HAVE_AVX512
    const int64_t blk = gy_dot_block(w_dtype), L = len / k_splits, Lp = (L + blk - 1) / blk * blk;
    const int64_t ldp = Lp * k_splits;
    const char *wp[8];
    for (int r = 0; r < 8; r++)
        wp[r] = (const char *)w + (r < valid_rows ? r : valid_rows - 1) * w_row_bytes;
    /* A later tile of W (GY_DOT_PF_TILES ahead) is fetched into L2 while this one runs, one line
     * per step of each group's inner loop (a group's steps cover one row's bytes), so that the
     * tiles arrive before their first group needs them. A prefetch past the weights never faults. */
    const char *pf = (const char *)w + GY_DOT_PF_TILES * 8 * w_row_bytes;
    for (int64_t i = 0; i < n_rows;) {
        const int64_t rest = n_rows - i;
        const int C = rest >= 3 && rest != 4 ? 3 : rest >= 2 ? 2 : 1;
        gy_dot_groups[w_dtype][C - 1](y + i * ldy, ldy, bias, wp, valid_rows, xp + i * ldp, ldp, L,
                                      Lp, k_splits, pf);
        pf += w_row_bytes;
        i += C;
    }
    return;
#endif
}
