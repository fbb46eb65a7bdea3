/* sim.c: the simulator's event loop (sim.h) and its face to the cluster controller. Events leave
 * the queue in (time, rank, push) order for their handler: an arrival goes to the controller, a
 * step's end commits it and starts the next, a phase's end goes to transform.c, a migration's KV
 * crossing to migrate.c, a sample records the time series and ticks the controller. The
 * controller reaches the simulator through gy_sim_cluster_ops, whose reconfigure hands each op to
 * the file of its mechanism (sim_impl.h lists them). Also the set-up, the results and the
 * invariants: what every mechanism shares and none owns. */
#include "sim_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

gy_status gy_sim_push(gy_sim *s, double time, int32_t kind, int64_t a, int64_t b) {
    return gy_sim_eventq_push(&s->q, time, kind, kind, a, b);
}

/* ---- the controller's executor ops (cluster/controller.h) ---- */

/* Every instance in GPU order, as the policy sees it (the controller adds held and reserved). */
static gy_status gy_sim_op_instances(void *ctx, gy_sim_inst_view *rows, int32_t cap,
                                     int32_t *n_out) {
    gy_sim *s = ctx;
    int32_t n = 0;
    for (int32_t g = 0; g < s->n_gpus && n < cap;) {
        gy_sim_inst *i = &s->inst[s->gpu_slot[g]];
        gy_sched_stats st;
        gy_sched_stats_get(i->core.sched, &st);
        int32_t max_min_tp = 0;
        for (int l = GY_SIM_MAX_LEVELS - 1; l >= 0; l--)
            if (i->by_min_tp[l] > 0) {
                max_min_tp = INT32_C(1) << l;
                break;
            }
        rows[n++] = (gy_sim_inst_view){
            .gpu_first = i->gpu_first,
            .tp = i->tp,
            .host = i->host,
            .xform = i->xform,
            .placeable = i->xform != GY_SIM_XFORM_SPLITTING &&
                         i->xform != GY_SIM_XFORM_BINDING && i->xform != GY_SIM_XFORM_RELEASING &&
                         i->xform != GY_SIM_XFORM_DROPPING && i->xform != GY_SIM_XFORM_RESTORING,
            .max_min_tp = max_min_tp,
            .kv_total = i->core.capacity,
            .kv_used = gy_sim_instance_used(&i->core),
            .footprint = i->footprint,
            .max_footprint = gy_sim_inst_max_footprint(s, i),
            .n_requests = i->n_req,
            .n_running = st.n_running,
            .n_waiting = st.n_waiting + st.n_preempted,
            .pending_prefill = i->pending_prefill,
            .pending_output = i->pending_output,
            .bound = i->bound,
            .prefill_only = i->prefill_only,
            .n_paused = i->n_paused,
            .n_tp_work = i->n_tp_work,
            .n_priority = i->n_priority,
            .n_stages = i->n_stages >= 2 ? i->n_stages : 0, /* a replica is a TP1 row */
        };
        memcpy(rows[n - 1].layers, i->layers, sizeof i->layers);
        g += i->width;
    }
    *n_out = n;
    return GY_OK;
}

/* Seesaw's tiered KV buffer (GY_SIM_OP_PARK, UNPARK): the TP instance at the op's GPU serves
 * prompts only, or everything again. Parked KV goes to host memory over swap_bw (step.c), so a
 * simulator without it refuses. */
static gy_status gy_sim_try_park(gy_sim *s, const gy_sim_op *op, int32_t *started) {
    const int32_t slot = gy_sim_slot_at(s, op->gpu_first, op->size);
    if (slot < 0 || !(s->config.swap_bw > 0) || s->config.replicated ||
        s->config.pipeline != NULL)
        return GY_OK;
    gy_sim_inst *i = &s->inst[slot];
    if (!i->alive || i->xform != GY_SIM_XFORM_NONE) return GY_OK;
    i->prefill_only = op->kind == GY_SIM_OP_PARK;
    gy_sched_prefill_only(i->core.sched, i->prefill_only);
    *started = 1;
    return gy_sim_start_step(s, slot); /* (an idle one parks, or takes its parked back, now) */
}

/* Which ops a cluster carries out is decided here; whether the state allows one now, by its
 * mechanism's gy_sim_try_* (a refusal changes nothing and the controller counts it). */
