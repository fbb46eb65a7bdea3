/* policy_kunserve.c: KunServe's parameter-centric memory management on a buddy cluster (sim/sim.h):
 * when the KV memory the requests will need runs past what the instances have free, replicas
 * drop parameters into buddy groups (DROP, planned by buddy.h's gy_buddy_plan); when the
 * demand fits the members' own memory again for a while, the groups restore (RESTORE).
 *
 * Placement: least outstanding work per instance (gy_sim_policy_load) among the instances that
 * can hold the request; a group counts as one instance (one batch in flight over its stages: it
 * is as fast as one replica, with more memory). A request no instance can hold waits at the
 * cluster (DEFER on no group) until a drop or a finish makes room. A request no replica can hold
 * (min_tp 0) but a buddy group of g GPUs can (the fewest, split evenly) goes to a group that
 * holds it, else the least-loaded run of g whole replicas drops into one for it (DEFER on it);
 * only one no group of the host holds is rejected (the paper's KV room for long requests).
 *
 * The monitor (on every placement and every tick, the paper's "in-processing and head-of-line
 * queued requests"), per host, in blocks:
 *   demand   = sum over its instances of kv_used + pending_prefill / block_size (the prompts
 *              not computed yet, queued ones included) + n_running * KUN_DECODE_RATE *
 *              KUN_HORIZON / block_size (what the running requests add in the next second),
 *              plus, on the first host, the blocks of the requests waiting at the cluster;
 *   free     = sum of kv_total * (1 - watermark).
 *   Drop: when demand > free, the host's runs of whole replicas (nothing under way) are planned
 *   with gy_buddy_plan(required = demand - free, param = one replica's weights in blocks,
 *   buddy_strategy, kv cap = one replica's blocks), and every group of >= 2 drops.
 *   Restore: a group (nothing under way) restores once, for restore_wait seconds (measured at
 *   ticks and placements), its own demand (as above) fits its members' usable blocks and its
 *   host's demand stays at most KUN_RESTORE_FRACTION of what the host's GPUs hold as replicas
 *   (the paper restores "when the memory demand decreases"). The fraction leaves room so that
 *   a restore does not drop again at once (hysteresis: 0.7, our choice).
 * KUN_DECODE_RATE = 25 tokens/s per running request (a 40 ms TBT, about what the roofline gives
 * a 14B model's decode batch on an A800) and KUN_HORIZON = 1 s (the paper's look-ahead). */
#include "policy.h"

#include <math.h>
#include <string.h>

#include "buddy.h"

#define KUN_DECODE_RATE 25.0
#define KUN_HORIZON 1.0
#define KUN_RESTORE_FRACTION 0.7
#define KUN_MAX_GPUS 4096 /* the restore clocks kept; groups past it restore at once */
#define KUN_MAX_HOSTS 512 /* hosts whose demand a restore checks; past it, the group's alone */

typedef struct kun_state {
    uint8_t fitting[KUN_MAX_GPUS]; /* by a group's first GPU: its demand fits since `since` */
    double since[KUN_MAX_GPUS];
} kun_state;

static double kun_demand(const gy_sim_view *v, const gy_sim_inst_view *i) {
    const double bs = (double)v->block_size;
    return (double)i->kv_used + ceil((double)i->pending_prefill / bs) +
           (double)i->n_running * KUN_DECODE_RATE * KUN_HORIZON / bs;
}

static double kun_free(const gy_sim_view *v, const gy_sim_inst_view *i) {
    return (double)i->kv_total * (1.0 - v->watermark);
}

/* Blocks of one replica's weights, and of one replica's KV (the view's capacity[0] is the
 * instances' at the start: a replica's unless the cluster started grouped). */
static double kun_param_blocks(const gy_sim_view *v) {
    const gy_sim_pipeline *p = v->pipeline;
    return p->layer_bytes / (p->kv_layer * (double)v->block_size);
}

