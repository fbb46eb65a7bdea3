/* model_ops.h: the elementwise and row kernels of a Llama layer (rmsnorm.cu, rope.cu, silu_mul.cu,
 * residual_add.cu, embedding.cu) and of a mixture of experts (moe_combine.cu).
 * The conventions of every kernel header are in kernels.h. Only declared when gyges is built with
 * CUDA (GY_WITH_CUDA). */
#ifndef GY_KERNELS_MODEL_OPS_H
#define GY_KERNELS_MODEL_OPS_H

#include "../core/dtype.h"
#include "device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- model kernels (Llama, HF conventions) ---- */

/* rmsnorm.cu: out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), HF LlamaRMSNorm: the normalised row
 * is rounded to the activation dtype before the weight multiplies it.
 *   out, x: (rows, dim) act_dtype (out may be x)   w: (dim) w_dtype */
gy_status gy_cuda_rmsnorm(void *out, const void *x, const void *w, int64_t rows, int64_t dim,
                          float eps, gy_dtype act_dtype, gy_dtype w_dtype, gy_cuda_stream stream);

/* rope.cu: rotary embedding in place, HF rotate_half convention (the two halves of a head are
 * the pairs): for i < half = head_dim/2, angle = position * inv_freq[i] (fp32),
 * cos = mscale cos(angle), sin = mscale sin(angle),
 *   x[i] <- x[i] cos - x[i + half] sin,   x[i + half] <- x[i + half] cos + x[i] sin
 *   q: (n_tokens, n_q_heads, head_dim)  k: (n_tokens, n_kv_heads, head_dim), dtype; k may be NULL
 *   positions: (n_tokens) int32; head_dim even; inv_freq: (head_dim / 2) fp32, device memory
 *   (gy_model's rope_inv_freq_dev); mscale finite and > 0 */
gy_status gy_cuda_rope(void *q, void *k, const int32_t *positions, int64_t n_tokens,
                       int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                       const float *inv_freq, float mscale, gy_dtype dtype,
                       gy_cuda_stream stream);

/* silu_mul.cu: out[r, j] = silu(x[r, j]) * x[r, dim + j], the fused gate_up convention.
 *   out: (rows, dim)  x: (rows, 2 * dim), both dtype */
gy_status gy_cuda_silu_mul(void *out, const void *x, int64_t rows, int64_t dim, gy_dtype dtype,
                           gy_cuda_stream stream);

/* residual_add.cu: out[i] = a[i] + b[i]; out may be a or b.  out, a, b: (n) dtype */
gy_status gy_cuda_residual_add(void *out, const void *a, const void *b, int64_t n, gy_dtype dtype,
                               gy_cuda_stream stream);

/* embedding.cu: out[t] = table[ids[t]], widened or rounded to out_dtype; ids outside [0, vocab)
 * give a row of zeros.
 *   out: (n_tokens, dim) out_dtype  table: (vocab, dim) table_dtype  ids: (n_tokens) int32 */
gy_status gy_cuda_embedding(void *out, const void *table, const int32_t *ids, int64_t n_tokens,
                            int64_t vocab, int64_t dim, gy_dtype out_dtype, gy_dtype table_dtype,
                            gy_cuda_stream stream);

/* moe_combine.cu: a mixture-of-experts layer's weighted sum of each token's k expert rows
 * (csrc/cpu/moe.h's grouping), then a shared expert's row behind its sigmoid gate, all fp32:
 *   out[t] = (accumulate ? out[t] : 0) + (sum over r = 0 .. k-1, from +0 in r order, of
 *            weight[t, r] * ys[slot[t, r]]) + sigmoid(gate[t]) * shared[t]
 *   out, shared: (n, dim)  ys: (rows, dim)  weight, slot: (n, k) fp32, int32  gate: (n)
 * shared may be NULL (no shared expert) and gate NULL (its weight is 1); out must not overlap
 * the rest. */
gy_status gy_cuda_moe_combine(float *out, const float *ys, const float *weight,
                              const int32_t *slot, const float *shared, const float *gate,
                              int64_t n, int64_t k, int64_t dim, int accumulate,
                              gy_cuda_stream stream);

#ifdef __cplusplus
}
#endif
#endif
