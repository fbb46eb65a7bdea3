/* policy_seesaw.c: Seesaw's dynamic model re-sharding (Su et al., MLSys '25), the baseline of
 * Gyges section 6.2.3, as a policy of a sharded cluster: each aligned unit of N GPUs (N =
 * decode_tp, its decode parallelism, which gyges.cluster.seesaw_search picks as Seesaw's search
 * does; 0: the largest TP a host forms, max_tp) alternates between a prefill phase, where its
 * GPUs serve as N TP1 instances, and a decode phase, where they are one TP-N instance. Run with
 * sim.run(reshard="seesaw") its transitions move the KV and the weights through host memory
 * with the instances stopped, as Seesaw's do (cost.h: reshard).
 *
 *   prefill phase: new requests go to the unit's TP1 instances once the unit has settled
 *                  (nothing transforming, every instance TP1 or held at its TP by a request
 *                  that needs it: its first TP1s must not take every waiting request), room
 *                  for the whole KV first, then least load. Settled, its TP1s are asked to
 *                  park (GY_SIM_OP_PARK: Seesaw's tiered KV buffer): each request's KV goes to
 *                  host memory once its prompt is prefilled, so a TP1 needs room for prompts
 *                  only, and the unit gathers as many requests as its TP-N instance holds.
 *                  Once no prompt token is left to prefill and nothing waits at the cluster,
 *                  or the unit has gathered that much (without parking: every TP1 has
 *                  committed all its KV), and the unit holds a request a GPU at least, it
 *                  merges into the TP-N instance (x2 merges, the requests along with their KV;
 *                  the parked ones come back from host memory as it admits them);
 *   decode phase:  the TP-N instance decodes the unit's requests; new requests wait at the
 *                  cluster (transition-minimizing scheduling: prefills are gathered, not
 *                  interleaved). It splits back (x2 splits, the requests along) once it is
 *                  empty, or once requests wait and the decode batch has thinned to
 *                  1 - scale_down_free of the requests the phase began with (half), no request
 *                  needs its TP and its requests fit its halves.
 *
 * A request no TP1 instance holds goes to an instance of its TP with room, else the aligned
 * group of min_tp GPUs around the least-loaded instance merges for it (the baselines' rule); it
 * keeps that TP until it finishes. One that needs more than N GPUs, and more than the prefill
 * instances have, is rejected (the search picks no N below what the trace's requests need).
 *
 * Seesaw prefills with pipeline parallelism (each GPU one N-th of the layers). Where one GPU
 * holds the weights this prefills on data-parallel TP1 instances instead (each every layer):
 * PP's advantage (no all-reduce) without its bubbles, but only the KV room the whole weights
 * leave, and no room for prompts only a TP > 1 holds. The prefill instances are of TP `base`
 * (seesaw_base: the smallest that holds the weights, or prefill_tp, which the search sets so that
 * few requests need more). Where base > 1 they are what the executor's cost model makes them: with
 * the roofline's pipeline_degree = base (sim.run's prefill_pp, searched by
 * seesaw_search.prefill_pp) they are base-stage pipelines, priced and re-sharded so; this
 * policy decides the same either way. Its tiered KV buffer keeps prefilled KV in host memory
 * until the decode phase loads it; so does this where the executor has a host link (the
 * simulator: sim.run's swap_bw, by default PCIe for this policy), and on the CPU host, whose
 * executor refuses PARK, the KV stays on the workers and a prefill phase gathers what the TP1
 * instances hold. Seesaw's search covers data parallelism inside a phase too; here a unit is
 * one decode instance. Units beyond SEESAW_MAX_UNITS keep their layout. */
#include "policy.h"

#include <string.h>

#define SEESAW_MAX_UNITS 1024

typedef struct seesaw_state {
    uint8_t decode[SEESAW_MAX_UNITS];  /* 1: the unit is in (or moving to) its decode phase */
    uint8_t parking[SEESAW_MAX_UNITS]; /* 1: its TP1s were asked to park in this prefill phase */
    int64_t batch[SEESAW_MAX_UNITS];   /* requests the unit held when that phase began */
} seesaw_state;

/* GPUs of a unit: decode_tp (0: max_tp), or the largest TP below it that an aligned group of
 * the first host forms. */
static int32_t seesaw_unit(const gy_sim_policy_config *cfg, const gy_sim_view *v) {
    int32_t n = cfg->decode_tp > 0 && cfg->decode_tp < v->max_tp ? cfg->decode_tp : v->max_tp;
    while (n > 1 && (gy_sim_level(n) < 0 || !gy_sim_group_valid(v, 0, n))) n /= 2;
    return n;
}

/* The TP of a unit's prefill phase: the smallest whose instance holds the model's weights (TP1,
 * unless they need more GPUs: Llama-3-70B on an H100 needs a TP4), or prefill_tp if larger
 * (the search's: where many prompts need more than that TP to prefill, each would merge a
 * unit out of its phase). "TP1" below means it. */
