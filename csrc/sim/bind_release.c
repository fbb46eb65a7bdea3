/* bind_release.c: Flying Serving's reconfigurations of a replicated cluster (sim.h): a bind makes
 * the unbound instances of an aligned group one bound TP instance over their replicas, a release
 * gives the members back. No weights move (every GPU keeps its replica), only switch_time
 * passes: a bind pauses the members' requests with their KV and recomputes their TP work on the
 * bound instance; a release resumes the paused requests where they were. The same two are
 * LoongServe's elastic scale-up and scale-down when the bound instance is sequence parallel
 * (config.sequence_parallel): every request then keeps its KV through both. */
#include "sim_impl.h"

/* Starts a bind of the members [first, first + n) (slots) into one TP-size instance: they serve
 * for switch_time more, then stop at their step's end (the phase, then the barrier). */
static gy_status gy_sim_start_bind(gy_sim *s, const int32_t *members, int32_t n, int32_t g,
                                   int32_t size) {
    int64_t x;
    GY_TRY(gy_sim_xf_new(s, GY_SIM_OP_BIND, g, s->inst[members[0]].tp, size, &x));
    s->xf[x] = (gy_sim_xf){.n_src = n, .dst = {-1, -1}, .phase = 0};
    for (int32_t k = 0; k < n; k++) {
        s->xf[x].src[k] = members[k];
        s->inst[members[k]].xform = GY_SIM_XFORM_BINDING;
        s->inst[members[k]].xform_id = (int32_t)x;
    }
    return gy_sim_push(s, s->now + s->config.switch_time, GY_SIM_EV_PHASE, x, 0);
}

/* A bind of the aligned group [op->gpu_first, + op->size): its instances, all unbound, of one
 * TP below size, nothing under way. */
gy_status gy_sim_try_bind(gy_sim *s, const gy_sim_op *op, int32_t *started) {
    const int32_t g = op->gpu_first, size = op->size;
    if (!gy_sim_group_ok(s, g, size)) return GY_OK;
    int32_t members[GY_SIM_XF_MAX_SRC], n = 0;
    for (int32_t x = g; x < g + size;) {
        const int32_t slot = s->gpu_slot[x];
        const gy_sim_inst *i = &s->inst[slot];
        if (i->gpu_first != x || i->tp >= size || i->bound || i->xform != GY_SIM_XFORM_NONE ||
            n == GY_SIM_XF_MAX_SRC || (n > 0 && i->tp != s->inst[members[0]].tp))
            return GY_OK;
        members[n++] = slot;
        x += i->tp;
    }
    *started = 1;
    return gy_sim_start_bind(s, members, n, g, size);
}

static gy_status gy_sim_start_release(gy_sim *s, int32_t c) {
    gy_sim_inst *i = &s->inst[c];
    int64_t x;
    GY_TRY(gy_sim_xf_new(s, GY_SIM_OP_RELEASE, i->gpu_first, i->tp, i->member_tp, &x));
    s->xf[x] = (gy_sim_xf){.src = {c}, .n_src = 1, .dst = {-1, -1}, .phase = 0};
    i->xform = GY_SIM_XFORM_RELEASING;
    i->xform_id = (int32_t)x;
    return gy_sim_push(s, s->now + s->config.switch_time, GY_SIM_EV_PHASE, x, 0);
}

/* The bound instance's requests, if any, go to the members to be recomputed there (their KV
 * has the TP geometry), packed beside the paused requests coming back; 0 when one does not fit
 * (a long request: the release must wait for it). Sets req.half to the member. */
static int gy_sim_pack_members(gy_sim *s, int32_t c) {
    const gy_sim_inst *i = &s->inst[c];
    const int32_t n = i->tp / i->member_tp;
    int64_t room[GY_SIM_XF_MAX_SRC];
    for (int32_t k = 0; k < n; k++) room[k] = gy_sim_usable(s, i->member_tp);
    for (int64_t r = i->paused_head; r >= 0; r = s->req[r].next)
        room[(s->req[r].home - i->gpu_first) / i->member_tp] -= s->req[r].footprint;
    return gy_sim_pack(s, i, room, n);
}

/* A release of the bound instance at op->gpu_first, unless the state refuses it: not bound,
 * something under way, or its requests do not fit its members. */
gy_status gy_sim_try_release(gy_sim *s, const gy_sim_op *op, int32_t *started) {
    const int32_t c = gy_sim_slot_at(s, op->gpu_first, op->size);
    if (c < 0 || !s->inst[c].bound || s->inst[c].xform != GY_SIM_XFORM_NONE ||
        !gy_sim_pack_members(s, c))
        return GY_OK;
    *started = 1;
    return gy_sim_start_release(s, c);
}

/* The members' TP work moves to the new bound instance (recomputed: its KV had the members'
 * geometry); the rest pause with their KV, which keeps its blocks in the members' pools. A
 * sequence-parallel bind moves every request in with its KV: nothing pauses, and the bound
 * instance's blocks are the members' pooled capacity. */
