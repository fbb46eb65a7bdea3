/* norm.c: RMSNorm with the fixed-order sum of squares. */
#include "norm.h"

#include <math.h>

#include "dot.h"

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
        const float ss = gy_dot_ref(xr, GY_DTYPE_F32, xr, dim);
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = (xr[i] * inv) * weight[i];
    }
    return GY_OK;
}
