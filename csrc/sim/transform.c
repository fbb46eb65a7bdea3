/* transform.c: what every reconfiguration shares, whatever its mechanism: its record (the
 * results' gy_sim_transform_out) and state (gy_sim_xf), its phases priced by the cost model, its
 * end, and the barrier that holds a topology change back until its sources' steps in flight
 * have ended. A phase's end and a switch are handed to the mechanism's file by kind, so the
 * order of events stays in one place. */
#include "sim_impl.h"

#include <math.h>
#include <string.h>

gy_status gy_sim_xf_new(gy_sim *s, int32_t kind, int32_t gpu_first, int32_t tp_from,
                        int32_t tp_to, int64_t *id) {
    GY_SIM_GROW(s->xf_out, s->n_xf, s->cap_xf_out);
    GY_SIM_GROW(s->xf, s->n_xf, s->cap_xf);
    s->xf_out[s->n_xf] = (gy_sim_transform_out){.kind = kind, .gpu_first = gpu_first,
                                                .tp_from = tp_from, .tp_to = tp_to,
                                                .start = s->now, .phase_end = NAN, .end = NAN};
    memset(&s->xf[s->n_xf], 0, sizeof s->xf[s->n_xf]);
    *id = s->n_xf++;
    s->n_active_xf++;
    return GY_OK;
}

gy_status gy_sim_xf_phase(gy_sim *s, int64_t x, int32_t kind, double kv_tokens) {
    gy_sim_transform_out *o = &s->xf_out[x];
    const gy_sim_phase_shape p = {.kind = kind, .tp_from = o->tp_from, .tp_to = o->tp_to,
                                  .kv_tokens = kv_tokens};
    double bytes = 0;
    const double dt = s->config.cost.phase_time(s->config.cost.ctx, &p, &bytes);
    if (!(dt >= 0) || !isfinite(dt))
        return GY_FAIL(GY_ERR_STATE, "the cost model gave a phase time of %g s", dt);
    if (kind == GY_SIM_PHASE_KV_SCATTER) o->kv_bytes += bytes; else o->weight_bytes += bytes;
    return gy_sim_push(s, s->now + dt, GY_SIM_EV_PHASE, x, s->xf[x].phase);
}

double gy_sim_kv_tokens(const gy_sim *s, int32_t slot) {
    return (double)gy_sim_instance_used(&s->inst[slot].core) * (double)s->config.sched.block_size;
}

/* A transformation is over with `c` (a slot, or -1) as its one new instance: it steps, and the
 * controller hears of the new topology. */
gy_status gy_sim_xf_finish(gy_sim *s, int64_t x, int32_t c, int64_t *counter) {
    gy_sim_xf *f = &s->xf[x];
    f->dst[0] = c;
    f->n_dst = c >= 0;
    f->phase = 2;
    s->xf_out[x].end = s->now;
    s->n_active_xf--;
    (*counter)++;
    if (c >= 0) GY_TRY(gy_sim_start_step(s, c));
    return gy_cluster_reconfigured(s->cluster, 1, s->now);
}

/* The topology change of a transformation, once its sources are idle. */
static gy_status gy_sim_xf_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    f->at_barrier = 0;
    if (o->kind == GY_SIM_OP_DROP) return gy_sim_drop_switch(s, x);
    if (o->kind == GY_SIM_OP_RESTORE) return gy_sim_restore_switch(s, x);
    if (o->kind == GY_SIM_OP_RESPLIT) return gy_sim_resplit_stop(s, x);
    if (o->kind == GY_SIM_OP_BIND) return gy_sim_bind_switch(s, x);
    if (o->kind == GY_SIM_OP_RELEASE) return gy_sim_release_switch(s, x);
    if (o->kind == GY_SIM_OP_MERGE) return gy_sim_merge_switch(s, x);
    return gy_sim_split_switch(s, x);
}

/* Sources that still have a step in flight hold the switch back. */
gy_status gy_sim_xf_try_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    for (int k = 0; k < f->n_src; k++)
        if (s->inst[f->src[k]].stepping) return GY_OK;
    return gy_sim_xf_switch(s, x);
}

gy_status gy_sim_on_phase(gy_sim *s, int64_t x, int64_t phase) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    if (phase != f->phase) return GY_FAIL(GY_ERR_STATE, "transformation %lld: stale phase",
                                          (long long)x);
    if (o->kind == GY_SIM_OP_RESPLIT && phase == 1) return gy_sim_resplit_commit(s, x);
    if (o->kind == GY_SIM_OP_DROP && phase == 1) return gy_sim_exchange_end(s, x);
    if (o->kind == GY_SIM_OP_RESTORE && phase == 0) return gy_sim_restore_gather(s, x);
    if (o->kind == GY_SIM_OP_RESTORE) { /* gathered: switch once its step in flight ended */
        f->at_barrier = 1;
        s->inst[f->src[0]].barrier = 1;
        return gy_sim_xf_try_switch(s, x);
    }
    if (o->kind == GY_SIM_OP_MERGE && phase == 0) return gy_sim_merge_weights_dropped(s, x);
    if (phase == 0 || o->kind == GY_SIM_OP_MERGE) { /* merge phase 1, split phase 0, a bind's
                                                       or a release's switch time: switch */
        f->at_barrier = 1;
        for (int k = 0; k < f->n_src; k++) s->inst[f->src[k]].barrier = 1;
        return gy_sim_xf_try_switch(s, x);
    }
    return gy_sim_split_weights_gathered(s, x); /* split phase 1 */
}
