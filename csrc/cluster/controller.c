/* controller.c: the cluster controller of controller.h. */
#include "controller.h"
#include "../core/alloc.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct gy_cluster_waiting {
    gy_cluster_request r;
    gy_sim_group group; /* the group it waits for (size 0: none) */
} gy_cluster_waiting;

struct gy_cluster {
    gy_cluster_config config;
    int64_t capacity[GY_SIM_MAX_LEVELS];
    double prefill_rate[GY_SIM_MAX_LEVELS];
    gy_cluster_ops ops;
    void *ctx;
    void *policy_state;
    int busy; /* inside a call: the ops may not call back */

    gy_cluster_waiting *deferred; /* (n_deferred) in the order they were deferred */
    int64_t n_deferred, cap_deferred;
    gy_cluster_request *deferred_out; /* gy_cluster_deferred's copy */
    gy_sim_group *deferred_groups;
    int64_t cap_out;

    int32_t *held; /* (n_held) pairs (gpu_first, tp) */
    int32_t n_held;

    /* the groups the deferred requests wait for, in the order they were first named, with
     * the blocks of those requests: kept as requests are deferred (a reconsideration starts
     * them afresh), so that a view costs nothing per waiting request */
    gy_sim_group *pending;
    int32_t n_pending;

    /* the view, rebuilt before each policy call: (n_gpus) rows and GPU map */
    gy_sim_inst_view *rows;
    int32_t *gpu_inst;

    gy_cluster_stats stats;
};

/* ---- checks ---- */

static int gy_cluster_tp_ok(int32_t tp, int32_t max_tp) {
    return tp >= 1 && tp <= max_tp && gy_sim_level(tp) >= 0;
}

/* A group a request may wait for: an aligned group of size <= max_tp, or on a buddy cluster a
 * run of 2 or more of one host's GPUs (DROP takes any run, aligned or not). */
static int gy_cluster_group_ok(const gy_sim_view *v, const gy_sim_group *g) {
    if (g->gpu_first < 0) return 0;
    if (v->buddy)
        return g->size >= 2 && g->size <= v->gpus_per_host &&
               g->gpu_first / v->gpus_per_host == (g->gpu_first + g->size - 1) / v->gpus_per_host;
    return gy_cluster_tp_ok(g->size, v->max_tp) && g->gpu_first % g->size == 0;
}

