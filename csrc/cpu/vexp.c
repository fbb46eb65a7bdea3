/* vexp.c: the deterministic exponential over an array. */
#include "vexp.h"

#include "isa.h"
#include "simd.h"

gy_status gy_cpu_exp(float *out, const float *in, int64_t n) {
    if (n < 0) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_exp: negative count %lld", (long long)n);
    if (n > 0 && (out == NULL || in == NULL)) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_exp: NULL buffer");
    int64_t i = 0;
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, gy_simd_exp(_mm512_loadu_ps(in + i)));
        if (i < n) {
            const __mmask16 m = gy_simd_mask(n - i);
            _mm512_mask_storeu_ps(out + i, m, gy_simd_exp(_mm512_maskz_loadu_ps(m, in + i)));
        }
        return GY_OK;
    }
#endif
    for (; i < n; i++) out[i] = gy_exp_ref(in[i]);
    return GY_OK;
}
