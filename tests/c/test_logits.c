/* test_logits.c: sched/logits.h on hand-made rows: each penalty's arithmetic and which tokens
 * it touches, min_tokens' mask lifting at the count, log-probabilities, ranks and the top k
 * with ties, and refusals. Random rows against NumPy are in tests/test_sampling.py. */
#include <math.h>
#include <string.h>

#include "gytest.h"
#include "sched/logits.h"

GYTEST(logits_penalties_by_hand) {
    /* prompt [0, 1], output [1, 2, 2]: token 0 prompt only, 1 both (output once), 2 output
     * twice, 3 unseen */
    const int32_t tokens[] = {0, 1, 1, 2, 2};
    int32_t counts[5] = {0};
    float x[5] = {2.0f, -1.0f, 3.0f, 4.0f, -2.0f};
    const gy_sampler_params p = {.repetition_penalty = 2.0, .frequency_penalty = 0.5,
                                 .presence_penalty = 0.25};
    CHECK(gy_logits_active(&p, 3, 0));
    CHECK_OK(gy_logits_process(x, 5, tokens, 5, 2, &p, 0, NULL, 0, counts));
    CHECK(x[0] == 1.0f);                                  /* 2 / 2; no output count */
    CHECK(x[1] == (float)(-1.0 * 2 - 0.5 * 1 - 0.25));    /* -2.75 */
    CHECK(x[2] == (float)(3.0 / 2 - 0.5 * 2 - 0.25));     /* 0.25 */
    CHECK(x[3] == 4.0f && x[4] == -2.0f);                 /* unseen: untouched */
    for (int i = 0; i < 5; i++) CHECK(counts[i] == 0);    /* scratch left zeroed */
    /* zeroed params: off (repetition_penalty 0 reads as 1) */
    const gy_sampler_params off = {0};
    CHECK(!gy_logits_active(&off, 3, 0));
    float y[5] = {2.0f, -1.0f, 3.0f, 4.0f, -2.0f};
    CHECK_OK(gy_logits_process(y, 5, tokens, 5, 2, &off, 0, NULL, 0, counts));
    CHECK(y[0] == 2.0f && y[1] == -1.0f && y[2] == 3.0f);
}

GYTEST(logits_min_tokens_masks_stop_tokens_until_the_count) {
    const int32_t tokens[] = {0, 1, 3};
    const int32_t stop[] = {2, 4};
    int32_t counts[5] = {0};
    const gy_sampler_params p = {0};
    float x[5] = {1, 1, 1, 1, 1};
    CHECK(gy_logits_active(&p, 1, 2));
    CHECK_OK(gy_logits_process(x, 5, tokens, 3, 2, &p, 2, stop, 2, counts)); /* 1 output < 2 */
    CHECK(x[2] == -INFINITY && x[4] == -INFINITY && x[0] == 1 && x[3] == 1);
    float y[5] = {1, 1, 1, 1, 1};
    CHECK(!gy_logits_active(&p, 2, 2));
    CHECK_OK(gy_logits_process(y, 5, tokens, 4 - 1, 1, &p, 2, stop, 2, counts)); /* 2 outputs */
    CHECK(y[2] == 1 && y[4] == 1);
}

GYTEST(logits_logprobs_ranks_and_top_k_with_ties) {
    const float x[6] = {1.0f, 3.0f, 3.0f, -INFINITY, 0.5f, 2.0f};
    double z = 0;
    for (int i = 0; i < 6; i++) z += exp((double)x[i] - 3.0);
    const double lse = 3.0 + log(z);
    gy_logprobs lp;
    CHECK_OK(gy_logits_logprobs(&lp, x, 6, 5, 4));
    CHECK(fabs(lp.logprob - (2.0 - lse)) < 1e-15);
    CHECK(lp.rank == 3); /* two logits above */
    CHECK(lp.n_top == 4);
    const int32_t want[4] = {1, 2, 5, 0}; /* ties: lower index first */
    for (int j = 0; j < 4; j++) {
        CHECK(lp.top_tokens[j] == want[j]);
        CHECK(fabs(lp.top_logprobs[j] - ((double)x[want[j]] - lse)) < 1e-15);
    }
    CHECK_OK(gy_logits_logprobs(&lp, x, 6, 3, 0));
    CHECK(lp.logprob == -INFINITY && lp.rank == 6 && lp.n_top == 0);
    CHECK_OK(gy_logits_logprobs(&lp, x, 6, 2, 20)); /* k above vocab: all of it */
    CHECK(lp.rank == 1 && lp.n_top == 6 && lp.top_tokens[5] == 3);
}

GYTEST(logits_refusals) {
    float x[3] = {0, 0, 0};
    int32_t counts[3] = {0};
    const int32_t bad[] = {0, 3};
    const gy_sampler_params p = {.presence_penalty = 1};
    CHECK_STATUS(gy_logits_process(x, 3, bad, 2, 1, &p, 0, NULL, 0, counts), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "outside the vocabulary") != NULL);
    gy_logprobs lp;
    CHECK_STATUS(gy_logits_logprobs(&lp, x, 3, 3, 0), GY_ERR_INVALID);
    CHECK_STATUS(gy_logits_logprobs(&lp, x, 3, 0, 21), GY_ERR_INVALID);
    gy_error_clear();
}
