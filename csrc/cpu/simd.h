/* simd.h: AVX-512 building blocks shared by the kernel files (private to csrc/cpu).
 *
 * Each helper performs exactly the IEEE operations of the portable definition it mirrors (see
 * dot.h for the lane tree, vexp.h for the exponential), so the two paths agree bit for bit. */
#ifndef GY_CPU_SIMD_H
#define GY_CPU_SIMD_H

#include "../core/dtype.h"
#include "isa.h"
#include "vexp.h"

#if GY_CPU_HAVE_AVX512
#include <immintrin.h>

#define GY_INLINE static inline __attribute__((always_inline))

/* Keeps a loaded vector in a register: without it the compiler may fold the load into each FMA
 * that uses it, loading the same data once per use. */
#define GY_SIMD_IN_REGISTER(v) __asm__("" : "+v"(v))

/* Mask of the first n lanes, n in [0, 16]. */
GY_INLINE __mmask16 gy_simd_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

/* 16 weights starting at element k of p, widened exactly to fp32 (masked lanes are 0). */
GY_INLINE __m512 gy_simd_load_w(const void *p, int64_t k, gy_dtype dtype) {
    if (dtype == GY_DTYPE_F32) return _mm512_loadu_ps((const float *)p + k);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + k));
    if (dtype == GY_DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

GY_INLINE __m512 gy_simd_load_w_mask(const void *p, int64_t k, gy_dtype dtype, __mmask16 m) {
    if (dtype == GY_DTYPE_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + k);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + k);
    if (dtype == GY_DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* The halving lane tree of dot.h on one vector. */
GY_INLINE float gy_simd_lane_tree(__m512 v) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* The lane tree of 16 vectors at once: lane i of the result is gy_simd_lane_tree(a[i]), with the
 * same additions, done as a transpose so that each level is one add per two vectors. */
GY_INLINE __m512 gy_simd_lane_tree16(const __m512 a[16]) {
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; k++) /* lanes 0-7: a[2k] s8, lanes 8-15: a[2k+1] s8 */
        t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; m++) /* quad j: a[4m + j] s4 */
        u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int p = 0; p < 2; p++) /* quad j: a[8p + j] s2[0..1], a[8p + 4 + j] s2[0..1] */
        w[p] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4j + m: a[j + 4m] */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
}

/* The same for 8 vectors: lane i of the result is gy_simd_lane_tree(a[i]), with the same
 * additions as gy_simd_lane_tree16 (its first three levels on half as many vectors). */
GY_INLINE __m256 gy_simd_lane_tree8(const __m512 a[8]) {
    __m512 t[4], u[2];
    for (int k = 0; k < 4; k++)
        t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 2; m++)
        u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* quad j: a[j] s2[0..1], a[4 + j] s2[0..1] */
    const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4j: a[j], lane 4j + 1: a[4 + j] */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w, w, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(w, w, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r));
}


/* gy_exp_ref on 16 lanes: the same operations in the same order. */
GY_INLINE __m512 gy_simd_exp(__m512 x) {
    __m512 xc = _mm512_min_ps(x, _mm512_set1_ps(GY_EXP_HI)); /* NaN lanes take HI */
    xc = _mm512_max_ps(xc, _mm512_set1_ps(GY_EXP_LO));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(GY_EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-GY_EXP_C1), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(GY_EXP_C2), r);
    const __m512 z = _mm512_mul_ps(r, r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(GY_EXP_P0), r, _mm512_set1_ps(GY_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GY_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GY_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GY_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GY_EXP_P5));
    p = _mm512_fmadd_ps(p, z, r);
    p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
    const __m512i ni = _mm512_cvtps_epi32(n);
    const __m512i n1 = _mm512_srai_epi32(ni, 1);
    const __m512i n2 = _mm512_sub_epi32(ni, n1);
    const __m512i bias = _mm512_set1_epi32(127);
    const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
    const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
    const __m512 res = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), res, x);
}

#endif /* GY_CPU_HAVE_AVX512 */
#endif
