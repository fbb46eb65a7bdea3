/* logits.c: penalties, min_tokens and log-probabilities of a row (logits.h). */
#include "logits.h"

#include <math.h>
#include <string.h>

int gy_logits_active(const gy_sampler_params *p, int64_t n_output, int64_t min_tokens) {
    const int rp = p->repetition_penalty != 0 && p->repetition_penalty != 1;
    return rp || p->frequency_penalty != 0 || p->presence_penalty != 0 || n_output < min_tokens;
}

gy_status gy_logits_process(float *x, int64_t V, const int32_t *tokens, int64_t n_tokens,
                            int64_t prompt_len, const gy_sampler_params *p, int64_t min_tokens,
                            const int32_t *stop, int64_t n_stop, int32_t *counts) {
    if (x == NULL || p == NULL || (n_tokens > 0 && (tokens == NULL || counts == NULL)) ||
        (n_stop > 0 && stop == NULL))
        return GY_FAIL(GY_ERR_INVALID, "gy_logits_process: NULL buffer");
    if (prompt_len < 0 || prompt_len > n_tokens)
        return GY_FAIL(GY_ERR_INVALID, "prompt_len %lld outside [0, %lld]", (long long)prompt_len,
                       (long long)n_tokens);
    for (int64_t i = 0; i < n_tokens; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return GY_FAIL(GY_ERR_INVALID, "token %lld is %d, outside the vocabulary [0, %lld)",
                           (long long)i, (int)tokens[i], (long long)V);
    const double rp = p->repetition_penalty == 0 ? 1.0 : p->repetition_penalty;
    const double fp = p->frequency_penalty, pp = p->presence_penalty;
    if (rp != 1 || fp != 0 || pp != 0) {
        /* counts[t]: 1 + its output count for every token seen (0 = unseen), so one pass over the
         * request's tokens finds both sets; a second pass applies each token once and clears. */
        for (int64_t i = 0; i < n_tokens; i++) {
            const int32_t t = tokens[i];
            if (counts[t] == 0) counts[t] = 1;
            if (i >= prompt_len) counts[t]++;
        }
        for (int64_t i = 0; i < n_tokens; i++) {
            const int32_t t = tokens[i];
            if (counts[t] == 0) continue; /* done already */
            const int32_t c = counts[t] - 1;
            double y = (double)x[t];
            if (rp != 1) y = y > 0 ? y / rp : y * rp;
            if (c > 0) y -= fp * (double)c + pp;
            x[t] = (float)y;
            counts[t] = 0;
        }
    }
    if (n_tokens - prompt_len < min_tokens)
        for (int64_t i = 0; i < n_stop; i++)
            if (stop[i] >= 0 && stop[i] < V) x[stop[i]] = -INFINITY;
    return GY_OK;
}

/* Smaller = ranked first: logit descending, then index ascending (NaN last). */
static int gy_logits_before(float a, int32_t i, float b, int32_t j) {
    if (a > b) return 1;
    if (a < b) return 0;
    if (a == b) return i < j;
    return !isnan(a) && isnan(b) ? 1 : (isnan(a) == isnan(b) && i < j);
}

gy_status gy_logits_logprobs(gy_logprobs *out, const float *x, int64_t V, int32_t token, int32_t k) {
    if (out == NULL || x == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_logits_logprobs: NULL buffer");
    if (V < 1 || V > INT32_MAX || token < 0 || token >= V)
        return GY_FAIL(GY_ERR_INVALID, "token %d outside the vocabulary [0, %lld)", (int)token,
                       (long long)V);
    if (k < 0 || k > GY_LOGPROBS_MAX)
        return GY_FAIL(GY_ERR_INVALID, "top-k logprobs must be in [0, %d], got %d",
                       GY_LOGPROBS_MAX, (int)k);
    double m = -INFINITY;
    for (int64_t i = 0; i < V; i++)
        if ((double)x[i] > m) m = (double)x[i];
    double z = 0;
    if (isfinite(m))
        for (int64_t i = 0; i < V; i++) z += exp((double)x[i] - m);
    const double lse = m + log(z); /* NaN or inf when the row is (the sampler refuses it) */
    const float xt = x[token];
    int64_t above = 0;
    for (int64_t i = 0; i < V; i++) above += x[i] > xt;
    out->logprob = (double)xt - lse;
    out->rank = above + 1;
    /* top k: insertion into a sorted list of k; most rows reject a logit at the first compare */
    int32_t n = 0;
    for (int32_t i = 0; i < (int32_t)V && k > 0; i++) {
        if (n == k && !gy_logits_before(x[i], i, x[out->top_tokens[n - 1]], out->top_tokens[n - 1]))
            continue;
        int32_t at = n < k ? n++ : k - 1;
        while (at > 0 && gy_logits_before(x[i], i, x[out->top_tokens[at - 1]], out->top_tokens[at - 1])) {
            out->top_tokens[at] = out->top_tokens[at - 1];
            at--;
        }
        out->top_tokens[at] = i;
    }
    out->n_top = n;
    for (int32_t j = 0; j < n; j++) out->top_logprobs[j] = (double)x[out->top_tokens[j]] - lse;
    return GY_OK;
}