static gy_status gy_sim_op_reconfigure(void *ctx, const gy_sim_op *op, int32_t *started) {
    gy_sim *s = ctx;
    *started = 0;
    if (op->kind == GY_SIM_OP_MIGRATE) return gy_sim_try_migrate(s, op, started);
    if (op->kind == GY_SIM_OP_DROP || op->kind == GY_SIM_OP_RESTORE) {
        if (!s->config.buddy) return GY_OK;
        return op->kind == GY_SIM_OP_DROP ? gy_sim_try_drop(s, op, started)
                                          : gy_sim_try_restore(s, op, started);
    }
    if (s->config.buddy) return GY_OK; /* a buddy cluster only drops and restores */
    if (op->kind == GY_SIM_OP_RESPLIT) return gy_sim_try_resplit(s, op, started);
    if (op->kind == GY_SIM_OP_PARK || op->kind == GY_SIM_OP_UNPARK)
        return gy_sim_try_park(s, op, started);
    if (s->config.pipeline != NULL) return GY_OK; /* a pipeline only re-splits */
    const int flying = op->kind == GY_SIM_OP_BIND || op->kind == GY_SIM_OP_RELEASE;
    if ((flying && !s->config.replicated) ||
        (!flying && s->config.replicated && (op->kind == GY_SIM_OP_MERGE ||
                                              op->kind == GY_SIM_OP_SPLIT)))
        return GY_OK; /* Flying moves nothing, Gyges moves shards: each on its own cluster */
    if (op->kind == GY_SIM_OP_BIND) return gy_sim_try_bind(s, op, started);
    if (op->kind == GY_SIM_OP_RELEASE) return gy_sim_try_release(s, op, started);
    if (op->kind == GY_SIM_OP_MERGE) return gy_sim_try_merge(s, op, started);
    if (op->kind == GY_SIM_OP_SPLIT) return gy_sim_try_split(s, op, started);
    return GY_FAIL(GY_ERR_STATE, "the simulator cannot carry out op kind %d", (int)op->kind);
}

static gy_status gy_sim_op_assign(void *ctx, const gy_cluster_request *cr, int32_t action,
                                  int32_t gpu_first, int32_t tp) {
    gy_sim *s = ctx;
    const int64_t r = cr->id;
    gy_sim_request_out *o = &s->out[r];
    s->req[r].tp_work = cr->tp_work;
    if (action == GY_SIM_ACTION_DEFER) {
        o->status = GY_SIM_REQ_DEFERRED;
        return GY_OK;
    }
    if (action == GY_SIM_ACTION_REJECT) {
        o->status = GY_SIM_REQ_REJECTED;
        s->stats.n_rejected++;
        return GY_OK;
    }
    const int32_t slot = gy_sim_slot_at(s, gpu_first, tp);
    if (slot < 0)
        return GY_FAIL(GY_ERR_STATE, "no TP%d instance at GPU %d for request %lld", (int)tp,
                       (int)gpu_first, (long long)r);
    gy_sim_inst *i = &s->inst[slot];
    const gy_sim_carry c = {.prompt = o->input_tokens, .max_new = o->output_tokens};
    GY_TRY(gy_sim_instance_put(&i->core, r, &c, o->arrival, s->req[r].priority));
    gy_sim_link(s, slot, r);
    o->status = GY_SIM_REQ_QUEUED;
    return GY_OK;
}

/* A placement and its ops are done: the instance starts stepping (after the ops, so that a
 * transformation they started prices the step). */
static gy_status gy_sim_op_decided(void *ctx, const gy_cluster_request *cr, int32_t action) {
    gy_sim *s = ctx;
    if (action != GY_SIM_ACTION_PLACE) return GY_OK;
    return gy_sim_start_step(s, s->req[cr->id].slot);
}

static const gy_cluster_ops gy_sim_cluster_ops = {
    .instances = gy_sim_op_instances,
    .assign = gy_sim_op_assign,
    .reconfigure = gy_sim_op_reconfigure,
    .decided = gy_sim_op_decided,
};

/* ---- events ---- */

static gy_status gy_sim_on_arrival(gy_sim *s, int64_t r) {
    s->next_arrival = r + 1;
    if (s->next_arrival < s->n)
        GY_TRY(gy_sim_push(s, s->out[s->next_arrival].arrival, GY_SIM_EV_ARRIVAL,
                           s->next_arrival, 0));
    s->stats.n_arrived++;
    const gy_sim_request_out *o = &s->out[r];
    const gy_cluster_request cr = {.id = r, .prompt = o->input_tokens,
                                   .output = o->output_tokens, .footprint = s->req[r].footprint,
                                   .min_tp = o->min_tp, .priority = s->req[r].priority,
                                   .arrival = o->arrival};
    return gy_cluster_arrive(s->cluster, &cr, s->now);
}

static gy_status gy_sim_on_step(gy_sim *s, int32_t slot, int64_t gen) {
    gy_sim_inst *i = &s->inst[slot];
    if (!i->alive || i->gen != gen || !i->stepping)
        return GY_FAIL(GY_ERR_STATE, "a step ended on an instance that was not stepping");
    i->stepping = 0;
    int finished = 0;
    GY_TRY(gy_sim_finish_step(s, slot, &finished));
    GY_TRY(gy_sim_migrate_crossed(s, slot));
    i = &s->inst[slot];
    if (i->draining && i->head < 0) return gy_sim_restore_drained(s, slot);
    if (i->barrier) return gy_sim_xf_try_switch(s, i->xform_id);
    GY_TRY(gy_sim_start_step(s, slot));
    i = &s->inst[slot];
    return gy_cluster_step_ended(s->cluster, i->gpu_first, i->tp, finished, s->now);
}

