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
                                   int64_t w_row_bytes, gy_dtype dtype, int32_t R, int32_t valid,
                                   const float *x, int64_t ldx, int64_t n_groups, int64_t len,
                                   int32_t k_splits) {
    const int32_t B = 16 / R;
    const int64_t L = len / k_splits, esize = gy_dtype_size(dtype);
    float parts[64];
    for (int64_t i = 0; i < n_groups * B; i++)
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
/* R weight rows times B = 16 / R activation rows, one zmm accumulator per pair: 16 independent
 * FMA chains, each weight vector loaded (and widened) once for the B rows. */
GY_INLINE void gy_dot_tile16_avx512(float out[16], const void *const *w, gy_dtype dtype,
                                    const int R, const float *const *x, int64_t len) {
    const int B = 16 / R;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
        __m512 xv[16];
#pragma GCC unroll 16
        for (int b = 0; b < B; b++) xv[b] = _mm512_loadu_ps(x[b] + k);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const __m512 wv = gy_simd_load_w(w[r], k, dtype);
#pragma GCC unroll 16
            for (int b = 0; b < B; b++) acc[r * B + b] = _mm512_fmadd_ps(wv, xv[b], acc[r * B + b]);
        }
    }
    if (k < len) {
        const __mmask16 m = gy_simd_mask(len - k);
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

/* The chunk partials of each group's 16 dot products stay in registers: acc over one chunk, lane
 * tree to one vector, the chunk tree on vectors, bias, then stores of R values per activation
 * row. */
GY_INLINE void gy_dot_rows16_avx512(float *y, int64_t ldy, const float *bias, const void *w,
                                    int64_t w_row_bytes, gy_dtype dtype, const int R, int32_t valid,
                                    const float *x, int64_t ldx, int64_t n_groups, int64_t len,
                                    int32_t k_splits) {
    const int B = 16 / R;
    const int64_t L = len / k_splits, esize = dtype == GY_DTYPE_F32 ? 4 : 2;
    const char *wp[16];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) wp[r] = (const char *)w + (r < valid ? r : valid - 1) * w_row_bytes;
    /* Lane order of a result vector is r * B + b; rows of y want b * R + r. */
    int32_t order[16];
    for (int b = 0; b < B; b++)
        for (int r = 0; r < R; r++) order[b * R + r] = r * B + b;
    const __m512i to_rows = _mm512_loadu_si512(order);
    float bias16[16] = {0};
    if (bias)
        for (int b = 0; b < B; b++)
            for (int r = 0; r < valid; r++) bias16[b * R + r] = bias[r];
    const __m512 bias_v = _mm512_loadu_ps(bias16);
    const __mmask16 tail = gy_simd_mask(L % 16);
    for (int64_t g = 0; g < n_groups; g++) {
        const float *xg = x + g * B * ldx;
        __m512 stack[7];
        __m512 res = _mm512_setzero_ps();
        for (int32_t c = 0; c < k_splits; c++) {
            __m512 acc[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            const int64_t k0 = c * L, k_end = k0 + L - L % 16;
            int64_t k = k0;
            for (; k < k_end; k += 16) {
                __m512 xv[16];
                /* With several activation rows they stream from L2 (W stays in L1): fetch ahead. */
                if (B > 1)
#pragma GCC unroll 16
                    for (int b = 0; b < B; b++)
                        _mm_prefetch((const char *)(xg + b * ldx + k) + 256, _MM_HINT_T0);
#pragma GCC unroll 16
                for (int b = 0; b < B; b++) xv[b] = _mm512_loadu_ps(xg + b * ldx + k);
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) {
                    const __m512 wv = gy_simd_load_w(wp[r], k, dtype);
#pragma GCC unroll 16
                    for (int b = 0; b < B; b++)
                        acc[r * B + b] = _mm512_fmadd_ps(wv, xv[b], acc[r * B + b]);
                }
            }
            if (tail) {
                __m512 xv[16];
#pragma GCC unroll 16
                for (int b = 0; b < B; b++) xv[b] = _mm512_maskz_loadu_ps(tail, xg + b * ldx + k);
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) {
                    const __m512 wv = gy_simd_load_w_mask(wp[r], k, dtype, tail);
#pragma GCC unroll 16
                    for (int b = 0; b < B; b++)
                        acc[r * B + b] = _mm512_fmadd_ps(wv, xv[b], acc[r * B + b]);
                }
            }
            res = gy_simd_lane_tree16(acc);
            int l = 0;
            for (; (c >> l) & 1; l++) res = _mm512_add_ps(stack[l], res);
            stack[l] = res;
        }
        res = _mm512_permutexvar_ps(to_rows, res);
        if (bias) res = _mm512_add_ps(res, bias_v);
        float *yg = y + g * B * ldy;
        if (R == 16) {
            _mm512_mask_storeu_ps(yg, gy_simd_mask(valid), res);
        } else if (R == 8) {
            const __mmask8 m = (__mmask8)gy_simd_mask(valid);
            _mm256_mask_storeu_ps(yg, m, _mm512_castps512_ps256(res));
            _mm256_mask_storeu_ps(yg + ldy, m, _mm512_extractf32x8_ps(res, 1));
        } else {
            const __mmask8 m = (__mmask8)gy_simd_mask(valid);
            _mm_mask_storeu_ps(yg, m, _mm512_castps512_ps128(res));
            _mm_mask_storeu_ps(yg + ldy, m, _mm512_extractf32x4_ps(res, 1));
            _mm_mask_storeu_ps(yg + 2 * ldy, m, _mm512_extractf32x4_ps(res, 2));
            _mm_mask_storeu_ps(yg + 3 * ldy, m, _mm512_extractf32x4_ps(res, 3));
        }
    }
    (void)esize;
}

