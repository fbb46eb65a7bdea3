/* rope.h: rotary position embedding, Hugging Face Llama convention (rotate_half).
 *
 * For a head vector x [head_dim] at position p, with half = head_dim / 2 and i < half:
 *   out[i]        = fma(x[i], cos[p][i], -(x[i + half] * sin[p][i]))
 *   out[i + half] = fma(x[i + half], cos[p][i], x[i] * sin[p][i])
 * where cos/sin[p][i] = mscale * cos/sin(p * inv_freq[i]), computed in double and rounded once
 * (gy_cpu_rope_table). The frequencies are data (gyges/models/rope.py computes them, scaled or
 * not, from the model's config); unscaled, inv_freq[i] = theta^(-2i / head_dim) and mscale = 1
 * (gy_cpu_rope_inv_freq). The second product is rounded, the first is fused: written as fmaf so
 * that no compiler contraction setting can change the bits. */
#ifndef GY_CPU_ROPE_H
#define GY_CPU_ROPE_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The unscaled frequencies: inv_freq[i] = pow(theta, -(2i) / head_dim) for i < head_dim / 2
 * (inv_freq: [head_dim / 2]); head_dim even, theta > 0 and finite. */
gy_status gy_cpu_rope_inv_freq(double *inv_freq, int64_t head_dim, double theta);

/* Fills cos_table and sin_table [max_pos, head_dim / 2] with mscale * cos/sin(p * inv_freq[i]);
 * inv_freq: [head_dim / 2], each finite and > 0; mscale finite and > 0; head_dim even. */
gy_status gy_cpu_rope_table(float *cos_table, float *sin_table, int64_t max_pos, int64_t head_dim,
                            const double *inv_freq, double mscale);

/* Rotates x [n, n_heads, head_dim] in place; token t is at positions[t] in [0, max_pos). */
gy_status gy_cpu_rope(float *x, const int32_t *positions, const float *cos_table,
                      const float *sin_table, int64_t n, int64_t n_heads, int64_t head_dim,
                      int64_t max_pos);

#ifdef __cplusplus
}
#endif
#endif