static int32_t seesaw_base(const gy_sim_policy_config *cfg, const gy_sim_view *v) {
    for (int l = 0; l < GY_SIM_MAX_LEVELS && (INT32_C(1) << l) <= v->max_tp; l++)
        if (v->capacity[l] >= 1) {
            const int32_t tp = INT32_C(1) << l;
            return cfg->prefill_tp > tp && cfg->prefill_tp <= v->max_tp ? cfg->prefill_tp : tp;
        }
    return v->max_tp;
}

static int seesaw_in_decode(const seesaw_state *st, int32_t unit, int32_t gpu) {
    const int32_t u = gpu / unit;
    return st != NULL && u < SEESAW_MAX_UNITS && st->decode[u];
}

/* What a unit holds: its prompt tokens not prefilled yet, its requests and their blocks,
 * whether any of its instances is transforming, whether it is settled at TP1 (nothing
 * transforming, every instance TP1 or held at its TP by a request that needs it), whether its
 * TP1s park what they prefill (Seesaw's host buffer), and whether the prefill phase has gathered
 * what the unit holds: with parking, the blocks the TP-unit instance has; without, every TP1's
 * KV committed. */
typedef struct seesaw_work {
    int64_t prefill, requests, footprint;
    int moving, settled, parked, full;
} seesaw_work;

static seesaw_work seesaw_unit_work(const gy_sim_policy_config *cfg, const gy_sim_view *v,
                                    int32_t g, int32_t unit) {
    const int32_t base = seesaw_base(cfg, v);
    seesaw_work w = {0, 0, 0, 0, 1, 0, 1};
    for (int32_t k = v->gpu_inst[g]; k < v->n_inst && v->inst[k].gpu_first < g + unit; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        w.prefill += i->pending_prefill;
        w.requests += i->n_requests;
        w.footprint += i->footprint;
        w.moving |= i->xform != GY_SIM_XFORM_NONE;
        w.settled &= i->reserved || (i->xform == GY_SIM_XFORM_NONE &&
                                     (i->tp == base || i->max_min_tp >= i->tp));
        w.parked |= i->prefill_only;
        w.full &= i->tp > base || i->footprint >= i->kv_total;
    }
    if (w.parked) w.full = w.footprint >= v->capacity[gy_sim_level(unit)];
    return w;
}

static gy_status seesaw_place(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                              const gy_sim_req_view *r, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    const seesaw_state *st = state;
    const int32_t unit = seesaw_unit(cfg, v), base = seesaw_base(cfg, v);
    /* more than a unit holds: rejected, unless the prefill instances are larger and hold it */
    if (r->min_tp == 0 || r->min_tp > (unit > base ? unit : base)) {
        d->action = GY_SIM_ACTION_REJECT;
        return GY_OK;
    }
    if (gy_sim_policy_resume(v, r, d)) return GY_OK;
    if (r->min_tp <= base) { /* a TP1 instance of a unit settled in its prefill phase (the whole
                           * unit re-sharded: its first TP1s must not take every waiting
                           * request), room first */
        int32_t best = -1, best_room = 0;
        for (int32_t k = 0; k < v->n_inst; k++) {
            const gy_sim_inst_view *i = &v->inst[k];
            if (i->tp != base || i->reserved || !gy_sim_policy_fits(i, r) ||
                seesaw_in_decode(st, unit, i->gpu_first))
                continue;
            const seesaw_work w =
                seesaw_unit_work(cfg, v, i->gpu_first - i->gpu_first % unit, unit);
            if (!w.settled) continue;
            /* parking: the unit gathers what its decode instance holds; the TP1 needs room
             * for the prompt only */
            if (i->prefill_only && w.footprint + r->footprint > v->capacity[gy_sim_level(unit)])
                continue;
            const int room = i->prefill_only
                                 ? i->kv_used + (r->prompt + v->block_size - 1) / v->block_size <=
                                       i->kv_total
                                 : i->footprint + r->footprint <= i->kv_total;
            if (best < 0 || room > best_room ||
                (room == best_room &&
                 gy_sim_policy_load(cfg, i) < gy_sim_policy_load(cfg, &v->inst[best]))) {
                best = k;
                best_room = room;
            }
        }
        if (best >= 0) {
            d->action = GY_SIM_ACTION_PLACE;
            d->target = best;
        } else { /* every unit decodes (or moves): it waits for a prefill phase */
            d->action = GY_SIM_ACTION_DEFER;
            d->blocked = 1;
        }
        return GY_OK;
    }
    /* No TP1 holds it: an instance of its TP with room for it, the least loaded; else the
     * aligned group of min_tp GPUs around the least-loaded instance merges for it (the
     * baselines' rule), where it stays, held at its TP, until it finishes. */
    int32_t room = -1, any = -1;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (!i->placeable || i->xform != GY_SIM_XFORM_NONE || i->reserved) continue;
        const double load = gy_sim_policy_load(cfg, i);
        if (gy_sim_policy_fits(i, r) && i->footprint + r->footprint <= i->kv_total &&
            (room < 0 || load < gy_sim_policy_load(cfg, &v->inst[room])))
            room = k;
        if (any < 0 || load < gy_sim_policy_load(cfg, &v->inst[any])) any = k;
    }
    gy_sim_policy_place_or_scale(v, room >= 0 ? room : any, r, d);
    return GY_OK;
}

