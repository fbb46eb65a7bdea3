/* slots.c: the simulator's instances and the requests on them. An instance lives in a slot
 * (reused, with a generation number so that a step-end event of a replaced instance is
 * recognised as stale) and each GPU names the slot that owns it; an instance's requests form an
 * intrusive list whose sums (footprint, pending tokens, min_tp levels) the policies' view reads.
 * Every mechanism opens and closes instances, moves requests between them (lift, land, carry
 * over) and packs requests into parts through these, so each rule is written once. */
#include "sim_impl.h"

#include <string.h>

static gy_status gy_sim_layout_record(gy_sim *s, const gy_sim_inst *i, int32_t change) {
    GY_SIM_GROW(s->layout_ev, s->n_layout_ev, s->cap_layout_ev);
    s->layout_ev[s->n_layout_ev++] = (gy_sim_layout_event){
        .time = s->now, .gpu_first = i->gpu_first, .tp = i->tp, .change = change};
    return GY_OK;
}

/* A new instance over GPUs [gpu_first, gpu_first + width) with `cap` blocks now, up to max_cap. */
static gy_status gy_sim_inst_open(gy_sim *s, int32_t gpu_first, int32_t tp, int32_t width,
                                  int64_t cap, int64_t max_cap, int32_t *slot_out) {
    int64_t slot = -1;
    for (int64_t k = 0; k < s->n_slots; k++)
        if (!s->inst[k].alive) {
            slot = k;
            break;
        }
    if (slot < 0) {
        GY_SIM_GROW(s->inst, s->n_slots, s->cap_inst);
        slot = s->n_slots++;
        memset(&s->inst[slot], 0, sizeof s->inst[slot]);
    }
    gy_sim_inst *i = &s->inst[slot];
    const int64_t gen = i->gen + 1;
    memset(i, 0, sizeof *i);
    GY_TRY(gy_sim_instance_init(&i->core, &s->config.sched, cap, max_cap));
    i->alive = 1;
    i->gen = gen;
    i->gpu_first = gpu_first;
    i->tp = tp;
    i->width = width;
    i->host = gpu_first / s->config.gpus_per_host;
    i->xform_id = -1;
    i->head = i->tail = -1;
    i->paused_head = -1;
    for (int32_t g = gpu_first; g < gpu_first + width; g++) s->gpu_slot[g] = (int32_t)slot;
    *slot_out = (int32_t)slot;
    return gy_sim_layout_record(s, i, +1);
}

gy_status gy_sim_inst_create(gy_sim *s, int32_t gpu_first, int32_t tp, int32_t *slot_out) {
    const int32_t l = gy_sim_level(tp);
    const int64_t cap = s->capacity[l];
    const int64_t max_cap = l + 1 < s->n_levels && s->capacity_mid[l] > cap ? s->capacity_mid[l]
                                                                            : cap;
    return gy_sim_inst_open(s, gpu_first, tp, tp, cap, max_cap, slot_out);
}

/* The description pricing the pipeline i: the cluster's, or a buddy group's first stages. */
const gy_sim_pipeline *gy_sim_inst_pipe(const gy_sim *s, const gy_sim_inst *i) {
    return s->config.buddy ? &s->sub[i->n_stages] : &s->pipeline;
}

/* A pipeline over GPUs [gpu_first, + n) at the split `layers` (n = 1: a buddy cluster's whole
 * replica; layers NULL: the even split). */
gy_status gy_sim_pipe_create(gy_sim *s, int32_t gpu_first, int32_t n,
                             const int32_t *layers, int32_t *slot_out) {
    const gy_sim_pipeline *p = s->config.buddy ? &s->sub[n] : &s->pipeline;
    int32_t even[GY_SIM_MAX_STAGES], slot = -1;
    if (layers == NULL) {
        gy_sim_pipeline_even(p, even);
        layers = even;
    }
    GY_TRY(gy_sim_inst_open(s, gpu_first, 1, n, gy_sim_pipeline_capacity(p, layers),
                            gy_sim_pipeline_max_capacity(&s->pipeline), &slot));
    gy_sim_inst *i = &s->inst[slot];
    i->n_stages = n;
    memcpy(i->layers, layers, (size_t)n * sizeof *layers);
    if (slot_out) *slot_out = slot;
    return GY_OK;
}

gy_status gy_sim_inst_destroy(gy_sim *s, int32_t slot) {
    gy_sim_inst *i = &s->inst[slot];
    GY_TRY(gy_sim_layout_record(s, i, -1));
    gy_sim_instance_free(&i->core);
    const int64_t gen = i->gen;
    memset(i, 0, sizeof *i);
    i->gen = gen;
    i->xform_id = -1;
    return GY_OK;
}

/* ---- request lists ---- */

void gy_sim_link(gy_sim *s, int32_t slot, int64_t r) {
    gy_sim_inst *i = &s->inst[slot];
    gy_sim_req *q = &s->req[r];
    q->prev = i->tail;
    q->next = -1;
    if (i->tail >= 0) s->req[i->tail].next = r; else i->head = r;
    i->tail = r;
    q->slot = slot;
    i->n_req++;
    i->footprint += q->footprint;
    if (!i->max_fp_stale) {
        if (q->footprint > i->max_footprint) {
            i->max_footprint = q->footprint;
            i->max_fp_count = 1;
        } else if (q->footprint == i->max_footprint) {
            i->max_fp_count++;
        }
    }
    i->pending_prefill += s->out[r].input_tokens - q->prefill_done;
    i->pending_output += s->out[r].output_tokens - q->generated;
    /* (a request no replica holds, on a buddy group: min_tp 0, counted at the first level) */
    i->by_min_tp[s->out[r].min_tp > 0 ? gy_sim_level(s->out[r].min_tp) : 0]++;
    i->n_tp_work += q->tp_work;
    i->n_priority += q->priority > 0;
    s->out[r].gpu_first = i->gpu_first;
    s->out[r].tp = i->tp;
}

