/* sampler.c: temperature / min-p / top-k / top-p / draw. Ranks are 64-bit keys (order-preserving logit
 * bits inverted, then the index), so one integer comparison gives "logit descending, index
 * ascending"; top-k is a quickselect on the keys, top-p a sort of the survivors. */
#include "sampler.h"
#include "../core/alloc.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/rng.h"
#include "../cpu/argmax.h"

/* Writes why the params are bad into `why` and returns 1, or returns 0. */
static int gy_sampler_bad_params(const gy_sampler_params *p, int64_t vocab, char *why, size_t n) {
    if (vocab < 1 || vocab > INT32_MAX)
        snprintf(why, n, "vocab must be in [1, 2^31), got %lld", (long long)vocab);
    else if (!isfinite(p->temperature) || p->temperature < 0)
        snprintf(why, n, "temperature must be finite and >= 0 (0 = greedy), got %g",
                 p->temperature);
    else if (p->top_k < 0 || p->top_k > vocab)
        snprintf(why, n, "top_k must be in [0, vocab=%lld] (0 = off), got %lld", (long long)vocab,
                 (long long)p->top_k);
    else if (!(p->top_p > 0 && p->top_p <= 1))
        snprintf(why, n, "top_p must be in (0, 1] (1 = off), got %g", p->top_p);
    else if (!(p->min_p >= 0 && p->min_p <= 1))
        snprintf(why, n, "min_p must be in [0, 1] (0 = off), got %g", p->min_p);
    else if (!(p->repetition_penalty >= 0 && isfinite(p->repetition_penalty)))
        snprintf(why, n, "repetition_penalty must be finite and > 0 (1 = off), got %g",
                 p->repetition_penalty);
    else if (!(p->frequency_penalty >= -2 && p->frequency_penalty <= 2))
        snprintf(why, n, "frequency_penalty must be in [-2, 2] (0 = off), got %g",
                 p->frequency_penalty);
    else if (!(p->presence_penalty >= -2 && p->presence_penalty <= 2))
        snprintf(why, n, "presence_penalty must be in [-2, 2] (0 = off), got %g",
                 p->presence_penalty);
    else
        return 0;
    return 1;
}

gy_status gy_sampler_check(const gy_sampler_params *p, int64_t vocab) {
    if (p == NULL) return GY_FAIL(GY_ERR_INVALID, "sampler params are NULL");
    char why[256];
    if (gy_sampler_bad_params(p, vocab, why, sizeof why)) return GY_FAIL(GY_ERR_INVALID, "%s", why);
    return GY_OK;
}

/* Scans a row: refuses NaN and +inf (returns 1 with `why`), finds the first maximum. The common
 * case is one vectorised pass; a refused row is scanned again here for the message. */
static int gy_sampler_bad_row(const float *x, int64_t V, int64_t *argmax, char *why, size_t n) {
    if (gy_cpu_argmax_checked(x, V, argmax) == 0) return 0;
    int64_t best = -1;
    for (int64_t i = 0; i < V; i++) {
        const float v = x[i];
        if (isnan(v) || v == INFINITY) {
            snprintf(why, n, "logit %lld is %s", (long long)i, isnan(v) ? "NaN" : "+inf");
            return 1;
        }
        if (v == -INFINITY) continue;
        if (best < 0 || v > x[best]) best = i;
    }
    if (best < 0) {
        snprintf(why, n, "every logit of the row is -inf");
        return 1;
    }
    *argmax = best;
    return 0;
}

/* Smaller key = ranked first: logit descending, then index ascending. */
static uint64_t gy_sampler_key(float v, int64_t i) {
    if (v == 0.0f) v = 0.0f; /* -0 ties with +0 */
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u = (u & UINT32_C(0x80000000)) ? ~u : (u | UINT32_C(0x80000000)); /* ascending with v */
    return (uint64_t)(~u) << 32 | (uint64_t)(uint32_t)i;
}

static int gy_sampler_key_cmp(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Reorders keys[0..n) so that keys[0..k) are the k smallest (k in [1, n)). */
static void gy_sampler_select(uint64_t *keys, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        /* median of three as pivot, moved to hi */
        const int64_t mid = lo + (hi - lo) / 2;
        uint64_t t;
#define GY_SWAP(a, b) (t = keys[a], keys[a] = keys[b], keys[b] = t)
        if (keys[mid] < keys[lo]) GY_SWAP(mid, lo);
        if (keys[hi] < keys[lo]) GY_SWAP(hi, lo);
        if (keys[mid] < keys[hi]) GY_SWAP(mid, hi);
        const uint64_t pivot = keys[hi];
        int64_t store = lo;
        for (int64_t i = lo; i < hi; i++)
            if (keys[i] < pivot) {
                GY_SWAP(i, store);
                store++;
            }
        GY_SWAP(store, hi);
#undef GY_SWAP
        /* [0, store) < pivot: done when that, or it plus the pivot, is the k smallest */
        if (store == k - 1 || store == k) return;
        if (store > k) hi = store - 1; else lo = store + 1;
    }
}