static int gy_sim_quiet(const gy_sim *s) {
    if (s->next_arrival < s->n || s->n_active_xf > 0) return 0;
    for (int64_t k = 0; k < s->n_slots; k++)
        if (s->inst[k].alive && s->inst[k].stepping) return 0;
    return 1;
}

static gy_status gy_sim_on_sample(gy_sim *s) {
    /* deferred requests are also reconsidered periodically: a policy may wait for time alone
     * (gyges' merge_wait) */
    GY_TRY(gy_cluster_tick(s->cluster, s->now));
    for (int32_t g = 0; g < s->n_gpus;) {
        gy_sim_inst *i = &s->inst[s->gpu_slot[g]];
        gy_sched_stats st;
        gy_sched_stats_get(i->core.sched, &st);
        GY_SIM_GROW(s->samples, s->n_samples, s->cap_samples);
        s->samples[s->n_samples++] = (gy_sim_sample){
            .time = s->now, .gpu_first = i->gpu_first, .tp = i->tp, .xform = i->xform,
            .held = gy_cluster_held(s->cluster, i->gpu_first, i->tp), .kv_used = gy_sim_instance_used(&i->core),
            .kv_total = i->core.capacity, .n_running = st.n_running,
            .n_waiting = st.n_waiting + st.n_preempted};
        g += i->width;
    }
    if (gy_sim_quiet(s)) return GY_OK;
    return gy_sim_push(s, s->now + s->config.sample_interval, GY_SIM_EV_SAMPLE, 0, 0);
}

