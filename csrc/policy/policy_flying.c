/* policy_flying.c: Flying Serving's scheduler (sections 3 and 5.2) on a replicated cluster: DP
 * instances of base_tp GPUs each keep a replica; aligned groups bind into TP instances for the
 * work that needs one and are released when it is done (policy.h: BIND, RELEASE).
 *
 * Where a request goes:
 *   long      no unbound instance holds it (min_tp > base_tp): a bound instance of TP >= min_tp
 *             with room, else it waits (DEFER) on the aligned group of min_tp GPUs with the
 *             fewest requests, whose members are held (no new DP work) and bind once their own
 *             requests are done: wait, as it cannot pre-run in DP mode (soft has no DP start).
 *             When smaller bound groups leave no such group, it claims one: those groups are
 *             released once idle and no smaller group binds inside it meanwhile;
 *   priority  (priority > 0) a bound instance with room, else a group of flying_tp GPUs binds
 *             at once and it waits for that (hard: the members' requests pause with their KV);
 *   normal    under light load (outstanding work per GPU at most light_load tokens) TP lowers
 *             its latency: a bound instance with room and no queue; else a group of flying_tp
 *             idle GPUs binds for it (at most scale_up_cap of the GPUs bound); else, when a group
 *             has an idle member, it starts there in DP mode as TP work, the members are held,
 *             and the group binds once they are done, recomputing it under TP (soft). Otherwise
 *             the least-loaded unbound, unheld DP unit.
 * In a burst (requests queued on DP units or at the cluster), bound groups go back to DP at once,
 * their requests recomputed there, unless one needs TP (it drains first) or is a priority one.
 * Rebalance: besides the burst rule, a bound instance with no requests is released when requests
 * are paused under it, it is held, the load is not light, or a larger group waits around it; a
 * held group binds once its members run TP work only (or nothing) and is unheld in a burst when
 * nothing needs it.
 * The thresholds (flying_tp, light_load) are ours: the paper gives none. */
#include "policy.h"

#include <string.h>

/* flying_tp, or half a host (the other half keeps DP instances), at least two DP units. */
static int32_t fl_group_tp(const gy_sim_policy_config *cfg, const gy_sim_view *v) {
    int32_t tp = cfg->flying_tp > 0 ? cfg->flying_tp : v->gpus_per_host / 2;
    if (tp < 2 * v->base_tp) tp = 2 * v->base_tp;
    if (tp > v->max_tp) tp = v->max_tp;
    return tp;
}

/* Light load: the outstanding work per GPU (gy_sim_policy_load's measure over the cluster) at
 * most light_load, and, when `cluster`, nobody waiting at the cluster (a rebalance sees the
 * whole waiting list, while a placement may be inside a pass over it). */
static int fl_light(const gy_sim_policy_config *cfg, const gy_sim_view *v, int cluster) {
    if (cfg->light_load <= 0 || (cluster && v->n_deferred > 0)) return 0;
    double work = 0;
    for (int32_t k = 0; k < v->n_inst; k++)
        work += gy_sim_policy_load(cfg, &v->inst[k]) * (double)v->inst[k].tp;
    return work <= cfg->light_load * (double)v->n_gpus;
}

/* The bound instance of TP >= min_tp with room for r and the least load (-1: none). A normal
 * request takes only one with nothing queued (TP work that would wait is better off in DP) and
 * nothing paused under it (each request there keeps the paused ones waiting). */
static int32_t fl_bound_with_room(const gy_sim_policy_config *cfg, const gy_sim_view *v,
                                  const gy_sim_req_view *r) {
    const int normal = r->min_tp <= v->base_tp && r->priority <= 0;
    int32_t best = -1;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (!i->bound || i->held || i->tp < r->min_tp || !gy_sim_policy_fits(i, r) ||
            i->kv_total - i->kv_used < r->footprint ||
            (normal && (i->n_waiting > 0 || i->n_paused > 0)))
            continue;
        if (best < 0 || gy_sim_policy_load(cfg, i) < gy_sim_policy_load(cfg, &v->inst[best]))
            best = k;
    }
    return best;
}

/* The group [g, g + size) can bind: every instance in it unbound, of TP below size, nothing
 * under way, no larger group waited for around it. *busy receives its requests that are not
 * TP work, *idle an idle member (-1). */
