/* sampler.h: the next token from fp32 logits, vLLM's way: temperature, then min-p, then top-k,
 * then top-p, then a draw. The draw's randomness is gy_rng_uniform(seed, token_index), so a request samples
 * the same token for the same (seed, token index, logits) whatever batch it is in and however
 * often it was preempted and recomputed.
 *
 * For one row of logits x (V):
 *   temperature == 0: greedy, the lowest index among the maxima (top_k/top_p ignored).
 *   otherwise w_i = exp((x_i - max x) / temperature) (in double; -inf logits give 0);
 *   min-p (0 = off): w_i = 0 where w_i < min_p, i.e. where the probability is below min_p times
 *     the largest probability (the largest w is exp(0) = 1);
 *   top-k (0 = off): keep the k tokens ranked first by (logit descending, index ascending);
 *   top-p (1 = off): over the survivors in that rank order, keep the shortest prefix whose sum of
 *     w (summed sequentially in rank order) reaches top_p * (sum of the survivors' w);
 *   draw: u = gy_rng_uniform(seed, token_index, GY_RNG_STREAM_SAMPLE); walking tokens in index
 *     order, the first kept token whose running sum of w exceeds u * (sum of kept w).
 * Ranking by logit rather than by w keeps ties exact: dividing by the same temperature in double
 * preserves the strict order of distinct floats.
 * Logits that are NaN or +inf are refused; a row needs one finite logit. */
#ifndef GY_SCHED_SAMPLER_H
#define GY_SCHED_SAMPLER_H

#include <stdint.h>

#include "../core/sampler_params.h" /* gy_sampler_params, shared with the CUDA sampler */
#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* GY_ERR_INVALID naming the bad field when the params are out of range for `vocab`. */
gy_status gy_sampler_check(const gy_sampler_params *params, int64_t vocab);

/* The distribution the draw uses: probs_out (vocab) sums to 1, zero outside the kept set
 * (one-hot for greedy). For tests and for reporting log-probabilities. */
gy_status gy_sampler_probs(double *probs_out, const float *logits, int64_t vocab,
                           const gy_sampler_params *params);

/* One row: logits (vocab). */
gy_status gy_sampler_sample(int32_t *token_out, const float *logits, int64_t vocab,
                            const gy_sampler_params *params, int64_t token_index);

/* n rows: tokens_out (n); logits (n, vocab) row-major; params (n); token_index (n). Every row's
 * params are checked before any work, and a failure names the row. */
gy_status gy_sampler_sample_batch(int32_t *tokens_out, const float *logits, int64_t n,
                                  int64_t vocab, const gy_sampler_params *params,
                                  const int64_t *token_index);

#ifdef __cplusplus
}
#endif
#endif
