/* policy_gyges.c: the transformation-aware scheduler of Gyges (section 5, Algorithms 1 and 2)
 * with the scale-up and scale-down rules of AMOEBAs (section 3.3).
 *
 * place (Algorithm 1, schedule_request):
 *   - a request that fits a TP1 instance ("short") goes to the instance where its prompt would
 *     be prefilled soonest (gy_sim_policy_prefill_wait: the prompt tokens waiting there, at that
 *     TP's prefill rate; ties to the least load per GPU, then the smaller TP), skipping reserved
 *     instances (check_reserve: GPUs a pending scale-up will take) and held ones (drained for a
 *     scale-down: Algorithm 2 "reduces the request rate to these instances"). Only when every
 *     candidate is reserved or held does it take a reserved TP1, then anything (gyges_pick).
 *     Least load per GPU (the paper's rule) treats a TP-k instance as k times as fast and adds
 *     decodes, which barely delay a prompt; on bench_sim's Azure runs, on 4xTP2, the soonest
 *     prefill cuts mean TTFT 1-3% and p99 TTFT 4-6%. First (ours) only among instances with
 *     room for its whole KV beside what they have committed (gyges_has_room, as for long
 *     requests), then among all: on Mooncake's prompts of thousands of tokens, TP1 instances
 *     that took them by prefill time alone preempted 1004 times in 20 minutes at 0.3 req/s
 *     (window throughput 0.76x least-load's; room first: 139 and 0.95x). When none has
 *     room and a TP1 instance holds fewer than GYGES_BURST_BATCH requests of its size (a
 *     memory burst), it is decided as a request that needs TP2, uncapped: a merge
 *     frees the halves' duplicate weights for KV (Qwen2.5-32B on H20: a TP2 holds 5.6x two
 *     TP1s' blocks). On KunServe's burst (bench_systems) that took its mean TTFT from 393 s
 *     (4020 preemptions) to 25 s (9), least-load's 21 s; it is placed as before when there
 *     is nothing to merge;
 *   - a request that needs TP > 1 ("long") is capable on an instance with room for its whole
 *     KV beside the footprints already committed there (no preemption thrash); held instances
 *     count (they are un-held: consecutive long requests reuse an instance already at a higher
 *     TP instead of transforming another group). Against the capable instance that prefills it
 *     soonest it weighs the scale-up it would otherwise start (Algorithm 1 "evaluates all
 *     potential transformation scenarios"): it goes to the instance unless that instance's load
 *     exceeds the group's by more than scale_up_load and the new group keeps at most
 *     scale_up_cap of the GPUs at TP > 1 (bursts of long requests must not take every TP1
 *     from the short ones);
 *     when no instance has room but one at its TP will once its requests finish and no group
 *     may take it (none can, or beyond scale_up_cap), the request waits for that room (DEFER,
 *     no group), and after merge_wait queues on the instance whose room comes soonest (ours:
 *     short requests placed meanwhile would otherwise take that room, over and over);
 *   - the scale-up: a deferred request keeps its group; a new one first joins a pending
 *     scale-up with room for it too, else starts one: the aligned group of min_tp GPUs with
 *     room, needing the fewest x2 merges, able to start now, least loaded; the request waits
 *     (DEFER) and the group is reserved until it is one instance: no new short requests, and
 *     each merge waits until its halves drained or merge_wait passed (gyges_gate_merges).
 * rebalance (Algorithm 2, schedule_parallelism): an instance with TP above the base TP that no
 * request needs (every request would fit its halves) and that no pending scale-up reserves is
 * held out of new placements; once `scale_down_free` (AMOEBAs: 50%) of its KV is free and its
 * requests fit in its halves, it splits (x2 steps down, as up).
 *
 * Latency mode (ours, not the paper's): at light load, a prompt's prefill time, not queueing,
 * is its TTFT, and TP2 or TP4 prefills it 1.4x or 1.7x as fast as TP1 (Qwen2.5-32B on H20). So
 * the base TP follows the cluster's outstanding work per GPU: 4 while it is at most idle_load,
 * 2 while at most light_load, else 1. Below the base, aligned pairs of equal instances merge
 * (their requests move along); above it, instances split as above once the load passes 4x the
 * threshold that merged them (the margin keeps a passing burst from churning). While a request
 * needs more than that base, the base is 1 (the paper's regime). Rebalance then also runs at
 * every tick (monitor), since a TP1 step never calls it. Where the view has the executor's cost
 * model, the mode also weighs decoding: a pair does not merge when the merged instance would
 * step its requests' decodes GYGES_DECODE_SLOWER slower than its halves do, and an instance
 * above the efficient floor that no request needs splits (held, as above) once it does, at
 * any load. Under the Table 1 fit a TP2 decodes a batch of 16 per half 1.6x as slowly as its
 * halves (its all-reduces): on Flying's alternating trace the pairs merged in a light phase
 * stayed about 25 s into the high one, and the goodput was 0.89x 8xTP1's; weighing decodes with
 * a 5% margin, 0.96x (10%: 0.94x; none: 0.99x, but Azure at 1.1 req/s then transforms 1,018
 * times instead of 434). Under the grounded calibration a TP2 decodes as fast as its halves and
 * nothing changes; the other traces of bench_sim and bench_systems are unchanged but Azure at
 * 1.1 req/s under the fit (goodput +0.1%, 472 transformations instead of 434).
 *
 * The efficient floor (ours): the base TP is at least the largest TP whose prefill rate per GPU
 * (the controller's, from the cost model) is GYGES_EFFICIENT of TP1's; while a request needs
 * TP > 1 the floor stays below that TP, unless long requests are most of the recent prompt
 * tokens (GYGES_LONG_MOST). Under the Table 1 fit it is 1 (the paper's premise: TP1
 * serves the most per GPU), so nothing above changes; under costs where TP is nearly free (NVLink
 * at NCCL's measured speed) short requests no longer wait on TP1 instances. Past light_load the
 * floor is instead the smallest TP up to it whose KV room per GPU is at least half the most
 * (gyges_roomy_tp): under load the queue is the KV, and a TP1 that keeps a whole copy of the
 * weights has little (Qwen2.5-32B on H20: 1/6 of a TP2's per GPU). Grounded, Flying's
 * alternating load: one TP8 through its high phases, goodput 0.86x 4xTP2's (the best static);
 * with TP1 under load 0.88x; with the roomy floor 0.96x (KunServe's burst 0.48x -> 0.53x of
 * 1xTP8's; the Table 1 fit, whose floor is 1, and the other traces unchanged).
 *
 * The work mix (ours): scale_up_cap keeps TP1 instances for short requests, which on Gyges'
 * workloads are most of the work. Where long prompts are (Mooncake's trace: 90% of the prompt
 * tokens need TP > 1), the TP1 half would idle while the long half queues (at 0.2 req/s on 8
 * H20, 0.6x the output throughput of least-load). So a scale-up may also take the GPUs at TP > 1
 * to the long requests' share of the recent prompt tokens (arrivals, decayed over
 * GYGES_MIX_SECONDS), give or take half its group. */