static int fl_bindable(const gy_sim_view *v, int32_t g, int32_t size, int64_t *busy,
                       int32_t *idle) {
    if (!gy_sim_group_valid(v, g, size) || gy_sim_pending_overlaps(v, g, size, size + 1)) return 0;
    *busy = 0;
    *idle = -1;
    for (int32_t x = g; x < g + size;) {
        const int32_t k = v->gpu_inst[x];
        const gy_sim_inst_view *i = &v->inst[k];
        if (i->gpu_first != x || i->bound || i->tp >= size || i->xform != GY_SIM_XFORM_NONE)
            return 0;
        *busy += i->n_requests - i->n_tp_work;
        if (i->n_requests == 0 && !i->held && *idle < 0) *idle = k;
        x += i->tp;
    }
    return 1;
}

/* The bindable group of `size` GPUs with the fewest busy requests (-1: none). */
static int32_t fl_pick_group(const gy_sim_view *v, int32_t size, int64_t *busy_out,
                             int32_t *idle_out) {
    int32_t best = -1;
    for (int32_t g = 0; g + size <= v->n_gpus; g += size) {
        int64_t busy;
        int32_t idle;
        if (!fl_bindable(v, g, size, &busy, &idle)) continue;
        if (best < 0 || busy < *busy_out) {
            best = g;
            *busy_out = busy;
            *idle_out = idle;
        }
    }
    return best;
}

/* Holds (or unholds: `hold` 0) every member of [g, g + size) not so already. */
static void fl_hold_members(const gy_sim_view *v, int32_t g, int32_t size, int hold,
                            gy_sim_decision *d) {
    for (int32_t x = g; x < g + size;) {
        const gy_sim_inst_view *i = &v->inst[v->gpu_inst[x]];
        if (!i->held == !!hold)
            gy_sim_decision_add_op(d, hold ? GY_SIM_OP_HOLD : GY_SIM_OP_UNHOLD, i->gpu_first,
                                   i->tp);
        x += i->tp;
    }
}

/* 1 when group [g, g + size) can be waited for: every instance in it smaller than size.
 * *n (may be NULL) receives its requests. */
static int fl_claim_holds(const gy_sim_view *v, int32_t g, int32_t size, int64_t *n) {
    if (!gy_sim_group_valid(v, g, size)) return 0;
    int64_t count = 0;
    for (int32_t x = g; x < g + size;) {
        const gy_sim_inst_view *i = &v->inst[v->gpu_inst[x]];
        if (i->tp >= size || i->gpu_first != x) return 0;
        count += i->n_requests;
        x += i->tp;
    }
    if (n != NULL) *n = count;
    return 1;
}

/* A group of `size` that smaller bound groups keep from binding, to wait for (they are
 * released by the rebalance once idle): the one with the fewest requests and no
 * instance of TP >= size in it (-1: none). */
static int32_t fl_claim(const gy_sim_view *v, int32_t size) {
    int32_t best = -1;
    int64_t best_n = 0, n;
    for (int32_t g = 0; g + size <= v->n_gpus; g += size)
        if (fl_claim_holds(v, g, size, &n) && (best < 0 || n < best_n)) {
            best = g;
            best_n = n;
        }
    return best;
}

static void fl_defer_on(gy_sim_decision *d, int32_t g, int32_t size) {
    d->action = GY_SIM_ACTION_DEFER;
    d->group = (gy_sim_group){.gpu_first = g, .size = size};
}

/* Waits for group [g, g + size), releasing the idle bound groups inside it now (busy ones are
 * released by the rebalance once idle). */
static void fl_defer_on_claim(const gy_sim_view *v, gy_sim_decision *d, int32_t g, int32_t size) {
    fl_defer_on(d, g, size);
    for (int32_t x = g; x < g + size;) {
        const gy_sim_inst_view *i = &v->inst[v->gpu_inst[x]];
        if (i->bound && i->n_requests == 0 && i->xform == GY_SIM_XFORM_NONE)
            gy_sim_decision_add_op(d, GY_SIM_OP_RELEASE, i->gpu_first, i->tp);
        x += i->tp;
    }
}

/* The least-loaded unbound instance that holds r, unheld unless `held_too` (-1: none). */
static int32_t fl_dp(const gy_sim_policy_config *cfg, const gy_sim_view *v,
                     const gy_sim_req_view *r, int held_too) {
    int32_t best = -1;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (i->bound || (i->held && !held_too) || !gy_sim_policy_fits(i, r)) continue;
        if (best < 0 || gy_sim_policy_load(cfg, i) < gy_sim_policy_load(cfg, &v->inst[best]))
            best = k;
    }
    return best;
}

static void fl_place(gy_sim_decision *d, int32_t k, int tp_work) {
    d->action = GY_SIM_ACTION_PLACE;
    d->target = k;
    d->tp_work = tp_work;
}