void gy_sim_unlink(gy_sim *s, int64_t r) {
    gy_sim_req *q = &s->req[r];
    gy_sim_inst *i = &s->inst[q->slot];
    if (q->prev >= 0) s->req[q->prev].next = q->next; else i->head = q->next;
    if (q->next >= 0) s->req[q->next].prev = q->prev; else i->tail = q->prev;
    i->n_req--;
    i->footprint -= q->footprint;
    if (!i->max_fp_stale && q->footprint == i->max_footprint && --i->max_fp_count == 0)
        i->max_fp_stale = 1;
    i->pending_prefill -= s->out[r].input_tokens - q->prefill_done;
    i->pending_output -= s->out[r].output_tokens - q->generated;
    i->by_min_tp[s->out[r].min_tp > 0 ? gy_sim_level(s->out[r].min_tp) : 0]--;
    i->n_tp_work -= q->tp_work;
    i->n_priority -= q->priority > 0;
    q->prev = q->next = -1;
    q->slot = -1;
}

int64_t gy_sim_inst_max_footprint(gy_sim *s, gy_sim_inst *i) {
    if (i->max_fp_stale) {
        i->max_footprint = i->max_fp_count = 0;
        for (int64_t r = i->head; r >= 0; r = s->req[r].next) {
            const int64_t fp = s->req[r].footprint;
            if (fp > i->max_footprint) {
                i->max_footprint = fp;
                i->max_fp_count = 1;
            } else if (fp == i->max_footprint) {
                i->max_fp_count++;
            }
        }
        i->max_fp_stale = 0;
    }
    return i->max_footprint;
}

/* ---- finding instances ---- */

int32_t gy_sim_slot_at(const gy_sim *s, int32_t gpu_first, int32_t size) {
    if (gpu_first < 0 || gpu_first >= s->n_gpus) return -1;
    const int32_t slot = s->gpu_slot[gpu_first];
    const gy_sim_inst *i = &s->inst[slot];
    /* size: its TP (a placement) or its GPUs (an op); a pipeline has TP 1 over its stages */
    if (i->gpu_first != gpu_first || (size > 0 && i->tp != size && i->width != size)) return -1;
    return slot;
}

/* 1 when [g, g + size) is an aligned group of TP 2 to max_tp inside one host. */
int gy_sim_group_ok(const gy_sim *s, int32_t g, int32_t size) {
    return gy_sim_level(size) >= 1 && size <= s->config.max_tp && g >= 0 && g % size == 0 &&
           g + size <= s->n_gpus &&
           g / s->config.gpus_per_host == (g + size - 1) / s->config.gpus_per_host;
}

/* ---- moving requests between instances ---- */

/* Takes request r out of its instance with what it carries (q->carry), its generated count
 * remapped; with `recompute` it keeps no KV (the next instance computes it all again). */
gy_status gy_sim_lift(gy_sim *s, int64_t r, int recompute) {
    gy_sim_req *q = &s->req[r];
    gy_sim_carry c;
    GY_TRY(gy_sim_instance_take(&s->inst[q->slot].core, r, &c));
    if (q->kept > c.kept) c.kept = q->kept; /* still catching up after an earlier move */
    if (recompute) c.kept = 0;
    gy_sim_unlink(s, r);
    q->gen_offset += c.gen_shift;
    q->kept = q->computed = c.kept;
    if (recompute) q->swapped = 0; /* else its KV still comes back from host memory */
    q->carry = c;
    return GY_OK;
}

/* Puts a lifted request on the instance at `slot`. */
gy_status gy_sim_land(gy_sim *s, int64_t r, int32_t slot) {
    gy_sim_req *q = &s->req[r];
    GY_TRY(gy_sim_instance_put(&s->inst[slot].core, r, &q->carry, s->out[r].arrival, q->priority));
    gy_sim_link(s, slot, r);
    return GY_OK;
}

/* Moves request r from its instance to `dst`, keeping its progress. */
gy_status gy_sim_carry_over(gy_sim *s, int64_t r, int32_t dst) {
    GY_TRY(gy_sim_lift(s, r, 0));
    GY_TRY(gy_sim_land(s, r, dst));
    s->out[r].migrations++;
    s->stats.n_migrations++;
    return GY_OK;
}

/* ---- packing requests into parts ---- */

/* Packs the requests of instance i into n parts with room[] blocks each: largest first, each
 * into the part with the most room left (the first of equals), req.half saying which; 0 when
 * one does not fit. An instance's queue is short: a pass per request is cheap. */
int gy_sim_pack(gy_sim *s, const gy_sim_inst *i, int64_t *room, int32_t n) {
    for (int64_t r = i->head; r >= 0; r = s->req[r].next) s->req[r].half = -1;
    for (;;) {
        int64_t best = -1;
        for (int64_t r = i->head; r >= 0; r = s->req[r].next)
            if (s->req[r].half < 0 && (best < 0 || s->req[r].footprint > s->req[best].footprint))
                best = r;
        if (best < 0) return 1;
        int32_t m = 0;
        for (int32_t k = 1; k < n; k++)
            if (room[k] > room[m]) m = k;
        if (s->req[best].footprint > room[m]) return 0;
        room[m] -= s->req[best].footprint;
        s->req[best].half = m;
    }
}

/* The blocks a fresh TP-tp instance lets requests take (its watermark kept free). */
int64_t gy_sim_usable(const gy_sim *s, int32_t tp) {
    const int64_t cap = s->capacity[gy_sim_level(tp)];
    return cap - (int64_t)(s->config.sched.watermark * (double)cap);
}