#include "policy.h"

#include <math.h>
#include <string.h>

#define GYGES_MIX_SECONDS 120.0 /* (ours) a couple of Gyges 6.2.4's long arrivals */
#define GYGES_EFFICIENT 0.9     /* (ours) a TP this close to TP1's prefill rate per GPU is free */
#define GYGES_BURST_BATCH 8     /* (ours) a TP1 holding fewer requests of a size: memory-bound */
#define GYGES_LONG_MOST 0.75    /* (ours) long requests' share of the prompt tokens that is most
                                   of the work (6.2.4: about 0.45; Mooncake's: about 0.9) */
#define GYGES_DECODE_SLOWER 1.05 /* (ours) a merged instance whose decode step is this much slower
                                   than its halves' (the view's cost model) costs its requests
                                   more in TPOT than its prefills save them in TTFT */

typedef struct gyges_state {
    double t;           /* when the mix was last updated */
    double long_tokens; /* decayed prompt tokens of arrivals that need TP > 1 */
    double all_tokens;  /* decayed prompt tokens of every arrival */
} gyges_state;

/* The long requests' share of the recent prompt tokens (state NULL: no history, 0). */
static double gyges_long_share(const gyges_state *st) {
    return st != NULL && st->all_tokens > 0 ? st->long_tokens / st->all_tokens : 0;
}

