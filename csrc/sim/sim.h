/* sim.h: the discrete-event simulator of a cluster whose tensor parallelism changes while it
 * serves. Hosts of GPUs carry instances (aligned groups of GPUs, see policy/policy.h); every
 * instance runs the real batch scheduler (sched/batch.h) over a block counter (instance.h), and
 * a cost model (policy/cost.h) says how long each of its steps takes. The simulator is one
 * executor of the cluster controller (cluster/controller.h): the controller asks the policy
 * (policy/policy.h) where arriving requests go and which transformations start, and the
 * simulator carries them out. sim/ is the layer above both: it includes cluster/ and policy/,
 * and neither of them includes anything from here.
 *
 * Events, in (time, rank, push) order (event_queue.h):
 *   arrival     the next trace request: the policy places, defers or rejects it;
 *   phase end   a transformation phase ends (below);
 *   step end    an instance's step ends: commit, tokens, finishes; its next step starts at once;
 *   sample      per-instance time series (layout, KV use, queues) every sample_interval; the
 *               deferred requests are reconsidered then too.
 * Steps run back to back while an instance has work; a step that computes nothing new (only KV
 * a request kept through a transformation, see instance.h) takes no time.
 *
 * Transformations (the scale-up of Gyges 4.3: MLP first, then KV; the scale-down of AMOEBAs 3.3:
 * KV first, then FFN), each two phases priced by the cost model; the instances keep serving
 * throughout with the cost model's transform slowdown:
 *   merge  two TP-k halves -> one TP-2k instance.
 *          phase 0, weights drop: at its end each half's KV capacity grows to capacity_mid[k];
 *          phase 1, KV scatter: at its end, once both halves finished their step in flight, the
 *          TP-2k instance replaces them and their requests move to it with their progress.
 *   split  one TP-2k instance -> two TP-k halves; it takes no new requests meanwhile. Its
 *          requests are packed into the halves (largest footprint first, into the half with more
 *          room; the split is refused if they do not fit).
 *          phase 0, KV scatter: at its end, after its step in flight, the halves replace it and
 *          take their requests with their progress;
 *          phase 1, weights gather: the halves serve (and take requests) but cannot transform.
 * On a replicated cluster (Flying Serving, `replicated`) the reconfigurations are instead
 *   bind     the unbound instances of an aligned group -> one bound instance over their GPUs.
 *            After switch_time (the members serve meanwhile) and their steps in flight, the
 *            requests placed there as TP work move to it, recomputed (their KV had the DP
 *            geometry); the others pause with their KV: they leave the schedulers, their blocks
 *            stay taken, and the bound instance gets the pooled blocks left (members / its TP
 *            times the least any member has free).
 *   release  a bound instance -> its members, after switch_time; the paused requests go back
 *            to their member with their progress and KV (nothing recomputed); the bound
 *            instance's own requests, if any (a release under load), are recomputed on the
 *            members (packed largest first; refused when one fits no member). It takes no new
 *            requests meanwhile.
 *   Nothing moves: the transform records carry no bytes. MERGE and SPLIT are refused there, and
 *   BIND and RELEASE elsewhere. With `sequence_parallel` (LoongServe) a bind pauses nothing: every
 *   member's request moves into the bound instance with its KV, whose blocks are the members'
 *   pooled capacity; a release packs its requests onto the members with their KV.
 * On a pipeline cluster (`pipeline`: PipeLive) every host is one pipeline instance, stage i on
 * the host's GPU i (its kind in the pipeline's stage i), priced and sized by policy/pipeline.h;
 * its one reconfiguration is
 *   resplit  the pipeline moves to a new split of the layers over the same GPUs (PipeLive's live
 *            in-place reconfiguration). Refused when its KV in use exceeds B_shrink.
 *            phase 0, migration (pipeline.h's bytes over the link): it serves at the old split,
 *            its capacity B_shrink (both layer sets held), steps slowed by transform_slowdown;
 *            at its end, once its step in flight finished, it stops;
 *            phase 1, stop (stop_time): then it serves at the new split with its capacity.
 *            The record's phase_end is when the stop began: migration seconds = phase_end -
 *            start, stop seconds = end - phase_end (also summed in the stats).
 *   Every other op is refused there, and RESPLIT elsewhere.
 * On a buddy cluster (`buddy`: KunServe) every GPU starts as a whole replica (a one-stage
 * pipeline priced by pipeline.h's first stage with every layer), or grouped from the start
 * (`buddy_group` > 1: the static pipeline baseline); pipeline->n_stages is gpus_per_host, the
 * largest group. Its reconfigurations, priced by pipeline.h's buddy costs:
 *   drop     g replicas of one host -> one buddy group (a g-stage pipeline, layers split
 *            evenly), once their steps in flight ended (they take no requests meanwhile). The
 *            freed weights are KV room at once: the group's capacity is pipeline.h's for its
 *            split. Their requests move in with their KV (victims); phase 1, the exchange,
 *            moves the victims' KV of the layers each member gave up while the group serves:
 *            until it ends a step pays remote attention for its victims' tokens over the
 *            layers still remote (n_layers (g-1)/g times the share of the exchange left), and
 *            those activation seconds on the link delay the exchange's end (activations have
 *            priority). It then takes requests and may restore.
 *   restore  a group -> its g replicas. Refused during its exchange, when its requests do not
 *            pack into the members' own blocks, or hold more than g of them. Its capacity
 *            falls to g replicas' blocks (the weights come back into it); phase 0, weights
 *            (from peers and the host copy), phase 1, its requests' KV gathered on the member
 *            each is packed to, serving throughout (no new requests); then the members take
 *            their requests with their KV. Without live_restore (KunServe Fig. 15's baseline)
 *            nothing is gathered: its weights back, it serves its requests as a pipeline (no
 *            new ones) and dissolves when the last has finished.
 *   Every other op is refused there, and DROP / RESTORE elsewhere. The record's phase_end is
 *   the switch (drop) or the end of the weights (restore).
 * After every transformation, every step that finished a request and every sample, the deferred
 * requests are reconsidered in the order they were deferred; after transformations and after
 * steps of TP > 1 or held instances that finished something, the policy may rebalance. */
