/* policy_round_robin.c: Gyges 6.2.4's round-robin baseline: requests go to the instances in
 * turn (by first GPU, wrapping). With eager_scale_up (the paper's baseline) the instance whose
 * turn it is, when it cannot hold the request, scales up with its aligned neighbours to the TP
 * the request needs; without it, the turn skips instances that cannot hold the request and the
 * group around the instance whose turn it was scales up only when none can. A deferred request
 * keeps its group. No reservations, no holding: rebalance splits a TP > 1 instance as soon as no
 * request needs its TP and its requests fit in its halves. */
#include "policy.h"

#include <string.h>

typedef struct {
    int32_t cursor; /* the next GPU in round-robin order */
} gy_sim_rr_state;

/* The first instance at or after `cursor` (wrapping) that is placeable and, when `need_fit`,
 * holds r. */
static int32_t rr_next(const gy_sim_view *v, int32_t cursor, const gy_sim_req_view *r,
                       int need_fit) {
    for (int32_t step = 0; step < v->n_inst; step++) {
        int32_t start = cursor % v->n_gpus;
        int32_t k = v->gpu_inst[start];
        if (v->inst[k].gpu_first != start) k = (k + 1) % v->n_inst; /* inside an instance */
        k = (k + step) % v->n_inst;
        const gy_sim_inst_view *i = &v->inst[k];
        if (!i->placeable) continue;
        if (need_fit && !gy_sim_policy_fits(i, r)) continue;
        return k;
    }
    return -1;
}

static gy_status rr_place(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                          const gy_sim_req_view *r, gy_sim_decision *d) {
    gy_sim_rr_state *st = state;
    memset(d, 0, sizeof *d);
    if (r->min_tp == 0 || r->min_tp > v->max_tp) {
        d->action = GY_SIM_ACTION_REJECT;
        return GY_OK;
    }
    if (gy_sim_policy_resume(v, r, d)) return GY_OK;
    int32_t k = rr_next(v, st->cursor, r, !cfg->eager_scale_up);
    if (k < 0) k = rr_next(v, st->cursor, r, 0);
    if (k >= 0) st->cursor = (v->inst[k].gpu_first + v->inst[k].tp) % v->n_gpus;
    gy_sim_policy_place_or_scale(v, k, r, d);
    return GY_OK;
}

const gy_sim_policy_ops gy_sim_policy_round_robin = {
    .name = "round_robin",
    .state_size = sizeof(gy_sim_rr_state),
    .place = rr_place,
    .rebalance = gy_sim_policy_split_unneeded,
};
