/* norm.h: RMSNorm, out = x / sqrt(mean(x^2) + eps) * weight (Llama / Qwen2 convention).
 *
 * The sum of squares uses the fixed 16-lane order of dot.h (gy_dot_ref(x, x)), so a row's result
 * depends only on that row; then r = 1 / sqrtf(ss / dim + eps) and out[i] = (x[i] * r) * w[i]. */
#ifndef GY_CPU_NORM_H
#define GY_CPU_NORM_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out [n, dim] = rmsnorm(x [n, dim]) * weight [dim]; out may equal x. */
gy_status gy_cpu_rmsnorm(float *out, const float *x, const float *weight, int64_t n, int64_t dim,
                         float eps);

#ifdef __cplusplus
}
#endif
#endif
