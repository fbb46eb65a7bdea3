/* sim_impl.h: the simulator's private state and the functions its files share; nothing outside
 * csrc/sim/ includes it (ggml's *-impl.h habit: sim.h stays the one interface). The simulator is
 * one executor of the cluster controller, in files of one job each:
 *   sim.c           the event loop, the controller's ops table, set-up, results and invariants;
 *   slots.c         the instances (in slots) and the requests on them: create, destroy, link,
 *                   move a request between instances, pack requests into parts;
 *   step.c          an instance's steps: schedule, price, commit;
 *   transform.c     what every reconfiguration shares: its record, phases, the barrier that
 *                   waits for steps in flight, and the dispatch of a phase's end to its kind;
 * and one file per mechanism, each carrying out its ops (a gy_sim_try_* that the state may
 * refuse, then its phases and switch):
 *   merge_split.c   Gyges' merges and splits (sharded TP groups);
 *   bind_release.c  Flying Serving's binds and releases (replicated TP groups);
 *   resplit.c       PipeLive's re-splits (pipelines);
 *   drop_restore.c  KunServe's drops, exchanges and restores (buddy groups);
 *   migrate.c       Llumnix's live migrations (one request at a time).
 * The functions below are not static, as several files call them, but they are no interface:
 * prefixed gy_sim_ like the rest, declared here only. */
#ifndef GY_SIM_SIM_IMPL_H
#define GY_SIM_SIM_IMPL_H

#include <stdint.h>

#include "../cluster/controller.h"
#include "../core/alloc.h"
#include "event_queue.h"
#include "sim.h"

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
    int32_t swapped;      /* swap_bw > 0: its KV (`kept` tokens) in host memory: 1 preempted
                             (the copies stall the steps, as vLLM's swap), 2 parked (prefill
                             only: Seesaw's copies overlap the steps) */
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
    int32_t stopped;       /* it starts no step (Seesaw's re-sharding under way) */
    int32_t prefill_only;  /* GY_SIM_OP_PARK: its scheduler parks what it has prefilled */
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

/* ceil(a / b) for a >= 0, b >= 1 (blocks of a token count). */
static inline int64_t gy_sim_cdiv(int64_t a, int64_t b) { return a / b + (a % b != 0); }

/* ---- sim.c: events ---- */

/* Queues an event of `kind` (GY_SIM_EV_*) at `time`: (a, b) its arguments (a slot and its
 * generation, a transformation and its phase, a request). */
gy_status gy_sim_push(gy_sim *s, double time, int32_t kind, int64_t a, int64_t b);

/* ---- slots.c: instances and their requests ---- */

/* A new TP-tp instance over [gpu_first, + tp) with the capacity of its level. */
gy_status gy_sim_inst_create(gy_sim *s, int32_t gpu_first, int32_t tp, int32_t *slot_out);
gy_status gy_sim_pipe_create(gy_sim *s, int32_t gpu_first, int32_t n, const int32_t *layers,
                             int32_t *slot_out);
gy_status gy_sim_inst_destroy(gy_sim *s, int32_t slot);
const gy_sim_pipeline *gy_sim_inst_pipe(const gy_sim *s, const gy_sim_inst *i);
/* Appends request r to the list of the instance at `slot` (its sums follow), or takes it off. */
void gy_sim_link(gy_sim *s, int32_t slot, int64_t r);
void gy_sim_unlink(gy_sim *s, int64_t r);
/* The largest footprint of i's requests (recounted only when it went stale). */
int64_t gy_sim_inst_max_footprint(gy_sim *s, gy_sim_inst *i);
/* The slot of the instance that starts at gpu_first, if its TP or its GPUs are `size` (0: any
 * size), or -1. */
int32_t gy_sim_slot_at(const gy_sim *s, int32_t gpu_first, int32_t size);
int gy_sim_group_ok(const gy_sim *s, int32_t g, int32_t size);
gy_status gy_sim_lift(gy_sim *s, int64_t r, int recompute);
gy_status gy_sim_land(gy_sim *s, int64_t r, int32_t slot);
gy_status gy_sim_carry_over(gy_sim *s, int64_t r, int32_t dst);
int gy_sim_pack(gy_sim *s, const gy_sim_inst *i, int64_t *room, int32_t n);
int64_t gy_sim_usable(const gy_sim *s, int32_t tp);