#define GY_DOT_ROWS_VARIANT(NAME, DTYPE, R)                                                        \
    static void NAME(float *y, int64_t ldy, const float *bias, const void *w, int64_t wrb,         \
                     int32_t valid, const float *x, int64_t ldx, int64_t g, int64_t len,           \
                     int32_t ks) {                                                                 \
        gy_dot_rows16_avx512(y, ldy, bias, w, wrb, DTYPE, R, valid, x, ldx, g, len, ks);           \
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
                               int64_t wrb, int32_t valid, const float *x, int64_t ldx, int64_t g,
                               int64_t len, int32_t ks);
static const gy_dot_rows_fn gy_dot_rows[GY_DTYPE_COUNT][3] = {
    [GY_DTYPE_F32] = {gy_dot_rows_f32_16, gy_dot_rows_f32_8, gy_dot_rows_f32_4},
    [GY_DTYPE_F16] = {gy_dot_rows_f16_16, gy_dot_rows_f16_8, gy_dot_rows_f16_4},
    [GY_DTYPE_BF16] = {gy_dot_rows_bf16_16, gy_dot_rows_bf16_8, gy_dot_rows_bf16_4},
};
#endif

void gy_dot_rows16(float *y, int64_t ldy, const float *bias, const void *w, int64_t w_row_bytes,
                   gy_dtype w_dtype, int32_t n_w, int32_t valid_rows, const float *x, int64_t ldx,
                   int64_t n_groups, int64_t len, int32_t k_splits) {
    if (n_groups <= 0 || valid_rows <= 0) return;
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        const int shape = n_w == 16 ? 0 : n_w == 8 ? 1 : 2;
        gy_dot_rows[w_dtype][shape](y, ldy, bias, w, w_row_bytes, valid_rows, x, ldx, n_groups, len,
                                    k_splits);
        return;
    }
#endif
    gy_dot_rows16_portable(y, ldy, bias, w, w_row_bytes, w_dtype, n_w, valid_rows, x, ldx,
                           n_groups, len, k_splits);
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
