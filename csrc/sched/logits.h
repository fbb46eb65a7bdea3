/* logits.h: what happens to a row of logits around the sampler (sampler.h), vLLM's way: the
 * penalties and min_tokens before it, the log-probabilities of the raw row beside it.
 *
 * Order (vLLM v1): penalties and min_tokens here, then the sampler's temperature, min-p, top-k,
 * top-p and draw. All of it is a pure function of (row, the request's tokens, its params), so a
 * request's tokens stay independent of the batch, the plan and every move between instances.
 *
 * Penalties, for a row x (V) of a request whose tokens are prompt (P) then output (G):
 *   repetition_penalty rp, over tokens in prompt or output: x_i > 0 -> x_i / rp, else x_i * rp;
 *   frequency_penalty fp and presence_penalty pp, over OUTPUT tokens only, c_i = count of i:
 *     x_i -= fp * c_i + pp * (c_i > 0).
 *   Each x_i is computed in double and rounded to float once (a NumPy float64 reference gives
 *   the same floats).
 * min_tokens: while G < min_tokens, every stop token (EOS unless ignored, and stop_token_ids:
 *   the engine's list) gets -inf.
 *
 * Log-probabilities are of the RAW logits (vLLM's default "raw_logprobs"): log_softmax in
 * double, lp_i = x_i - max x - log(sum_j exp(x_j - max x)). A token's rank is 1 + the number of
 * tokens with a strictly larger logit; the top k are ranked by (logit descending, index
 * ascending). */
#ifndef GY_SCHED_LOGITS_H
#define GY_SCHED_LOGITS_H

#include <stdint.h>

#include "../core/sampler_params.h"
#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* vLLM's cap on logprobs and prompt_logprobs. */
#define GY_LOGPROBS_MAX 20

/* One scored token of a row: its log-probability and rank, and the row's top n_top. */
typedef struct gy_logprobs {
    double logprob;                        /* of the scored token; -inf when its logit is */
    int64_t rank;                          /* 1 = most likely */
    int32_t n_top;                         /* [0, GY_LOGPROBS_MAX] */
    int32_t top_tokens[GY_LOGPROBS_MAX];   /* (n_top) most likely first */
    double top_logprobs[GY_LOGPROBS_MAX];  /* (n_top) */
} gy_logprobs;

/* Whether the params or min_tokens change a row at all (the engine copies only those rows). */
int gy_logits_active(const gy_sampler_params *params, int64_t n_output, int64_t min_tokens);

/* Applies the penalties and min_tokens to logits (vocab) in place. tokens (n_tokens): the
 * request's prompt (prompt_len) then its output; stop (n_stop): the tokens min_tokens holds
 * back; counts (vocab): int32 scratch, all zero on entry and left so. Tokens outside the
 * vocabulary are refused (GY_ERR_INVALID). */
gy_status gy_logits_process(float *logits, int64_t vocab, const int32_t *tokens, int64_t n_tokens,
                            int64_t prompt_len, const gy_sampler_params *params,
                            int64_t min_tokens, const int32_t *stop, int64_t n_stop,
                            int32_t *counts);

/* out: token's log-probability and rank in the raw row logits (vocab), and the top k
 * (0 <= k <= GY_LOGPROBS_MAX). */
gy_status gy_logits_logprobs(gy_logprobs *out, const float *logits, int64_t vocab, int32_t token,
                             int32_t k);

#ifdef __cplusplus
}
#endif
#endif