static void gyges_count_arrival(gyges_state *st, const gy_sim_view *v, const gy_sim_req_view *r) {
    if (st == NULL || r->deferred) return;
    const double decay = st->all_tokens > 0 ? exp(-(v->now - st->t) / GYGES_MIX_SECONDS) : 0;
    st->t = v->now;
    st->long_tokens = st->long_tokens * decay + (r->min_tp > 1 ? (double)r->prompt : 0);
    st->all_tokens = st->all_tokens * decay + (double)r->prompt;
}

/* Least load; ties to the smaller TP for short requests (more throughput per GPU), to the
 * larger for long ones (more room for the next), then the lower GPU. */
static int gyges_better(const gy_sim_policy_config *cfg, const gy_sim_inst_view *a,
                        const gy_sim_inst_view *b, int is_long) {
    const double la = gy_sim_policy_load(cfg, a), lb = gy_sim_policy_load(cfg, b);
    if (la != lb) return la < lb;
    if (a->tp != b->tp) return is_long ? a->tp > b->tp : a->tp < b->tp;
    return a->gpu_first < b->gpu_first;
}

/* 1 when r's prompt is prefilled sooner on a than on b (ties: gyges_better). */
static int gyges_sooner(const gy_sim_policy_config *cfg, const gy_sim_view *v,
                        const gy_sim_inst_view *a, const gy_sim_inst_view *b,
                        const gy_sim_req_view *r, int is_long) {
    const double wa = gy_sim_policy_prefill_wait(v, a, r->prompt);
    const double wb = gy_sim_policy_prefill_wait(v, b, r->prompt);
    return wa != wb ? wa < wb : gyges_better(cfg, a, b, is_long);
}

/* Room for all of a request's KV beside what the instance has already committed: a request
 * placed there will not be preempted by the requests already there. */
static int gyges_has_room(const gy_sim_inst_view *i, const gy_sim_req_view *r) {
    return i->placeable && r->min_tp <= i->tp && i->footprint + r->footprint <= i->kv_total;
}

/* The instance that prefills a short request soonest (Algorithm 1's check_and_update), in
 * tiers: tier 0, instances neither reserved nor held (a long prompt being prefilled there is
 * in its waiting tokens); tier 1, any TP1 (a reserved group only drains more slowly); tier 2,
 * anything that fits (held instances are draining towards a scale-down). With `room`, only
 * instances with room for its whole KV beside what they have committed (gyges_has_room). */
static int32_t gyges_pick(const gy_sim_policy_config *cfg, const gy_sim_view *v,
                          const gy_sim_req_view *r, int tier, int room) {
    int32_t best = -1;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (!gy_sim_policy_fits(i, r) || (room && !gyges_has_room(i, r))) continue;
        if (tier == 1 && i->tp > 1) continue;
        if (tier < 1 && (i->reserved || i->held)) continue;
        if (best < 0 || gyges_sooner(cfg, v, i, &v->inst[best], r, 0)) best = k;
    }
    return best;
}

/* The blocks committed on, and the load per GPU of, the instances inside group [g, g + s). */
static void gyges_group_load(const gy_sim_policy_config *cfg, const gy_sim_view *v, int32_t g,
                             int32_t s, int64_t *footprint, double *load) {
    *footprint = 0;
    *load = 0;
    for (int32_t k = v->gpu_inst[g]; k < v->n_inst && v->inst[k].gpu_first < g + s; k++) {
        *footprint += v->inst[k].footprint;
        *load += gy_sim_policy_load(cfg, &v->inst[k]) * v->inst[k].tp / s;
    }
}

/* The scale-up a long request would start or join: DEFER and ops in d; returns 1 and the
 * group's load per GPU in *load when one is possible, 0 (d: DEFER on no group) when none. */
