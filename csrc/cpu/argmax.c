/* argmax.c: two passes per row, both vectorisable: the maximum (exact whatever the order), then
 * the first index holding it. */
#include "argmax.h"

#include <math.h>
#include <stddef.h>

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