#ifndef GY_SIM_SIM_H
#define GY_SIM_SIM_H

#include <stdint.h>

#include "../core/status.h"
#include "../policy/cost.h"
#include "instance.h"
#include "../policy/policy.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_sim_config {
    int32_t hosts, gpus_per_host; /* gpus_per_host a power of two */
    int32_t max_tp;               /* largest TP; a power of two <= gpus_per_host */
    int32_t n_layout;
    const int32_t *layout;        /* (n_layout) TP of each instance of ONE host, in GPU order,
                                     summing to gpus_per_host, each aligned; every host starts so */
    const int64_t *capacity;      /* (log2(max_tp) + 1) KV blocks of a TP-2^l instance, >= 1 */
    const int64_t *capacity_mid;  /* (same) blocks of a TP-2^l instance after it dropped the FFN
                                     shards of TP-2^(l+1) in a scale-up; >= capacity[l] */
    const int64_t *max_input;     /* (same) or NULL: the longest prompt a TP-2^l instance can
                                     prefill (its activations grow with the prompt; Gyges Table 1's
                                     "maximal supported sequence"), non-decreasing, >= 1 */
    gy_sim_sched_params sched;
    gy_sim_cost_ops cost;         /* its ctx must outlive the simulator */
    const gy_sim_policy_ops *policy;
    gy_sim_policy_config policy_config;
    double sample_interval;       /* seconds, > 0: time-series samples and throughput bins */
    int32_t record_tokens;        /* 1: keep the time of every output token */
    int32_t replicated;           /* 1: every GPU keeps its replica; BIND / RELEASE (above), and
                                     capacity[l] is the pooled blocks of a bound TP-2^l group */
    double switch_time;           /* replicated: seconds of a bind or a release (>= 0) */
    int32_t sequence_parallel;    /* replicated: 1 a bound instance is a sequence-parallel group
                                     (LoongServe's elastic instances; the cost model prices it
                                     so): a bind takes every member's requests in with their KV
                                     (SP keeps a token's KV whole on one rank, so nothing is
                                     paused or recomputed) and a release packs the bound
                                     instance's requests onto the members with their KV (the
                                     KV's place planned during the prefill: LoongServe's
                                     proactive scale-down), refused while one fits no member */
    int32_t stop_transforming;    /* sharded: 1 an instance serves nothing while it merges or
                                     splits (Seesaw's re-sharding, which nothing overlaps: the
                                     halves of a merge stop at its start, a split's halves start
                                     once their weights are in); 0 Gyges' (served throughout) */
    const gy_sim_pipeline *pipeline; /* NULL: TP groups. Else a pipeline cluster (above): every
                                     host is one pipeline of pipeline->n_stages GPUs
                                     (gpus_per_host), max_tp 1, not replicated; layout and
                                     capacity are ignored (capacity[0] is the initial split's,
                                     which decides a request's min_tp) and cost may be NULL.
                                     Copied. */
    const int32_t *pipe_layers;   /* (pipeline->n_stages) the split every pipeline starts at
                                     (a buddy cluster splits its groups evenly instead) */
    int32_t buddy;                /* 1: a buddy cluster (above); needs a pipeline */
    int32_t buddy_group;          /* buddy: GPUs per instance at the start, dividing gpus_per_host
                                     (1: replicas; g: every host starts as buddy groups of g) */
    int32_t live_restore;         /* buddy: 1 a restoring group's requests go home with their
                                     KV (live restore); 0 they finish in the pipeline first */
    int32_t pad_;
    /* Preemption by swapping (vLLM's preemption_mode="swap", KunServe's KV-swap baseline):
     * swap_bw > 0 moves a preempted request's KV to host memory and back instead of computing
     * it again, at swap_bw bytes/s per GPU of the instance (PCIe; the KV is spread over its
     * GPUs), kv_token_bytes a token's KV over every layer. The scheduler still re-admits it as
     * a prefill; its swapped tokens are free (as KV carried by a transformation is), and the
     * step that preempts pays the swap-out, the one that re-admits it the swap-in. 0: recompute. */
    double swap_bw;
    double kv_token_bytes;
    /* Live migration (GY_SIM_OP_MIGRATE, the llumnix policy): a request's KV crosses to another
     * instance at migrate_bw bytes/s (kv_token_bytes a token) while it keeps running; 0: the
     * simulator refuses migrations. */
    double migrate_bw;
} gy_sim_config;

