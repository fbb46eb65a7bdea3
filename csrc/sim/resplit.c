/* resplit.c: PipeLive's live re-split of a pipeline (sim.h): the layers that change stage migrate
 * while the pipeline serves at its old split with the intermediate KV budget (B_shrink,
 * policy/pipeline.h), then a short stop commits the new split and its capacity. */
#include "sim_impl.h"

#include <math.h>
#include <string.h>

/* Starts the re-split of the pipeline at `c` to `tgt` (checked: B_shrink holds its KV). */
static gy_status gy_sim_start_resplit(gy_sim *s, int32_t c, const int32_t *tgt, int64_t shrink) {
    gy_sim_inst *i = &s->inst[c];
    const gy_sim_pipeline *p = &s->pipeline;
    int64_t x;
    GY_TRY(gy_sim_xf_new(s, GY_SIM_OP_RESPLIT, i->gpu_first, 1, 1, &x));
    s->xf[x] = (gy_sim_xf){.src = {c}, .n_src = 1, .dst = {-1, -1}, .phase = 0};
    gy_sim_transform_out *o = &s->xf_out[x];
    memcpy(o->layers_from, i->layers, (size_t)p->n_stages * sizeof *tgt);
    memcpy(o->layers_to, tgt, (size_t)p->n_stages * sizeof *tgt);
    memcpy(i->target, tgt, (size_t)p->n_stages * sizeof *tgt);
    i->xform = GY_SIM_XFORM_RESPLITTING;
    i->xform_id = (int32_t)x;
    GY_TRY(gy_sim_instance_set_capacity(&i->core, shrink)); /* both layer sets held */
    const double dt = gy_sim_pipeline_migration_time(p, i->layers, tgt, gy_sim_kv_tokens(s, c),
                                                     &o->weight_bytes, &o->kv_bytes);
    if (!(dt >= 0) || !isfinite(dt))
        return GY_FAIL(GY_ERR_STATE, "the pipeline model gave a migration time of %g s", dt);
    return gy_sim_push(s, s->now + dt, GY_SIM_EV_PHASE, x, 0);
}

/* A re-split of the pipeline at op->gpu_first to op->layers, unless the state refuses it:
 * not a pipeline cluster or not a pipeline there, something under way, not a new split of the
 * model, or KV in use above B_shrink (nothing changes then). */
gy_status gy_sim_try_resplit(gy_sim *s, const gy_sim_op *op, int32_t *started) {
    if (s->config.pipeline == NULL) return GY_OK;
    const gy_sim_pipeline *p = &s->pipeline;
    const int32_t c = gy_sim_slot_at(s, op->gpu_first, op->size);
    if (c < 0 || s->inst[c].n_stages != p->n_stages || s->inst[c].xform != GY_SIM_XFORM_NONE ||
        !gy_sim_pipeline_split_ok(p, op->layers) ||
        memcmp(op->layers, s->inst[c].layers, (size_t)p->n_stages * sizeof *op->layers) == 0)
        return GY_OK;
    const int64_t shrink = gy_sim_pipeline_shrink_capacity(p, s->inst[c].layers, op->layers);
    if (shrink < 1 || gy_sim_instance_used(&s->inst[c].core) > shrink) return GY_OK;
    *started = 1;
    return gy_sim_start_resplit(s, c, op->layers, shrink);
}

/* Migrated, its last step at the old split done: the stop (stop_time) before the commit. */
gy_status gy_sim_resplit_stop(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    f->phase = 1;
    o->phase_end = s->now;
    return gy_sim_push(s, s->now + s->pipeline.stop_time, GY_SIM_EV_PHASE, x, 1);
}

/* The stop is over: the pipeline serves at its new split with that split's blocks. */
gy_status gy_sim_resplit_commit(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    const int32_t c = f->src[0];
    gy_sim_inst *i = &s->inst[c];
    memcpy(i->layers, i->target, sizeof i->layers);
    GY_TRY(gy_sim_instance_set_capacity(&i->core, gy_sim_pipeline_capacity(&s->pipeline,
                                                                           i->layers)));
    i->xform = GY_SIM_XFORM_NONE;
    i->xform_id = -1;
    i->barrier = 0;
    f->phase = 2;
    f->dst[0] = c;
    f->n_dst = 1;
    o->end = s->now;
    s->n_active_xf--;
    s->stats.n_resplits++;
    s->stats.resplit_migration_s += o->phase_end - o->start;
    s->stats.resplit_stop_s += o->end - o->phase_end;
    GY_TRY(gy_sim_start_step(s, c));
    return gy_cluster_reconfigured(s->cluster, 1, s->now);
}
