/* activation.c: SwiGLU and the residual add. */
#include "activation.h"

#include "isa.h"
#include "simd.h"
#include "vexp.h"

gy_status gy_cpu_swiglu(float *out, const float *gate, const float *up, int64_t count) {
    if (count < 0) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_swiglu: negative count %lld", (long long)count);
    if (count == 0) return GY_OK;
    if (out == NULL || gate == NULL || up == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_swiglu: NULL buffer");
    int64_t i = 0;
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i < count; i += 16) {
            const __mmask16 m = gy_simd_mask(count - i);
            const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
            const __m512 u = _mm512_maskz_loadu_ps(m, up + i);
            const __m512 e = gy_simd_exp(_mm512_xor_ps(g, _mm512_set1_ps(-0.0f))) /* -g */;
            const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
            _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, u));
        }
        return GY_OK;
    }
#endif
    for (; i < count; i++) {
        const float g = gate[i];
        out[i] = (g / (1.0f + gy_exp_ref(-g))) * up[i];
    }
    return GY_OK;
}

gy_status gy_cpu_add(float *out, const float *a, const float *b, int64_t count) {
    if (count < 0) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_add: negative count %lld", (long long)count);
    if (count == 0) return GY_OK;
    if (out == NULL || a == NULL || b == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_add: NULL buffer");
    for (int64_t i = 0; i < count; i++) out[i] = a[i] + b[i];
    return GY_OK;
}