static int gyges_scale_up(const gy_sim_policy_config *cfg, const gy_sim_view *v,
                          const gy_sim_req_view *r, gy_sim_decision *d, double *load_out) {
    d->action = GY_SIM_ACTION_DEFER;
    d->group = (gy_sim_group){0, 0, 0};
    *load_out = 0;
    /* join a pending scale-up that will hold it as well */
    for (int32_t p = 0; p < v->n_pending; p++) {
        const gy_sim_group g = v->pending[p];
        const int l = gy_sim_level(g.size);
        if (l < 0 || g.size < r->min_tp) continue;
        int64_t fp;
        double load;
        gyges_group_load(cfg, v, g.gpu_first, g.size, &fp, &load);
        if (fp + g.footprint + r->footprint > v->capacity[l]) continue;
        gy_sim_decision tmp = *d;
        if (gy_sim_policy_build_group(v, g.gpu_first, g.size, &tmp) < 0) continue;
        *d = tmp;
        d->group = (gy_sim_group){g.gpu_first, g.size, 0};
        *load_out = load;
        return 1;
    }
    /* a new group of min_tp GPUs: fewest merges, then one that can start now, then least load */
    const int32_t s = r->min_tp;
    int best_merges = 0, best_ready = 0, found = 0;
    double best_load = 0;
    gy_sim_decision best = *d;
    for (int32_t g = 0; g + s <= v->n_gpus; g += s) {
        if (!gy_sim_group_valid(v, g, s) || gy_sim_pending_overlaps(v, g, s, 0)) continue;
        gy_sim_decision tmp = *d;
        /* 1: already one instance, judged as such by the caller */
        if (gy_sim_policy_build_group(v, g, s, &tmp) != 0) continue;
        int64_t fp;
        double load;
        gyges_group_load(cfg, v, g, s, &fp, &load);
        if (fp + r->footprint > v->capacity[gy_sim_level(s)]) continue;
        int merges = 0;
        for (int32_t k = v->gpu_inst[g]; k < v->n_inst && v->inst[k].gpu_first < g + s; k++)
            merges++;
        const int ready = tmp.n_ops > d->n_ops;
        const int better = !found || merges < best_merges ||
                           (merges == best_merges && ready > best_ready) ||
                           (merges == best_merges && ready == best_ready && load < best_load);
        if (better) {
            found = 1;
            best_merges = merges;
            best_ready = ready;
            best_load = load;
            best = tmp;
            best.group = (gy_sim_group){g, s, 0};
        }
    }
        if (found) {
        *d = best;
        *load_out = best_load;
    }
    return found;
}

/* Reservation (Algorithm 1's check_reserve): the group takes no new short requests from the
 * moment the long request waits for it, and each x2 merge starts once both halves have drained
 * (no requests left), or once the request has waited merge_wait seconds. Requests still there
 * then move into the merged instance with their progress; draining first keeps short requests
 * from decoding beside the long request's prefill chunks. Drops the merges not due yet from
 * d->ops[from..]. */
static void gyges_gate_merges(const gy_sim_policy_config *cfg, const gy_sim_view *v,
                              const gy_sim_req_view *r, gy_sim_decision *d, int32_t from) {
    if (v->now - r->arrival >= cfg->merge_wait) return;
    int32_t kept = from;
    for (int32_t k = from; k < d->n_ops; k++) {
        const gy_sim_op *op = &d->ops[k];
        int due = 1;
        if (op->kind == GY_SIM_OP_MERGE) {
            const int32_t a = gy_sim_group_instance(v, op->gpu_first, op->size / 2);
            const int32_t b = gy_sim_group_instance(v, op->gpu_first + op->size / 2, op->size / 2);
            due = a >= 0 && b >= 0 && v->inst[a].n_requests == 0 && v->inst[b].n_requests == 0;
        }
        if (due) d->ops[kept++] = *op;
    }
    d->n_ops = kept;
}

/* 1 when the GPUs at TP > 1 or reserved, with group g added, stay within scale_up_cap of them,
 * or within the long requests' share of the work `long_share` give or take half the group (the
 * nearest whole group to that share). */
