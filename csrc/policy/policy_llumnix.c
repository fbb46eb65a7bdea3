/* policy_llumnix.c: Llumnix-style live migration, KunServe's migration baseline (its Fig. 10:
 * "Llumnix (migration)"). Requests go where least_load puts them; then, whenever the controller
 * looks (monitor: at every tick as well), the instance whose requests' KV demand is furthest
 * beyond its memory (footprint / kv_total, the blocks its unfinished requests will hold at their
 * end) migrates running requests live to the instance where that ratio is lowest, if the
 * destination is not over-committed itself and the gap is worth a move (LLUMNIX_GAP). Under a
 * burst that fills every replica, migration finds no room: that is what KunServe shows. */
#include "policy.h"

#include <string.h>

#define LLUMNIX_GAP 0.25 /* demand ratios must differ by this much for a move */

static double llumnix_demand(const gy_sim_inst_view *i) {
    return i->kv_total > 0 ? (double)i->footprint / (double)i->kv_total : 0.0;
}

static gy_status llumnix_rebalance(void *state, const gy_sim_policy_config *cfg,
                                   const gy_sim_view *v, gy_sim_decision *d) {
    (void)state;
    memset(d, 0, sizeof *d);
    int32_t src = -1, dst = -1;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (i->xform != GY_SIM_XFORM_NONE || i->bound || i->kv_total <= 0) continue;
        if (i->n_running >= 2 && (src < 0 || llumnix_demand(i) > llumnix_demand(&v->inst[src])))
            src = k;
        if (i->placeable && (dst < 0 || llumnix_demand(i) < llumnix_demand(&v->inst[dst])))
            dst = k;
    }
    if (src < 0 || dst < 0 || src == dst) return GY_OK;
    const double from = llumnix_demand(&v->inst[src]), to = llumnix_demand(&v->inst[dst]);
    if (from <= 1.0 || to >= 1.0 || from - to < LLUMNIX_GAP) return GY_OK;
    for (int32_t n = 0; n < cfg->max_migrations && d->n_ops < GY_SIM_MAX_OPS; n++) {
        gy_sim_decision_add_op(d, GY_SIM_OP_MIGRATE, v->inst[src].gpu_first, v->inst[src].tp);
        d->ops[d->n_ops - 1].target = v->inst[dst].gpu_first;
    }
    return GY_OK;
}

static gy_status llumnix_place(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                               const gy_sim_req_view *r, gy_sim_decision *d) {
    return gy_sim_policy_least_load.place(state, cfg, v, r, d);
}

const gy_sim_policy_ops gy_sim_policy_llumnix = {
    .name = "llumnix",
    .state_size = 0,
    .place = llumnix_place,
    .rebalance = llumnix_rebalance,
    .monitor = 1,
};
