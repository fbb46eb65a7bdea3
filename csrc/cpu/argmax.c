/* argmax.c: two passes per row, both vectorisable: the maximum (exact whatever the order), then
 * the first index holding it. */
#include "argmax.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "isa.h"
#include "simd.h"

#if GY_CPU_HAVE_AVX512
static int32_t gy_argmax_row_avx512(const float *v, int64_t vocab) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < vocab; i += 16) /* max_ps(v, m) keeps m when v is NaN */
        m = _mm512_max_ps(_mm512_mask_loadu_ps(m, gy_simd_mask(vocab - i), v + i), m);
    const float best = _mm512_reduce_max_ps(m);
    const __m512 bv = _mm512_set1_ps(best);
    for (int64_t i = 0; i < vocab; i += 16) {
        const __mmask16 in = gy_simd_mask(vocab - i);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, v + i), bv, _CMP_EQ_OQ);
        if (hit) return (int32_t)(i + __builtin_ctz(hit));
    }
    return 0;
}
#endif

gy_status gy_cpu_argmax(int32_t *out, const float *logits, int64_t n, int64_t vocab) {
    if (n < 0 || vocab <= 0 || vocab > INT32_MAX)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_argmax: need n >= 0 and vocab in [1, 2^31) "
                       "(n=%lld vocab=%lld)", (long long)n, (long long)vocab);
    if (n == 0) return GY_OK;
    if (out == NULL || logits == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_argmax: NULL buffer");
    for (int64_t r = 0; r < n; r++) {
        const float *v = logits + r * vocab;
#if GY_CPU_HAVE_AVX512
        if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
            out[r] = gy_argmax_row_avx512(v, vocab);
            continue;
        }
#endif
        /* The maximum over 16 lanes (exact in any order; the lanes let the compiler vectorise),
         * then the first index that holds it, 16 at a time. NaN never wins a comparison. */
        float lanes[16];
        for (int l = 0; l < 16; l++) lanes[l] = -INFINITY;
        int64_t i = 0;
        for (; i + 16 <= vocab; i += 16)
            for (int l = 0; l < 16; l++) lanes[l] = v[i + l] > lanes[l] ? v[i + l] : lanes[l];
        for (; i < vocab; i++) lanes[0] = v[i] > lanes[0] ? v[i] : lanes[0];
        float best = lanes[0];
        for (int l = 1; l < 16; l++) best = lanes[l] > best ? lanes[l] : best;
        int32_t idx = 0;
        for (i = 0; i < vocab; i += 16) {
            const int64_t m = vocab - i < 16 ? vocab - i : 16;
            int hit = 0;
            for (int64_t l = 0; l < m; l++) hit |= v[i + l] == best;
            if (hit) {
                for (int64_t l = 0; l < m; l++)
                    if (v[i + l] == best) {
                        idx = (int32_t)(i + l);
                        break;
                    }
                break;
            }
        }
        out[r] = idx;
    }
    return GY_OK;
}

/* Per lane: the first index holding the lane's maximum (a strict > never moves it to a later tie),
 * and whether a NaN or +inf was seen; then the lowest index among the lanes holding the row's
 * maximum. -inf never becomes a lane maximum, so a lane that saw only -inf keeps -inf. */
int gy_cpu_argmax_checked(const float *v, int64_t vocab, int64_t *argmax) {
    if (vocab <= 0) return 1;
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512 && vocab <= INT32_MAX) {
        /* Four independent sets of lanes (blocks of 16 in turn), so that the compare-and-select
         * chains overlap; the lowest index over every set's lanes holding the maximum is the
         * row's first maximum. */
        const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
        const __m512i step = _mm512_set1_epi32(16);
        __m512 m[4];
        __m512i idx[4], at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int a = 0; a < 4; a++) {
            m[a] = neg_inf;
            idx[a] = _mm512_setzero_si512();
        }
        __mmask16 bad = 0;
        for (int64_t i = 0; i < vocab; i += 64)
#pragma GCC unroll 4
            for (int a = 0; a < 4; a++, at = _mm512_add_epi32(at, step)) {
                const int64_t j = i + 16 * a;
                if (j >= vocab) break;
                const __m512 x = j + 16 <= vocab
                                     ? _mm512_loadu_ps(v + j)
                                     : _mm512_mask_loadu_ps(neg_inf, gy_simd_mask(vocab - j), v + j);
                bad |= _mm512_fpclass_ps_mask(x, 0x01 | 0x08 | 0x80); /* QNaN, +inf, SNaN */
                const __mmask16 gt = _mm512_cmp_ps_mask(x, m[a], _CMP_GT_OQ);
                m[a] = _mm512_mask_mov_ps(m[a], gt, x);
                idx[a] = _mm512_mask_mov_epi32(idx[a], gt, at);
            }
        const __m512 top = _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
        const float best = _mm512_reduce_max_ps(top);
        if (bad || best == -INFINITY) return 1;
        const __m512 bv = _mm512_set1_ps(best);
        int32_t first = INT32_MAX;
        for (int a = 0; a < 4; a++) {
            const __mmask16 hit = _mm512_cmp_ps_mask(m[a], bv, _CMP_EQ_OQ);
            if (hit) {
                const int32_t f = _mm512_mask_reduce_min_epi32(hit, idx[a]);
                first = f < first ? f : first;
            }
        }
        *argmax = first;
        return 0;
    }
#endif
    float m[16];
    int64_t idx[16] = {0};
    int bad = 0;
    for (int l = 0; l < 16; l++) m[l] = -INFINITY;
    for (int64_t i = 0; i < vocab; i += 16)
        for (int l = 0; l < 16 && i + l < vocab; l++) {
            const float x = v[i + l];
            bad |= isnan(x) || x == INFINITY;
            if (x > m[l]) {
                m[l] = x;
                idx[l] = i + l;
            }
        }
    float best = m[0];
    for (int l = 1; l < 16; l++) best = m[l] > best ? m[l] : best;
    if (bad || best == -INFINITY) return 1;
    int64_t first = INT64_MAX;
    for (int l = 0; l < 16; l++)
        if (m[l] == best && idx[l] < first) first = idx[l];
    *argmax = first;
    return 0;
}
