/* sampling.h: the next token of each row of logits (argmax.cu, sample.cu).
 * The conventions of every kernel header are in kernels.h. Only declared when gyges is built with
 * CUDA (GY_WITH_CUDA). */
#ifndef GY_KERNELS_SAMPLING_H
#define GY_KERNELS_SAMPLING_H

#include "../core/dtype.h"
#include "../core/sampler_params.h"
#include "device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* argmax.cu: out[r] = index of the largest logits[r, :]; the first one on ties; NaN counts as
 * larger than any number (like torch.argmax).
 *   out: (rows) int32  logits: (rows, vocab) dtype, vocab < 2^31 */
gy_status gy_cuda_argmax(int32_t *out, const void *logits, int64_t rows, int64_t vocab,
                         gy_dtype dtype, gy_cuda_stream stream);

/* sample.cu: the next token of each row, with the algorithm, order of operations and random
 * stream of csrc/sched/sampler.c (temperature, min-p, top-k, top-p, Philox draw at (seed,
 * token_index)): for fp32 logits the same token as gy_sampler_sample_batch except when a draw or a
 * top-p boundary lies within a few double ulps (sample.cu says why); 16-bit logits are widened.
 *   tokens:      (rows) int32; -1 for a row the CPU sampler would refuse (NaN or +inf logit, only
 *                -inf, parameters out of range) and for a sampled row without a workspace
 *   logits:      (rows, vocab) dtype, vocab < 2^31
 *   params:      (rows) gy_sampler_params, device (check them with gy_sampler_check first)
 *   token_index: (rows) int64, the index of the token being sampled in its request
 *   workspace:   gy_cuda_sample_workspace_bytes(rows, vocab) bytes, 8-byte aligned; may be NULL
 *                when every row is greedy (temperature 0) */
gy_status gy_cuda_sample_check(gy_dtype dtype, int64_t rows, int64_t vocab);
int64_t gy_cuda_sample_workspace_bytes(int64_t rows, int64_t vocab);
gy_status gy_cuda_sample(int32_t *tokens, const void *logits, gy_dtype dtype, int64_t rows,
                         int64_t vocab, const gy_sampler_params *params,
                         const int64_t *token_index, void *workspace, int64_t workspace_bytes,
                         gy_cuda_stream stream);

#ifdef __cplusplus
}
#endif
#endif
