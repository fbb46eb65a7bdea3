/* test_sampler.c: Philox against Random123's known answers, greedy ties, the top-k and top-p
 * sets on hand-made rows, determinism across batch positions, and refusals. Frequencies and the
 * sets on random rows are checked against NumPy in tests/test_sampler.py. */
#include <math.h>
#include <string.h>

#include "gytest.h"
#include "core/rng.h"
#include "sched/sampler.h"

GYTEST(rng_philox_known_answers) {
    /* Random123 tests/kat_vectors, the three philox4x32 10 lines: counter, key, expected */
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d,
         0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09,
         0x94fdcceb, 0x5001e420, 0x24126ea1},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        gy_rng_philox4x32(out, kat[i], kat[i] + 4);
        CHECK(memcmp(out, kat[i] + 6, sizeof out) == 0);
    }
    double sum = 0;
    for (int64_t i = 0; i < 10000; i++) {
        const double u = gy_rng_uniform(42, i, GY_RNG_STREAM_SAMPLE);
        CHECK(u >= 0 && u < 1);
        sum += u;
    }
    CHECK(fabs(sum / 10000 - 0.5) < 0.01); /* sd of the mean is 0.0029 */
    CHECK(gy_rng_uniform(1, 5, 0) == gy_rng_uniform(1, 5, 0));
    CHECK(gy_rng_uniform(1, 5, 0) != gy_rng_uniform(2, 5, 0));
    CHECK(gy_rng_uniform(1, 5, 0) != gy_rng_uniform(1, 6, 0));
}

static gy_sampler_params params(double t, int64_t k, double p) {
    gy_sampler_params q = {.temperature = t, .top_k = k, .top_p = p, .seed = 3};
    return q;
}

/* The support of the distribution as a bit mask. */
static uint32_t support(const float *x, int64_t V, gy_sampler_params p) {
    double probs[32];
    CHECK_OK(gy_sampler_probs(probs, x, V, &p));
    uint32_t mask = 0;
    double sum = 0;
    for (int64_t i = 0; i < V; i++) {
        if (probs[i] > 0) mask |= 1u << i;
        sum += probs[i];
    }
    CHECK(fabs(sum - 1) < 1e-12);
    return mask;
}

GYTEST(sampler_greedy_ties_go_to_the_lowest_index) {
    const float x[6] = {-INFINITY, 1.0f, 3.0f, -2.0f, 3.0f, 0.5f};
    int32_t tok = -1;
    gy_sampler_params g = params(0, 0, 1);
    CHECK_OK(gy_sampler_sample(&tok, x, 6, &g, 0));
    CHECK(tok == 2);
    CHECK(support(x, 6, g) == (1u << 2));
    const float z[3] = {-0.0f, 0.0f, -1.0f};
    CHECK_OK(gy_sampler_sample(&tok, z, 3, &g, 0));
    CHECK(tok == 0);
}

GYTEST(sampler_top_k_and_top_p_sets) {
    const float x[5] = {1.0f, 3.0f, 3.0f, 2.0f, 0.0f};
    CHECK(support(x, 5, params(1, 2, 1)) == 0x6);  /* {1, 2} */
    CHECK(support(x, 5, params(1, 3, 1)) == 0xe);  /* {1, 2, 3} */
    CHECK(support(x, 5, params(0.5, 1, 1)) == 0x2); /* tie at the top: lower index */
    CHECK(support(x, 5, params(1, 5, 1)) == 0x1f);
    CHECK(support(x, 5, params(1, 0, 1)) == 0x1f);
    /* probabilities 0.5, 0.3, 0.2 */
    const float y[3] = {logf(0.5f), logf(0.3f), logf(0.2f)};
    CHECK(support(y, 3, params(1, 0, 0.3)) == 0x1);
    CHECK(support(y, 3, params(1, 0, 0.5)) == 0x1 || support(y, 3, params(1, 0, 0.5)) == 0x3);
    CHECK(support(y, 3, params(1, 0, 0.6)) == 0x3);
    CHECK(support(y, 3, params(1, 0, 0.79)) == 0x3);
    CHECK(support(y, 3, params(1, 0, 0.81)) == 0x7);
    /* top-p after top-k renormalises over the k survivors: 0.5/0.8 = 0.625 */
    CHECK(support(y, 3, params(1, 2, 0.6)) == 0x1);
    CHECK(support(y, 3, params(1, 2, 0.65)) == 0x3);
    /* equal weights and a threshold reached exactly: p * Z = 2 of 4 is met by two tokens */
    const float z[4] = {0, 0, 0, 0};
    CHECK(support(z, 4, params(1, 0, 0.5)) == 0x3);
    CHECK(support(z, 4, params(1, 0, 0.75)) == 0x7);
    /* -inf logits never come back, even when top-k would keep them */
    const float m[4] = {0.0f, -INFINITY, -INFINITY, 1.0f};
    CHECK(support(m, 4, params(1, 4, 1)) == 0x9);
    double probs[4];
    gy_sampler_params q = params(2, 0, 1);
    CHECK_OK(gy_sampler_probs(probs, m, 4, &q));
    CHECK(fabs(probs[3] - 1 / (1 + exp(-0.5))) < 1e-12);
}

