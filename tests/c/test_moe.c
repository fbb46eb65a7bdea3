/* test_moe.c: the router and the grouped dispatch of cpu/moe.h against hand-worked cases. */
#include <math.h>
#include <string.h>

#include "../../csrc/core/status.h"
#include "../../csrc/cpu/moe.h"
#include "gytest.h"

/* Top-2 of 4 experts: a tie between experts 1 and 3 goes to 1; weights are the softmax over all
 * four experts, or over the chosen two when renormalised. */
GYTEST(test_moe_route_ties_and_weights) {
    const float logits[2 * 4] = {0.5f, 2.0f, -1.0f, 2.0f, /* tie: 1 then 3 */
                                 3.0f, 0.0f, 1.0f, NAN};  /* a NaN is never chosen */
    int32_t choice[4];
    float weight[4];
    CHECK_OK(gy_cpu_moe_route(choice, weight, logits, 2, 4, 2, 0));
    CHECK(choice[0] == 1 && choice[1] == 3 && choice[2] == 0 && choice[3] == 2);
    const double z = exp(0.5 - 2.0) + 1.0 + exp(-3.0) + 1.0;
    CHECK(weight[0] == (float)(1.0 / z) && weight[1] == weight[0]);
    CHECK_OK(gy_cpu_moe_route(choice, weight, logits, 2, 4, 2, 1));
    CHECK(weight[0] == 0.5f && weight[1] == 0.5f);
    CHECK(weight[2] == (float)(1.0 / (1.0 + exp(-2.0))));
    CHECK_STATUS(gy_cpu_moe_route(choice, weight, logits, 2, 4, 5, 0), GY_ERR_INVALID);
}

/* Three tokens, top-2 of 3 experts: each expert's slots hold its tokens in increasing order, and
 * combining rows that are their slot numbers gives each token's weighted sum in rank order. */
GYTEST(test_moe_group_gather_combine) {
    const int32_t choice[3 * 2] = {2, 0, 0, 1, 2, 1};
    int64_t offsets[4];
    int32_t token_of[6], slot_of[6];
    CHECK_OK(gy_cpu_moe_group(offsets, token_of, slot_of, choice, 3, 3, 2));
    const int64_t want_offsets[4] = {0, 2, 4, 6};
    const int32_t want_tokens[6] = {0, 1, 1, 2, 0, 2};
    CHECK(memcmp(offsets, want_offsets, sizeof offsets) == 0);
    CHECK(memcmp(token_of, want_tokens, sizeof token_of) == 0);
    for (int32_t i = 0; i < 6; i++) CHECK(token_of[slot_of[i]] == i / 2 && choice[i] >= 0);
    const float x[3 * 2] = {1, 2, 3, 4, 5, 6};
    float xs[6 * 2], ys[6 * 2], out[3 * 2];
    CHECK_OK(gy_cpu_moe_gather(xs, x, token_of, 6, 2));
    CHECK(xs[2 * 2] == 3 && xs[2 * 2 + 1] == 4 && xs[5 * 2] == 5);
    for (int32_t j = 0; j < 6; j++) ys[2 * j] = ys[2 * j + 1] = (float)j;
    const float weight[6] = {0.25f, 0.75f, 1.0f, 2.0f, 0.5f, 0.5f};
    CHECK_OK(gy_cpu_moe_combine(out, ys, weight, slot_of, 3, 2, 2));
    /* token 0: 0.25 * slot 4 + 0.75 * slot 0; token 1: 1 * slot 1 + 2 * slot 2 */
    CHECK(out[0] == 1.0f && out[2] == 5.0f && out[4] == 0.5f * 5 + 0.5f * 3);
    const int32_t bad[2] = {0, 3};
    CHECK_STATUS(gy_cpu_moe_group(offsets, token_of, slot_of, bad, 1, 3, 2), GY_ERR_INVALID);
    const float gate[3] = {0.0f, 100.0f, -100.0f};
    CHECK_OK(gy_cpu_moe_add_gated(out, x, gate, 3, 2));
    CHECK(out[0] == 1.5f && out[2] == 5.0f + 3.0f);
}