static int gyges_within_cap(const gy_sim_policy_config *cfg, double long_share,
                            const gy_sim_view *v, gy_sim_group g) {
    int32_t scaled = 0;
    for (int32_t x = 0; x < v->n_gpus; x++) {
        scaled += v->inst[v->gpu_inst[x]].tp > 1 ||
                  gy_sim_ranges_overlap(x, 1, g.gpu_first, g.size) ||
                  gy_sim_pending_overlaps(v, x, 1, 0);
    }
    return scaled <= cfg->scale_up_cap * v->n_gpus ||
           scaled <= long_share * v->n_gpus + 0.5 * g.size;
}

/* The instance of r's TP whose committed requests leave room for r soonest (the fewest blocks
 * committed; ties: gyges_better), neither held nor reserved; -1 when none holds r at all. */
static int32_t gyges_soonest_room(const gy_sim_policy_config *cfg, const gy_sim_view *v,
                                  const gy_sim_req_view *r) {
    int32_t best = -1;
    for (int32_t j = 0; j < v->n_inst; j++) {
        const gy_sim_inst_view *i = &v->inst[j];
        if (!gy_sim_policy_fits(i, r) || i->held || i->reserved) continue;
        if (best < 0 || i->footprint < v->inst[best].footprint ||
            (i->footprint == v->inst[best].footprint && gyges_better(cfg, i, &v->inst[best], 1)))
            best = j;
    }
    return best;
}

/* A request that needs TP > 1 (Algorithm 1's long branch; the module comment). queue: 1 lets it
 * queue on an instance without room once it has waited merge_wait (below); 0 defers it. */
static gy_status gyges_place_long(const gy_sim_policy_config *cfg, double long_share,
                                  const gy_sim_view *v, const gy_sim_req_view *r, int queue,
                                  gy_sim_decision *d) {
    /* long: the instance with room for it that prefills it soonest, held ones included */
    int32_t k = -1;
    for (int32_t j = 0; j < v->n_inst; j++) {
        if (!gyges_has_room(&v->inst[j], r)) continue;
        if (k < 0 || gyges_sooner(cfg, v, &v->inst[j], &v->inst[k], r, 1)) k = j;
    }
    gy_sim_decision up;
    memset(&up, 0, sizeof up);
    double group_load = 0;
    int can_scale = 0;
    if (!gy_sim_policy_resume(v, r, &up)) {
        memset(&up, 0, sizeof up);
        can_scale = gyges_scale_up(cfg, v, r, &up, &group_load);
        /* No instance has room for it now and no group may take it: none can (every group of
         * its TP is one instance already, as in a memory burst), or a scale-up beyond
         * scale_up_cap would leave short requests too few instances (at 2x the 6.2.4 rate, a
         * second TP4 left none). It waits at the cluster for room, at most merge_wait (the
         * drain a merge waits for), then queues where room comes soonest (ours): an instance
         * admits in order, so the requests placed after it stop taking the room it waits for.
         * KunServe's burst: P99 TTFT 550 s of requests that need a TP2, now 83 s. */
        const int capped = up.group.size > 0 && !gyges_within_cap(cfg, long_share, v, up.group);
        if (k < 0 && (up.group.size == 0 || capped)) {
            const int32_t j = queue && v->now - r->arrival >= cfg->merge_wait
                                  ? gyges_soonest_room(cfg, v, r)
                                  : -1;
            if (j >= 0) {
                memset(d, 0, sizeof *d);
                d->action = GY_SIM_ACTION_PLACE;
                d->target = j;
                return GY_OK;
            }
            for (int32_t i = 0; capped && i < v->n_inst; i++)
                if (v->inst[i].tp >= r->min_tp && v->inst[i].kv_total >= r->footprint) {
                    memset(d, 0, sizeof *d);
                    d->action = GY_SIM_ACTION_DEFER; /* no group: decided again as room frees */
                    return GY_OK;
                }
        }
    } else if (up.action == GY_SIM_ACTION_PLACE) {
        *d = up; /* its group is ready */
        return GY_OK;
    } else {
        can_scale = 1; /* waiting for its group, which is on its way */
        group_load = 0;
    }
    if (k >= 0 && (!can_scale || up.group.size == 0 ||
                   gy_sim_policy_load(cfg, &v->inst[k]) - group_load <= cfg->scale_up_load ||
                   !gyges_within_cap(cfg, long_share, v, up.group))) {
        d->action = GY_SIM_ACTION_PLACE;
        d->target = k;
        if (v->inst[k].held)
            gy_sim_decision_add_op(d, GY_SIM_OP_UNHOLD, v->inst[k].gpu_first, v->inst[k].tp);
        return GY_OK;
    }
    *d = up;
    gyges_gate_merges(cfg, v, r, d, 0);
    /* no instance has room and no group can take it: nor any larger request of its TP that
     * the controller decides after it in this pass (deferred later, so waited no longer: none
     * would queue after merge_wait where this one does not) */
    d->blocked = k < 0 && up.group.size == 0 && d->n_ops == 0;
    return GY_OK;
}

