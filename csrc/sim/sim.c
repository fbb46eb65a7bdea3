/* sim.c: the event loop of sim.h. Instances live in slots (reused) with a generation number so
 * that a step-end event of a replaced instance is recognised as stale; each GPU names the slot
 * that owns it; requests keep an intrusive list per instance (for carry-over and packing). */
#include "sim.h"
#include "../core/alloc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../cluster/controller.h"
#include "event_queue.h"

enum { GY_SIM_EV_ARRIVAL = 0, GY_SIM_EV_PHASE = 1, GY_SIM_EV_STEP = 2, GY_SIM_EV_SAMPLE = 3,
       GY_SIM_EV_MIGRATED = 4 /* a live migration's KV has crossed: switch */ };

/* What the simulator tracks per request beside its public record. */
typedef struct gy_sim_req {
    int64_t footprint;    /* blocks at its end */
    int64_t generated;    /* output tokens so far */
    int64_t gen_offset;   /* generated = gen_offset + its current scheduler's G (see instance.h) */
    int64_t kept;         /* tokens whose KV it kept through a transformation (free to recompute) */
    int64_t prefill_done; /* prompt tokens computed at least once */
    int64_t prev, next;   /* its instance's list */
    int32_t slot;         /* its instance, or -1 */
    int32_t half;         /* the half it goes to in the split under way, or -1 */
    int32_t priority;
    int32_t tp_work;      /* placed as TP work (replicated): recomputed by a bind, not paused */
    int32_t home;         /* paused: the GPU of the member it resumes on; else -1 */
    gy_sim_carry carry;   /* lifted out of its instance (gy_sim_lift): what it takes to the next
                             one (instance.h), while paused or across a bind or a release */
    int32_t victim;       /* buddy: its KV is still partly on its old GPU (an exchange runs) */
    int32_t swapped;      /* swap_bw > 0: preempted with its KV in host memory (`kept` tokens) */
    int64_t computed;     /* tokens whose KV it holds: the furthest entry end since it last lost
                             its KV */
    int32_t migrating;    /* MIGRATE: 1 its KV is crossing, 2 crossed (switch after the step) */
    int32_t migrate_from, migrate_to; /* the slot it leaves, the gpu_first it goes to */
    int32_t pad2_;
} gy_sim_req;

typedef struct gy_sim_inst {
    gy_sim_instance core;
    int32_t alive;
    int32_t gpu_first, tp, host;
    int32_t width;         /* GPUs it owns: tp, or its stages (a pipeline) */
    int32_t n_stages;      /* a pipeline: its stages, one GPU each; 0: a TP group */
    int32_t layers[GY_SIM_MAX_STAGES]; /* a pipeline: the split it serves at */
    int32_t target[GY_SIM_MAX_STAGES]; /* a re-split under way: the split it moves to */
    int64_t gen;
    int32_t xform, xform_id;
    int32_t stepping;      /* a step-end event is pending */
    int32_t barrier;       /* a transformation waits for it to stop stepping */
    gy_sched_batch batch;  /* the step in flight */
    int64_t head, tail;    /* its requests (indices), in assignment order */
    int64_t n_req, footprint, pending_prefill, pending_output;
    int64_t max_footprint;
    int64_t max_fp_count;  /* its requests with that footprint: the maximum is recounted only
                              when the last of them leaves (overloaded queues are long) */
    int32_t max_fp_stale;  /* max_footprint must be recomputed */
    int64_t by_min_tp[GY_SIM_MAX_LEVELS]; /* its requests per level of min_tp */
    int64_t n_tp_work;     /* its requests placed as TP work */
    int64_t n_priority;    /* its requests with priority > 0 */
    int32_t bound;         /* replicated: a bound group of members of TP member_tp */
    int32_t member_tp;
    int64_t n_paused, paused_head; /* the requests paused under it (a list through req.next) */
    int32_t draining;      /* buddy, no live restore: its weights are back; it dissolves once
                              its last request has finished */
    int32_t n_migrated;    /* its requests whose live migration's KV has crossed (switch them
                              when its step in flight ends) */
    double exch_start, exch_len; /* buddy: its exchange's switch and planned seconds */
    double exch_debt;      /* buddy: link seconds its remote attention took since the last check */
} gy_sim_inst;

#define GY_SIM_XF_MAX_SRC 16 /* members of one bind */

typedef struct gy_sim_xf {
    int32_t src[GY_SIM_XF_MAX_SRC], n_src; /* slots */
    int32_t dst[2], n_dst;
    int32_t phase;         /* the phase under way: 0, 1; 2 when done */
    int32_t at_barrier;
} gy_sim_xf;