/* Binds group [g, g + size) now when no member runs anything but TP work, else holds them. */
static void fl_bind_when_drained(const gy_sim_view *v, int32_t g, int32_t size, int64_t busy,
                                 gy_sim_decision *d) {
    if (busy == 0) gy_sim_decision_add_op(d, GY_SIM_OP_BIND, g, size);
    else fl_hold_members(v, g, size, 1, d);
}

/* A burst: requests wait at the cluster or in a DP unit's queue. */
static int fl_heavy(const gy_sim_view *v) {
    if (v->n_deferred > 0) return 1;
    for (int32_t k = 0; k < v->n_inst; k++)
        if (!v->inst[k].bound && v->inst[k].n_waiting > 0) return 1;
    return 0;
}

/* In a burst a bound group goes back to DP at once when its requests fit DP units (they are
 * recomputed there: a drain would keep its GPUs from the burst for a whole decode); one that
 * serves a long request takes no more and is released once drained (rebalance). Groups serving
 * priority requests stay. */
static void fl_release_or_drain(const gy_sim_view *v, const gy_sim_inst_view *i,
                                gy_sim_decision *d) {
    if (!i->bound || i->xform != GY_SIM_XFORM_NONE || i->n_priority > 0 ||
        gy_sim_pending_overlaps(v, i->gpu_first, i->tp, 0))
        return;
    if (i->max_min_tp <= v->base_tp)
        gy_sim_decision_add_op(d, GY_SIM_OP_RELEASE, i->gpu_first, i->tp);
    else if (!i->held)
        gy_sim_decision_add_op(d, GY_SIM_OP_HOLD, i->gpu_first, i->tp);
}

static gy_status fl_place_request(void *state, const gy_sim_policy_config *cfg,
                                  const gy_sim_view *v, const gy_sim_req_view *r,
                                  gy_sim_decision *d) {
    (void)state;
    memset(d, 0, sizeof *d);
    if (r->min_tp == 0 || r->min_tp > v->max_tp) {
        d->action = GY_SIM_ACTION_REJECT;
        return GY_OK;
    }
    const int32_t bound = fl_bound_with_room(cfg, v, r);
    const int32_t group_tp = fl_group_tp(cfg, v);
    int64_t busy = 0;
    int32_t idle = -1;
    if (r->deferred && r->group.size > 0) { /* it waits for its group: bound yet? */
        const int32_t k = gy_sim_policy_bound_group(v, r);
        if (k >= 0) {
            fl_place(d, k, 1);
            return GY_OK;
        }
        if (bound >= 0) {
            fl_place(d, bound, 1);
            return GY_OK;
        }
        if (fl_bindable(v, r->group.gpu_first, r->group.size, &busy, &idle)) {
            fl_defer_on(d, r->group.gpu_first, r->group.size);
            fl_bind_when_drained(v, r->group.gpu_first, r->group.size, busy, d);
            return GY_OK;
        }
        if (gy_sim_group_under(v, r->group.gpu_first, r->group.size, /* its bind under way, */
                               GY_SIM_XFORM_BINDING) ||
            fl_claim_holds(v, r->group.gpu_first, r->group.size, NULL)) { /* or smaller clear */
            fl_defer_on_claim(v, d, r->group.gpu_first, r->group.size);
            return GY_OK;
        }
        /* its group is taken (being bound for it, or by another): decide afresh */
    }
    if (r->min_tp > v->base_tp) { /* long: only a bound group holds it */
        if (bound >= 0) {
            fl_place(d, bound, 1);
            return GY_OK;
        }
        const int32_t g = fl_pick_group(v, r->min_tp, &busy, &idle);
        if (g < 0) { /* smaller bound groups are in the way: wait for one of them to clear */
            const int32_t c = fl_claim(v, r->min_tp);
            if (c >= 0) fl_defer_on_claim(v, d, c, r->min_tp);
            else d->action = GY_SIM_ACTION_DEFER;
            return GY_OK;
        }
        fl_defer_on(d, g, r->min_tp);
        fl_bind_when_drained(v, g, r->min_tp, busy, d);
        return GY_OK;
    }
    const int priority = r->priority > 0;
    const int waited = r->deferred && r->group.size == 0; /* no room for it: not light */
    const int light = !waited && fl_light(cfg, v, 0);
    if (priority || light) {
        if (bound >= 0) {
            fl_place(d, bound, 1);
            return GY_OK;
        }
        const int32_t size = group_tp > r->min_tp ? group_tp : r->min_tp;
        /* light load binds at most scale_up_cap of the GPUs, so that a burst finds DP units */
        int64_t bound_gpus = 0;
        for (int32_t j = 0; j < v->n_inst; j++) bound_gpus += v->inst[j].bound ? v->inst[j].tp : 0;
        const int capped = !priority &&
                           (double)(bound_gpus + size) > cfg->scale_up_cap * (double)v->n_gpus;
        const int32_t g = size > v->base_tp && !capped ? fl_pick_group(v, size, &busy, &idle) : -1;
        if (g >= 0 && (priority || busy == 0)) { /* hard, or every member idle */
            fl_defer_on(d, g, size);
            gy_sim_decision_add_op(d, GY_SIM_OP_BIND, g, size);
            return GY_OK;
        }
        if (g < 0 && priority && !capped) { /* smaller bound groups in the way clear first */
            const int32_t c = fl_claim(v, size);
            if (c >= 0) {
                fl_defer_on_claim(v, d, c, size);
                return GY_OK;
            }
        }
        if (g >= 0) { /* the group drains (no new DP work) and binds once it has (rebalance) */
            if (idle >= 0 && gy_sim_policy_fits(&v->inst[idle], r)) { /* soft: start here */
                fl_place(d, idle, 1);
                fl_hold_members(v, g, size, 1, d);
                return GY_OK;
            }
            fl_hold_members(v, g, size, 1, d);
        }
    }
    /* DP (a burst, or no TP group to be had yet). In a burst, bound groups take no more and go
     * back to DP once drained (the release is the rebalance's, or here when one is empty). */
    for (int32_t j = 0; !light && fl_heavy(v) && j < v->n_inst; j++)
        fl_release_or_drain(v, &v->inst[j], d);
    int32_t k = fl_dp(cfg, v, r, 0);
    for (int32_t j = 0; k >= 0 && j < d->n_ops; j++) /* not on a member just held */
        if (d->ops[j].kind == GY_SIM_OP_HOLD &&
            gy_sim_ranges_overlap(d->ops[j].gpu_first, d->ops[j].size, v->inst[k].gpu_first,
                                  v->inst[k].tp))
            k = -1;
    if (k < 0 && d->n_ops > 0) /* every other DP unit is held: the least loaded, held or not */
        k = fl_dp(cfg, v, r, 1);
    if (k >= 0) {
        fl_place(d, k, 0);
        return GY_OK;
    }
    d->action = GY_SIM_ACTION_DEFER; /* every DP unit is bound or held: until one is back */
    return GY_OK;
}

