/* policy_least_load.c: Gyges 6.2.4's least-load-first baseline: requests go to the instance
 * with the least outstanding work per GPU (gy_sim_policy_load). With eager_scale_up (the
 * paper's baseline) the least-loaded instance, when it cannot hold the request, scales up with
 * its aligned neighbours; without it only instances that can hold the request compete and the
 * least-loaded instance's group scales up only when none can. A deferred request keeps its
 * group. No reservations, no holding (see policy_round_robin.c). */
#include "policy.h"

#include <string.h>

static gy_status ll_place(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                          const gy_sim_req_view *r, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    if (r->min_tp == 0 || r->min_tp > v->max_tp) {
        d->action = GY_SIM_ACTION_REJECT;
        return GY_OK;
    }
    if (gy_sim_policy_resume(v, r, d)) return GY_OK;
    int32_t best = -1, best_any = -1;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (!i->placeable) continue;
        const double load = gy_sim_policy_load(cfg, i);
        if (best_any < 0 || load < gy_sim_policy_load(cfg, &v->inst[best_any])) best_any = k;
        if (gy_sim_policy_fits(i, r) &&
            (best < 0 || load < gy_sim_policy_load(cfg, &v->inst[best])))
            best = k;
    }
    gy_sim_policy_place_or_scale(v, cfg->eager_scale_up || best < 0 ? best_any : best, r, d);
    return GY_OK;
}

const gy_sim_policy_ops gy_sim_policy_least_load = {
    .name = "least_load",
    .state_size = 0,
    .place = ll_place,
    .rebalance = gy_sim_policy_split_unneeded,
};
