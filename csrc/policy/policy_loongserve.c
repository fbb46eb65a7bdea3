/* policy_loongserve.c: LoongServe's elastic sequence parallelism (ESP; Wu et al., SOSP '24), the
 * baseline of Gyges Figure 14, on a replicated cluster whose bound instances are sequence
 * parallel (sim.h: sequence_parallel; the cost model prices them, cost.h). Every GPU keeps the
 * whole model; a group of them serves as one instance whose tokens' KV is striped over its GPUs,
 * so a scale-up (BIND) or a scale-down (RELEASE) moves no weight and keeps every request's KV.
 *
 * Where a request goes:
 *   short  (its prompt below sp_min_prompt and its KV within one instance): the least-loaded
 *          unbound instance that holds it, else the least-loaded bound one (the instances share
 *          one pool of work; unbound first, so that groups can scale down);
 *   long   (a prompt of sp_min_prompt tokens or more, or KV no unbound instance holds): of the
 *          instances of TP >= min_tp with room for it and the groups of min_tp, 2 min_tp,
 *          ... GPUs that can bind (every member unbound, nothing under way; idle, for a group
 *          larger than its KV needs: a prefill spread for speed must not stall other requests'
 *          decodes), the one where its prefill ends first at the view's prefill rates, the
 *          prompt tokens already waiting there first (a group binding for it takes its members'
 *          requests in with their KV, so their prompts count). A prompt below sp_min_prompt
 *          only considers groups of min_tp.
 *          With no such choice it waits at the cluster until one frees.
 * Rebalance (scale-down): a bound instance with nothing under way, no request waiting for a group
 * around it and less than sp_min_prompt of prompt left to prefill (its long prompts done; the
 * short ones its members serve on) is released when its requests plausibly fit its
 * members (the simulator packs them, largest first, each keeping its KV: LoongServe places the
 * KV during the prefill where the decode will use it); an empty one always. A request whose KV
 * fits no member keeps its group until it finishes (multi-master decoding).
 *
 * What LoongServe has that this does not: its scheduler picks the degree of each prefill batch
 * from a fitted model of the iteration time, and it batches prefills of several requests over
 * one group; here each long request picks its group by the earliest end of its prefill. */
#include "policy.h"

#include <string.h>

/* 1 when the aligned group [g, g + size) can bind now: every instance in it unbound, of TP
 * below size, nothing under way, placeable, idle too when `idle`, and no larger group waited
 * for around it. *pending receives its prompt tokens not prefilled yet. */
static int ls_bindable(const gy_sim_view *v, int32_t g, int32_t size, int idle, int64_t *pending) {
    if (!gy_sim_group_valid(v, g, size) || gy_sim_pending_overlaps(v, g, size, size + 1)) return 0;
    *pending = 0;
    for (int32_t x = g; x < g + size;) {
        const gy_sim_inst_view *i = &v->inst[v->gpu_inst[x]];
        if (i->gpu_first != x || i->bound || i->tp >= size || i->xform != GY_SIM_XFORM_NONE ||
            !i->placeable || (idle && i->n_requests > 0))
            return 0;
        *pending += i->pending_prefill;
        x += i->tp;
    }
    return 1;
}

static double ls_rate(const gy_sim_view *v, int32_t tp) {
    const int l = gy_sim_level(tp);
    return v->prefill_rate != NULL && l >= 0 ? v->prefill_rate[l] : (double)tp;
}

/* 1 when i has room for r now (not only once its requests finish). */
static int ls_room(const gy_sim_inst_view *i, const gy_sim_req_view *r) {
    return gy_sim_policy_fits(i, r) && i->kv_total - i->kv_used >= r->footprint;
}

/* The least-loaded instance that holds r, bound or not as asked (-1: none). */
static int32_t ls_least_loaded(const gy_sim_policy_config *cfg, const gy_sim_view *v,
                               const gy_sim_req_view *r, int bound) {
    int32_t best = -1;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (!i->bound != !bound || !gy_sim_policy_fits(i, r)) continue;
        if (best < 0 || gy_sim_policy_load(cfg, i) < gy_sim_policy_load(cfg, &v->inst[best]))
            best = k;
    }
    return best;
}

static void ls_place(gy_sim_decision *d, int32_t k) {
    d->action = GY_SIM_ACTION_PLACE;
    d->target = k;
}

static void ls_defer_on(gy_sim_decision *d, int32_t g, int32_t size) {
    d->action = GY_SIM_ACTION_DEFER;
    d->group = (gy_sim_group){.gpu_first = g, .size = size};
}

