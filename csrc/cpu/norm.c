/* norm.c: RMSNorm with the fixed-order sum of squares. */
#include "norm.h"

#include <math.h>

#include "dot.h"
#include "isa.h"
#include "simd.h"

/* gy_dot_ref(x, x) over dim: one 16-lane chain and the lane tree, the same operations. */
static float gy_norm_sum_squares(const float *x, int64_t dim) {
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        __m512 acc = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        if (i < dim) { /* zero padding: fma(0, 0, acc) */
            const __m512 v = _mm512_maskz_loadu_ps(gy_simd_mask(dim - i), x + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        return gy_simd_lane_tree(acc);
    }
#endif
    return gy_dot_ref(x, GY_DTYPE_F32, x, dim);
}

gy_status gy_cpu_rmsnorm(float *out, const float *x, const float *weight, int64_t n, int64_t dim,
                         float eps) {
    if (n < 0 || dim <= 0)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rmsnorm: need n >= 0 and dim > 0 (n=%lld dim=%lld)",
                       (long long)n, (long long)dim);
    if (!(eps >= 0.0f)) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rmsnorm: eps=%g must be >= 0", (double)eps);
    if (n == 0) return GY_OK;
    if (out == NULL || x == NULL || weight == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rmsnorm: NULL buffer");
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        const float ss = gy_norm_sum_squares(xr, dim);
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = (xr[i] * inv) * weight[i];
    }
    return GY_OK;
}
