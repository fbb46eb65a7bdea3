/* drop_restore.c: KunServe's buddy groups on a buddy cluster (sim.h): a drop makes g replicas of
 * one host one group over a shared copy of the layers (the freed weights are KV room at once;
 * the victims' KV moves while the group serves: the exchange), a restore gives the members their
 * weights back and sends each request home with its KV (or, without live restore, lets the group
 * finish its requests first). Priced by policy/pipeline.h's buddy costs. */
#include "sim_impl.h"

#include <math.h>

/* The blocks a whole replica lets requests take (its watermark kept free). */
static int64_t gy_sim_single_usable(const gy_sim *s) {
    return s->single_cap - (int64_t)(s->config.sched.watermark * (double)s->single_cap);
}

/* A drop of the replicas [g, g + size), unless the state refuses it: not one host, a GPU not a
 * whole replica of its own, or something under way. The switch waits for the members' steps
 * in flight (an event now, outside the controller's call). */
gy_status gy_sim_try_drop(gy_sim *s, const gy_sim_op *op, int32_t *started) {
    const int32_t g = op->gpu_first, size = op->size;
    if (size < 2 || size > s->pipeline.n_stages || g < 0 || g + size > s->n_gpus ||
        g / s->config.gpus_per_host != (g + size - 1) / s->config.gpus_per_host)
        return GY_OK;
    int32_t members[GY_SIM_MAX_STAGES];
    for (int32_t k = 0; k < size; k++) {
        const int32_t slot = s->gpu_slot[g + k];
        const gy_sim_inst *i = &s->inst[slot];
        if (i->gpu_first != g + k || i->n_stages != 1 || i->xform != GY_SIM_XFORM_NONE)
            return GY_OK;
        members[k] = slot;
    }
    int64_t x;
    GY_TRY(gy_sim_xf_new(s, GY_SIM_OP_DROP, g, 1, size, &x));
    s->xf[x] = (gy_sim_xf){.n_src = size, .dst = {-1, -1}, .phase = 0};
    for (int32_t k = 0; k < size; k++) {
        s->xf[x].src[k] = members[k];
        s->inst[members[k]].xform = GY_SIM_XFORM_DROPPING;
        s->inst[members[k]].xform_id = (int32_t)x;
    }
    *started = 1;
    return gy_sim_push(s, s->now, GY_SIM_EV_PHASE, x, 0);
}

/* The members are idle: one group replaces them and takes their requests with their KV (the
 * victims); the exchange starts. */
gy_status gy_sim_drop_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    const int32_t n = f->n_src;
    double tokens[GY_SIM_MAX_STAGES];
    int64_t head = -1, tail = -1; /* the members' requests in order, through req.next */
    for (int32_t k = 0; k < n; k++) {
        tokens[k] = gy_sim_kv_tokens(s, f->src[k]);
        while (s->inst[f->src[k]].head >= 0) {
            const int64_t r = s->inst[f->src[k]].head;
            GY_TRY(gy_sim_lift(s, r, 0));
            s->req[r].victim = s->req[r].kept > 0;
            if (tail >= 0) s->req[tail].next = r; else head = r;
            tail = r;
        }
    }
    for (int32_t k = 0; k < n; k++) GY_TRY(gy_sim_inst_destroy(s, f->src[k]));
    int32_t c;
    GY_TRY(gy_sim_pipe_create(s, o->gpu_first, n, NULL, &c));
    while (head >= 0) {
        const int64_t r = head;
        head = r == tail ? -1 : s->req[r].next;
        GY_TRY(gy_sim_land(s, r, c));
        s->out[r].migrations++;
        o->n_migrated++;
        s->stats.n_victims += s->req[r].victim;
    }
    gy_sim_inst *i = &s->inst[c];
    const double dt = gy_sim_pipeline_exchange_time(&s->sub[n], i->layers, tokens, &o->kv_bytes);
    if (!(dt >= 0) || !isfinite(dt))
        return GY_FAIL(GY_ERR_STATE, "the pipeline model gave an exchange time of %g s", dt);
    f->phase = 1;
    f->dst[0] = c;
    f->n_dst = 1;
    o->phase_end = s->now;
    i->xform = GY_SIM_XFORM_EXCHANGING;
    i->xform_id = (int32_t)x;
    i->exch_start = s->now;
    i->exch_len = dt;
    i->exch_debt = 0;
    s->stats.n_drops++;
    GY_TRY(gy_sim_push(s, s->now + dt, GY_SIM_EV_PHASE, x, 1));
    GY_TRY(gy_sim_start_step(s, c));
    return gy_cluster_reconfigured(s->cluster, 0, s->now);
}

/* The exchange's bytes are through, unless remote attention held the link meanwhile (then it
 * ends that much later). */
gy_status gy_sim_exchange_end(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    const int32_t c = f->dst[0];
    gy_sim_inst *i = &s->inst[c];
    if (i->exch_debt > 0) {
        const double debt = i->exch_debt;
        i->exch_debt = 0;
        return gy_sim_push(s, s->now + debt, GY_SIM_EV_PHASE, x, 1);
    }
    for (int64_t r = i->head; r >= 0; r = s->req[r].next) s->req[r].victim = 0;
    i->xform = GY_SIM_XFORM_NONE;
    i->xform_id = -1;
    f->phase = 2;
    o->end = s->now;
    s->n_active_xf--;
    s->stats.exchange_s += o->end - o->phase_end;
    s->stats.exchange_bytes += o->kv_bytes;
    GY_TRY(gy_sim_start_step(s, c));
    return gy_cluster_reconfigured(s->cluster, 1, s->now);
}