/* Appends the drops of host h's runs of whole replicas for `required` blocks. */
static void kun_plan_host(const gy_sim_policy_config *cfg, const gy_sim_view *v, int32_t h,
                          double required, gy_sim_decision *d) {
    const int32_t first = h * v->gpus_per_host, end = first + v->gpus_per_host;
    double single_kv = 0;
    for (int32_t g = first; g < end;) {
        const gy_sim_inst_view *i = &v->inst[v->gpu_inst[g]];
        if (i->n_stages == 0 && (double)i->kv_total > single_kv) single_kv = (double)i->kv_total;
        g += gy_sim_inst_gpus(i);
    }
    for (int32_t g = first; g < end && required > 0;) {
        /* a run of whole replicas with nothing under way */
        int32_t run = 0;
        while (g + run < end) {
            const gy_sim_inst_view *i = &v->inst[v->gpu_inst[g + run]];
            if (i->n_stages != 0 || i->xform != GY_SIM_XFORM_NONE) break;
            run++;
        }
        if (run < 2) {
            g += run > 0 ? run : gy_sim_inst_gpus(&v->inst[v->gpu_inst[g]]);
            continue;
        }
        int32_t group_of[GY_SIM_MAX_STAGES * 16];
        int32_t met = 0;
        double freed = 0;
        if (run > (int32_t)(sizeof group_of / sizeof group_of[0]) ||
            gy_buddy_plan(run, required, kun_param_blocks(v), cfg->buddy_strategy, single_kv,
                          group_of, &met, &freed) != GY_OK) {
            g += run;
            continue;
        }
        for (int32_t a = 0; a < run;) {
            int32_t b = a;
            while (b < run && group_of[b] == group_of[a]) b++;
            if (b - a >= 2) gy_sim_decision_add_op(d, GY_SIM_OP_DROP, g + a, b - a);
            a = b;
        }
        required -= freed;
        g += run;
    }
}

/* The monitor: drops for hosts short of memory, restores for groups whose demand fits. */
static void kun_monitor(kun_state *st, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                        gy_sim_decision *d) {
    if (v->pipeline == NULL || !v->buddy) return;
    const int32_t hosts = v->n_gpus / v->gpus_per_host;
    double single_usable = 0; /* a replica's usable blocks, from a replica in the view or the
                                 group's per-member share */
    double host_demand[KUN_MAX_HOSTS] = {0};
    for (int32_t h = 0; h < hosts; h++) {
        double demand = h == 0 ? (double)v->n_deferred : 0.0, room = 0;
        const int32_t first = h * v->gpus_per_host, end = first + v->gpus_per_host;
        for (int32_t g = first; g < end;) {
            const gy_sim_inst_view *i = &v->inst[v->gpu_inst[g]];
            demand += kun_demand(v, i);
            room += kun_free(v, i);
            if (i->n_stages == 0 && kun_free(v, i) > single_usable) single_usable = kun_free(v, i);
            g += gy_sim_inst_gpus(i);
        }
        if (demand > room) kun_plan_host(cfg, v, h, demand - room, d);
        if (h < KUN_MAX_HOSTS) host_demand[h] = demand;
    }
    if (single_usable <= 0) single_usable = (double)v->capacity[0] * (1.0 - v->watermark);
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (i->n_stages < 2) continue;
        const int32_t g = i->gpu_first;
        /* the host's demand would fit its GPUs as replicas, and the group's its members */
        const int32_t h = g / v->gpus_per_host;
        const int fits = i->xform == GY_SIM_XFORM_NONE &&
                         kun_demand(v, i) <= single_usable * i->n_stages &&
                         (h >= KUN_MAX_HOSTS ||
                          host_demand[h] <= KUN_RESTORE_FRACTION * single_usable * v->gpus_per_host);
        if (g >= KUN_MAX_GPUS) {
            if (fits) gy_sim_decision_add_op(d, GY_SIM_OP_RESTORE, g, i->n_stages);
            continue;
        }
        if (!fits) {
            st->fitting[g] = 0;
            continue;
        }
        if (!st->fitting[g]) {
            st->fitting[g] = 1;
            st->since[g] = v->now;
        }
        if (v->now - st->since[g] >= cfg->restore_wait) {
            gy_sim_decision_add_op(d, GY_SIM_OP_RESTORE, g, i->n_stages);
            st->fitting[g] = 0;
        }
    }
}

