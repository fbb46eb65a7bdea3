/* policy.c: the policy registry and the helpers the policies share (load, fitting, aligned
 * groups and the x2 merge plan). */
#include "policy.h"

#include <string.h>

static const gy_sim_policy_ops *const gy_sim_policies[] = {
    &gy_sim_policy_gyges,
    &gy_sim_policy_round_robin,
    &gy_sim_policy_least_load,
    &gy_sim_policy_static,
    &gy_sim_policy_flying,
    &gy_sim_policy_pipelive,
    &gy_sim_policy_kunserve,
    &gy_sim_policy_llumnix,
    &gy_sim_policy_loongserve,
    &gy_sim_policy_seesaw,
};

const gy_sim_policy_ops *gy_sim_policy_find(const char *name) {
    if (name == NULL) return NULL;
    for (size_t i = 0; i < sizeof gy_sim_policies / sizeof gy_sim_policies[0]; i++)
        if (strcmp(gy_sim_policies[i]->name, name) == 0) return gy_sim_policies[i];
    return NULL;
}

const char *gy_sim_policy_names(void) {
    return "gyges, round_robin, least_load, static, flying, pipelive, kunserve, llumnix, "
           "loongserve, seesaw";
}

gy_sim_policy_config gy_sim_policy_config_default(void) {
    return (gy_sim_policy_config){.decode_weight = 8.0, .scale_down_free = 0.5,
                                  .scale_up_load = 16384.0, .scale_up_cap = 0.5,
                                  /* 2 s: on the Azure runs of bench_sim, 10 s cost goodput
                                   * and p99 TTFT (long prompts waiting for a drain) and the
                                   * 6.2.4 workload does not tell them apart */
                                  .merge_wait = 2.0,
                                  .eager_scale_up = 1,
                                  /* flying: half a host; arrivals go to TP groups while the
                                   * outstanding work is at most 4000 tokens per GPU (on
                                   * bench_flying's bursty Llama-3-70B trace, 1000 keeps DP's
                                   * burst TTFT but TP's light-load gain is small, 16000 the
                                   * reverse) */
                                  .flying_tp = 0, .light_load = 4000.0,
                                  /* gyges' latency mode: base TP 2 up to light_load, 4 up to
                                   * 250 tokens per GPU (bench_sim's Azure runs: 3000 to 6000
                                   * give the same TTFT; 500 for TP4 churns twice as much) */
                                  .idle_load = 250.0,
                                  /* kunserve: Algorithm 1; 5 s of fitting demand before a
                                   * restore (policy_kunserve.c) */
                                  .buddy_strategy = 0, .restore_wait = 5.0,
                                  /* llumnix: one migration per instance pair and look */
                                  .max_migrations = 1,
                                  /* loongserve: a prompt of 8K tokens or more may take more
                                   * instances than its KV needs (ours: the paper's scheduler
                                   * prices each choice; at 8K a TP1 prefill of a 32B model on
                                   * an H20 is about a second) */
                                  .sp_min_prompt = 8192.0,
                                  /* seesaw: decode at the largest TP a host forms */
                                  .decode_tp = 0, .prefill_tp = 0};
}

int gy_sim_level(int32_t tp) {
    for (int l = 0; l < GY_SIM_MAX_LEVELS; l++)
        if (tp == (INT32_C(1) << l)) return l;
    return -1;
}

int32_t gy_sim_inst_gpus(const gy_sim_inst_view *i) {
    return i->n_stages > 0 ? i->n_stages : i->tp;
}

double gy_sim_policy_load(const gy_sim_policy_config *cfg, const gy_sim_inst_view *i) {
    return ((double)i->pending_prefill + cfg->decode_weight * (double)i->pending_output) /
           (double)i->tp;
}

double gy_sim_policy_prefill_wait(const gy_sim_view *v, const gy_sim_inst_view *i, int64_t prompt) {
    const int l = gy_sim_level(i->tp);
    const double rate = v->prefill_rate != NULL && l >= 0 ? v->prefill_rate[l] : (double)i->tp;
    return ((double)i->pending_prefill + (double)prompt) / rate;
}