gy_status gy_sim_bind_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    const int32_t member_tp = o->tp_from;
    const int sp = s->config.sequence_parallel;
    int64_t moving = -1, paused = -1, n_paused = 0, least_free = INT64_MAX;
    for (int32_t k = 0; k < f->n_src; k++) {
        gy_sim_inst *m = &s->inst[f->src[k]];
        const int32_t home = m->gpu_first;
        int64_t kept_blocks = 0;
        while (m->head >= 0) {
            const int64_t r = m->head;
            gy_sim_req *q = &s->req[r];
            const int recompute = q->tp_work && !sp; /* TP work is recomputed under TP */
            GY_TRY(gy_sim_lift(s, r, recompute));
            if (q->tp_work || sp) {
                q->next = moving;
                moving = r;
                if (recompute) s->stats.n_recomputed++;
            } else {
                q->home = home;
                q->next = paused;
                paused = r;
                n_paused++;
                kept_blocks += gy_sim_cdiv(q->carry.kept, s->config.sched.block_size);
            }
            m = &s->inst[f->src[k]];
        }
        const int64_t free_blocks = m->core.capacity - kept_blocks;
        if (free_blocks < least_free) least_free = free_blocks;
    }
    for (int32_t k = 0; k < f->n_src; k++) GY_TRY(gy_sim_inst_destroy(s, f->src[k]));
    int32_t c;
    GY_TRY(gy_sim_inst_create(s, o->gpu_first, o->tp_to, &c));
    gy_sim_inst *b = &s->inst[c];
    if (!sp) { /* (SP: the requests come with their blocks into the pooled capacity) */
        /* a TP-k block holds k / member_tp times the tokens of a member's block in the same
         * bytes */
        int64_t cap = least_free * (o->tp_to / member_tp);
        if (cap > b->core.counter_total) cap = b->core.counter_total;
        if (cap < 1) cap = 1;
        GY_TRY(gy_sim_instance_set_capacity(&b->core, cap));
    }
    b->bound = 1;
    b->member_tp = member_tp;
    b->paused_head = paused;
    b->n_paused = n_paused;
    s->stats.n_paused += n_paused;
    while (moving >= 0) {
        const int64_t r = moving;
        moving = s->req[r].next;
        GY_TRY(gy_sim_land(s, r, c));
        if (!sp) s->out[r].migrations++; /* (SP: its KV stays where it is) */
        o->n_migrated++;
    }
    return gy_sim_xf_finish(s, x, c, &s->stats.n_binds);
}

/* The members come back: their paused requests resume, KV and progress kept; the bound
 * instance's own requests (a release under load) are recomputed on the members packed (SP:
 * they go with their KV, placed on their member during the prefill). */
gy_status gy_sim_release_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    const int32_t c = f->src[0];
    int64_t paused = s->inst[c].paused_head;
    const int32_t first = s->inst[c].gpu_first, size = s->inst[c].tp, member_tp = o->tp_to;
    /* checked when it started; it takes no requests meanwhile, so this holds, but stay safe */
    if (!gy_sim_pack_members(s, c))
        return GY_FAIL(GY_ERR_STATE, "a release's requests no longer fit its members");
    int64_t moving = -1;
    const int sp = s->config.sequence_parallel;
    while (s->inst[c].head >= 0) { /* recomputed on the member gy_sim_pack chose (req.half) */
        const int64_t r = s->inst[c].head;
        gy_sim_req *q = &s->req[r];
        GY_TRY(gy_sim_lift(s, r, !sp));
        q->tp_work = 0;
        q->next = moving;
        moving = r;
        if (!sp) s->stats.n_recomputed++;
    }
    GY_TRY(gy_sim_inst_destroy(s, c));
    int32_t members[GY_SIM_XF_MAX_SRC];
    const int32_t n = size / member_tp;
    for (int32_t k = 0; k < n; k++)
        GY_TRY(gy_sim_inst_create(s, first + k * member_tp, member_tp, &members[k]));
    while (moving >= 0) {
        const int64_t r = moving;
        gy_sim_req *q = &s->req[r];
        moving = q->next;
        const int32_t slot = members[q->half];
        q->half = -1;
        GY_TRY(gy_sim_land(s, r, slot));
        if (!sp) s->out[r].migrations++;
        o->n_migrated++;
    }
    while (paused >= 0) {
        const int64_t r = paused;
        gy_sim_req *q = &s->req[r];
        paused = q->next;
        const int32_t slot = s->gpu_slot[q->home];
        q->home = -1;
        GY_TRY(gy_sim_land(s, r, slot));
        o->n_migrated++;
    }
    for (int32_t k = 0; k < n; k++) GY_TRY(gy_sim_start_step(s, members[k]));
    return gy_sim_xf_finish(s, x, -1, &s->stats.n_releases);
}