#define GY_SIM_GROW(ptr, n, cap)                                                                   \
    do {                                                                                           \
        if ((n) >= (cap)) {                                                                        \
            int64_t c_ = (cap) ? 2 * (cap) : 64;                                                   \
            void *p_ = gy_realloc((ptr), (size_t)c_ * sizeof *(ptr));                                 \
            if (p_ == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory in the simulator"); \
            (ptr) = p_;                                                                            \
            (cap) = c_;                                                                            \
        }                                                                                          \
    } while (0)

struct gy_sim {
    gy_sim_config config;
    gy_sim_pipeline pipeline;  /* config.pipeline points here when set */
    gy_sim_pipeline sub[GY_SIM_MAX_STAGES + 1]; /* buddy: sub[g], the first g stages */
    int64_t single_cap;        /* buddy: blocks of a whole replica */
    int32_t pipe_layers[GY_SIM_MAX_STAGES];
    int32_t layout[64];
    int64_t capacity[GY_SIM_MAX_LEVELS], capacity_mid[GY_SIM_MAX_LEVELS];
    int64_t max_input[GY_SIM_MAX_LEVELS]; /* INT64_MAX when the config gives none */
    double prefill_rate[GY_SIM_MAX_LEVELS]; /* the cost model's, for the policies */
    int32_t n_levels, n_gpus;
    int32_t base_tp;           /* replicated: the smallest TP with capacity (the DP unit) */
    gy_cluster *cluster;       /* the controller: the policy, deferred and held requests */

    int64_t n;                 /* requests */
    gy_sim_request_out *out;   /* (n) */
    gy_sim_req *req;           /* (n) */
    int64_t next_arrival;      /* index of the next request to arrive */
    double t0;                 /* the first arrival: bins and samples start here */

    gy_sim_inst *inst;         /* (cap_inst) slots */
    int64_t n_slots, cap_inst;
    int32_t *gpu_slot;         /* (n_gpus) */

    gy_sim_eventq q;
    double now;

    gy_sim_transform_out *xf_out;
    gy_sim_xf *xf;
    int64_t n_xf, cap_xf, cap_xf_out;
    int64_t n_active_xf;

    gy_sim_sample *samples;
    int64_t n_samples, cap_samples;
    gy_sim_layout_event *layout_ev;
    int64_t n_layout_ev, cap_layout_ev;
    gy_sim_token *tokens;
    int64_t n_tokens, cap_tokens;
    double *bin_out, *bin_prompt;
    int64_t n_bins, cap_bins;

    gy_sim_stats stats;
};

/* ---- small helpers ---- */

static int64_t gy_sim_cdiv(int64_t a, int64_t b) { return a / b + (a % b != 0); }

static int32_t gy_sim_level_of(int32_t tp) { return gy_sim_level(tp); }

static gy_status gy_sim_push(gy_sim *s, double time, int32_t kind, int64_t a, int64_t b) {
    return gy_sim_eventq_push(&s->q, time, kind, kind, a, b);
}

static gy_status gy_sim_layout_record(gy_sim *s, const gy_sim_inst *i, int32_t change) {
    GY_SIM_GROW(s->layout_ev, s->n_layout_ev, s->cap_layout_ev);
    s->layout_ev[s->n_layout_ev++] = (gy_sim_layout_event){
        .time = s->now, .gpu_first = i->gpu_first, .tp = i->tp, .change = change};
    return GY_OK;
}

/* Grows the bins so that time t has one. */
static gy_status gy_sim_bin_at(gy_sim *s, double t, int64_t *bin) {
    int64_t b = (int64_t)floor((t - s->t0) / s->config.sample_interval);
    if (b < 0) b = 0;
    while (s->n_bins <= b) {
        if (s->n_bins >= s->cap_bins) {
            const int64_t c = s->cap_bins ? 2 * s->cap_bins : 1024;
            double *o = gy_realloc(s->bin_out, (size_t)c * sizeof *o);
            if (o == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for bins");
            s->bin_out = o;
            double *p = gy_realloc(s->bin_prompt, (size_t)c * sizeof *p);
            if (p == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for bins");
            s->bin_prompt = p;
            s->cap_bins = c;
        }
        s->bin_out[s->n_bins] = s->bin_prompt[s->n_bins] = 0.0;
        s->n_bins++;
    }
    *bin = b;
    return GY_OK;
}

/* ---- instances ---- */

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

static gy_status gy_sim_inst_create(gy_sim *s, int32_t gpu_first, int32_t tp, int32_t *slot_out) {
    const int32_t l = gy_sim_level_of(tp);
    const int64_t cap = s->capacity[l];
    const int64_t max_cap = l + 1 < s->n_levels && s->capacity_mid[l] > cap ? s->capacity_mid[l]
                                                                            : cap;
    return gy_sim_inst_open(s, gpu_first, tp, tp, cap, max_cap, slot_out);
}

/* The description pricing the pipeline i: the cluster's, or a buddy group's first stages. */
static const gy_sim_pipeline *gy_sim_inst_pipe(const gy_sim *s, const gy_sim_inst *i) {
    return s->config.buddy ? &s->sub[i->n_stages] : &s->pipeline;
}

/* A pipeline over GPUs [gpu_first, + n) at the split `layers` (n = 1: a buddy cluster's whole
 * replica; layers NULL: the even split). */
static gy_status gy_sim_pipe_create(gy_sim *s, int32_t gpu_first, int32_t n,
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

static gy_status gy_sim_inst_destroy(gy_sim *s, int32_t slot) {
    gy_sim_inst *i = &s->inst[slot];
    GY_TRY(gy_sim_layout_record(s, i, -1));
    gy_sim_instance_free(&i->core);
    const int64_t gen = i->gen;
    memset(i, 0, sizeof *i);
    i->gen = gen;
    i->xform_id = -1;
    return GY_OK;
}

static void gy_sim_link(gy_sim *s, int32_t slot, int64_t r) {
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
    i->by_min_tp[gy_sim_level_of(s->out[r].min_tp)]++;
    i->n_tp_work += q->tp_work;
    i->n_priority += q->priority > 0;
    s->out[r].gpu_first = i->gpu_first;
    s->out[r].tp = i->tp;
}

static void gy_sim_unlink(gy_sim *s, int64_t r) {
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
    i->by_min_tp[gy_sim_level_of(s->out[r].min_tp)]--;
    i->n_tp_work -= q->tp_work;
    i->n_priority -= q->priority > 0;
    q->prev = q->next = -1;
    q->slot = -1;
}

static int64_t gy_sim_inst_max_footprint(gy_sim *s, gy_sim_inst *i) {
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

/* ---- steps ---- */

static gy_status gy_sim_finish_step(gy_sim *s, int32_t slot, int *finished_any);

/* Starts steps on an idle instance until one takes time (or there is no work). */
static gy_status gy_sim_start_step(gy_sim *s, int32_t slot) {
    for (int64_t guard = 0;; guard++) {
        gy_sim_inst *i = &s->inst[slot];
        if (i->stepping || i->barrier) return GY_OK;
        if (guard > (INT64_C(1) << 24))
            return GY_FAIL(GY_ERR_STATE, "instance at GPU %d made no progress in %lld steps",
                           (int)i->gpu_first, (long long)guard);
        GY_TRY(gy_sched_schedule(i->core.sched, s->now, &i->batch));
        double swap_out = 0, swap_in = 0; /* tokens of KV this step moves to host memory, back */
        for (int64_t k = 0; k < i->batch.n_preempted; k++) {
            gy_sim_req *q = &s->req[i->batch.preempted[k]];
            if (s->config.swap_bw > 0) { /* its KV goes to host memory and comes back */
                q->kept = q->computed;
                q->swapped = q->computed > 0;
                swap_out += (double)q->computed;
            } else { /* its KV is released: recompute for real */
                q->kept = q->computed = 0;
            }
            s->out[i->batch.preempted[k]].preemptions++;
            s->stats.n_preemptions++;
        }
        if (i->batch.n_entries == 0) {
            GY_TRY(gy_sched_commit(i->core.sched, s->now, NULL, 0, NULL));
            return GY_OK;
        }
        gy_sim_step_shape shape = {0};
        double victim_tokens = 0; /* buddy: query tokens of requests whose KV is partly remote */
        for (int64_t k = 0; k < i->batch.n_entries; k++) {
            const gy_sched_entry *e = &i->batch.entries[k];
            if (isnan(s->out[e->id].scheduled)) s->out[e->id].scheduled = s->now;
            if (s->req[e->id].swapped) { /* re-admitted: its KV comes back from host memory */
                swap_in += (double)s->req[e->id].kept;
                s->req[e->id].swapped = 0;
            }
            const int64_t end = e->pos + e->n_tokens;
            const int64_t kept = s->req[e->id].kept;
            const int64_t start = e->pos > kept ? e->pos : kept;
            if (end <= start) continue; /* all of it kept */
            if (s->req[e->id].victim) victim_tokens += (double)(end - start);
            shape.n_tokens += end - start;
            shape.n_seqs++;
            shape.n_samples += e->samples;
            shape.kv_read_tokens += (double)end;
            shape.attn_pairs += ((double)end * (double)(end + 1) -
                                 (double)start * (double)(start + 1)) / 2.0;
        }
        const int busy = i->xform != GY_SIM_XFORM_NONE && i->xform != GY_SIM_XFORM_EXCHANGING;
        double dt = i->n_stages > 0
                        ? gy_sim_pipeline_step_time(gy_sim_inst_pipe(s, i), i->layers, busy,
                                                    &shape)
                        : s->config.cost.step_time(s->config.cost.ctx, i->tp, busy, &shape);
        if (i->xform == GY_SIM_XFORM_EXCHANGING && victim_tokens > 0) {
            const gy_sim_pipeline *p = gy_sim_inst_pipe(s, i);
            double left = i->exch_len > 0 ? 1.0 - (s->now - i->exch_start) / i->exch_len : 0.0;
            if (left < 0) left = 0;
            if (left > 1) left = 1;
            const double remote = gy_sim_pipeline_remote_time(
                p, left * (double)p->n_layers * (double)(i->n_stages - 1) / i->n_stages,
                victim_tokens);
            dt += remote;
            i->exch_debt += remote; /* the link carried it before the exchange's bytes */
        }
        if (swap_out + swap_in > 0) { /* over every GPU's PCIe link at once */
            const double swap = (swap_out + swap_in) * s->config.kv_token_bytes /
                                (s->config.swap_bw * (double)i->width);
            dt += swap;
            s->stats.swap_s += swap;
            s->stats.swap_out_bytes += swap_out * s->config.kv_token_bytes;
            s->stats.swap_in_bytes += swap_in * s->config.kv_token_bytes;
        }
        if (!(dt >= 0) || !isfinite(dt))
            return GY_FAIL(GY_ERR_STATE, "the cost model gave a step time of %g s", dt);
        if (dt > 0) {
            i->stepping = 1;
            return gy_sim_push(s, s->now + dt, GY_SIM_EV_STEP, slot, i->gen);
        }
        int finished = 0; /* a step over kept KV only: done at once */
        GY_TRY(gy_sim_finish_step(s, slot, &finished));
    }
}

static gy_status gy_sim_finish_request(gy_sim *s, int32_t slot, int64_t r) {
    gy_sim_req *q = &s->req[r];
    if (q->generated != s->out[r].output_tokens)
        return GY_FAIL(GY_ERR_STATE, "request %lld finished with %lld of %lld output tokens",
                       (long long)r, (long long)q->generated,
                       (long long)s->out[r].output_tokens);
    s->out[r].finish = s->now;
    s->out[r].status = GY_SIM_REQ_FINISHED;
    gy_sim_unlink(s, r);
    s->stats.n_finished++;
    return gy_sched_forget(s->inst[slot].core.sched, r);
}

static gy_status gy_sim_finish_step(gy_sim *s, int32_t slot, int *finished_any) {
    gy_sim_inst *i = &s->inst[slot];
    gy_sched_done done;
    GY_TRY(gy_sched_commit(i->core.sched, s->now, NULL, i->batch.n_entries, &done));
    s->stats.n_steps++;
    int64_t bin = -1;
    for (int64_t k = 0; k < i->batch.n_entries; k++) {
        const gy_sched_entry *e = &i->batch.entries[k];
        gy_sim_req *q = &s->req[e->id];
        gy_sim_request_out *o = &s->out[e->id];
        const int64_t end = e->pos + e->n_tokens;
        if (e->is_prefill) {
            const int64_t upto = end < o->input_tokens ? end : o->input_tokens;
            if (upto > q->prefill_done) {
                if (bin < 0) GY_TRY(gy_sim_bin_at(s, s->now, &bin));
                s->bin_prompt[bin] += (double)(upto - q->prefill_done);
                i->pending_prefill -= upto - q->prefill_done;
                q->prefill_done = upto;
            }
        }
        if (q->kept > 0 && end >= q->kept) q->kept = 0;
        if (end > q->computed) q->computed = end;
        if (!e->samples) continue;
        const int64_t index = q->gen_offset + e->sample_index;
        if (index > q->generated)
            return GY_FAIL(GY_ERR_STATE, "request %lld sampled token %lld with only %lld before",
                           (long long)e->id, (long long)index, (long long)q->generated);
        if (index < q->generated) continue; /* the token it had before a carry-over */
        q->generated++;
        i->pending_output--;
        if (q->generated == 1) o->first_token = s->now;
        if (bin < 0) GY_TRY(gy_sim_bin_at(s, s->now, &bin));
        s->bin_out[bin] += 1.0;
        if (s->config.record_tokens) {
            GY_SIM_GROW(s->tokens, s->n_tokens, s->cap_tokens);
            s->tokens[s->n_tokens++] = (gy_sim_token){.request = e->id, .time = s->now};
        }
    }
    for (int64_t k = 0; k < done.n_finished; k++)
        GY_TRY(gy_sim_finish_request(s, slot, done.finished[k]));
    *finished_any = done.n_finished > 0;
    return GY_OK;
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

/* ---- transformations ---- */

static gy_status gy_sim_xf_new(gy_sim *s, int32_t kind, int32_t gpu_first, int32_t tp_from,
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

static gy_status gy_sim_phase(gy_sim *s, int64_t x, int32_t kind, double kv_tokens) {
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

static double gy_sim_kv_tokens(const gy_sim *s, int32_t slot) {
    return (double)gy_sim_instance_used(&s->inst[slot].core) * (double)s->config.sched.block_size;
}

static gy_status gy_sim_start_merge(gy_sim *s, int32_t a, int32_t b, int32_t g, int32_t size) {
    int64_t x;
    GY_TRY(gy_sim_xf_new(s, GY_SIM_OP_MERGE, g, size / 2, size, &x));
    s->xf[x] = (gy_sim_xf){.src = {a, b}, .n_src = 2, .dst = {-1, -1}, .phase = 0};
    for (int k = 0; k < 2; k++) {
        s->inst[s->xf[x].src[k]].xform = GY_SIM_XFORM_MERGING;
        s->inst[s->xf[x].src[k]].xform_id = (int32_t)x;
    }
    return gy_sim_phase(s, x, GY_SIM_PHASE_WEIGHTS_DROP, 0.0);
}

/* Packs the requests of instance i into n parts with room[] blocks each: largest first, each
 * into the part with the most room left (the first of equals), req.half saying which; 0 when
 * one does not fit. An instance's queue is short: a pass per request is cheap. */
static int gy_sim_pack(gy_sim *s, const gy_sim_inst *i, int64_t *room, int32_t n) {
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
static int64_t gy_sim_usable(const gy_sim *s, int32_t tp) {
    const int64_t cap = s->capacity[gy_sim_level_of(tp)];
    return cap - (int64_t)(s->config.sched.watermark * (double)cap);
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
    return gy_sim_phase(s, x, GY_SIM_PHASE_KV_SCATTER, gy_sim_kv_tokens(s, c));
}

/* Takes request r out of its instance with what it carries (q->carry), its generated count
 * remapped; with `recompute` it keeps no KV (the next instance computes it all again). */
static gy_status gy_sim_lift(gy_sim *s, int64_t r, int recompute) {
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
static gy_status gy_sim_land(gy_sim *s, int64_t r, int32_t slot) {
    gy_sim_req *q = &s->req[r];
    GY_TRY(gy_sim_instance_put(&s->inst[slot].core, r, &q->carry, s->out[r].arrival, q->priority));
    gy_sim_link(s, slot, r);
    return GY_OK;
}

/* Moves request r from its instance to `dst`, keeping its progress. */
static gy_status gy_sim_carry_over(gy_sim *s, int64_t r, int32_t dst) {
    GY_TRY(gy_sim_lift(s, r, 0));
    GY_TRY(gy_sim_land(s, r, dst));
    s->out[r].migrations++;
    s->stats.n_migrations++;
    return GY_OK;
}

/* A transformation is over with `c` (a slot, or -1) as its one new instance: it steps, and the
 * controller hears of the new topology. */
static gy_status gy_sim_xf_finish(gy_sim *s, int64_t x, int32_t c, int64_t *counter) {
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

/* ---- binds and releases (replicated) ---- */

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

static gy_status gy_sim_start_release(gy_sim *s, int32_t c) {
    gy_sim_inst *i = &s->inst[c];
    int64_t x;
    GY_TRY(gy_sim_xf_new(s, GY_SIM_OP_RELEASE, i->gpu_first, i->tp, i->member_tp, &x));
    s->xf[x] = (gy_sim_xf){.src = {c}, .n_src = 1, .dst = {-1, -1}, .phase = 0};
    i->xform = GY_SIM_XFORM_RELEASING;
    i->xform_id = (int32_t)x;
    return gy_sim_push(s, s->now + s->config.switch_time, GY_SIM_EV_PHASE, x, 0);
}

/* The members' TP work moves to the new bound instance (recomputed: its KV had the members'
 * geometry); the rest pause with their KV, which keeps its blocks in the members' pools. */
static gy_status gy_sim_bind_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    const int32_t member_tp = o->tp_from;
    int64_t moving = -1, paused = -1, n_paused = 0, least_free = INT64_MAX;
    for (int32_t k = 0; k < f->n_src; k++) {
        gy_sim_inst *m = &s->inst[f->src[k]];
        const int32_t home = m->gpu_first;
        int64_t kept_blocks = 0;
        while (m->head >= 0) {
            const int64_t r = m->head;
            gy_sim_req *q = &s->req[r];
            GY_TRY(gy_sim_lift(s, r, q->tp_work)); /* TP work is recomputed under TP */
            if (q->tp_work) {
                q->next = moving;
                moving = r;
                s->stats.n_recomputed++;
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
    /* a TP-k block holds k / member_tp times the tokens of a member's block in the same bytes */
    int64_t cap = least_free * (o->tp_to / member_tp);
    if (cap > b->core.counter_total) cap = b->core.counter_total;
    if (cap < 1) cap = 1;
    GY_TRY(gy_sim_instance_set_capacity(&b->core, cap));
    b->bound = 1;
    b->member_tp = member_tp;
    b->paused_head = paused;
    b->n_paused = n_paused;
    s->stats.n_paused += n_paused;
    while (moving >= 0) {
        const int64_t r = moving;
        moving = s->req[r].next;
        GY_TRY(gy_sim_land(s, r, c));
        s->out[r].migrations++;
        o->n_migrated++;
    }
    return gy_sim_xf_finish(s, x, c, &s->stats.n_binds);
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

/* The members come back: their paused requests resume, KV and progress kept; the bound
 * instance's own requests (a release under load) are recomputed on the members packed. */
static gy_status gy_sim_release_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    const int32_t c = f->src[0];
    int64_t paused = s->inst[c].paused_head;
    const int32_t first = s->inst[c].gpu_first, size = s->inst[c].tp, member_tp = o->tp_to;
    /* checked when it started; it takes no requests meanwhile, so this holds, but stay safe */
    if (!gy_sim_pack_members(s, c))
        return GY_FAIL(GY_ERR_STATE, "a release's requests no longer fit its members");
    int64_t moving = -1;
    while (s->inst[c].head >= 0) { /* recomputed on the member gy_sim_pack chose (req.half) */
        const int64_t r = s->inst[c].head;
        gy_sim_req *q = &s->req[r];
        GY_TRY(gy_sim_lift(s, r, 1));
        q->tp_work = 0;
        q->next = moving;
        moving = r;
        s->stats.n_recomputed++;
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
        s->out[r].migrations++;
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

/* ---- pipeline re-splits ---- */

static int32_t gy_sim_slot_at(const gy_sim *s, int32_t gpu_first, int32_t size);

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
static gy_status gy_sim_try_resplit(gy_sim *s, const gy_sim_op *op, int32_t *started) {
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

/* The stop is over: the pipeline serves at its new split with that split's blocks. */
static gy_status gy_sim_resplit_commit(gy_sim *s, int64_t x) {
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

/* ---- buddy groups (KunServe) ---- */

/* The blocks a whole replica lets requests take (its watermark kept free). */
static int64_t gy_sim_single_usable(const gy_sim *s) {
    return s->single_cap - (int64_t)(s->config.sched.watermark * (double)s->single_cap);
}

/* A drop of the replicas [g, g + size), unless the state refuses it: not one host, a GPU not a
 * whole replica of its own, or something under way. The switch waits for the members' steps
 * in flight (an event now, outside the controller's call). */
static gy_status gy_sim_try_drop(gy_sim *s, const gy_sim_op *op, int32_t *started) {
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
static gy_status gy_sim_drop_switch(gy_sim *s, int64_t x) {
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
static gy_status gy_sim_exchange_end(gy_sim *s, int64_t x) {
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
static gy_status gy_sim_try_restore(gy_sim *s, const gy_sim_op *op, int32_t *started) {
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

static gy_status gy_sim_xf_try_switch(gy_sim *s, int64_t x);

/* Without live restore, a group whose weights are back and whose last request finished: it
 * dissolves once its step in flight (if any) ends. */
static gy_status gy_sim_restore_drained(gy_sim *s, int32_t slot) {
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
static gy_status gy_sim_restore_gather(gy_sim *s, int64_t x) {
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
static gy_status gy_sim_restore_switch(gy_sim *s, int64_t x) {
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

/* The topology change of a transformation, once its sources are idle. */
static gy_status gy_sim_xf_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    gy_sim_transform_out *o = &s->xf_out[x];
    f->at_barrier = 0;
    if (o->kind == GY_SIM_OP_DROP) return gy_sim_drop_switch(s, x);
    if (o->kind == GY_SIM_OP_RESTORE) return gy_sim_restore_switch(s, x);
    if (o->kind == GY_SIM_OP_RESPLIT) { /* migrated, its last step done: the stop */
        f->phase = 1;
        o->phase_end = s->now;
        return gy_sim_push(s, s->now + s->pipeline.stop_time, GY_SIM_EV_PHASE, x, 1);
    }
    if (o->kind == GY_SIM_OP_BIND) return gy_sim_bind_switch(s, x);
    if (o->kind == GY_SIM_OP_RELEASE) return gy_sim_release_switch(s, x);
    if (o->kind == GY_SIM_OP_MERGE) {
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
    /* split: the halves replace the instance and take their requests */
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
    }
    f->n_dst = 2;
    f->phase = 1;
    o->phase_end = s->now;
    GY_TRY(gy_sim_phase(s, x, GY_SIM_PHASE_WEIGHTS_GATHER, 0.0));
    for (int k = 0; k < 2; k++) GY_TRY(gy_sim_start_step(s, h[k]));
    return gy_cluster_reconfigured(s->cluster, 0, s->now);
}

/* Sources that still have a step in flight hold the switch back. */
static gy_status gy_sim_xf_try_switch(gy_sim *s, int64_t x) {
    gy_sim_xf *f = &s->xf[x];
    for (int k = 0; k < f->n_src; k++)
        if (s->inst[f->src[k]].stepping) return GY_OK;
    return gy_sim_xf_switch(s, x);
}

static gy_status gy_sim_on_phase(gy_sim *s, int64_t x, int64_t phase) {
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
    if (o->kind == GY_SIM_OP_MERGE && phase == 0) {
        /* the dropped FFN shards become KV room */
        const int64_t cap = s->capacity_mid[gy_sim_level_of(o->tp_from)];
        double kv = 0;
        for (int k = 0; k < 2; k++) {
            gy_sim_inst *i = &s->inst[f->src[k]];
            if (cap > i->core.capacity) GY_TRY(gy_sim_instance_set_capacity(&i->core, cap));
            kv += gy_sim_kv_tokens(s, f->src[k]);
        }
        f->phase = 1;
        o->phase_end = s->now;
        GY_TRY(gy_sim_phase(s, x, GY_SIM_PHASE_KV_SCATTER, kv));
        /* more room may let queued requests in */
        for (int k = 0; k < 2; k++) GY_TRY(gy_sim_start_step(s, f->src[k]));
        return GY_OK;
    }
    if (phase == 0 || o->kind == GY_SIM_OP_MERGE) { /* merge phase 1, split phase 0, a bind's
                                                       or a release's switch time: switch */
        f->at_barrier = 1;
        for (int k = 0; k < f->n_src; k++) s->inst[f->src[k]].barrier = 1;
        return gy_sim_xf_try_switch(s, x);
    }
    /* split phase 1: the halves have their weights */
    for (int k = 0; k < 2; k++) {
        s->inst[f->dst[k]].xform = GY_SIM_XFORM_NONE;
        s->inst[f->dst[k]].xform_id = -1;
    }
    f->phase = 2;
    o->end = s->now;
    s->n_active_xf--;
    s->stats.n_splits++;
    return gy_cluster_reconfigured(s->cluster, 1, s->now);
}

/* ---- live migration (Llumnix) ---- */

static int32_t gy_sim_slot_at(const gy_sim *s, int32_t gpu_first, int32_t size);

/* Request r's KV has crossed: it moves to its destination between two of its source's steps,
 * keeping its progress (the destination re-admits it over kept KV). Dropped when it finished,
 * moved with a transformation meanwhile, or the destination is gone or busy. */
static gy_status gy_sim_migrate_switch(gy_sim *s, int64_t r) {
    gy_sim_req *q = &s->req[r];
    const int32_t from = q->migrate_from;
    q->migrating = 0;
    if (q->slot != from) return GY_OK;
    const int32_t to = q->migrate_to >= 0 && q->migrate_to < s->n_gpus ? s->gpu_slot[q->migrate_to] : -1;
    if (to < 0 || to == from || s->inst[to].gpu_first != q->migrate_to ||
        s->inst[to].xform != GY_SIM_XFORM_NONE || s->inst[to].bound)
        return GY_OK;
    s->stats.migrate_bytes += (double)q->computed * s->config.kv_token_bytes;
    s->stats.n_live_migrations++;
    GY_TRY(gy_sim_carry_over(s, r, to));
    return gy_sim_start_step(s, to);
}

static gy_status gy_sim_on_migrated(gy_sim *s, int64_t r) {
    gy_sim_req *q = &s->req[r];
    if (q->migrating != 1) return GY_FAIL(GY_ERR_STATE, "request %lld: a stale migration", (long long)r);
    if (q->slot != q->migrate_from) { /* finished or moved meanwhile */
        q->migrating = 0;
        return GY_OK;
    }
    if (!s->inst[q->slot].stepping) {
        GY_TRY(gy_sim_migrate_switch(s, r));
        return gy_sim_start_step(s, q->migrate_from);
    }
    q->migrating = 2; /* after the step in flight (its batch may hold r) */
    s->inst[q->slot].n_migrated++;
    return GY_OK;
}

/* The migrations that crossed while slot stepped. */
static gy_status gy_sim_migrate_crossed(gy_sim *s, int32_t slot) {
    if (s->inst[slot].n_migrated == 0) return GY_OK;
    s->inst[slot].n_migrated = 0;
    for (int64_t r = s->inst[slot].head; r >= 0;) {
        const int64_t next = s->req[r].next;
        if (s->req[r].migrating == 2) GY_TRY(gy_sim_migrate_switch(s, r));
        r = next;
    }
    return GY_OK;
}

/* A live migration out of the instance at op->gpu_first to the one at op->target: of its
 * running requests not moving yet whose footprint fits the destination's free blocks, the one
 * with the least KV (cheapest to move) starts; its KV takes computed tokens x kv_token_bytes /
 * migrate_bw while it keeps running. */
static gy_status gy_sim_try_migrate(gy_sim *s, const gy_sim_op *op, int32_t *started) {
    const int32_t from = gy_sim_slot_at(s, op->gpu_first, 0), to = gy_sim_slot_at(s, op->target, 0);
    if (!(s->config.migrate_bw > 0) || from < 0 || to < 0 || from == to) return GY_OK;
    const gy_sim_inst *a = &s->inst[from], *b = &s->inst[to];
    if (a->xform != GY_SIM_XFORM_NONE || b->xform != GY_SIM_XFORM_NONE || a->bound || b->bound)
        return GY_OK;
    const int64_t room = b->core.capacity - gy_sim_instance_used(&b->core);
    int64_t best = -1;
    for (int64_t r = a->head; r >= 0; r = s->req[r].next) {
        const gy_sim_req *q = &s->req[r];
        gy_sched_info info;
        if (q->migrating || q->footprint > room || q->computed <= 0 ||
            gy_sched_info_get(a->core.sched, r, &info) != GY_OK ||
            info.state != GY_SCHED_STATE_RUNNING)
            continue;
        if (best < 0 || q->computed < s->req[best].computed) best = r;
    }
    gy_error_clear(); /* (a request the scheduler no longer knows is simply not a candidate) */
    if (best < 0) return GY_OK;
    gy_sim_req *q = &s->req[best];
    q->migrating = 1;
    q->migrate_from = from;
    q->migrate_to = op->target;
    *started = 1;
    return gy_sim_push(s, s->now + (double)q->computed * s->config.kv_token_bytes /
                                       s->config.migrate_bw,
                       GY_SIM_EV_MIGRATED, best, 0);
}

/* ---- decisions (the controller's ops) ---- */

static int32_t gy_sim_slot_at(const gy_sim *s, int32_t gpu_first, int32_t size) {
    if (gpu_first < 0 || gpu_first >= s->n_gpus) return -1;
    const int32_t slot = s->gpu_slot[gpu_first];
    const gy_sim_inst *i = &s->inst[slot];
    /* size: its TP (a placement) or its GPUs (an op); a pipeline has TP 1 over its stages */
    if (i->gpu_first != gpu_first || (size > 0 && i->tp != size && i->width != size)) return -1;
    return slot;
}

/* 1 when [g, g + size) is an aligned group of TP 2 to max_tp inside one host. */
static int gy_sim_group_ok(const gy_sim *s, int32_t g, int32_t size) {
    return gy_sim_level_of(size) >= 1 && size <= s->config.max_tp && g >= 0 && g % size == 0 &&
           g + size <= s->n_gpus &&
           g / s->config.gpus_per_host == (g + size - 1) / s->config.gpus_per_host;
}

/* A bind of the aligned group [g, g + size): its instances, all unbound, of one TP below size,
 * nothing under way. */
static gy_status gy_sim_try_bind(gy_sim *s, int32_t g, int32_t size, int32_t *started) {
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
    if (s->config.pipeline != NULL) return GY_OK; /* a pipeline only re-splits */
    const int flying = op->kind == GY_SIM_OP_BIND || op->kind == GY_SIM_OP_RELEASE;
    if ((flying && !s->config.replicated) ||
        (!flying && s->config.replicated && (op->kind == GY_SIM_OP_MERGE ||
                                              op->kind == GY_SIM_OP_SPLIT)))
        return GY_OK; /* Flying moves nothing, Gyges moves shards: each on its own cluster */
    if (op->kind == GY_SIM_OP_BIND) return gy_sim_try_bind(s, op->gpu_first, op->size, started);
    if (op->kind == GY_SIM_OP_RELEASE) {
        const int32_t c = gy_sim_slot_at(s, op->gpu_first, op->size);
        if (c < 0 || !s->inst[c].bound || s->inst[c].xform != GY_SIM_XFORM_NONE ||
            !gy_sim_pack_members(s, c))
            return GY_OK;
        *started = 1;
        return gy_sim_start_release(s, c);
    }
    if (op->kind == GY_SIM_OP_MERGE) {
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
    if (op->kind == GY_SIM_OP_SPLIT) {
        const int32_t c = gy_sim_slot_at(s, op->gpu_first, op->size);
        if (c < 0 || s->inst[c].tp < 2 || s->inst[c].xform != GY_SIM_XFORM_NONE) return GY_OK;
        if (s->capacity[gy_sim_level_of(s->inst[c].tp) - 1] < 1) return GY_OK; /* halves unfit */
        if (!gy_sim_pack_halves(s, c)) return GY_OK;
        *started = 1;
        return gy_sim_start_split(s, c);
    }
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
    while (s->capacity[gy_sim_level_of(s->base_tp)] < 1) s->base_tp *= 2;
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
                                  .prefill_rate = c->pipeline ? NULL : s->prefill_rate};
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
