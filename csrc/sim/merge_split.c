/* merge_split.c: Gyges' transformations of a sharded cluster (sim.h): a merge makes two TP-k
 * halves one TP-2k instance (Gyges 4.3: the MLP weights first, then the KV scatter), a split makes
 * a TP-2k instance its two halves (AMOEBAs 3.3: the KV scatter first, then the FFN gather). Each is
 * two phases priced by the cost model, the instances serving throughout; the requests move with
 * their progress. */
#include "sim_impl.h"

static gy_status gy_sim_start_merge(gy_sim *s, int32_t a, int32_t b, int32_t g, int32_t size) {
    int64_t x;
    GY_TRY(gy_sim_xf_new(s, GY_SIM_OP_MERGE, g, size / 2, size, &x));
    s->xf[x] = (gy_sim_xf){.src = {a, b}, .n_src = 2, .dst = {-1, -1}, .phase = 0};
    for (int k = 0; k < 2; k++) {
        s->inst[s->xf[x].src[k]].xform = GY_SIM_XFORM_MERGING;
        s->inst[s->xf[x].src[k]].xform_id = (int32_t)x;
        s->inst[s->xf[x].src[k]].stopped = s->config.stop_transforming; /* after its step */
    }
    return gy_sim_xf_phase(s, x, GY_SIM_PHASE_WEIGHTS_DROP, 0.0);
}

/* A merge of the aligned group [op->gpu_first, + op->size), unless the state refuses it: its
 * halves are not one instance each, or something is under way on one. */
gy_status gy_sim_try_merge(gy_sim *s, const gy_sim_op *op, int32_t *started) {
    const int32_t size = op->size, half = size / 2;
    const int32_t g = op->gpu_first;
    const int ok_group = gy_sim_group_ok(s, g, size);
    const int32_t a = ok_group ? gy_sim_slot_at(s, g, half) : -1;
    const int32_t b = ok_group ? gy_sim_slot_at(s, g + half, half) : -1;
    if (a < 0 || b < 0 || s->inst[a].xform != GY_SIM_XFORM_NONE ||
        s->inst[b].xform != GY_SIM_XFORM_NONE)
        return GY_OK;
    *started = 1;
    return gy_sim_start_merge(s, a, b, g, size);
}

/* Merge phase 0 (the weights' drop) is over: the halves grow to capacity_mid, and phase 1,
 * the KV scatter, begins. */
gy_status gy_sim_merge_weights_dropped(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    /* the dropped FFN shards become KV room */
    const int64_t cap = s->capacity_mid[gy_sim_level(o->tp_from)];
    double kv = 0;
    for (int k = 0; k < 2; k++) {
        gy_sim_inst *i = &s->inst[f->src[k]];
        if (cap > i->core.capacity) GY_TRY(gy_sim_instance_set_capacity(&i->core, cap));
        kv += gy_sim_kv_tokens(s, f->src[k]);
    }
    f->phase = 1;
    o->phase_end = s->now;
    GY_TRY(gy_sim_xf_phase(s, x, GY_SIM_PHASE_KV_SCATTER, kv));
    /* more room may let queued requests in */
    for (int k = 0; k < 2; k++) GY_TRY(gy_sim_start_step(s, f->src[k]));
    return GY_OK;
}

/* Both halves are idle: the TP-2k instance replaces them and takes their requests with their
 * progress. */
gy_status gy_sim_merge_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    int32_t c;
    GY_TRY(gy_sim_inst_create(s, o->gpu_first, o->tp_to, &c));
    f = &s->xf[x];
    for (int k = 0; k < 2; k++) {
        const int32_t src = f->src[k];
        while (s->inst[src].head >= 0) {
            GY_TRY(gy_sim_carry_over(s, s->inst[src].head, c));
            o->n_migrated++;
        }
    }
    for (int k = 0; k < 2; k++) GY_TRY(gy_sim_inst_destroy(s, f->src[k]));
    return gy_sim_xf_finish(s, x, c, &s->stats.n_merges);
}