/* The fewest GPUs of one host whose buddy group (layers split evenly) holds r's KV; 0: none. */
static int32_t kun_group_size(const gy_sim_view *v, const gy_sim_req_view *r) {
    for (int32_t g = 2; g <= v->gpus_per_host && g <= v->pipeline->n_stages; g++) {
        const gy_sim_pipeline sub = gy_sim_pipeline_sub(v->pipeline, g);
        int32_t even[GY_SIM_MAX_STAGES];
        gy_sim_pipeline_even(&sub, even);
        if (gy_sim_pipeline_capacity(&sub, even) >= r->footprint) return g;
    }
    return 0;
}

/* For r, which no replica holds: DEFER on the least-loaded run of g whole replicas of one host
 * (nothing under way, no request waiting on it) with its DROP; DEFER on no group when none. */
static void kun_drop_for(const gy_sim_policy_config *cfg, const gy_sim_view *v, int32_t g,
                         gy_sim_decision *d) {
    int32_t best = -1;
    double best_load = 0;
    for (int32_t x = 0; x + g <= v->n_gpus; x++) {
        if (x / v->gpus_per_host != (x + g - 1) / v->gpus_per_host ||
            gy_sim_pending_overlaps(v, x, g, 0))
            continue;
        double load = 0;
        int whole = 1;
        for (int32_t y = x; y < x + g && whole; y++) {
            const gy_sim_inst_view *i = &v->inst[v->gpu_inst[y]];
            whole = i->n_stages == 0 && i->xform == GY_SIM_XFORM_NONE && i->placeable;
            load += gy_sim_policy_load(cfg, i);
        }
        if (whole && (best < 0 || load < best_load)) {
            best = x;
            best_load = load;
        }
    }
    d->action = GY_SIM_ACTION_DEFER;
    if (best < 0) return; /* every run is grouped or busy: as room frees */
    d->group = (gy_sim_group){.gpu_first = best, .size = g};
    gy_sim_decision_add_op(d, GY_SIM_OP_DROP, best, g);
}

static gy_status kun_place(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                           const gy_sim_req_view *r, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    const int32_t group = r->min_tp == 0 && v->buddy && v->pipeline != NULL
                              ? kun_group_size(v, r) : 0;
    if ((r->min_tp == 0 && group == 0) || r->min_tp > v->max_tp) {
        d->action = GY_SIM_ACTION_REJECT;
        return GY_OK;
    }
    int32_t best = -1;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        const int fits = group > 0 ? i->placeable && i->n_stages > 1 &&
                                         r->footprint <= i->kv_total
                                   : gy_sim_policy_fits(i, r);
        if (!fits) continue;
        if (best < 0 || gy_sim_policy_load(cfg, i) < gy_sim_policy_load(cfg, &v->inst[best]))
            best = k;
    }
    if (best >= 0) {
        d->action = GY_SIM_ACTION_PLACE;
        d->target = best;
    } else if (group > 0 && r->deferred && r->group.size > 0 &&
               gy_sim_group_under(v, r->group.gpu_first, r->group.size,
                                  GY_SIM_XFORM_DROPPING)) {
        d->action = GY_SIM_ACTION_DEFER; /* its group is on its way */
        d->group = r->group;
    } else if (group > 0) {
        kun_drop_for(cfg, v, group, d);
    } else {
        d->action = GY_SIM_ACTION_DEFER; /* on no group: a drop or a finish frees room */
    }
    kun_monitor(state, cfg, v, d);
    return GY_OK;
}

static gy_status kun_rebalance(void *state, const gy_sim_policy_config *cfg,
                               const gy_sim_view *v, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    kun_monitor(state, cfg, v, d);
    return GY_OK;
}

const gy_sim_policy_ops gy_sim_policy_kunserve = {
    .name = "kunserve",
    .state_size = sizeof(kun_state),
    .place = kun_place,
    .rebalance = kun_rebalance,
    .monitor = 1,
};