gy_status gy_sim_run(gy_sim *s, double until) {
    if (s == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sim_run: NULL simulator");
    if (isnan(until)) return GY_FAIL(GY_ERR_INVALID, "gy_sim_run: `until` is NaN");
    const gy_sim_event *next;
    while ((next = gy_sim_eventq_peek(&s->q)) != NULL && next->time <= until) {
        gy_sim_event e;
        gy_sim_eventq_pop(&s->q, &e);
        if (e.time < s->now)
            return GY_FAIL(GY_ERR_STATE, "time went backwards: %.17g after %.17g", e.time, s->now);
        s->now = e.time;
        s->stats.n_events++;
        switch (e.kind) {
        case GY_SIM_EV_ARRIVAL: GY_TRY(gy_sim_on_arrival(s, e.a)); break;
        case GY_SIM_EV_PHASE: GY_TRY(gy_sim_on_phase(s, e.a, e.b)); break;
        case GY_SIM_EV_STEP: GY_TRY(gy_sim_on_step(s, (int32_t)e.a, e.b)); break;
        case GY_SIM_EV_MIGRATED: GY_TRY(gy_sim_on_migrated(s, e.a)); break;
        default: GY_TRY(gy_sim_on_sample(s)); break;
        }
    }
    return GY_OK;
}

/* ---- set-up ---- */

/* A pipeline cluster's own settings (sim.h: `pipeline`). */
static gy_status gy_sim_check_pipeline(const gy_sim_config *c) {
    const gy_sim_pipeline *p = c->pipeline;
    GY_TRY(gy_sim_pipeline_check(p));
    if (c->gpus_per_host != p->n_stages || c->max_tp != 1 || c->replicated)
        return GY_FAIL(GY_ERR_INVALID, "a pipeline cluster has one pipeline per host: "
                       "gpus_per_host %d must be its %d stages, max_tp 1 (got %d), not replicated",
                       (int)c->gpus_per_host, (int)p->n_stages, (int)c->max_tp);
    if (p->block_size != c->sched.block_size)
        return GY_FAIL(GY_ERR_INVALID, "the pipeline's block_size %lld is not the scheduler's "
                       "%lld", (long long)p->block_size, (long long)c->sched.block_size);
    if (c->pipe_layers == NULL || !gy_sim_pipeline_split_ok(p, c->pipe_layers))
        return GY_FAIL(GY_ERR_INVALID, "pipe_layers must split the model's %d layers over its %d "
                       "stages, at least one each", (int)p->n_layers, (int)p->n_stages);
    if (gy_sim_pipeline_capacity(p, c->pipe_layers) < 1)
        return GY_FAIL(GY_ERR_INVALID, "the pipeline's initial split leaves no KV block on some "
                       "stage (its layers' weights fill it)");
    if (c->buddy) {
        const int32_t g = c->buddy_group;
        if (g < 1 || g > c->gpus_per_host || c->gpus_per_host % g != 0)
            return GY_FAIL(GY_ERR_INVALID, "buddy_group %d must divide gpus_per_host %d",
                           (int)g, (int)c->gpus_per_host);
        const gy_sim_pipeline sub = gy_sim_pipeline_sub(p, g);
        int32_t even[GY_SIM_MAX_STAGES];
        gy_sim_pipeline_even(&sub, even);
        if (gy_sim_pipeline_capacity(&sub, even) < 1)
            return GY_FAIL(GY_ERR_INVALID, "an instance of %d GPU(s) keeps no KV block after the "
                           "model's weights", (int)g);
    }
    return GY_OK;
}

static gy_status gy_sim_check_config(const gy_sim_config *c, const gy_sim_trace *t,
                                     int32_t *n_levels) {
    if (c->buddy && c->pipeline == NULL)
        return GY_FAIL(GY_ERR_INVALID, "a buddy cluster needs a pipeline description");
    if (c->pipeline != NULL) {
        if (c->hosts < 1)
            return GY_FAIL(GY_ERR_INVALID, "need hosts >= 1, got %d", (int)c->hosts);
        GY_TRY(gy_sim_check_pipeline(c));
        *n_levels = 1;
        goto common; /* no layout, capacities or TP cost model */
    }
    if (c->hosts < 1 || c->gpus_per_host < 1 || gy_sim_level(c->gpus_per_host) < 0 ||
        c->gpus_per_host > 128)
        return GY_FAIL(GY_ERR_INVALID,
                       "need hosts >= 1 and gpus_per_host a power of two <= 128 (got %d, %d)",
                       (int)c->hosts, (int)c->gpus_per_host);
    if (gy_sim_level(c->max_tp) < 0 || c->max_tp > c->gpus_per_host)
        return GY_FAIL(GY_ERR_INVALID, "max_tp must be a power of two <= gpus_per_host %d, got %d",
                       (int)c->gpus_per_host, (int)c->max_tp);
    *n_levels = gy_sim_level(c->max_tp) + 1;
    if (c->capacity == NULL || c->capacity_mid == NULL)
        return GY_FAIL(GY_ERR_INVALID, "KV capacities are missing");
    /* the smallest TPs may not fit the model (no KV room after the weights: capacity 0); from
     * the first that fits, every larger one does */
    int32_t min_level = -1;
    for (int32_t l = 0; l < *n_levels; l++) {
        if (c->capacity[l] < 0 || (min_level >= 0 && c->capacity[l] < 1))
            return GY_FAIL(GY_ERR_INVALID,
                           "a TP%d instance has %lld KV blocks: capacities are >= 0, and >= 1 "
                           "from the smallest TP that fits on",
                           1 << l, (long long)c->capacity[l]);
        if (min_level < 0 && c->capacity[l] >= 1) min_level = l;
        if (c->capacity_mid[l] < c->capacity[l])
            return GY_FAIL(GY_ERR_INVALID, "capacity_mid[%d] %lld is below capacity %lld", (int)l,
                           (long long)c->capacity_mid[l], (long long)c->capacity[l]);
        if (c->max_input && (c->max_input[l] < 1 || (l > 0 && c->max_input[l] < c->max_input[l - 1])))
            return GY_FAIL(GY_ERR_INVALID, "max_input[%d] %lld must be >= 1 and not below the "
                           "smaller TP's", (int)l, (long long)c->max_input[l]);
    }
    if (min_level < 0)
        return GY_FAIL(GY_ERR_INVALID, "the model fits no instance up to TP%d (no KV room)",
                       (int)c->max_tp);
    if (c->n_layout < 1 || c->n_layout > 64 || c->layout == NULL)
        return GY_FAIL(GY_ERR_INVALID, "a host layout needs 1 to 64 instances, got %d",
                       (int)c->n_layout);
    int32_t g = 0;
    for (int32_t k = 0; k < c->n_layout; k++) {
        const int32_t tp = c->layout[k];
        if (gy_sim_level(tp) < 0 || tp > c->max_tp)
            return GY_FAIL(GY_ERR_INVALID, "layout instance %d has TP %d: not a power of two <= "
                           "max_tp %d", (int)k, (int)tp, (int)c->max_tp);
        if (gy_sim_level(tp) < min_level)
            return GY_FAIL(GY_ERR_INVALID, "layout instance %d is TP%d, but the model fits no "
                           "instance below TP%d", (int)k, (int)tp, 1 << min_level);
        if (g % tp != 0)
            return GY_FAIL(GY_ERR_INVALID,
                           "layout instance %d (TP%d) would start at GPU %d, not a multiple of %d: "
                           "list larger instances first or align them", (int)k, (int)tp, (int)g,
                           (int)tp);
        g += tp;
    }
    if (g != c->gpus_per_host)
        return GY_FAIL(GY_ERR_INVALID, "the layout covers %d GPUs but a host has %d", (int)g,
                       (int)c->gpus_per_host);
    if (c->cost.step_time == NULL || c->cost.phase_time == NULL)
        return GY_FAIL(GY_ERR_INVALID, "the cost model has a NULL entry");
common:
    if ((int64_t)c->hosts * c->gpus_per_host > (INT64_C(1) << 20))
        return GY_FAIL(GY_ERR_INVALID, "%d hosts of %d GPUs is too many", (int)c->hosts,
                       (int)c->gpus_per_host);
    if (c->sched.block_size < 1 || c->sched.max_batch_tokens < 1 || c->sched.max_running < 1 ||
        c->sched.max_prefill_chunk < 0 || !(c->sched.watermark >= 0 && c->sched.watermark < 1))
        return GY_FAIL(GY_ERR_INVALID, "bad scheduler settings (block_size %lld, max_batch_tokens "
                       "%lld, max_running %lld, max_prefill_chunk %lld, watermark %g)",
                       (long long)c->sched.block_size, (long long)c->sched.max_batch_tokens,
                       (long long)c->sched.max_running, (long long)c->sched.max_prefill_chunk,
                       c->sched.watermark);
    if (c->policy == NULL || c->policy->place == NULL)
        return GY_FAIL(GY_ERR_INVALID, "no policy");
    if (!(c->migrate_bw >= 0) || !isfinite(c->migrate_bw) ||
        (c->migrate_bw > 0 && (!(c->kv_token_bytes > 0) || !isfinite(c->kv_token_bytes))))
        return GY_FAIL(GY_ERR_INVALID, "migrate_bw must be >= 0 and, when > 0, kv_token_bytes > 0 "
                       "(got %g, %g)", c->migrate_bw, c->kv_token_bytes);
    if (!(c->swap_bw >= 0) || !isfinite(c->swap_bw) ||
        (c->swap_bw > 0 && (!(c->kv_token_bytes > 0) || !isfinite(c->kv_token_bytes))))
        return GY_FAIL(GY_ERR_INVALID, "swap_bw must be >= 0 and, when > 0, kv_token_bytes > 0 "
                       "(got %g, %g)", c->swap_bw, c->kv_token_bytes);
    if (!(c->sample_interval > 0) || !isfinite(c->sample_interval))
        return GY_FAIL(GY_ERR_INVALID, "sample_interval must be > 0, got %g", c->sample_interval);
    if (c->replicated && (!(c->switch_time >= 0) || !isfinite(c->switch_time)))
        return GY_FAIL(GY_ERR_INVALID, "switch_time must be >= 0, got %g", c->switch_time);
    if ((c->stop_transforming != 0 && c->stop_transforming != 1) ||
        (c->stop_transforming && (c->replicated || c->pipeline != NULL)))
        return GY_FAIL(GY_ERR_INVALID, "stop_transforming must be 0 or 1, and 1 only on a sharded "
                       "cluster of TP groups (got %d)", (int)c->stop_transforming);
    if ((c->sequence_parallel != 0 && c->sequence_parallel != 1) ||
        (c->sequence_parallel && !c->replicated))
        return GY_FAIL(GY_ERR_INVALID, "sequence_parallel must be 0 or 1, and 1 only on a "
                       "replicated cluster (got %d, replicated %d)", (int)c->sequence_parallel,
                       (int)c->replicated);
    if (t == NULL || t->n < 0 || (t->n > 0 && (t->arrival == NULL || t->input_tokens == NULL ||
                                               t->output_tokens == NULL)))
        return GY_FAIL(GY_ERR_INVALID, "the trace is missing columns");
    for (int64_t r = 0; r < t->n; r++) {
        if (!isfinite(t->arrival[r]) || (r > 0 && t->arrival[r] < t->arrival[r - 1]))
            return GY_FAIL(GY_ERR_INVALID, "request %lld: arrival %g is not finite or not sorted",
                           (long long)r, t->arrival[r]);
        if (t->input_tokens[r] < 1 || t->output_tokens[r] < 1 ||
            t->input_tokens[r] > (INT64_C(1) << 36) || t->output_tokens[r] > (INT64_C(1) << 36))
            return GY_FAIL(GY_ERR_INVALID, "request %lld: lengths must be in [1, 2^36] (input %lld, "
                           "output %lld)", (long long)r, (long long)t->input_tokens[r],
                           (long long)t->output_tokens[r]);
    }
    return GY_OK;
}

gy_status gy_sim_prefill_rates(const gy_sim_cost_ops *cost, int32_t n_levels, int64_t chunk,
                               double *out) {
    if (cost == NULL || cost->step_time == NULL || n_levels < 1 ||
        n_levels > GY_SIM_MAX_LEVELS || chunk < 1)
        return GY_FAIL(GY_ERR_INVALID, "gy_sim_prefill_rates: %d levels, chunk %lld",
                       (int)n_levels, (long long)chunk);
    /* one prompt's chunk: every token computed, the last sampled, causal attention over it */
    const double n = (double)chunk;
    const gy_sim_step_shape shape = {.n_tokens = chunk, .n_seqs = 1, .n_samples = 1,
                                     .kv_read_tokens = n, .attn_pairs = n * (n + 1) / 2};
    for (int32_t l = 0; l < n_levels; l++) {
        const double t = cost->step_time(cost->ctx, INT32_C(1) << l, 0, &shape);
        if (!(t > 0.0 && t < INFINITY))
            return GY_FAIL(GY_ERR_STATE, "the cost model gave a TP%d prefill step of %g s",
                           1 << l, t);
        out[l] = n / t;
    }
    return GY_OK;
}

gy_status gy_sim_init(gy_sim **out, const gy_sim_config *c, const gy_sim_trace *t) {
    if (out == NULL || c == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sim_init: NULL argument");
    *out = NULL;
    int32_t n_levels = 0;
    GY_TRY(gy_sim_check_config(c, t, &n_levels));
    gy_sim *s = gy_calloc(1, sizeof *s);
    if (s == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    s->config = *c;
    if (c->pipeline != NULL) {
        s->pipeline = *c->pipeline;
        s->config.pipeline = &s->pipeline;
        memcpy(s->pipe_layers, c->pipe_layers, (size_t)s->pipeline.n_stages * sizeof *s->pipe_layers);
        s->config.pipe_layers = s->pipe_layers;
        s->capacity[0] = s->capacity_mid[0] = gy_sim_pipeline_capacity(&s->pipeline,
                                                                       s->pipe_layers);
        if (c->buddy) { /* a request's min_tp: the instances it starts with */
            for (int32_t g = 1; g <= s->pipeline.n_stages; g++)
                s->sub[g] = gy_sim_pipeline_sub(&s->pipeline, g);
            int32_t even[GY_SIM_MAX_STAGES];
            gy_sim_pipeline_even(&s->sub[1], even);
            s->single_cap = gy_sim_pipeline_capacity(&s->sub[1], even);
            gy_sim_pipeline_even(&s->sub[c->buddy_group], even);
            s->capacity[0] = s->capacity_mid[0] =
                gy_sim_pipeline_capacity(&s->sub[c->buddy_group], even);
        }
        s->config.n_layout = 0;
    } else {
        memcpy(s->layout, c->layout, (size_t)c->n_layout * sizeof *s->layout);
        memcpy(s->capacity, c->capacity, (size_t)n_levels * sizeof *s->capacity);
        memcpy(s->capacity_mid, c->capacity_mid, (size_t)n_levels * sizeof *s->capacity_mid);
    }
    s->config.layout = s->layout;
    for (int32_t l = 0; l < n_levels; l++)
        s->max_input[l] = c->max_input && c->pipeline == NULL ? c->max_input[l] : INT64_MAX;
    s->config.capacity = s->capacity;
    s->config.capacity_mid = s->capacity_mid;
    s->config.max_input = s->max_input;
    s->n_levels = n_levels;
    s->n_gpus = c->hosts * c->gpus_per_host;
    s->base_tp = 1;
    while (s->capacity[gy_sim_level(s->base_tp)] < 1) s->base_tp *= 2;
    s->n = t->n;
    gy_status st = GY_OK;
    s->gpu_slot = gy_calloc((size_t)s->n_gpus, sizeof *s->gpu_slot);
    s->out = gy_calloc((size_t)(s->n > 0 ? s->n : 1), sizeof *s->out);
    s->req = gy_calloc((size_t)(s->n > 0 ? s->n : 1), sizeof *s->req);
    if (s->gpu_slot == NULL || s->out == NULL || s->req == NULL) {
        st = GY_FAIL(GY_ERR_SYSTEM, "out of host memory for %lld requests", (long long)s->n);
        goto fail;
    }
    if (c->pipeline == NULL) {
        const int64_t chunk = c->sched.max_prefill_chunk > 0 ? c->sched.max_prefill_chunk
                                                             : c->sched.max_batch_tokens;
        st = gy_sim_prefill_rates(&c->cost, n_levels, chunk, s->prefill_rate);
        if (st != GY_OK) goto fail;
    }
    const gy_cluster_config cc = {.n_gpus = s->n_gpus, .gpus_per_host = c->gpus_per_host,
                                  .max_tp = c->max_tp, .capacity = s->capacity,
                                  .block_size = c->sched.block_size,
                                  .watermark = c->sched.watermark, .policy = c->policy,
                                  .policy_config = c->policy_config,
                                  .replicated = c->replicated, .base_tp = s->base_tp,
                                  .pipeline = c->pipeline ? &s->pipeline : NULL,
                                  .buddy = c->buddy,
                                  .prefill_rate = c->pipeline ? NULL : s->prefill_rate,
                                  .cost = c->pipeline ? NULL : &s->config.cost};
    st = gy_cluster_init(&s->cluster, &cc, &gy_sim_cluster_ops, s);
    if (st != GY_OK) goto fail;
    const int64_t bs = c->sched.block_size;
    for (int64_t r = 0; r < s->n; r++) {
        gy_sim_request_out *o = &s->out[r];
        *o = (gy_sim_request_out){.arrival = t->arrival[r], .scheduled = NAN,
                                  .first_token = NAN, .finish = NAN,
                                  .input_tokens = t->input_tokens[r],
                                  .output_tokens = t->output_tokens[r],
                                  .status = GY_SIM_REQ_PENDING, .gpu_first = -1, .tp = 0};
        gy_sim_req *q = &s->req[r];
        q->footprint = gy_sim_cdiv(o->input_tokens + o->output_tokens, bs);
        q->prev = q->next = -1;
        q->slot = -1;
        q->half = -1;
        q->home = -1;
        q->priority = t->priority ? t->priority[r] : 0;
        for (int32_t l = 0; l < n_levels; l++)
            if (s->capacity[l] >= q->footprint && s->max_input[l] >= o->input_tokens) {
                o->min_tp = INT32_C(1) << l;
                break;
            }
    }
    s->t0 = s->n > 0 ? t->arrival[0] : 0.0;
    s->now = s->t0;
    s->stats.n_requests = s->n;
    for (int32_t h = 0; h < c->hosts && st == GY_OK && c->pipeline != NULL; h++)
        for (int32_t g = 0; g < c->gpus_per_host && st == GY_OK; g += c->buddy ? c->buddy_group
                                                                             : c->gpus_per_host)
            st = c->buddy ? gy_sim_pipe_create(s, h * c->gpus_per_host + g, c->buddy_group, NULL,
                                               NULL)
                          : gy_sim_pipe_create(s, h * c->gpus_per_host, s->pipeline.n_stages,
                                               s->pipe_layers, NULL);
    for (int32_t h = 0; h < c->hosts && st == GY_OK && c->pipeline == NULL; h++) {
        int32_t g = h * c->gpus_per_host;
        for (int32_t k = 0; k < c->n_layout && st == GY_OK; k++) {
            int32_t slot;
            st = gy_sim_inst_create(s, g, c->layout[k], &slot);
            if (st == GY_OK && c->replicated && c->layout[k] > s->base_tp) {
                s->inst[slot].bound = 1; /* a layout's TP group: bound from the start */
                s->inst[slot].member_tp = s->base_tp;
            }
            g += c->layout[k];
        }
    }
    if (st == GY_OK && s->n > 0) st = gy_sim_push(s, s->out[0].arrival, GY_SIM_EV_ARRIVAL, 0, 0);
    if (st == GY_OK) st = gy_sim_push(s, s->t0, GY_SIM_EV_SAMPLE, 0, 0);
    if (st != GY_OK) goto fail;
    *out = s;
    return GY_OK;
fail:
    gy_sim_free(s);
    return st;
}

void gy_sim_free(gy_sim *s) {
    if (s == NULL) return;
    for (int64_t k = 0; k < s->n_slots; k++)
        if (s->inst[k].alive) gy_sim_instance_free(&s->inst[k].core);
    free(s->inst);
    free(s->gpu_slot);
    free(s->out);
    free(s->req);
    gy_cluster_free(s->cluster);
    gy_sim_eventq_free(&s->q);
    free(s->xf_out);
    free(s->xf);
    free(s->samples);
    free(s->layout_ev);
    free(s->tokens);
    free(s->bin_out);
    free(s->bin_prompt);
    free(s);
}

/* ---- results ---- */

void gy_sim_stats_get(const gy_sim *s, gy_sim_stats *out) {
    *out = s->stats;
    out->now = s->now;
    gy_cluster_stats cs;
    gy_cluster_stats_get(s->cluster, &cs);
    out->n_deferred = cs.n_deferred;
    out->n_ops_refused = cs.n_ops_refused;
    out->n_decisions = cs.n_decisions;
    out->n_rebalances = cs.n_rebalances;
    out->n_transforming = s->n_active_xf;
    out->done = gy_sim_eventq_peek(&s->q) == NULL;
}

const gy_sim_request_out *gy_sim_requests(const gy_sim *s, int64_t *n) {
    *n = s->n;
    return s->out;
}
const gy_sim_sample *gy_sim_samples(const gy_sim *s, int64_t *n) {
    *n = s->n_samples;
    return s->samples;
}
const gy_sim_layout_event *gy_sim_layout(const gy_sim *s, int64_t *n) {
    *n = s->n_layout_ev;
    return s->layout_ev;
}
const gy_sim_transform_out *gy_sim_transforms(const gy_sim *s, int64_t *n) {
    *n = s->n_xf;
    return s->xf_out;
}
const gy_sim_token *gy_sim_tokens(const gy_sim *s, int64_t *n) {
    *n = s->n_tokens;
    return s->tokens;
}
const double *gy_sim_bins(const gy_sim *s, int64_t *n, const double **prompt_tokens) {
    *n = s->n_bins;
    if (prompt_tokens) *prompt_tokens = s->bin_prompt;
    return s->bin_out;
}

gy_status gy_sim_check(const gy_sim *s) {
    int32_t covered = 0;
    for (int64_t k = 0; k < s->n_slots; k++) {
        const gy_sim_inst *i = &s->inst[k];
        if (!i->alive) continue;
        for (int32_t g = i->gpu_first; g < i->gpu_first + i->width; g++)
            if (g >= s->n_gpus || s->gpu_slot[g] != k)
                return GY_FAIL(GY_ERR_STATE, "GPU %d of the TP%d instance at GPU %d belongs to "
                               "another instance", (int)g, (int)i->tp, (int)i->gpu_first);
        if (i->gpu_first % i->tp != 0)
            return GY_FAIL(GY_ERR_STATE, "the TP%d instance at GPU %d is not aligned", (int)i->tp,
                           (int)i->gpu_first);
        covered += i->width;
        if (i->n_stages > 0 && (!gy_sim_pipeline_split_ok(gy_sim_inst_pipe(s, i), i->layers) ||
                                ((i->xform == GY_SIM_XFORM_NONE ||
                                  i->xform == GY_SIM_XFORM_EXCHANGING) &&
                                 i->core.capacity != gy_sim_pipeline_capacity(
                                                         gy_sim_inst_pipe(s, i), i->layers))))
            return GY_FAIL(GY_ERR_STATE, "the pipeline at GPU %d serves at a bad split or with "
                           "%lld blocks, not its split's", (int)i->gpu_first,
                           (long long)i->core.capacity);
        const int64_t used = gy_sim_instance_used(&i->core);
        if (used < 0 || used > i->core.capacity)
            return GY_FAIL(GY_ERR_STATE, "the instance at GPU %d holds %lld of %lld blocks",
                           (int)i->gpu_first, (long long)used, (long long)i->core.capacity);
        int64_t held = 0, n = 0;
        for (int64_t r = i->head; r >= 0; r = s->req[r].next) {
            held += gy_sched_block_counter_held(i->core.bc, r);
            n++;
            if (s->req[r].slot != k || s->out[r].status != GY_SIM_REQ_QUEUED)
                return GY_FAIL(GY_ERR_STATE, "request %lld is listed on the instance at GPU %d "
                               "but says otherwise", (long long)r, (int)i->gpu_first);
        }
        if (held != used || n != i->n_req)
            return GY_FAIL(GY_ERR_STATE, "the instance at GPU %d: its requests hold %lld blocks "
                           "(%lld listed) but %lld are used (%lld counted)", (int)i->gpu_first,
                           (long long)held, (long long)n, (long long)used, (long long)i->n_req);
    }
    if (covered != s->n_gpus)
        return GY_FAIL(GY_ERR_STATE, "instances cover %d GPUs of %d", (int)covered,
                       (int)s->n_gpus);
    gy_cluster_stats cs;
    gy_cluster_stats_get(s->cluster, &cs);
    int64_t counts[5] = {0};
    for (int64_t r = 0; r < s->n; r++) {
        const int32_t st = s->out[r].status;
        if (st < 0 || st > GY_SIM_REQ_REJECTED)
            return GY_FAIL(GY_ERR_STATE, "request %lld has status %d", (long long)r, (int)st);
        counts[st]++;
        if ((st == GY_SIM_REQ_FINISHED) != !isnan(s->out[r].finish))
            return GY_FAIL(GY_ERR_STATE, "request %lld: finish time and status disagree",
                           (long long)r);
    }
    if (counts[GY_SIM_REQ_FINISHED] != s->stats.n_finished ||
        counts[GY_SIM_REQ_REJECTED] != s->stats.n_rejected ||
        counts[GY_SIM_REQ_DEFERRED] != cs.n_deferred ||
        counts[GY_SIM_REQ_PENDING] != s->n - s->stats.n_arrived)
        return GY_FAIL(GY_ERR_STATE, "request accounting is off: %lld finished (%lld counted), "
                       "%lld rejected (%lld), %lld deferred (%lld), %lld pending (%lld)",
                       (long long)counts[GY_SIM_REQ_FINISHED], (long long)s->stats.n_finished,
                       (long long)counts[GY_SIM_REQ_REJECTED], (long long)s->stats.n_rejected,
                       (long long)counts[GY_SIM_REQ_DEFERRED], (long long)cs.n_deferred,
                       (long long)counts[GY_SIM_REQ_PENDING],
                       (long long)(s->n - s->stats.n_arrived));
    return GY_OK;
}