/* PARK (park 1) or UNPARK (0) every prefill instance (TP `base`) of the unit at g whose parking
 * is not that already; 0 when the decision is full. An instance held at a larger TP by a request
 * that needs it is not parked: that request keeps its TP and decodes there until it finishes
 * (parked, it would wait for a decode phase that the requests waiting for TP1s hold off). */
static int seesaw_park_unit(const gy_sim_view *v, int32_t g, int32_t unit, int32_t base,
                            int park, gy_sim_decision *d) {
    for (int32_t k = v->gpu_inst[g]; k < v->n_inst && v->inst[k].gpu_first < g + unit; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (i->tp == base && i->prefill_only != park &&
            !gy_sim_decision_add_op(d, park ? GY_SIM_OP_PARK : GY_SIM_OP_UNPARK, i->gpu_first,
                                    i->tp))
            return 0;
    }
    return 1;
}

static gy_status seesaw_rebalance(void *state, const gy_sim_policy_config *cfg,
                                  const gy_sim_view *v, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    seesaw_state *st = state;
    const int32_t unit = seesaw_unit(cfg, v), base = seesaw_base(cfg, v);
    if (unit <= base) return GY_OK;
    for (int32_t g = 0; g + unit <= v->n_gpus && g / unit < SEESAW_MAX_UNITS; g += unit) {
        if (!gy_sim_group_valid(v, g, unit)) continue;
        uint8_t *decode = &st->decode[g / unit];
        const seesaw_work w = seesaw_unit_work(cfg, v, g, unit);
        const int32_t whole = gy_sim_group_instance(v, g, unit);
        const int waited_for = gy_sim_pending_overlaps(v, g, unit, 0);
        /* its prompts are prefilled (and no request waits to be placed here), or its KV is all
         * committed */
        const int ready = w.settled && ((w.prefill == 0 && v->n_deferred == 0) || w.full);
        if (!*decode && !w.moving) {
            /* ready: decode at TP-N, for a batch of at least a request a GPU (fewer are not
             * worth two re-shardings: on the Azure trace, 8,000 transformations for 2,000
             * requests, now 340) */
            const int gathered = ready && w.requests >= unit;
            if (gathered) {
                *decode = 1;
                st->parking[g / unit] = 0;
                st->batch[g / unit] = w.requests;
            }
        } else if (*decode && !w.moving && whole >= 0) {
            const gy_sim_inst_view *i = &v->inst[whole];
            const int thinned = v->n_deferred > 0 && !waited_for && i->max_min_tp < i->tp &&
                                (double)w.requests <=
                                    (1.0 - cfg->scale_down_free) * (double)st->batch[g / unit] &&
                                gy_sim_policy_split_plausible(v, i);
            if (!i->reserved && (w.requests == 0 || thinned)) *decode = 0;
        }
        if (*decode) {
            /* -1: it cannot become one instance now (the decision is full): next time */
            if (gy_sim_policy_build_group(v, g, unit, d) < 0) return GY_OK;
            continue;
        }
        /* prefill phase: split what is above TP1, its requests along with their KV (a request
         * that needs its TP keeps it until it finishes), and merge what is below it (a layout
         * of smaller instances than prefill_tp); once settled, its instances park what they
         * prefill (asked once a phase: an executor without a host buffer refuses) */
        if (!gy_sim_policy_split_unneeded_in(v, g, unit, base, d)) return GY_OK;
        for (int32_t b = g; b < g + unit; b += base)
            if (gy_sim_policy_build_group(v, b, base, d) < 0 && d->n_ops >= GY_SIM_MAX_OPS)
                return GY_OK;
        if (w.settled && !w.moving && !st->parking[g / unit]) {
            if (!seesaw_park_unit(v, g, unit, base, 1, d)) return GY_OK;
            st->parking[g / unit] = 1;
        } else if (ready && !w.moving && w.parked && w.requests < unit) {
            /* ready, but too few to merge for: its instances decode them themselves (parked,
             * they would wait for a decode phase that does not come); not parked again until
             * its next prefill phase */
            if (!seesaw_park_unit(v, g, unit, base, 0, d)) return GY_OK;
        }
    }
    return GY_OK;
}

const gy_sim_policy_ops gy_sim_policy_seesaw = {
    .name = "seesaw",
    .state_size = sizeof(seesaw_state),
    .place = seesaw_place,
    .rebalance = seesaw_rebalance,
    .monitor = 1,     /* a TP1 step calls no rebalance; the prefill phase's end is watched */
    .pass_stable = 1, /* the phases change in rebalance only, never while requests are decided */
};