GYTEST(sampler_min_p_comes_before_top_k_and_top_p) {
    /* probabilities 0.5, 0.3, 0.2: relative to the largest 1, 0.6, 0.4 */
    const float y[3] = {logf(0.5f), logf(0.3f), logf(0.2f)};
    gy_sampler_params p = params(1, 0, 1);
    p.min_p = 0.5;
    CHECK(support(y, 3, p) == 0x3);
    p.min_p = 0.7;
    CHECK(support(y, 3, p) == 0x1);
    p.min_p = 1.0; /* only the maximum */
    CHECK(support(y, 3, p) == 0x1);
    p.min_p = 0.3;
    CHECK(support(y, 3, p) == 0x7);
    /* top-p over what min-p kept: 0.5 / 0.8 = 0.625 */
    p = params(1, 0, 0.6);
    p.min_p = 0.5;
    CHECK(support(y, 3, p) == 0x1);
    p.top_p = 0.65;
    CHECK(support(y, 3, p) == 0x3);
}

GYTEST(sampler_same_seed_and_index_same_token_in_any_batch) {
    enum { V = 37, N = 6 };
    float logits[N * V];
    for (int r = 0; r < N; r++)
        for (int i = 0; i < V; i++) logits[r * V + i] = (float)sin(0.7 * i + r) * 2.0f;
    gy_sampler_params ps[N];
    int64_t idx[N];
    for (int r = 0; r < N; r++) {
        ps[r] = params(0.8 + 0.1 * r, r % 3 == 0 ? 0 : 10, r % 2 ? 0.9 : 1.0);
        ps[r].seed = 1000 + (uint64_t)r;
        idx[r] = 17 * r;
    }
    int32_t batch[N];
    CHECK_OK(gy_sampler_sample_batch(batch, logits, N, V, ps, idx));
    for (int r = 0; r < N; r++) {
        int32_t one;
        CHECK_OK(gy_sampler_sample(&one, logits + r * V, V, &ps[r], idx[r]));
        CHECK(one == batch[r]);
        double probs[V];
        CHECK_OK(gy_sampler_probs(probs, logits + r * V, V, &ps[r]));
        CHECK(probs[one] > 0);
    }
    /* reversed batch order: same tokens */
    float rev[N * V];
    gy_sampler_params rps[N];
    int64_t ridx[N];
    for (int r = 0; r < N; r++) {
        memcpy(rev + r * V, logits + (N - 1 - r) * V, V * sizeof(float));
        rps[r] = ps[N - 1 - r];
        ridx[r] = idx[N - 1 - r];
    }
    int32_t rbatch[N];
    CHECK_OK(gy_sampler_sample_batch(rbatch, rev, N, V, rps, ridx));
    for (int r = 0; r < N; r++) CHECK(rbatch[r] == batch[N - 1 - r]);
}

GYTEST(sampler_refusals_name_the_cause) {
    const float x[4] = {0, 1, 2, 3};
    int32_t tok;
    struct { gy_sampler_params p; const char *word; } bad[] = {
        {params(-1, 0, 1), "temperature"}, {params(NAN, 0, 1), "temperature"},
        {params(INFINITY, 0, 1), "temperature"}, {params(1, -1, 1), "top_k"},
        {params(1, 5, 1), "top_k"}, {params(1, 0, 0), "top_p"}, {params(1, 0, 1.5), "top_p"},
        {params(1, 0, NAN), "top_p"},
        {{.temperature = 1, .top_p = 1, .min_p = -0.5}, "min_p"},
        {{.temperature = 1, .top_p = 1, .min_p = 2}, "min_p"},
        {{.temperature = 1, .top_p = 1, .min_p = NAN}, "min_p"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_STATUS(gy_sampler_sample(&tok, x, 4, &bad[i].p, 0), GY_ERR_INVALID);
        CHECK(strstr(gy_error_message(), bad[i].word) != NULL);
        CHECK_STATUS(gy_sampler_check(&bad[i].p, 4), GY_ERR_INVALID);
    }
    gy_sampler_params ok = params(1, 0, 1);
    const float nan_row[3] = {0, NAN, 1};
    CHECK_STATUS(gy_sampler_sample(&tok, nan_row, 3, &ok, 0), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "logit 1 is NaN") != NULL);
    const float inf_row[2] = {INFINITY, 0};
    CHECK_STATUS(gy_sampler_sample(&tok, inf_row, 2, &ok, 0), GY_ERR_INVALID);
    const float dead[2] = {-INFINITY, -INFINITY};
    CHECK_STATUS(gy_sampler_sample(&tok, dead, 2, &ok, 0), GY_ERR_INVALID);
    gy_sampler_params rows[2] = {params(1, 0, 1), params(1, 0, 2)};
    const float two[8] = {0};
    int32_t toks[2];
    const int64_t idx[2] = {0, 0};
    CHECK_STATUS(gy_sampler_sample_batch(toks, two, 2, 4, rows, idx), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "row 1: top_p") != NULL);
    CHECK_STATUS(gy_sampler_check(&ok, 0), GY_ERR_INVALID);
}