gy_status gy_cluster_view_check(const gy_sim_view *v) {
    if (v == NULL) return GY_FAIL(GY_ERR_INVALID, "view: NULL");
    /* a host's GPUs: a power of two for TP groups; a pipeline's stages any count (max_tp 1) */
    if (v->n_gpus < 1 || v->gpus_per_host < 1 ||
        (v->max_tp > 1 && gy_sim_level(v->gpus_per_host) < 0) ||
        v->n_gpus % v->gpus_per_host != 0 || !gy_cluster_tp_ok(v->max_tp, v->gpus_per_host) ||
        v->block_size < 1 || !(v->watermark >= 0.0 && v->watermark < 1.0))
        return GY_FAIL(GY_ERR_INVALID,
                       "bad view: n_gpus %d, gpus_per_host %d (a power of two dividing n_gpus), "
                       "max_tp %d (a power of two <= gpus_per_host), block_size %lld, "
                       "watermark %g",
                       (int)v->n_gpus, (int)v->gpus_per_host, (int)v->max_tp,
                       (long long)v->block_size, v->watermark);
    if (v->n_inst < 1 || v->n_inst > v->n_gpus || v->inst == NULL || v->gpu_inst == NULL ||
        v->capacity == NULL || v->n_pending < 0 || (v->n_pending > 0 && v->pending == NULL))
        return GY_FAIL(GY_ERR_INVALID, "bad view: %d instances for %d GPUs, %d pending groups",
                       (int)v->n_inst, (int)v->n_gpus, (int)v->n_pending);
    int min_level = -1; /* the smallest TP the model fits: smaller ones have capacity 0 */
    for (int l = 0; l <= gy_sim_level(v->max_tp); l++) {
        if (v->capacity[l] < 0 || (min_level >= 0 && v->capacity[l] < 1))
            return GY_FAIL(GY_ERR_INVALID, "bad view: capacity of TP%d is %lld blocks", 1 << l,
                           (long long)v->capacity[l]);
        if (min_level < 0 && v->capacity[l] >= 1) min_level = l;
    }
    if (min_level < 0)
        return GY_FAIL(GY_ERR_INVALID, "bad view: no TP up to max_tp %d has KV capacity",
                       (int)v->max_tp);
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (i->n_stages != 0) { /* a pipeline: one GPU a stage, any first GPU */
            const int32_t prev_end = k > 0 ? v->inst[k - 1].gpu_first +
                                                 gy_sim_inst_gpus(&v->inst[k - 1]) : 0;
            int ok = i->n_stages >= 2 && i->n_stages <= GY_SIM_MAX_STAGES && i->tp == 1 &&
                     i->gpu_first >= prev_end && i->gpu_first + i->n_stages <= v->n_gpus &&
                     i->kv_total >= 1;
            for (int32_t s = 0; ok && s < i->n_stages; s++) ok = i->layers[s] >= 1;
            if (ok && v->pipeline != NULL) { /* a buddy group may have fewer stages */
                const gy_sim_pipeline sub = gy_sim_pipeline_sub(v->pipeline, i->n_stages);
                ok = (i->n_stages == v->pipeline->n_stages || v->buddy) &&
                     i->n_stages <= v->pipeline->n_stages && gy_sim_pipeline_split_ok(&sub,
                                                                                      i->layers);
            }
            if (!ok)
                return GY_FAIL(GY_ERR_INVALID,
                               "bad view: instance %d (GPU %d, %d stages, %lld blocks) is not a "
                               "pipeline of 2 to %d one-GPU stages of at least a layer each "
                               "(a split of the model's), in GPU order without overlap",
                               (int)k, (int)i->gpu_first, (int)i->n_stages,
                               (long long)i->kv_total, GY_SIM_MAX_STAGES);
            continue;
        }
        if (!gy_cluster_tp_ok(i->tp, v->max_tp) || gy_sim_level(i->tp) < min_level ||
            i->gpu_first < 0 || i->gpu_first % i->tp ||
            i->gpu_first + i->tp > v->n_gpus ||
            (k > 0 && i->gpu_first < v->inst[k - 1].gpu_first +
                                         gy_sim_inst_gpus(&v->inst[k - 1])) ||
            i->kv_total < 1)
            return GY_FAIL(GY_ERR_INVALID,
                           "bad view: instance %d (GPU %d, TP%d, %lld blocks) is not an aligned "
                           "group of a power-of-two TP <= max_tp %d with blocks, in GPU order "
                           "without overlap",
                           (int)k, (int)i->gpu_first, (int)i->tp, (long long)i->kv_total,
                           (int)v->max_tp);
    }
    for (int32_t k = 0; k < v->n_inst; k++)
        if (v->inst[k].xform == GY_SIM_XFORM_LOST && v->inst[k].placeable)
            return GY_FAIL(GY_ERR_INVALID, "bad view: instance %d (GPU %d) is lost but placeable",
                           (int)k, (int)v->inst[k].gpu_first);
    for (int32_t g = 0; g < v->n_gpus; g++) {
        const int32_t k = v->gpu_inst[g];
        if (k < 0 || k >= v->n_inst || g < v->inst[k].gpu_first ||
            g >= v->inst[k].gpu_first + gy_sim_inst_gpus(&v->inst[k]))
            return GY_FAIL(GY_ERR_INVALID,
                           "bad view: GPU %d maps to instance %d, which does not own it", (int)g,
                           (int)k);
    }
    for (int32_t p = 0; p < v->n_pending; p++) {
        const gy_sim_group *g = &v->pending[p];
        if (!gy_cluster_group_ok(v, g) || g->gpu_first + g->size > v->n_gpus)
            return GY_FAIL(GY_ERR_INVALID,
                           "bad view: pending group %d (GPU %d, size %d) is not an aligned group "
                           "of size <= max_tp (a buddy cluster: a run of one host's GPUs)",
                           (int)p, (int)g->gpu_first, (int)g->size);
    }
    return GY_OK;
}