static gy_status gyges_place(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                             const gy_sim_req_view *r, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    if (r->min_tp == 0 || r->min_tp > v->max_tp) {
        d->action = GY_SIM_ACTION_REJECT;
        return GY_OK;
    }
    gyges_count_arrival(state, v, r);
    const double long_share = gyges_long_share(state);
    if (r->min_tp == 1) { /* short: first where its KV will not be preempted (ours: prompts
                           * of thousands of tokens, Mooncake's, thrash TP1 instances that take
                           * them by prefill time alone), then the tiers without that */
        int32_t k = -1;
        for (int tier = 0; tier < 3 && k < 0; tier++) k = gyges_pick(cfg, v, r, tier, 1);
        if (k < 0 && v->max_tp >= 2 && v->capacity[0] < GYGES_BURST_BATCH * r->footprint) {
            /* No instance has room for its KV and a TP1 instance holds few requests of its size
             * (a memory burst): decided as a request that needs TP2, whose merge frees the
             * halves' duplicate weights for KV (Qwen2.5-32B on H20: a TP2 holds 5.6x two TP1s'
             * blocks); placed as before when that finds nothing to do. Where a TP1 holds many
             * (6.2.4's 1K-token requests: 8.4), the queue is compute, which a merge slows:
             * 6.2.4 at 3x, mean TTFT 215 s merging and 99 s not; Flying's alternating trace,
             * TPOT 304 ms and 127 ms; KunServe's burst (3,000-token outputs) merges still */
            gy_sim_req_view wide = *r;
            wide.min_tp = 2;
            /* (uncapped: the cap keeps TP1 instances for short requests, and none of them has
             * room for this one) */
            GY_TRY(gyges_place_long(cfg, 1.0, v, &wide, 0, d)); /* queues as a short one below */
            if (d->action != GY_SIM_ACTION_DEFER || d->group.size > 0 || d->n_ops > 0)
                return GY_OK;
            memset(d, 0, sizeof *d);
        }
        for (int tier = 0; tier < 3 && k < 0; tier++) k = gyges_pick(cfg, v, r, tier, 0);
        if (k >= 0) {
            d->action = GY_SIM_ACTION_PLACE;
            d->target = k;
        } else {
            d->action = GY_SIM_ACTION_DEFER; /* nothing placeable now (everything splitting) */
            d->blocked = 1;
        }
        return GY_OK;
    }
    return gyges_place_long(cfg, long_share, v, r, 1, d);
}

/* The largest TP whose prefill rate per GPU (the controller's, from the cost model) is at least
 * GYGES_EFFICIENT of TP1's (ours): a larger instance then gives up no throughput and prefills
 * faster. Under the Table 1 fit (Qwen2.5-32B on H20: TP2 at 68% of TP1's rate per GPU) it is 1,
 * the paper's regime; with NVLink at NCCL's measured speed (the grounded calibration: TP8 at
 * 95%) it is 8, and short requests stop queueing on TP1 instances for nothing. */