double gy_sim_policy_decode_step(const gy_sim_view *v, int32_t tp, int64_t batch, double context) {
    if (v->cost == NULL || v->cost->step_time == NULL || batch < 1) return -1.0;
    const gy_sim_step_shape s = {.n_tokens = batch, .n_seqs = batch, .n_samples = batch,
                                 .kv_read_tokens = (double)batch * context,
                                 .attn_pairs = (double)batch * context, .busy_share = 1.0};
    return v->cost->step_time(v->cost->ctx, tp, 0, &s);
}

int gy_sim_policy_fits(const gy_sim_inst_view *i, const gy_sim_req_view *r) {
    return i->placeable && r->footprint <= i->kv_total && r->min_tp > 0 && r->min_tp <= i->tp;
}

int gy_sim_group_valid(const gy_sim_view *v, int32_t g, int32_t size) {
    if (gy_sim_level(size) < 0 || size > v->max_tp || g < 0 || g % size != 0) return 0;
    if (g + size > v->n_gpus) return 0;
    return g / v->gpus_per_host == (g + size - 1) / v->gpus_per_host;
}

int32_t gy_sim_group_instance(const gy_sim_view *v, int32_t g, int32_t size) {
    if (g < 0 || g >= v->n_gpus) return -1;
    const int32_t k = v->gpu_inst[g];
    return v->inst[k].gpu_first == g && v->inst[k].tp == size ? k : -1;
}

int gy_sim_ranges_overlap(int32_t a, int32_t na, int32_t b, int32_t nb) {
    return a < b + nb && b < a + na;
}

int gy_sim_pending_overlaps(const gy_sim_view *v, int32_t g, int32_t size, int32_t min_size) {
    for (int32_t p = 0; p < v->n_pending; p++)
        if (v->pending[p].size >= min_size &&
            gy_sim_ranges_overlap(v->pending[p].gpu_first, v->pending[p].size, g, size))
            return 1;
    return 0;
}

int32_t gy_sim_policy_bound_group(const gy_sim_view *v, const gy_sim_req_view *r) {
    if (!r->deferred || r->group.size == 0) return -1;
    const int32_t k = gy_sim_group_instance(v, r->group.gpu_first, r->group.size);
    return k >= 0 && v->inst[k].bound && gy_sim_policy_fits(&v->inst[k], r) ? k : -1;
}

int gy_sim_group_under(const gy_sim_view *v, int32_t g, int32_t size, int32_t xform) {
    for (int32_t x = g; x < g + size && x < v->n_gpus;) {
        const gy_sim_inst_view *i = &v->inst[v->gpu_inst[x]];
        if (i->xform == xform) return 1;
        x = i->gpu_first + gy_sim_inst_gpus(i);
    }
    return 0;
}

int gy_sim_decision_add_op(gy_sim_decision *d, int32_t kind, int32_t gpu_first, int32_t size) {
    for (int32_t i = 0; i < d->n_ops; i++) /* the same op twice would only be refused */
        if (d->ops[i].kind == kind && d->ops[i].gpu_first == gpu_first && d->ops[i].size == size)
            return 1;
    if (d->n_ops >= GY_SIM_MAX_OPS) return 0;
    d->ops[d->n_ops++] = (gy_sim_op){.kind = kind, .gpu_first = gpu_first, .size = size};
    return 1;
}

int gy_sim_policy_build_group(const gy_sim_view *v, int32_t g, int32_t size, gy_sim_decision *d) {
    if (!gy_sim_group_valid(v, g, size)) return -1;
    const gy_sim_inst_view *owner = &v->inst[v->gpu_inst[g]];
    if (owner->xform == GY_SIM_XFORM_LOST) return -1; /* its host is gone */
    if (owner->tp > size) return -1; /* the group is a part of a larger instance */
    if (owner->gpu_first == g && owner->tp == size) return 1;
    const int32_t half = size / 2;
    const int ra = gy_sim_policy_build_group(v, g, half, d);
    const int rb = gy_sim_policy_build_group(v, g + half, half, d);
    if (ra < 0 || rb < 0) return -1;
    if (ra == 0 || rb == 0) return 0;
    const gy_sim_inst_view *a = &v->inst[gy_sim_group_instance(v, g, half)];
    const gy_sim_inst_view *b = &v->inst[gy_sim_group_instance(v, g + half, half)];
    if (a->xform != GY_SIM_XFORM_NONE || b->xform != GY_SIM_XFORM_NONE) return 0; /* wait */
    return gy_sim_decision_add_op(d, GY_SIM_OP_MERGE, g, size) ? 0 : -1;
}