/* ---- set-up ---- */

gy_status gy_cluster_init(gy_cluster **out, const gy_cluster_config *config,
                          const gy_cluster_ops *ops, void *ctx) {
    if (out == NULL || config == NULL || ops == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_cluster_init: NULL argument");
    *out = NULL;
    if (ops->instances == NULL || ops->assign == NULL || ops->reconfigure == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_cluster_init: the executor lacks instances, assign "
                                       "or reconfigure");
    if (config->policy == NULL || config->policy->place == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_cluster_init: no policy");
    const int32_t levels = gy_sim_level(config->max_tp) + 1;
    if (config->n_gpus < 1 || config->gpus_per_host < 1 ||
        (config->max_tp > 1 && gy_sim_level(config->gpus_per_host) < 0) ||
        config->n_gpus % config->gpus_per_host != 0 ||
        levels < 1 || levels > GY_SIM_MAX_LEVELS || config->max_tp > config->gpus_per_host ||
        config->capacity == NULL || config->block_size < 1 ||
        !(config->watermark >= 0.0 && config->watermark < 1.0))
        return GY_FAIL(GY_ERR_INVALID,
                       "gy_cluster_init: n_gpus %d, gpus_per_host %d, max_tp %d, block_size "
                       "%lld, watermark %g",
                       (int)config->n_gpus, (int)config->gpus_per_host, (int)config->max_tp,
                       (long long)config->block_size, config->watermark);
    for (int32_t l = 0; config->prefill_rate != NULL && l < levels; l++)
        if (!(config->prefill_rate[l] > 0.0 && config->prefill_rate[l] < INFINITY))
            return GY_FAIL(GY_ERR_INVALID, "gy_cluster_init: prefill_rate of TP%d is %g", 1 << l,
                           config->prefill_rate[l]);
    gy_cluster *c = gy_calloc(1, sizeof *c);
    if (c == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the controller");
    c->config = *config;
    memcpy(c->capacity, config->capacity, (size_t)levels * sizeof *c->capacity);
    c->config.capacity = c->capacity;
    for (int32_t l = 0; config->prefill_rate != NULL && l < levels; l++)
        c->prefill_rate[l] = config->prefill_rate[l];
    if (config->prefill_rate != NULL) c->config.prefill_rate = c->prefill_rate;
    c->ops = *ops;
    c->ctx = ctx;
    const size_t n = (size_t)config->n_gpus;
    c->rows = gy_calloc(n, sizeof *c->rows);
    c->gpu_inst = gy_calloc(n, sizeof *c->gpu_inst);
    c->pending = gy_calloc(n, sizeof *c->pending);
    c->held = gy_calloc(2 * n, sizeof *c->held);
    if (config->policy->state_size > 0)
        c->policy_state = gy_calloc(1, config->policy->state_size);
    if (c->rows == NULL || c->gpu_inst == NULL || c->pending == NULL || c->held == NULL ||
        (config->policy->state_size > 0 && c->policy_state == NULL)) {
        gy_cluster_free(c);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the controller");
    }
    *out = c;
    return GY_OK;
}

void gy_cluster_free(gy_cluster *c) {
    if (c == NULL) return;
    free(c->deferred);
    free(c->deferred_out);
    free(c->deferred_groups);
    free(c->held);
    free(c->rows);
    free(c->gpu_inst);
    free(c->pending);
    free(c->policy_state);
    free(c);
}

/* ---- held instances ---- */

static int32_t gy_cluster_held_index(const gy_cluster *c, int32_t gpu_first, int32_t tp) {
    for (int32_t k = 0; k < c->n_held; k++)
        if (c->held[2 * k] == gpu_first && c->held[2 * k + 1] == tp) return k;
    return -1;
}

int gy_cluster_held(const gy_cluster *c, int32_t gpu_first, int32_t tp) {
    return c != NULL && gy_cluster_held_index(c, gpu_first, tp) >= 0;
}

static void gy_cluster_set_held(gy_cluster *c, int32_t gpu_first, int32_t tp, int held) {
    const int32_t k = gy_cluster_held_index(c, gpu_first, tp);
    if (held && k < 0 && c->n_held < c->config.n_gpus) { /* at most one per GPU: instances */
        c->held[2 * c->n_held] = gpu_first;
        c->held[2 * c->n_held + 1] = tp;
        c->n_held++;
    } else if (!held && k >= 0) {
        c->n_held--;
        c->held[2 * k] = c->held[2 * c->n_held];
        c->held[2 * k + 1] = c->held[2 * c->n_held + 1];
    }
}

/* ---- the policy's view ---- */

static gy_status gy_cluster_view(gy_cluster *c, double now, gy_sim_view *v) {
    int32_t n = 0;
    GY_TRY(c->ops.instances(c->ctx, c->rows, c->config.n_gpus, &n));
    if (n < 1 || n > c->config.n_gpus)
        return GY_FAIL(GY_ERR_STATE, "the executor listed %d instances for %d GPUs", (int)n,
                       (int)c->config.n_gpus);
    const int32_t n_pending = c->n_pending;
    for (int32_t g = 0; g < c->config.n_gpus; g++) c->gpu_inst[g] = -1;
    for (int32_t k = 0; k < n; k++) {
        gy_sim_inst_view *i = &c->rows[k];
        i->held = gy_cluster_held(c, i->gpu_first, i->tp);
        i->reserved = 0;
        const int32_t width = gy_sim_inst_gpus(i);
        for (int32_t p = 0; p < n_pending && !i->reserved; p++)
            i->reserved = gy_sim_ranges_overlap(i->gpu_first, width, c->pending[p].gpu_first,
                                                c->pending[p].size);
        for (int32_t x = i->gpu_first; x < i->gpu_first + width; x++)
            if (x >= 0 && x < c->config.n_gpus) c->gpu_inst[x] = k;
    }
    *v = (gy_sim_view){
        .now = now,
        .n_gpus = c->config.n_gpus,
        .gpus_per_host = c->config.gpus_per_host,
        .max_tp = c->config.max_tp,
        .n_inst = n,
        .inst = c->rows,
        .gpu_inst = c->gpu_inst,
        .capacity = c->capacity,
        .block_size = c->config.block_size,
        .watermark = c->config.watermark,
        .n_pending = n_pending,
        .pending = c->pending,
        .replicated = c->config.replicated,
        .base_tp = c->config.base_tp,
        .n_deferred = c->n_deferred,
        .pipeline = c->config.pipeline,
        .buddy = c->config.buddy,
        .prefill_rate = c->config.prefill_rate, /* NULL unless the executor gave them */
        .cost = c->config.cost,
    };
    if (gy_cluster_view_check(v) != GY_OK) {
        char why[512]; /* the message is rewritten below: copy it out first */
        snprintf(why, sizeof why, "%s", gy_error_message());
        return GY_FAIL(GY_ERR_STATE, "the executor's instances make a bad view (%s)", why);
    }
    return GY_OK;
}

/* ---- decisions ---- */

static gy_status gy_cluster_apply_op(gy_cluster *c, const gy_sim_view *v, const gy_sim_op *op) {
    c->stats.n_ops++;
    int32_t started = 0;
    switch (op->kind) {
    case GY_SIM_OP_MERGE:
    case GY_SIM_OP_SPLIT:
        GY_TRY(c->ops.reconfigure(c->ctx, op, &started));
        if (!started) break;
        if (op->kind == GY_SIM_OP_MERGE) {
            c->stats.n_merges_started++;
            gy_cluster_set_held(c, op->gpu_first, op->size / 2, 0);
            gy_cluster_set_held(c, op->gpu_first + op->size / 2, op->size / 2, 0);
        } else {
            c->stats.n_splits_started++;
            gy_cluster_set_held(c, op->gpu_first, op->size, 0);
        }
        return GY_OK;
    case GY_SIM_OP_BIND:
    case GY_SIM_OP_RELEASE:
        GY_TRY(c->ops.reconfigure(c->ctx, op, &started));
        if (!started) break;
        if (op->kind == GY_SIM_OP_BIND) c->stats.n_binds_started++;
        else c->stats.n_releases_started++;
        /* the members (or the bound instance) are gone once it ends: nothing stays held */
        for (int32_t k = 0; k < v->n_inst; k++)
            if (gy_sim_ranges_overlap(v->inst[k].gpu_first, gy_sim_inst_gpus(&v->inst[k]),
                                      op->gpu_first,
                                      op->size))
                gy_cluster_set_held(c, v->inst[k].gpu_first, v->inst[k].tp, 0);
        return GY_OK;
    case GY_SIM_OP_RESPLIT:
        GY_TRY(c->ops.reconfigure(c->ctx, op, &started));
        if (!started) break;
        c->stats.n_resplits_started++; /* the pipeline stays itself: held or not as before */
        return GY_OK;
    case GY_SIM_OP_DROP:
    case GY_SIM_OP_RESTORE:
        GY_TRY(c->ops.reconfigure(c->ctx, op, &started));
        if (!started) break;
        if (op->kind == GY_SIM_OP_DROP) c->stats.n_drops_started++;
        else c->stats.n_restores_started++;
        /* the members (or the group) are gone once it switches: nothing stays held */
        for (int32_t k = 0; k < v->n_inst; k++)
            if (gy_sim_ranges_overlap(v->inst[k].gpu_first, gy_sim_inst_gpus(&v->inst[k]),
                                      op->gpu_first, op->size))
                gy_cluster_set_held(c, v->inst[k].gpu_first, v->inst[k].tp, 0);
        return GY_OK;
    case GY_SIM_OP_PARK: /* the instance stays; what it serves changes */
    case GY_SIM_OP_UNPARK:
        GY_TRY(c->ops.reconfigure(c->ctx, op, &started));
        if (!started) break;
        return GY_OK;
    case GY_SIM_OP_MIGRATE: /* a request moves; the instances stay as they are */
        GY_TRY(c->ops.reconfigure(c->ctx, op, &started));
        if (!started) break;
        c->stats.n_migrations_started++;
        return GY_OK;
    case GY_SIM_OP_HOLD:
    case GY_SIM_OP_UNHOLD: {
        const int32_t k = op->gpu_first >= 0 && op->gpu_first < v->n_gpus
                              ? v->gpu_inst[op->gpu_first] : -1;
        if (k < 0 || v->inst[k].gpu_first != op->gpu_first ||
            (op->size > 0 && v->inst[k].tp != op->size))
            break;
        gy_cluster_set_held(c, op->gpu_first, v->inst[k].tp, op->kind == GY_SIM_OP_HOLD);
        return GY_OK;
    }
    default:
        return GY_FAIL(GY_ERR_STATE, "policy %s returned an unknown op kind %d",
                       c->config.policy->name, (int)op->kind);
    }
    c->stats.n_ops_refused++;
    return GY_OK;
}

static gy_status gy_cluster_apply_ops(gy_cluster *c, const gy_sim_view *v,
                                      const gy_sim_decision *d) {
    if (d->n_ops < 0 || d->n_ops > GY_SIM_MAX_OPS)
        return GY_FAIL(GY_ERR_STATE, "policy %s returned %d ops", c->config.policy->name,
                       (int)d->n_ops);
    for (int32_t k = 0; k < d->n_ops; k++) GY_TRY(gy_cluster_apply_op(c, v, &d->ops[k]));
    return GY_OK;
}

/* Adds a deferred request's blocks to the group it waits for. */
static gy_status gy_cluster_pending_add(gy_cluster *c, gy_sim_group g, int64_t footprint) {
    if (g.size == 0) return GY_OK;
    int32_t p = 0;
    while (p < c->n_pending &&
           !(c->pending[p].gpu_first == g.gpu_first && c->pending[p].size == g.size))
        p++;
    if (p == c->n_pending) {
        if (c->n_pending == c->config.n_gpus)
            return GY_FAIL(GY_ERR_STATE, "more pending groups than GPUs");
        c->pending[c->n_pending++] = (gy_sim_group){g.gpu_first, g.size, 0};
    }
    c->pending[p].footprint += footprint;
    return GY_OK;
}

static gy_status gy_cluster_defer_push(gy_cluster *c, const gy_cluster_request *r,
                                       gy_sim_group group) {
    if (c->n_deferred == c->cap_deferred) {
        const int64_t cap = c->cap_deferred ? 2 * c->cap_deferred : 64;
        gy_cluster_waiting *p = gy_realloc(c->deferred, (size_t)cap * sizeof *p);
        if (p == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory in the controller");
        c->deferred = p;
        c->cap_deferred = cap;
    }
    GY_TRY(gy_cluster_pending_add(c, group, r->footprint));
    c->deferred[c->n_deferred++] = (gy_cluster_waiting){.r = *r, .group = group};
    return GY_OK;
}

/* Asks the policy about r: `deferred_before` and `group` say whether and on what it waited.
 * *outcome (may be NULL): 1 when r was deferred again on no group with no ops and the policy
 * says it is blocked (gy_sim_decision.blocked), 0 when it was deferred with nothing changed,
 * -1 when the cluster changed (a placement, a rejection, an op). */
static gy_status gy_cluster_decide(gy_cluster *c, const gy_cluster_request *r, int deferred_before,
                                   gy_sim_group group, double now, int *outcome) {
    gy_sim_view v;
    GY_TRY(gy_cluster_view(c, now, &v));
    const gy_sim_req_view rv = {.id = r->id, .prompt = r->prompt, .output = r->output,
                                .footprint = r->footprint, .min_tp = r->min_tp,
                                .deferred = deferred_before, .group = group,
                                .arrival = r->arrival, .priority = r->priority};
    gy_sim_decision d;
    memset(&d, 0, sizeof d);
    GY_TRY(c->config.policy->place(c->policy_state, &c->config.policy_config, &v, &rv, &d));
    c->stats.n_decisions++;
    const char *name = c->config.policy->name;
    switch (d.action) {
    case GY_SIM_ACTION_PLACE: {
        if (d.target < 0 || d.target >= v.n_inst)
            return GY_FAIL(GY_ERR_STATE, "policy %s placed request %lld on instance %d of %d",
                           name, (long long)r->id, (int)d.target, (int)v.n_inst);
        const gy_sim_inst_view *i = &v.inst[d.target];
        /* on a buddy cluster a request no replica holds (min_tp 0) may go to a group */
        const int group_only = r->min_tp == 0 && v.buddy && i->n_stages > 1;
        if (!i->placeable || r->footprint > i->kv_total || (r->min_tp == 0 && !group_only) ||
            i->tp < r->min_tp)
            return GY_FAIL(GY_ERR_STATE,
                           "policy %s placed request %lld (%lld blocks) on the TP%d instance at "
                           "GPU %d, which cannot take it (%lld blocks, %s)",
                           name, (long long)r->id, (long long)r->footprint, (int)i->tp,
                           (int)i->gpu_first, (long long)i->kv_total,
                           i->placeable ? "too small" : "not placeable");
        gy_cluster_request placed = *r;
        placed.tp_work = d.tp_work != 0;
        GY_TRY(c->ops.assign(c->ctx, &placed, GY_SIM_ACTION_PLACE, i->gpu_first, i->tp));
        break;
    }
    case GY_SIM_ACTION_DEFER:
        GY_TRY(c->ops.assign(c->ctx, r, GY_SIM_ACTION_DEFER, -1, 0));
        GY_TRY(gy_cluster_defer_push(c, r, d.group));
        break;
    case GY_SIM_ACTION_REJECT:
        GY_TRY(c->ops.assign(c->ctx, r, GY_SIM_ACTION_REJECT, -1, 0));
        c->stats.n_rejected++;
        break;
    default:
        return GY_FAIL(GY_ERR_STATE, "policy %s returned action %d for request %lld", name,
                       (int)d.action, (long long)r->id);
    }
    if (outcome != NULL)
        *outcome = d.action != GY_SIM_ACTION_DEFER || d.n_ops > 0 ? -1
                   : d.group.size == 0 && d.blocked                ? 1
                                                                   : 0;
    GY_TRY(gy_cluster_apply_ops(c, &v, &d));
    if (c->ops.decided != NULL) GY_TRY(c->ops.decided(c->ctx, r, d.action));
    return GY_OK;
}

/* What the deferred requests are decided again after (the contract of policy.h). */
enum { GY_CLUSTER_ALL = 0, GY_CLUSTER_STEP = 1, GY_CLUSTER_TIME = 2 };

/* Whether the event can change the decision about a waiting request: a step that ended on the
 * instance at (g, tp) concerns those waiting for no group, for a group it is part of, or for an
 * instance it could be; time passing concerns those waiting for a group (its merges wait for
 * merge_wait); a reconfiguration, all. */
static int gy_cluster_relevant(const gy_cluster_waiting *w, int event, int32_t g, int32_t tp) {
    if (event == GY_CLUSTER_TIME) return w->group.size > 0;
    return event == GY_CLUSTER_ALL || w->group.size == 0 || tp >= w->r.min_tp ||
           gy_sim_ranges_overlap(g, tp, w->group.gpu_first, w->group.size);
}

/* The deferred requests, in the order they were deferred, are decided again: those the event
 * can concern; the others keep their place. */
static gy_status gy_cluster_reconsider_after(gy_cluster *c, double now, int event, int32_t g,
                                             int32_t tp) {
    /* In place: entry k is read before anything is written at index n_deferred <= k (a
     * decision defers its request at most once), so the list is rebuilt in order without a
     * copy and never grows past its n entries (no reallocation while it is read). */
    const int64_t n = c->n_deferred;
    if (n == 0) return GY_OK;
    c->n_deferred = 0;
    c->n_pending = 0;
    /* A stateless policy that found a request blocked (nothing holds it, no scale-up) would
     * find every later one of its TP and at least its footprint blocked too, until the pass
     * changes the cluster: those keep their place undecided (the policy's contract). */
    int64_t blocked[GY_SIM_MAX_LEVELS];
    const int prune = c->config.policy->state_size == 0 || c->config.policy->pass_stable;
    for (int l = 0; l < GY_SIM_MAX_LEVELS; l++) blocked[l] = INT64_MAX;
    gy_status st = GY_OK;
    int64_t k = 0;
    for (; k < n && st == GY_OK; k++) {
        const gy_cluster_waiting w = c->deferred[k];
        const int level = w.r.min_tp > 0 ? gy_sim_level(w.r.min_tp) : -1;
        if (!gy_cluster_relevant(&w, event, g, tp) ||
            (prune && level >= 0 && w.group.size == 0 && w.r.footprint >= blocked[level])) {
            c->deferred[c->n_deferred++] = w; /* keeps its place */
            st = gy_cluster_pending_add(c, w.group, w.r.footprint);
            continue;
        }
        int outcome = 0;
        st = gy_cluster_decide(c, &w.r, 1, w.group, now, &outcome);
        if (outcome < 0)
            for (int l = 0; l < GY_SIM_MAX_LEVELS; l++) blocked[l] = INT64_MAX;
        else if (outcome > 0 && level >= 0 && w.r.footprint < blocked[level])
            blocked[level] = w.r.footprint;
    }
    /* after a failure the ones not decided yet stay waiting, in order */
    for (; k < n && st != GY_OK; k++) {
        c->deferred[c->n_deferred++] = c->deferred[k];
        (void)gy_cluster_pending_add(c, c->deferred[k].group, c->deferred[k].r.footprint);
    }
    return st;
}


static gy_status gy_cluster_rebalance(gy_cluster *c, double now) {
    if (c->config.policy->rebalance == NULL) return GY_OK;
    gy_sim_view v;
    GY_TRY(gy_cluster_view(c, now, &v));
    gy_sim_decision d;
    memset(&d, 0, sizeof d);
    GY_TRY(c->config.policy->rebalance(c->policy_state, &c->config.policy_config, &v, &d));
    c->stats.n_rebalances++;
    return gy_cluster_apply_ops(c, &v, &d);
}

/* ---- the calls ---- */

#define GY_CLUSTER_ENTER(c)                                                                        \
    do {                                                                                           \
        if ((c) == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL controller");                       \
        if ((c)->busy)                                                                             \
            return GY_FAIL(GY_ERR_STATE, "the cluster controller was called from one of its "    \
                                         "executor's ops");                                        \
        (c)->busy = 1;                                                                             \
    } while (0)

static gy_status gy_cluster_leave(gy_cluster *c, gy_status s) {
    c->busy = 0;
    return s;
}

gy_status gy_cluster_arrive(gy_cluster *c, const gy_cluster_request *r, double now) {
    GY_CLUSTER_ENTER(c);
    if (r == NULL || r->prompt < 1 || r->output < 0 || r->footprint < 1 || r->min_tp < 0 ||
        (r->min_tp > 0 && gy_sim_level(r->min_tp) < 0))
        return gy_cluster_leave(
            c, GY_FAIL(GY_ERR_INVALID,
                       "gy_cluster_arrive: prompt %lld, output %lld, footprint %lld, min_tp %d "
                       "(0 or a power of two)",
                       r ? (long long)r->prompt : 0LL, r ? (long long)r->output : 0LL,
                       r ? (long long)r->footprint : 0LL, r ? (int)r->min_tp : 0));
    return gy_cluster_leave(c, gy_cluster_decide(c, r, 0, (gy_sim_group){0, 0, 0}, now, NULL));
}

gy_status gy_cluster_step_ended(gy_cluster *c, int32_t gpu_first, int32_t tp, int finished,
                                double now) {
    GY_CLUSTER_ENTER(c);
    gy_status s = GY_OK;
    /* room freed may let a deferred request in without a transformation */
    if (finished && c->n_deferred > 0)
        s = gy_cluster_reconsider_after(c, now, GY_CLUSTER_STEP, gpu_first, tp);
    if (s == GY_OK && ((tp > 1 && finished) || gy_cluster_held(c, gpu_first, tp)))
        s = gy_cluster_rebalance(c, now);
    return gy_cluster_leave(c, s);
}

gy_status gy_cluster_reconfigured(gy_cluster *c, int rebalance, double now) {
    GY_CLUSTER_ENTER(c);
    gy_status s = gy_cluster_reconsider_after(c, now, GY_CLUSTER_ALL, 0, 0);
    if (s == GY_OK && rebalance) s = gy_cluster_rebalance(c, now);
    return gy_cluster_leave(c, s);
}

gy_status gy_cluster_tick(gy_cluster *c, double now) {
    GY_CLUSTER_ENTER(c);
    gy_status s = gy_cluster_reconsider_after(c, now, GY_CLUSTER_TIME, 0, 0);
    if (s == GY_OK && c->config.policy->monitor) s = gy_cluster_rebalance(c, now);
    return gy_cluster_leave(c, s);
}

/* ---- results ---- */

void gy_cluster_stats_get(const gy_cluster *c, gy_cluster_stats *out) {
    *out = c->stats;
    out->n_deferred = c->n_deferred;
}

const gy_cluster_request *gy_cluster_deferred(const gy_cluster *c, int64_t *n,
                                              const gy_sim_group **groups) {
    gy_cluster *m = (gy_cluster *)c; /* the copies are a cache */
    *n = 0;
    if (groups) *groups = NULL;
    if (c->n_deferred == 0) return NULL;
    if (m->cap_out < c->n_deferred) {
        gy_cluster_request *r = gy_realloc(m->deferred_out, (size_t)c->n_deferred * sizeof *r);
        if (r == NULL) return NULL;
        m->deferred_out = r;
        gy_sim_group *g = gy_realloc(m->deferred_groups, (size_t)c->n_deferred * sizeof *g);
        if (g == NULL) return NULL;
        m->deferred_groups = g;
        m->cap_out = c->n_deferred;
    }
    for (int64_t k = 0; k < c->n_deferred; k++) {
        m->deferred_out[k] = c->deferred[k].r;
        m->deferred_groups[k] = c->deferred[k].group;
    }
    *n = c->n_deferred;
    if (groups) *groups = m->deferred_groups;
    return m->deferred_out;
}