static int32_t gyges_efficient_tp(const gy_sim_view *v) {
    int32_t tp = 1;
    if (v->prefill_rate == NULL) return tp;
    for (int32_t l = 1; l < GY_SIM_MAX_LEVELS && (INT32_C(1) << l) <= v->max_tp; l++)
        if (v->prefill_rate[l] >= GYGES_EFFICIENT * (double)(INT32_C(1) << l) * v->prefill_rate[0])
            tp = INT32_C(1) << l;
    while (tp > 1 && !gy_sim_group_valid(v, 0, tp)) tp /= 2; /* the host */
    return tp;
}

/* The smallest TP up to `most` whose KV room per GPU is at least half the most any TP up to it
 * has (the floor under load): below it the copies of the weights leave the KV little room. */
static int32_t gyges_roomy_tp(const gy_sim_view *v, int32_t most) {
    double best = 0;
    for (int32_t l = 0; l < GY_SIM_MAX_LEVELS && (INT32_C(1) << l) <= most; l++) {
        const double room = (double)v->capacity[l] / (double)(INT32_C(1) << l);
        if (room > best) best = room;
    }
    for (int32_t l = 0; l < GY_SIM_MAX_LEVELS && (INT32_C(1) << l) <= most; l++)
        if ((double)v->capacity[l] / (double)(INT32_C(1) << l) >= 0.5 * best)
            return INT32_C(1) << l;
    return most;
}

/* The base TP at `load` outstanding tokens per GPU: the latency mode's, at least `floor` (1 on
 * clusters that do not merge and split). */
static int32_t gyges_base_tp(const gy_sim_policy_config *cfg, const gy_sim_view *v, double load,
                             int32_t floor) {
    if (v->replicated || v->pipeline != NULL || v->buddy) return 1;
    int32_t tp = floor;
    if (cfg->idle_load > 0 && load <= cfg->idle_load && tp < 4) tp = 4;
    else if (cfg->light_load > 0 && load <= cfg->light_load && tp < 2) tp = 2;
    while (tp > 1 && !gy_sim_group_valid(v, 0, tp)) tp /= 2; /* max_tp, the host */
    return tp;
}

/* The context of `n_running` requests holding `kv_used` blocks (tokens each). */
static double gyges_context(const gy_sim_view *v, int64_t kv_used, int64_t n_running) {
    return n_running > 0 ? (double)kv_used * (double)v->block_size / (double)n_running : 0.0;
}

/* 1 when a TP-`tp` instance decoding `batch` requests of `context` tokens steps
 * GYGES_DECODE_SLOWER slower than its halves would with `half_a` and `half_b` of them (by the
 * view's cost model; 0 without one). */
static int gyges_decode_slower(const gy_sim_view *v, int32_t tp, int64_t half_a, int64_t half_b,
                               double context) {
    const double merged = gy_sim_policy_decode_step(v, tp, half_a + half_b, context);
    const double a = gy_sim_policy_decode_step(v, tp / 2, half_a, context);
    const double b = gy_sim_policy_decode_step(v, tp / 2, half_b, context);
    const double halves = a > b ? a : b;
    return merged > 0 && halves > 0 && merged > GYGES_DECODE_SLOWER * halves;
}

/* Latency mode, up: a MERGE of every aligned pair of equal instances below `base` that nothing
 * holds, reserves or transforms, unless the merged instance would decode their requests more
 * slowly than they do (gyges_decode_slower). Returns 0 when the decision is full. */
static int gyges_merge_to_base(const gy_sim_view *v, int32_t base, gy_sim_decision *d) {
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *a = &v->inst[k];
        const int32_t g = a->gpu_first, size = 2 * a->tp;
        if (a->tp >= base || g % size != 0 || v->capacity[gy_sim_level(size)] < 1) continue;
        const int32_t j = gy_sim_group_instance(v, g + a->tp, a->tp);
        if (j < 0 || !gy_sim_group_valid(v, g, size)) continue;
        const gy_sim_inst_view *b = &v->inst[j];
        if (a->xform != GY_SIM_XFORM_NONE || b->xform != GY_SIM_XFORM_NONE || a->reserved ||
            b->reserved || a->held || b->held || !a->placeable || !b->placeable)
            continue;
        if (gyges_decode_slower(v, size, a->n_running, b->n_running,
                                gyges_context(v, a->kv_used + b->kv_used,
                                              a->n_running + b->n_running)))
            continue;
        if (!gy_sim_pending_overlaps(v, g, size, 0) &&
            !gy_sim_decision_add_op(d, GY_SIM_OP_MERGE, g, size))
            return 0;
    }
    return 1;
}