static gy_status fl_rebalance(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                              gy_sim_decision *d) {
    (void)state;
    memset(d, 0, sizeof *d);
    d->action = GY_SIM_ACTION_NONE;
    const int light = fl_light(cfg, v, 1);
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (!i->bound || i->xform != GY_SIM_XFORM_NONE ||
            gy_sim_pending_overlaps(v, i->gpu_first, i->tp, 0))
            continue;
        /* a larger group waited for around it goes first */
        if (i->n_requests == 0 &&
            (i->n_paused > 0 || i->held || !light ||
             gy_sim_pending_overlaps(v, i->gpu_first, i->tp, i->tp + 1)))
            gy_sim_decision_add_op(d, GY_SIM_OP_RELEASE, i->gpu_first, i->tp);
        else if (!light && fl_heavy(v))
            fl_release_or_drain(v, i, d);
        else if (i->held)
            gy_sim_decision_add_op(d, GY_SIM_OP_UNHOLD, i->gpu_first, i->tp);
    }
    /* Draining groups (every member held) bind once they run TP work only, when a request waits
     * for them, they carry TP work or the load is light; in a burst, one with neither goes back
     * to DP. */
    for (int32_t size = 2 * v->base_tp; size <= v->max_tp; size *= 2)
        for (int32_t g = 0; g + size <= v->n_gpus; g += size) {
            int64_t busy;
            int32_t idle;
            if (!fl_bindable(v, g, size, &busy, &idle)) continue;
            int held = 1, work = 0;
            for (int32_t x = g; x < g + size;) {
                const gy_sim_inst_view *i = &v->inst[v->gpu_inst[x]];
                held &= i->held;
                work += i->n_tp_work > 0;
                x += i->tp;
            }
            if (!held) continue;
            const int wanted = work || gy_sim_pending_overlaps(v, g, size, 0);
            if (busy == 0 && (wanted || light))
                gy_sim_decision_add_op(d, GY_SIM_OP_BIND, g, size);
            else if (!wanted && !light)
                fl_hold_members(v, g, size, 0, d);
        }
    return GY_OK;
}

const gy_sim_policy_ops gy_sim_policy_flying = {
    .name = "flying",
    .state_size = 0,
    .place = fl_place_request,
    .rebalance = fl_rebalance,
};