/* The requests (copied). Arrivals sorted; lengths >= 1. */
typedef struct gy_sim_trace {
    int64_t n;
    const double *arrival;
    const int64_t *input_tokens, *output_tokens;
    const int32_t *priority;      /* may be NULL: all 0 */
} gy_sim_trace;

typedef enum gy_sim_req_status {
    GY_SIM_REQ_PENDING = 0,  /* not arrived yet */
    GY_SIM_REQ_DEFERRED = 1, /* waiting at the cluster for a scale-up */
    GY_SIM_REQ_QUEUED = 2,   /* assigned to an instance */
    GY_SIM_REQ_FINISHED = 3,
    GY_SIM_REQ_REJECTED = 4,
} gy_sim_req_status;

/* One request (trace order); the layout is gyges/results.py's REQUEST_DTYPE. Times NaN until. */
typedef struct gy_sim_request_out {
    double arrival, scheduled, first_token, finish;
    int64_t input_tokens, output_tokens;
    int32_t status;      /* gy_sim_req_status */
    int32_t min_tp;      /* smallest TP that can hold it; 0: none */
    int32_t gpu_first;   /* its instance (the last one); -1 */
    int32_t tp;
    int32_t preemptions; /* by its schedulers (recompute) */
    int32_t migrations;  /* moves with a transformation (no recompute) */
} gy_sim_request_out;

typedef struct gy_sim_sample {
    double time;
    int32_t gpu_first, tp, xform, held;
    int64_t kv_used, kv_total, n_running, n_waiting;
} gy_sim_sample;

typedef struct gy_sim_layout_event {
    double time;
    int32_t gpu_first, tp;
    int32_t change; /* +1 created, -1 gone */
    int32_t pad_;
} gy_sim_layout_event;