/* Packs the requests of `slot` into its two halves; 0 when they do not fit. */
static int gy_sim_pack_halves(gy_sim *s, int32_t slot) {
    const gy_sim_inst *i = &s->inst[slot];
    int64_t room[2] = {gy_sim_usable(s, i->tp / 2), gy_sim_usable(s, i->tp / 2)};
    return gy_sim_pack(s, i, room, 2);
}

static gy_status gy_sim_start_split(gy_sim *s, int32_t c) {
    gy_sim_inst *i = &s->inst[c];
    int64_t x;
    GY_TRY(gy_sim_xf_new(s, GY_SIM_OP_SPLIT, i->gpu_first, i->tp, i->tp / 2, &x));
    s->xf[x] = (gy_sim_xf){.src = {c, -1}, .n_src = 1, .dst = {-1, -1}, .phase = 0};
    i->xform = GY_SIM_XFORM_SPLITTING;
    i->xform_id = (int32_t)x;
    i->stopped = s->config.stop_transforming; /* once its step in flight ends */
    return gy_sim_xf_phase(s, x, GY_SIM_PHASE_KV_SCATTER, gy_sim_kv_tokens(s, c));
}

/* A split of the instance at op->gpu_first, unless the state refuses it: TP 1, something under
 * way, halves the model does not fit, or its requests do not pack into them. */
gy_status gy_sim_try_split(gy_sim *s, const gy_sim_op *op, int32_t *started) {
    const int32_t c = gy_sim_slot_at(s, op->gpu_first, op->size);
    if (c < 0 || s->inst[c].tp < 2 || s->inst[c].xform != GY_SIM_XFORM_NONE) return GY_OK;
    if (s->capacity[gy_sim_level(s->inst[c].tp) - 1] < 1) return GY_OK; /* halves unfit */
    if (!gy_sim_pack_halves(s, c)) return GY_OK;
    *started = 1;
    return gy_sim_start_split(s, c);
}

/* The instance is idle: the halves replace it and take their requests (as packed when the
 * split started); phase 1, the FFN weights' gather, begins while they serve. */
gy_status gy_sim_split_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    const int32_t src = f->src[0];
    const int32_t half = o->tp_to;
    int32_t h[2];
    GY_TRY(gy_sim_inst_create(s, o->gpu_first, half, &h[0]));
    GY_TRY(gy_sim_inst_create(s, o->gpu_first + half, half, &h[1]));
    f = &s->xf[x];
    while (s->inst[src].head >= 0) {
        const int64_t r = s->inst[src].head;
        int32_t which = s->req[r].half;
        if (which < 0) /* cannot happen (it takes no requests), but stay safe */
            which = s->inst[h[1]].footprint < s->inst[h[0]].footprint;
        GY_TRY(gy_sim_carry_over(s, r, h[which]));
        o->n_migrated++;
    }
    GY_TRY(gy_sim_inst_destroy(s, src));
    for (int k = 0; k < 2; k++) {
        f->dst[k] = h[k];
        s->inst[h[k]].xform = GY_SIM_XFORM_SPLIT_TAIL;
        s->inst[h[k]].xform_id = (int32_t)x;
        s->inst[h[k]].stopped = s->config.stop_transforming; /* until their weights are in */
    }
    f->n_dst = 2;
    f->phase = 1;
    o->phase_end = s->now;
    GY_TRY(gy_sim_xf_phase(s, x, GY_SIM_PHASE_WEIGHTS_GATHER, 0.0));
    for (int k = 0; k < 2; k++) GY_TRY(gy_sim_start_step(s, h[k]));
    return gy_cluster_reconfigured(s->cluster, 0, s->now);
}

/* Split phase 1 is over: the halves have their weights and may transform again. */
gy_status gy_sim_split_weights_gathered(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    for (int k = 0; k < 2; k++) {
        s->inst[f->dst[k]].xform = GY_SIM_XFORM_NONE;
        s->inst[f->dst[k]].xform_id = -1;
        s->inst[f->dst[k]].stopped = 0;
    }
    f->phase = 2;
    o->end = s->now;
    s->n_active_xf--;
    s->stats.n_splits++;
    for (int k = 0; k < 2; k++) GY_TRY(gy_sim_start_step(s, f->dst[k]));
    return gy_cluster_reconfigured(s->cluster, 1, s->now);
}