static gy_status gyges_rebalance(void *state, const gy_sim_policy_config *cfg,
                                 const gy_sim_view *v, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    double load = 0; /* outstanding work per GPU of the cluster */
    for (int32_t k = 0; k < v->n_inst; k++)
        load += gy_sim_policy_load(cfg, &v->inst[k]) * (double)v->inst[k].tp;
    load /= (double)v->n_gpus;
    /* A request that needs more than the base (served, or waiting for its group) puts the
     * cluster in the paper's regime: short requests on TP1, away from the groups that merge
     * for long ones (a base-TP2 pair merged into its TP4 would carry its short requests into
     * the long prompt's prefill chunks: 6.2.4's TPOT +5%, goodput -0.5%). */
    int32_t need = 0;
    for (int32_t k = 0; k < v->n_inst; k++)
        if (v->inst[k].max_min_tp > need) need = v->inst[k].max_min_tp;
    for (int32_t p = 0; p < v->n_pending; p++)
        if (v->pending[p].size > need) need = v->pending[p].size;
    /* The efficient TP is the floor; while a request needs TP > 1, below what it needs, so
     * that its group and the instances of the other requests stay apart (grounded costs, 6.2.4
     * at 2x: mean TTFT 2.1 s, where a floor of what it needs gave 10.3 s and none 3.5 s),
     * unless long requests are most of the work (Mooncake's: 11.4 s kept apart at 0.1 req/s,
     * 6.2 s not, 1xTP8's 6.0 s). */
    int32_t floor = gyges_efficient_tp(v);
    if (need > 1 && floor >= need && gyges_long_share(state) < GYGES_LONG_MOST) floor = need / 2;
    /* under load (for the merges: now; for the splits: at a quarter, the latency mode's
     * margin), the KV room the weights leave decides, not the prefill rate */
    const int32_t roomy = gyges_roomy_tp(v, floor);
    const int32_t floor_up = cfg->light_load > 0 && load > cfg->light_load ? roomy : floor;
    const int32_t floor_base = cfg->light_load > 0 && load / 4 > cfg->light_load ? roomy : floor;
    int32_t up = gyges_base_tp(cfg, v, load, floor_up),
            base = gyges_base_tp(cfg, v, load / 4, floor_base);
    if (need > up) up = floor;
    if (need > base) base = floor; /* what a split must be above */
    if (!gyges_merge_to_base(v, up, d)) return GY_OK;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (i->xform != GY_SIM_XFORM_NONE || i->reserved) continue;
        if (i->max_min_tp >= i->tp) continue; /* a request still needs this TP */
        /* above the base; or above the efficient floor, decoding more slowly than its halves
         * would, which hold its requests (the latency mode's merges as the load grows) */
        if (i->tp <= base &&
            (i->tp <= floor || !gy_sim_policy_split_plausible(v, i) ||
             !gyges_decode_slower(v, i->tp, i->n_running - i->n_running / 2, i->n_running / 2,
                                  gyges_context(v, i->kv_used, i->n_running))))
            continue;
        if (!i->held && !gy_sim_decision_add_op(d, GY_SIM_OP_HOLD, i->gpu_first, i->tp)) break;
        const double free_frac = 1.0 - (double)i->kv_used / (double)i->kv_total;
        if (free_frac >= cfg->scale_down_free && gy_sim_policy_split_plausible(v, i))
            if (!gy_sim_decision_add_op(d, GY_SIM_OP_SPLIT, i->gpu_first, i->tp)) break;
    }
    return GY_OK;
}

const gy_sim_policy_ops gy_sim_policy_gyges = {
    .name = "gyges",
    .state_size = sizeof(gyges_state),
    .place = gyges_place,
    .rebalance = gyges_rebalance,
    .monitor = 1,
    .pass_stable = 1, /* its work mix counts arrivals only */
};