/* Packs the group's requests into its members' own blocks (req.half: the member); 0 when they
 * do not fit. */
static int gy_sim_pack_replicas(gy_sim *s, int32_t c) {
    int64_t room[GY_SIM_MAX_STAGES];
    for (int32_t k = 0; k < s->inst[c].n_stages; k++) room[k] = gy_sim_single_usable(s);
    return gy_sim_pack(s, &s->inst[c], room, s->inst[c].n_stages);
}

/* A restore of the group at op->gpu_first, unless the state refuses it (sim.h). */
gy_status gy_sim_try_restore(gy_sim *s, const gy_sim_op *op, int32_t *started) {
    const int32_t c = gy_sim_slot_at(s, op->gpu_first, op->size);
    if (c < 0 || s->inst[c].n_stages < 2 || s->inst[c].xform != GY_SIM_XFORM_NONE) return GY_OK;
    gy_sim_inst *i = &s->inst[c];
    const int32_t n = i->n_stages;
    const int64_t cap = (int64_t)n * s->single_cap;
    if (gy_sim_instance_used(&i->core) > cap || !gy_sim_pack_replicas(s, c)) return GY_OK;
    int64_t x;
    GY_TRY(gy_sim_xf_new(s, GY_SIM_OP_RESTORE, i->gpu_first, n, 1, &x));
    s->xf[x] = (gy_sim_xf){.src = {c}, .n_src = 1, .dst = {-1, -1}, .phase = 0};
    gy_sim_transform_out *o = &s->xf_out[x];
    i = &s->inst[c];
    i->xform = GY_SIM_XFORM_RESTORING;
    i->xform_id = (int32_t)x;
    if (cap < i->core.capacity) GY_TRY(gy_sim_instance_set_capacity(&i->core, cap));
    const double dt = gy_sim_pipeline_restore_time(&s->sub[n], i->layers, &o->weight_bytes);
    if (!(dt >= 0) || !isfinite(dt))
        return GY_FAIL(GY_ERR_STATE, "the pipeline model gave a restore time of %g s", dt);
    *started = 1;
    return gy_sim_push(s, s->now + dt, GY_SIM_EV_PHASE, x, 0);
}

/* Without live restore, a group whose weights are back and whose last request finished: it
 * dissolves once its step in flight (if any) ends. */
gy_status gy_sim_restore_drained(gy_sim *s, int32_t slot) {
    gy_sim_inst *i = &s->inst[slot];
    if (!i->draining || i->head >= 0) return GY_OK;
    i->draining = 0;
    s->xf[i->xform_id].at_barrier = 1;
    i->barrier = 1;
    return gy_sim_xf_try_switch(s, i->xform_id);
}

/* The weights are back: the requests' KV gathers on the members they are packed to; without
 * live restore (KunServe Fig. 15's baseline) nothing is gathered: the group serves its requests
 * as a pipeline, taking no new ones, until the last has finished. */
gy_status gy_sim_restore_gather(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    const int32_t c = f->src[0];
    gy_sim_inst *i = &s->inst[c];
    if (!s->config.live_restore) {
        f->phase = 1;
        o->phase_end = s->now;
        i->draining = 1;
        return gy_sim_restore_drained(s, c);
    }
    if (!gy_sim_pack_replicas(s, c)) /* it took no requests since the check */
        return GY_FAIL(GY_ERR_STATE, "a restore's requests no longer fit its members");
    double tokens[GY_SIM_MAX_STAGES] = {0};
    for (int64_t r = i->head; r >= 0; r = s->req[r].next)
        tokens[s->req[r].half] += (double)gy_sched_block_counter_held(i->core.bc, r) *
                                  (double)s->config.sched.block_size;
    const double dt = gy_sim_pipeline_gather_time(&s->sub[i->n_stages], i->layers, tokens,
                                                  &o->kv_bytes);
    f->phase = 1;
    o->phase_end = s->now;
    return gy_sim_push(s, s->now + dt, GY_SIM_EV_PHASE, x, 1);
}

/* The group is idle: its members come back as replicas and take their requests with KV. */
gy_status gy_sim_restore_switch(gy_sim *s, int64_t x) {
    gy_sim_transform_out *o = &s->xf_out[x];
    const int32_t c = s->xf[x].src[0];
    const int32_t first = s->inst[c].gpu_first, n = s->inst[c].n_stages;
    if (!gy_sim_pack_replicas(s, c))
        return GY_FAIL(GY_ERR_STATE, "a restore's requests no longer fit its members");
    int64_t head = -1, tail = -1;
    while (s->inst[c].head >= 0) {
        const int64_t r = s->inst[c].head;
        GY_TRY(gy_sim_lift(s, r, 0));
        if (tail >= 0) s->req[tail].next = r; else head = r;
        tail = r;
    }
    GY_TRY(gy_sim_inst_destroy(s, c));
    int32_t members[GY_SIM_MAX_STAGES];
    for (int32_t k = 0; k < n; k++) GY_TRY(gy_sim_pipe_create(s, first + k, 1, NULL, &members[k]));
    while (head >= 0) {
        const int64_t r = head;
        head = r == tail ? -1 : s->req[r].next;
        const int32_t slot = members[s->req[r].half];
        s->req[r].half = -1;
        GY_TRY(gy_sim_land(s, r, slot));
        s->out[r].migrations++;
        o->n_migrated++;
    }
    for (int32_t k = 0; k < n; k++) GY_TRY(gy_sim_start_step(s, members[k]));
    s->stats.restore_s += s->now - o->start;
    s->stats.restore_bytes += o->weight_bytes + o->kv_bytes;
    return gy_sim_xf_finish(s, x, -1, &s->stats.n_restores);
}
