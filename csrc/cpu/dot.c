/* dot.c: the fixed-order dot product (definition in dot.h) and its 16-wide tiles. */
#include "dot.h"

#include <math.h>

#include "isa.h"
#include "simd.h"

static inline float gy_dot_load(const void *w, gy_dtype dtype, int64_t k) {
    switch (dtype) {
    case GY_DTYPE_F16: return gy_f16_to_f32(((const uint16_t *)w)[k]);
    case GY_DTYPE_BF16: return gy_bf16_to_f32(((const uint16_t *)w)[k]);
    default: return ((const float *)w)[k];
    }
}

float gy_dot_ref(const void *w, gy_dtype w_dtype, const float *x, int64_t len) {
    float acc[GY_DOT_LANES] = {0};
    if (w_dtype == GY_DTYPE_BF16) {
        /* Blocks of 32: lane l takes element 2l, then 2l + 1 (the two halves of one 32-bit word). */
        const uint16_t *h = (const uint16_t *)w;
        for (int64_t k0 = 0; k0 < len; k0 += 2 * GY_DOT_LANES)
            for (int l = 0; l < GY_DOT_LANES; l++)
                for (int64_t k = k0 + 2 * l; k < k0 + 2 * l + 2; k++)
                    acc[l] = k < len ? fmaf(gy_bf16_to_f32(h[k]), x[k], acc[l])
                                     : fmaf(0.0f, 0.0f, acc[l]);
        return gy_dot_lane_tree(acc);
    }
    int64_t k0 = 0;
    for (; k0 + GY_DOT_LANES <= len; k0 += GY_DOT_LANES)
        for (int l = 0; l < GY_DOT_LANES; l++)
            acc[l] = fmaf(gy_dot_load(w, w_dtype, k0 + l), x[k0 + l], acc[l]);
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
                                 const float *const *x, int64_t k0, int64_t len) {
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
    gy_dot_accumulate(acc, (const char *const *)w, dtype, R, x, 0, len);
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
                                   int64_t ldx, int64_t L, int32_t k_splits, __m512i to_rows) {
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
        gy_dot_accumulate(acc, wp, dtype, R, xp, c * L, L);
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
                                valid - sl * R, x + g * ldx, ldx, len / k_splits, k_splits, to_rows);
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