/* w (V): the kept weights (0 elsewhere); keys (V): scratch. Returns their sum in index order. */
static double gy_sampler_weights(double *w, uint64_t *keys, const float *x, int64_t V,
                                 const gy_sampler_params *p, int64_t argmax) {
    if (p->temperature == 0) {
        memset(w, 0, (size_t)V * sizeof *w);
        w[argmax] = 1.0;
        return 1.0;
    }
    const double m = (double)x[argmax], t = p->temperature;
    for (int64_t i = 0; i < V; i++) w[i] = exp(((double)x[i] - m) / t);
    if (p->min_p > 0) /* before top-k and top-p, as vLLM applies it; w[argmax] = 1 stays */
        for (int64_t i = 0; i < V; i++)
            if (w[i] < p->min_p) w[i] = 0;
    const int top_k = p->top_k > 0 && p->top_k < V, top_p = p->top_p < 1.0;
    if (top_k || top_p) {
        for (int64_t i = 0; i < V; i++) keys[i] = gy_sampler_key(x[i], i);
        int64_t kept = V;
        if (top_k) {
            gy_sampler_select(keys, V, p->top_k);
            kept = p->top_k;
        }
        uint64_t last = 0; /* the largest kept key */
        if (top_p) {
            double z = 0;
            for (int64_t j = 0; j < kept; j++) z += w[(uint32_t)keys[j]];
            /* Only tokens with w > (1 - top_p) z / kept can be in the nucleus: the tokens ranked
             * at or after one of them weigh at most w each and must outweigh (1 - top_p) z. The
             * rest (usually nearly all the vocabulary) rank last and need no sorting; the factor
             * 1/2 keeps rounding on the safe side. */
            const double floor_w = 0.5 * (1.0 - p->top_p) * z / (double)kept;
            int64_t n_sort = 0;
            for (int64_t j = 0; j < kept; j++)
                if (w[(uint32_t)keys[j]] > floor_w) keys[n_sort++] = keys[j];
            qsort(keys, (size_t)n_sort, sizeof *keys, gy_sampler_key_cmp);
            const double target = p->top_p * z;
            double acc = 0;
            int64_t j = 0;
            for (; j < n_sort - 1; j++) {
                acc += w[(uint32_t)keys[j]];
                if (acc >= target) break;
            }
            last = keys[j];
        } else {
            for (int64_t j = 0; j < kept; j++) last = keys[j] > last ? keys[j] : last;
        }
        for (int64_t i = 0; i < V; i++)
            if (gy_sampler_key(x[i], i) > last) w[i] = 0;
    }
    double total = 0;
    for (int64_t i = 0; i < V; i++) total += w[i];
    return total;
}

static int32_t gy_sampler_draw(const double *w, int64_t V, double total, double u) {
    const double target = u * total;
    double acc = 0;
    int64_t last = 0;
    for (int64_t i = 0; i < V; i++) {
        if (w[i] <= 0) continue;
        acc += w[i];
        last = i;
        if (acc > target) return (int32_t)i;
    }
    return (int32_t)last; /* u * total rounded up to the full sum */
}

gy_status gy_sampler_probs(double *probs_out, const float *logits, int64_t vocab,
                           const gy_sampler_params *params) {
    if (probs_out == NULL || logits == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_sampler_probs: NULL buffer");
    GY_TRY(gy_sampler_check(params, vocab));
    int64_t argmax;
    char why[256];
    if (gy_sampler_bad_row(logits, vocab, &argmax, why, sizeof why))
        return GY_FAIL(GY_ERR_INVALID, "%s", why);
    uint64_t *keys = gy_malloc((size_t)vocab * sizeof *keys);
    if (keys == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a vocab of %lld",
                                     (long long)vocab);
    const double total = gy_sampler_weights(probs_out, keys, logits, vocab, params, argmax);
    for (int64_t i = 0; i < vocab; i++) probs_out[i] /= total;
    free(keys);
    return GY_OK;
}

gy_status gy_sampler_sample(int32_t *token_out, const float *logits, int64_t vocab,
                            const gy_sampler_params *params, int64_t token_index) {
    return gy_sampler_sample_batch(token_out, logits, 1, vocab, params, &token_index);
}

gy_status gy_sampler_sample_batch(int32_t *tokens_out, const float *logits, int64_t n,
                                  int64_t vocab, const gy_sampler_params *params,
                                  const int64_t *token_index) {
    if (tokens_out == NULL || logits == NULL || params == NULL || token_index == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_sampler_sample_batch: NULL buffer");
    if (n < 0) return GY_FAIL(GY_ERR_INVALID, "row count must be >= 0, got %lld", (long long)n);
    int need_work = 0;
    for (int64_t r = 0; r < n; r++) {
        char why[256];
        if (gy_sampler_bad_params(&params[r], vocab, why, sizeof why))
            return GY_FAIL(GY_ERR_INVALID, "row %lld: %s", (long long)r, why);
        need_work |= params[r].temperature > 0;
    }
    double *w = NULL;
    uint64_t *keys = NULL;
    if (need_work) {
        w = gy_malloc((size_t)vocab * sizeof *w);
        keys = gy_malloc((size_t)vocab * sizeof *keys);
        if (w == NULL || keys == NULL) {
            free(w);
            free(keys);
            return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a vocab of %lld",
                           (long long)vocab);
        }
    }
    gy_status st = GY_OK;
    for (int64_t r = 0; r < n && st == GY_OK; r++) {
        const float *x = logits + r * vocab;
        int64_t argmax;
        char why[256];
        if (gy_sampler_bad_row(x, vocab, &argmax, why, sizeof why)) {
            st = GY_FAIL(GY_ERR_INVALID, "row %lld: %s", (long long)r, why);
            break;
        }
        if (params[r].temperature == 0) {
            tokens_out[r] = (int32_t)argmax;
            continue;
        }
        const double total = gy_sampler_weights(w, keys, x, vocab, &params[r], argmax);
        const double u = gy_rng_uniform(params[r].seed, token_index[r], GY_RNG_STREAM_SAMPLE);
        tokens_out[r] = gy_sampler_draw(w, vocab, total, u);
    }
    free(w);
    free(keys);
    return st;
}
