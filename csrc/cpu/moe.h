/* moe.h: a mixture-of-experts layer's router, and the bookkeeping that runs its experts grouped
 * (the tokens of one expert gathered into a run of rows, one GEMM each, the rows combined back).
 *
 * DETERMINISM CONTRACT
 *  1. A token's choice depends only on its own router logits: its k experts are those of highest
 *     logit, best first, ties to the lower expert index (a NaN logit is never chosen over a number
 *     after it); its weights are their softmax probabilities over all experts (the maximum
 *     subtracted, exp and the sum in double, in expert order), divided by the sum of the chosen
 *     ones when `norm_topk`, rounded to float once.
 *  2. gy_cpu_moe_combine adds a token's k rows in its rank order (best first) from +0, each times
 *     its weight: the bits depend on the token's own rows and weights only. With linear.h's rows
 *     being independent, a token's output never depends on which other tokens share the batch or
 *     an expert's GEMM. */
#ifndef GY_CPU_MOE_H
#define GY_CPU_MOE_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* choice [n, k] expert ids and weight [n, k] from logits [n, n_experts] (1 <= k <= n_experts). */
gy_status gy_cpu_moe_route(int32_t *choice, float *weight, const float *logits, int64_t n,
                           int64_t n_experts, int64_t k, int norm_topk);

/* The grouping of the n * k (token, rank) pairs by expert, a counting sort: the slots
 * [offsets[e], offsets[e + 1]) are expert e's, its tokens in increasing order; token_of [n * k]
 * the token of each slot; slot_of [n * k] the slot of token t's rank r choice at t * k + r.
 * offsets [n_experts + 1]. */
gy_status gy_cpu_moe_group(int64_t *offsets, int32_t *token_of, int32_t *slot_of,
                           const int32_t *choice, int64_t n, int64_t n_experts, int64_t k);

/* xs [rows, dim]: row j = x [token_of[j], :]. */
gy_status gy_cpu_moe_gather(float *xs, const float *x, const int32_t *token_of, int64_t rows,
                            int64_t dim);

/* out [n, dim] = sum over r = 0 .. k-1 of weight[t, r] * ys[slot_of[t * k + r], :], from +0 in r
 * order. out must not overlap ys. */
gy_status gy_cpu_moe_combine(float *out, const float *ys, const float *weight,
                             const int32_t *slot_of, int64_t n, int64_t k, int64_t dim);

/* out [n, dim] += sigmoid(gate[t]) * y [n, dim] (Qwen2-MoE's shared expert); gate [n] or NULL
 * (a weight of 1). */
gy_status gy_cpu_moe_add_gated(float *out, const float *y, const float *gate, int64_t n,
                               int64_t dim);

#ifdef __cplusplus
}
#endif
#endif