/* ---- step.c: steps ---- */

gy_status gy_sim_start_step(gy_sim *s, int32_t slot);
/* The step in flight of `slot` is over: its tokens, bins and finished requests (*finished_any). */
gy_status gy_sim_finish_step(gy_sim *s, int32_t slot, int *finished_any);

/* ---- transform.c: what every transformation shares ---- */

/* A new transformation record (under way) of `kind`; *id its index in xf and xf_out. */
gy_status gy_sim_xf_new(gy_sim *s, int32_t kind, int32_t gpu_first, int32_t tp_from,
                        int32_t tp_to, int64_t *id);
/* Starts phase `kind` of transformation x, priced by the cost model (its bytes recorded). */
gy_status gy_sim_xf_phase(gy_sim *s, int64_t x, int32_t kind, double kv_tokens);
/* Tokens of KV the instance at `slot` holds (its blocks' worth). */
double gy_sim_kv_tokens(const gy_sim *s, int32_t slot);
gy_status gy_sim_xf_finish(gy_sim *s, int64_t x, int32_t c, int64_t *counter);
gy_status gy_sim_xf_try_switch(gy_sim *s, int64_t x);
/* A phase of transformation x ended (the event): on to its next phase or its switch. */
gy_status gy_sim_on_phase(gy_sim *s, int64_t x, int64_t phase);

/* ---- the mechanisms: gy_sim_try_* start op unless the state refuses it (*started stays 0,
 * nothing changes); the others are the phase ends and switches transform.c hands on ---- */

/* merge_split.c (Gyges) */
gy_status gy_sim_try_merge(gy_sim *s, const gy_sim_op *op, int32_t *started);
gy_status gy_sim_try_split(gy_sim *s, const gy_sim_op *op, int32_t *started);
gy_status gy_sim_merge_weights_dropped(gy_sim *s, int64_t x);
gy_status gy_sim_merge_switch(gy_sim *s, int64_t x);
gy_status gy_sim_split_switch(gy_sim *s, int64_t x);
gy_status gy_sim_split_weights_gathered(gy_sim *s, int64_t x);

/* bind_release.c (Flying Serving) */
gy_status gy_sim_try_bind(gy_sim *s, const gy_sim_op *op, int32_t *started);
gy_status gy_sim_try_release(gy_sim *s, const gy_sim_op *op, int32_t *started);
gy_status gy_sim_bind_switch(gy_sim *s, int64_t x);
gy_status gy_sim_release_switch(gy_sim *s, int64_t x);

/* resplit.c (PipeLive) */
gy_status gy_sim_try_resplit(gy_sim *s, const gy_sim_op *op, int32_t *started);
gy_status gy_sim_resplit_stop(gy_sim *s, int64_t x);
gy_status gy_sim_resplit_commit(gy_sim *s, int64_t x);

/* drop_restore.c (KunServe) */
gy_status gy_sim_try_drop(gy_sim *s, const gy_sim_op *op, int32_t *started);
gy_status gy_sim_try_restore(gy_sim *s, const gy_sim_op *op, int32_t *started);
gy_status gy_sim_drop_switch(gy_sim *s, int64_t x);
gy_status gy_sim_exchange_end(gy_sim *s, int64_t x);
gy_status gy_sim_restore_gather(gy_sim *s, int64_t x);
gy_status gy_sim_restore_drained(gy_sim *s, int32_t slot);
gy_status gy_sim_restore_switch(gy_sim *s, int64_t x);

/* migrate.c (Llumnix) */
gy_status gy_sim_try_migrate(gy_sim *s, const gy_sim_op *op, int32_t *started);
/* The event: request r's KV has crossed. */
gy_status gy_sim_on_migrated(gy_sim *s, int64_t r);
/* The migrations whose KV crossed while `slot` stepped switch now. */
gy_status gy_sim_migrate_crossed(gy_sim *s, int32_t slot);

#endif
