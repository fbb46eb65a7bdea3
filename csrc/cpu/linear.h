/* linear.h: y = x @ W^T (+ bias), the projections of a decoder layer and the lm_head.
 *
 * Two storage orders of the weight (fp32, bf16 or f16, widened exactly on the fly):
 *   gy_cpu_linear    W [out, in] row-major: Hugging Face orientation (q/k/v/o/gate/up, lm_head).
 *   gy_cpu_linear_t  W [in, out] row-major: the transposed form (the padded FFN down projection),
 *                    so that a tensor-parallel shard of the reduction dimension is a contiguous
 *                    run of rows.
 * The two forms use different (each fixed) summation orders and are not bit-identical to each
 * other; a weight is always used through one of them. Performance: at batch 1 both stream W once
 * per call near the memory read bandwidth (16-row tiles that fetch the next tile as they go; one
 * FMA chain per output vector of a column range). In batches W is still read once per call:
 * gy_cpu_linear packs x (dot.h) and runs 8-row tiles of W against 3 rows of x at a time (24
 * accumulators, each one pair's 16-lane chain); gy_cpu_linear_t runs register tiles of 4 rows of x
 * by up to 6 output vectors over k-blocks of W that stay in L1 while every row of x passes. The
 * tile shapes change the speed, never the bits.
 *
 * DETERMINISM CONTRACT (both forms)
 *  1. Rows are independent: y[r, :] depends only on x[r, :], W and bias, bit for bit: not on n,
 *     not on the other rows, not on the thread count or the pool's timing (work is split by output
 *     columns, never along `in`).
 *  2. k-splits: `in` is cut into k_splits equal contiguous chunks (k_splits in
 *     [1, GY_LINEAR_MAX_K_SPLITS], a power of two for gy_cpu_linear, any for gy_cpu_linear_t;
 *     in % k_splits == 0). Chunk c's partial P_c covers
 *     in-indices [c*L, (c+1)*L), L = in / k_splits, in an order that starts at the chunk start and
 *     depends only on L:
 *       gy_cpu_linear:   the fixed 16-lane dot product of dot.h over the chunk (its lane
 *                        blocks start at the chunk start; bf16 has its own lane order);
 *       gy_cpu_linear_t: a sequential chain acc = fma(x[r, i], W[i, o], acc) from acc = +0 for i
 *                        increasing through the chunk.
 *     The partials are combined by the tree of core/tree.h, ((P0 + P1) + (P2 + P3)) for
 *     k_splits = 4, (P0 + P1) + P2 for 3, and the bias, if any, is added last: y = tree + bias[o].
 *  3. Hence tensor parallelism is exact. A TP-t worker holding the reduction shard s (in/t
 *     columns of x and the matching part of W) and calling with bias NULL and k_splits = K/t
 *     computes exactly the subtree of chunks [s*K/t, (s+1)*K/t) of a TP-1 call with k_splits = K;
 *     gy_cpu_add_tree over the t workers' results (in shard order), then gy_cpu_add_bias, gives
 *     the TP-1 result bit for bit when K/t is a power of two or t = 1 (gy_tree_split_ok). E.g.
 *     K = 4, t = 2: (P0+P1) and (P2+P3) -> ((P0+P1)+(P2+P3)); K = 3, t = 3: (P0 + P1) + P2.
 *  4. The AVX-512 and portable paths (isa.h) give the same bits.
 *
 * x and y must not overlap. A NULL pool runs on the calling thread. */
#ifndef GY_CPU_LINEAR_H
#define GY_CPU_LINEAR_H

#include <stdint.h>

#include "../core/dtype.h"
#include "threadpool.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_LINEAR_MAX_K_SPLITS 64

/* y [n, out] = x [n, in] @ w^T + bias, w [out, in] of w_dtype, bias [out] or NULL. */
gy_status gy_cpu_linear(float *y, const float *x, const void *w, gy_dtype w_dtype,
                        const float *bias, int64_t n, int64_t in, int64_t out, int32_t k_splits,
                        gy_threadpool *pool);

/* y [n, out] = x [n, in] @ wt + bias, wt [in, out] of w_dtype, bias [out] or NULL. */
gy_status gy_cpu_linear_t(float *y, const float *x, const void *wt, gy_dtype w_dtype,
                          const float *bias, int64_t n, int64_t in, int64_t out, int32_t k_splits,
                          gy_threadpool *pool);

/* out [n] = the tree of core/tree.h over parts[0..n_parts) (each [n]): ((p0 + p1) + (p2 + p3)),
 * (p0 + p1) + p2, ...; n_parts in [1, GY_LINEAR_MAX_K_SPLITS]; out may be one of the parts. */
gy_status gy_cpu_add_tree(float *out, const float *const *parts, int32_t n_parts, int64_t n);

/* y [n, out] += bias [out], row by row. */
gy_status gy_cpu_add_bias(float *y, const float *bias, int64_t n, int64_t out);

#ifdef __cplusplus
}
#endif
#endif
