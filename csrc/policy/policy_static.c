/* policy_static.c: a fixed layout (8xTP1, 2xTP4, 4xTP1+1xTP4, ...): each request goes to the
 * least-loaded instance that can hold it (ties to the lower GPU); a request no instance can
 * ever hold is rejected. Never transforms. */
#include "policy.h"

#include <string.h>

static gy_status static_place(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                              const gy_sim_req_view *r, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    int32_t best = -1;
    for (int32_t k = 0; k < v->n_inst; k++) {
        if (!gy_sim_policy_fits(&v->inst[k], r)) continue;
        if (best < 0 || gy_sim_policy_load(cfg, &v->inst[k]) <
                            gy_sim_policy_load(cfg, &v->inst[best]))
            best = k;
    }
    if (best < 0) {
        d->action = GY_SIM_ACTION_REJECT;
    } else {
        d->action = GY_SIM_ACTION_PLACE;
        d->target = best;
    }
    return GY_OK;
}

const gy_sim_policy_ops gy_sim_policy_static = {
    .name = "static",
    .state_size = 0,
    .place = static_place,
    .rebalance = NULL,
};
