/* activation.h: the elementwise steps of a decoder layer.
 *
 * SwiGLU uses the deterministic exponential of vexp.h: out = (g / (1 + exp(-g))) * up, the same
 * bits on the AVX-512 and portable paths. */
#ifndef GY_CPU_ACTIVATION_H
#define GY_CPU_ACTIVATION_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out [count] = silu(gate) * up; out may equal gate or up. */
gy_status gy_cpu_swiglu(float *out, const float *gate, const float *up, int64_t count);

/* out [count] = a + b (the residual connection); out may equal a or b. */
gy_status gy_cpu_add(float *out, const float *a, const float *b, int64_t count);

#ifdef __cplusplus
}
#endif
#endif