typedef struct gy_sim_transform_out {
    int32_t kind;          /* GY_SIM_OP_MERGE, SPLIT, BIND, RELEASE, RESPLIT, DROP, RESTORE */
    int32_t gpu_first, tp_from, tp_to;
    double start, phase_end, end; /* end NaN while under way */
    double kv_bytes, weight_bytes; /* moved per GPU */
    int64_t n_migrated;    /* requests carried over */
    int32_t layers_from[GY_SIM_MAX_STAGES], layers_to[GY_SIM_MAX_STAGES]; /* RESPLIT: the
                                                                             splits; else 0 */
} gy_sim_transform_out;

typedef struct gy_sim_token {
    int64_t request;
    double time;
} gy_sim_token;

typedef struct gy_sim_stats {
    double now;
    int64_t n_requests, n_arrived, n_finished, n_rejected, n_deferred;
    int64_t n_steps, n_events, n_preemptions, n_migrations;
    int64_t n_merges, n_splits, n_transforming, n_ops_refused;
    int64_t n_binds, n_releases, n_paused, n_recomputed; /* replicated: requests paused by binds,
                                                            TP work recomputed at a bind */
    int64_t n_decisions, n_rebalances; /* the controller's: policy calls */
    int32_t done;          /* nothing left to happen */
    int32_t pad_;
    int64_t n_resplits;    /* pipelines: re-splits committed */
    double resplit_migration_s, resplit_stop_s; /* their seconds of migration and of stop */
    int64_t n_drops, n_restores; /* buddy: groups formed (switched) and dissolved */
    int64_t n_victims;     /* buddy: requests whose KV an exchange moved */
    double exchange_s, restore_s; /* buddy: seconds of exchanges (switch to end) and restores */
    double exchange_bytes, restore_bytes; /* KV of exchanges; weights and KV of restores */
    double swap_s;               /* swap_bw > 0: seconds steps spent swapping KV */
    int64_t n_live_migrations;   /* MIGRATE: requests moved live (also in n_migrations) */
    double migrate_bytes;        /* their KV */
    double swap_out_bytes, swap_in_bytes; /* KV moved to host memory by preemptions, and back */
} gy_sim_stats;

typedef struct gy_sim gy_sim;

/* out[l] (l < n_levels): prompt tokens per second a TP-2^l instance prefills in steps of `chunk`
 * tokens under the cost model: what the policies compare placements by (the view's
 * prefill_rate). Also gyges.experiment's, for a host whose cost model it is given. */
gy_status gy_sim_prefill_rates(const gy_sim_cost_ops *cost, int32_t n_levels, int64_t chunk,
                               double *out);
gy_status gy_sim_init(gy_sim **out, const gy_sim_config *config, const gy_sim_trace *trace);
void gy_sim_free(gy_sim *s);
/* Processes every event at or before `until` (INFINITY: to the end). */
gy_status gy_sim_run(gy_sim *s, double until);
void gy_sim_stats_get(const gy_sim *s, gy_sim_stats *out);
/* Checks the invariants: every GPU in exactly one instance, KV within capacity and equal to what
 * the requests hold, request accounting. GY_ERR_STATE names the first broken one. */
gy_status gy_sim_check(const gy_sim *s);

/* Results, valid until the next gy_sim_run (the arrays grow). */
const gy_sim_request_out *gy_sim_requests(const gy_sim *s, int64_t *n);
const gy_sim_sample *gy_sim_samples(const gy_sim *s, int64_t *n);
const gy_sim_layout_event *gy_sim_layout(const gy_sim *s, int64_t *n);
const gy_sim_transform_out *gy_sim_transforms(const gy_sim *s, int64_t *n);
const gy_sim_token *gy_sim_tokens(const gy_sim *s, int64_t *n);
/* Tokens per bin of sample_interval from the first arrival: output tokens generated and prompt
 * tokens computed for the first time. */
const double *gy_sim_bins(const gy_sim *s, int64_t *n, const double **prompt_tokens);

#ifdef __cplusplus
}
#endif
#endif