/* A long request: the bound instance or the group to bind where its prefill ends first. */
static void ls_place_long(const gy_sim_policy_config *cfg, const gy_sim_view *v,
                          const gy_sim_req_view *r, gy_sim_decision *d) {
    double best = 0;
    int32_t inst = -1, group = -1, group_size = 0;
    for (int32_t k = 0; k < v->n_inst; k++) { /* bound ones, and unbound ones that hold it */
        const gy_sim_inst_view *i = &v->inst[k];
        if (!ls_room(i, r)) continue;
        const double t = gy_sim_policy_prefill_wait(v, i, r->prompt);
        if (inst < 0 || t < best) {
            best = t;
            inst = k;
        }
    }
    const int32_t base = v->base_tp > r->min_tp ? v->base_tp : r->min_tp;
    const int32_t first = base > v->base_tp ? base : 2 * v->base_tp;
    const int32_t last = (double)r->prompt >= cfg->sp_min_prompt ? v->max_tp : first;
    for (int32_t size = first; size <= last; size *= 2)
        for (int32_t g = 0; g + size <= v->n_gpus; g += size) {
            int64_t pending;
            /* beyond what its KV needs, only over idle instances: a prefill spread for speed
             * must not stall other requests' decodes in its chunks */
            if (!ls_bindable(v, g, size, size > base, &pending)) continue;
            const double t = (double)(pending + r->prompt) / ls_rate(v, size);
            if ((inst < 0 && group < 0) || t < best) {
                best = t;
                inst = -1;
                group = g;
                group_size = size;
            }
        }
    if (group >= 0) {
        ls_defer_on(d, group, group_size);
        gy_sim_decision_add_op(d, GY_SIM_OP_BIND, group, group_size);
    } else if (inst >= 0) {
        ls_place(d, inst);
    } else if (r->min_tp <= v->base_tp) { /* no room now anywhere: queue where it fits */
        const int32_t k = ls_least_loaded(cfg, v, r, 0);
        if (k >= 0) ls_place(d, k);
        else d->action = GY_SIM_ACTION_DEFER;
    } else {
        d->action = GY_SIM_ACTION_DEFER; /* until a group frees (the rebalance releases) */
    }
}

static gy_status ls_place_request(void *state, const gy_sim_policy_config *cfg,
                                  const gy_sim_view *v, const gy_sim_req_view *r,
                                  gy_sim_decision *d) {
    (void)state;
    memset(d, 0, sizeof *d);
    if (r->min_tp == 0 || r->min_tp > v->max_tp) {
        d->action = GY_SIM_ACTION_REJECT;
        return GY_OK;
    }
    if (r->deferred && r->group.size > 0) { /* it waits for its group: bound yet? */
        const int32_t k = gy_sim_policy_bound_group(v, r);
        if (k >= 0) {
            ls_place(d, k);
            return GY_OK;
        }
        if (gy_sim_group_under(v, r->group.gpu_first, r->group.size,
                               GY_SIM_XFORM_BINDING)) {
            ls_defer_on(d, r->group.gpu_first, r->group.size);
            return GY_OK;
        }
        /* its bind was refused or its group taken: decided afresh */
    }
    const int long_prompt = (double)r->prompt >= cfg->sp_min_prompt;
    if (!long_prompt && r->min_tp <= v->base_tp) {
        int32_t k = ls_least_loaded(cfg, v, r, 0);
        if (k < 0) k = ls_least_loaded(cfg, v, r, 1);
        if (k >= 0) ls_place(d, k);
        else d->action = GY_SIM_ACTION_DEFER;
        return GY_OK;
    }
    ls_place_long(cfg, v, r, d);
    return GY_OK;
}

/* 1 when i's requests plausibly fit its members (footprints, as a split's check). */
static int ls_release_plausible(const gy_sim_view *v, const gy_sim_inst_view *i) {
    const int l = gy_sim_level(v->base_tp);
    if (l < 0) return 0;
    const int64_t cap = v->capacity[l];
    const int64_t usable = cap - (int64_t)(v->watermark * (double)cap);
    const double members = (double)(i->tp / v->base_tp);
    /* slack: the simulator packs greedily */
    return i->max_footprint <= usable && (double)i->footprint <= (members - 0.1) * (double)usable;
}

static gy_status ls_rebalance(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                              gy_sim_decision *d) {
    (void)state;
    memset(d, 0, sizeof *d);
    d->action = GY_SIM_ACTION_NONE;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (!i->bound || i->xform != GY_SIM_XFORM_NONE ||
            gy_sim_pending_overlaps(v, i->gpu_first, i->tp, 0))
            continue;
        if (i->n_requests == 0 ||
            ((double)i->pending_prefill < cfg->sp_min_prompt && ls_release_plausible(v, i)))
            if (!gy_sim_decision_add_op(d, GY_SIM_OP_RELEASE, i->gpu_first, i->tp)) break;
    }
    return GY_OK;
}

const gy_sim_policy_ops gy_sim_policy_loongserve = {
    .name = "loongserve",
    .state_size = 0,
    .place = ls_place_request,
    .rebalance = ls_rebalance,
    .monitor = 1, /* a group scales down once its prompts are done, whatever finished */
};