int gy_sim_policy_split_plausible(const gy_sim_view *v, const gy_sim_inst_view *i) {
    const int l = gy_sim_level(i->tp);
    if (l < 1) return 0;
    const int64_t cap = v->capacity[l - 1];
    if (cap < 1) return 0; /* the model does not fit the halves */
    const int64_t usable = cap - (int64_t)(v->watermark * (double)cap);
    /* the simulator packs the requests greedily into the halves; keep a little slack so that
     * the greedy packing almost always succeeds when this says yes */
    return i->max_footprint <= usable && (double)i->footprint <= 1.9 * (double)usable;
}

int gy_sim_policy_resume(const gy_sim_view *v, const gy_sim_req_view *r, gy_sim_decision *d) {
    if (!r->deferred || r->group.size == 0) return 0;
    const int32_t k = gy_sim_group_instance(v, r->group.gpu_first, r->group.size);
    if (k >= 0) {
        if (v->inst[k].kv_total < r->footprint || v->inst[k].xform == GY_SIM_XFORM_LOST)
            return 0; /* the group is too small after all, or gone: decided afresh */
        if (v->inst[k].placeable) {
            d->action = GY_SIM_ACTION_PLACE;
            d->target = k;
        } else { /* being split: wait until it is settled */
            d->action = GY_SIM_ACTION_DEFER;
            d->group = r->group;
        }
        return 1;
    }
    if (gy_sim_policy_build_group(v, r->group.gpu_first, r->group.size, d) < 0) return 0;
    d->action = GY_SIM_ACTION_DEFER;
    d->group = r->group;
    return 1;
}

/* Defers r on the aligned group of min_tp GPUs around inst[k] and starts its merges. */
static void gy_sim_policy_scale_up_around(const gy_sim_view *v, int32_t k,
                                          const gy_sim_req_view *r, gy_sim_decision *d) {
    d->action = GY_SIM_ACTION_DEFER;
    const int32_t s = r->min_tp;
    const int32_t g = v->inst[k].gpu_first / s * s;
    gy_sim_decision tmp = *d;
    if (gy_sim_policy_build_group(v, g, s, &tmp) >= 0) {
        *d = tmp;
        d->group = (gy_sim_group){g, s, 0};
    }
}

void gy_sim_policy_place_or_scale(const gy_sim_view *v, int32_t k, const gy_sim_req_view *r,
                                  gy_sim_decision *d) {
    if (k < 0) {
        d->action = GY_SIM_ACTION_DEFER;
        d->blocked = 1; /* nothing placeable, whatever the request */
    } else if (gy_sim_policy_fits(&v->inst[k], r)) {
        d->action = GY_SIM_ACTION_PLACE;
        d->target = k;
    } else {
        gy_sim_policy_scale_up_around(v, k, r, d);
    }
}

int gy_sim_policy_split_unneeded_in(const gy_sim_view *v, int32_t g, int32_t size,
                                    int32_t floor, gy_sim_decision *d) {
    for (int32_t k = v->gpu_inst[g]; k < v->n_inst && v->inst[k].gpu_first < g + size; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (i->tp <= floor || i->xform != GY_SIM_XFORM_NONE || i->reserved) continue;
        if (i->max_min_tp >= i->tp || !gy_sim_policy_split_plausible(v, i)) continue;
        if (!gy_sim_decision_add_op(d, GY_SIM_OP_SPLIT, i->gpu_first, i->tp)) return 0;
    }
    return 1;
}

gy_status gy_sim_policy_split_unneeded(void *state, const gy_sim_policy_config *cfg,
                                       const gy_sim_view *v, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    gy_sim_policy_split_unneeded_in(v, 0, v->n_gpus, 1, d);
    return GY_OK;
}

