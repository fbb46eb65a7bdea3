/* policy.h: cluster policies behind one interface. A policy sees a read-only view of the
 * cluster (its instances: GPUs, TP degree, KV blocks, queues, whether transforming, held or
 * reserved) and one request, and decides where the request goes and which transformations start.
 * It never touches an executor: it returns a decision that the cluster controller
 * (cluster/controller.h) checks and has its executor (the simulator, or a real host) carry out,
 * so each policy can be tested on hand-built views (tests/c/test_sim.c). policy/ is the layer
 * below the controller because both executors run these policies: it includes nothing from
 * cluster/ or sim/ (the cost models it prices placements by, cost.h and pipeline.h, live here
 * too).
 *
 * Groups of GPUs are aligned as in Flying Serving's communicator pool: a TP-k instance owns GPUs
 * [g, g + k) with g a multiple of k, inside one host; pairs {0,1},{2,3},..., quartets {0..3},
 * {4..7}. A scale-up merges the two aligned halves of a group (two TP-k instances) into one
 * TP-2k instance (x2 steps, AMOEBAs 3.3); a scale-down splits a TP-2k instance into its halves.
 *
 * A replicated cluster (Flying Serving: every GPU keeps the whole model, or its base TP's shard)
 * changes parallelism with BIND and RELEASE instead: a bind makes the instances of an aligned
 * group one TP instance over their replicas, moving nothing; their requests pause in place with
 * their KV (those the policy placed there as TP work are recomputed in the bound instance); a
 * release gives the members back, their paused requests resuming where they were.
 *
 * A pipeline cluster (PipeLive, pipeline.h) has one pipeline instance per host: n_stages
 * one-GPU stages over the host's GPUs (tp 1, n_stages > 0 in its view row, layers[] its split).
 * It changes its split with RESPLIT: the layers that move migrate while it serves at the old
 * split with the intermediate KV budget, then a short stop commits the new split.
 *
 * A buddy cluster (KunServe, sim/sim.h) starts with one full replica per GPU (tp 1 rows, or
 * pipelines when it starts grouped). DROP makes a run of g of them on one host a buddy group:
 * one pipeline of g one-GPU stages over one shared copy of the layers (the rest of each
 * member's weights become KV room at once); its requests keep running while their KV moves
 * (the exchange). RESTORE gives the members their weights back and dissolves the group.
 *
 * Policies (one file each): gyges (policy_gyges.c: Gyges Algorithms 1 and 2 with AMOEBAs 3.3),
 * round_robin and least_load (policy_round_robin.c, policy_least_load.c: Gyges 6.2.4's
 * baselines), static (policy_static.c: a fixed layout; requests no instance can hold are
 * rejected), flying (policy_flying.c: Flying Serving's DP <-> TP switching), pipelive
 * (policy_pipelive.c: re-splits pipelines as the prefill/decode mix shifts), kunserve
 * (policy_kunserve.c: drops parameters into buddy groups under KV pressure, restores after),
 * llumnix (policy_llumnix.c: least-load placement, then live migrations from the instance
 * whose KV demand is highest to the one where it is lowest: KunServe's migration baseline),
 * loongserve (policy_loongserve.c: LoongServe's elastic sequence parallelism on a replicated
 * cluster whose bound instances are sequence parallel: a long prompt scales its group up for its
 * prefill, the group scales down once its prompts are done), seesaw (policy_seesaw.c: Seesaw's
 * re-sharding: each unit of max_tp GPUs prefills as TP1 instances, then merges to decode at
 * TP-max_tp, then splits back). */
#ifndef GY_POLICY_POLICY_H
#define GY_POLICY_POLICY_H

#include <stddef.h>
#include <stdint.h>

#include "../core/status.h"
#include "pipeline.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_SIM_MAX_LEVELS 8 /* TP degrees 1, 2, 4, ..., 128: level l is TP 2^l */
#define GY_SIM_MAX_OPS 16   /* transformation ops one decision may carry */

/* What is under way on an instance. */
typedef enum gy_sim_xform {
    GY_SIM_XFORM_NONE = 0,
    GY_SIM_XFORM_MERGING = 1,  /* a half of a scale-up under way; keeps serving */
    GY_SIM_XFORM_SPLITTING = 2,/* a scale-down under way (KV phase); takes no new requests */
    GY_SIM_XFORM_SPLIT_TAIL = 3,/* a half of a finished split still gathering FFN weights;
                                   serves and takes requests, but cannot transform yet */
    GY_SIM_XFORM_BINDING = 4,   /* a member of a bind under way; takes no new requests */
    GY_SIM_XFORM_RELEASING = 5, /* a bound instance being released; takes no new requests */
    GY_SIM_XFORM_RESPLITTING = 6,/* a pipeline migrating layers to a new split; serves at the
                                   old split (and takes requests), cannot transform */
    GY_SIM_XFORM_DROPPING = 7,  /* a member of a buddy drop until its step in flight ends;
                                   takes no new requests */
    GY_SIM_XFORM_EXCHANGING = 8,/* a buddy group whose victims' KV is still moving; serves and
                                   takes requests (victims pay remote attention), cannot
                                   transform */
    GY_SIM_XFORM_RESTORING = 9, /* a buddy group getting its weights back; serves (live
                                   restore) or stops, takes no new requests */
    GY_SIM_XFORM_LOST = 10,     /* GPUs of a host that is gone (its process or machine died):
                                   never placeable, never part of a group to build; a real
                                   cluster's executor lists them so that every GPU keeps an
                                   instance (gyges/distributed/replay.py) */
} gy_sim_xform;

typedef struct gy_sim_inst_view {
    int32_t gpu_first;      /* the instance owns GPUs [gpu_first, gpu_first + tp) */
    int32_t tp;
    int32_t host;
    int32_t xform;          /* gy_sim_xform */
    int32_t placeable;      /* 0: the simulator refuses new requests here (splitting) */
    int32_t held;           /* the policy holds it out of new placements (draining) */
    int32_t reserved;       /* a GPU of it is in a group a deferred request waits for */
    int32_t max_min_tp;     /* largest min_tp of its unfinished requests; 0 when it has none */
    int64_t kv_total;       /* KV blocks it can hold now */
    int64_t kv_used;        /* KV blocks its requests hold now */
    int64_t footprint;      /* blocks its unfinished requests will hold at their end */
    int64_t max_footprint;  /* the largest of those */
    int64_t n_requests;     /* unfinished requests assigned to it */
    int64_t n_running, n_waiting;
    int64_t pending_prefill;/* prompt tokens of its requests not computed yet */
    int64_t pending_output; /* output tokens of its requests not generated yet */
    int32_t bound;          /* replicated: a bound group (its members' requests are paused) */
    int32_t prefill_only;   /* 1: parked by GY_SIM_OP_PARK (serves prompts only) */
    int64_t n_paused;       /* replicated: requests paused under it until its release */
    int64_t n_tp_work;      /* replicated: its requests placed as TP work (decision.tp_work) */
    int64_t n_priority;     /* its requests with priority > 0 */
    int32_t n_stages;       /* a pipeline of n_stages one-GPU stages over GPUs [gpu_first,
                               gpu_first + n_stages), tp 1; 0: a TP group of tp GPUs */
    int32_t layers[GY_SIM_MAX_STAGES]; /* (n_stages) layers of each stage now */
    int32_t pad2_;
} gy_sim_inst_view;

typedef struct gy_sim_group {
    int32_t gpu_first, size; /* size 0: no group */
    int64_t footprint;       /* in view.pending: blocks of the requests deferred on it */
} gy_sim_group;

typedef struct gy_sim_view {
    double now;
    int32_t n_gpus, gpus_per_host, max_tp;
    int32_t n_inst;
    const gy_sim_inst_view *inst;  /* (n_inst) sorted by gpu_first */
    const int32_t *gpu_inst;       /* (n_gpus) index into inst of the instance owning each GPU */
    const int64_t *capacity;       /* (levels of TP up to max_tp) KV blocks of a TP-2^l instance */
    int64_t block_size;            /* tokens per block */
    double watermark;              /* fraction of an instance's blocks admission keeps free */
    int32_t n_pending;
    const gy_sim_group *pending;   /* (n_pending) groups deferred requests wait for */
    int32_t replicated;            /* 1: BIND / RELEASE (Flying Serving); 0: MERGE / SPLIT */
    int32_t base_tp;               /* replicated: the TP of the unbound instances (the DP unit) */
    int64_t n_deferred;            /* requests waiting at the cluster (on a group or none) */
    const gy_sim_pipeline *pipeline; /* the pipelines' cost model (pipeline.h), every host's the
                                      same; NULL: no pipelines (TP groups) */
    int32_t buddy;                 /* 1: a buddy cluster (DROP / RESTORE): tp 1 rows are whole
                                      replicas, pipelines buddy groups of 2 to n_stages stages */
    int32_t pad3_;
    const double *prefill_rate;    /* (levels of TP up to max_tp) prompt tokens per second a
                                      TP-2^l instance prefills (the executor's cost model; only
                                      ratios matter); NULL: proportional to TP */
    const gy_sim_cost_ops *cost;   /* the executor's cost model of a TP step (cost.h), for a
                                      policy to price a batch it considers; NULL: none */
} gy_sim_view;

typedef struct gy_sim_req_view {
    int64_t id;
    int64_t prompt, output;        /* tokens */
    int64_t footprint;             /* KV blocks it holds at its end: ceil((prompt+output)/block) */
    int32_t min_tp;                /* smallest TP whose fresh instance can hold it; 0: none */
    int32_t deferred;              /* 1: it was deferred before and is being reconsidered */
    gy_sim_group group;            /* the group it was deferred on (size 0: none) */
    double arrival;
    int32_t priority;              /* > 0: a priority request (flying binds a TP group for it) */
    int32_t pad_;
} gy_sim_req_view;

typedef enum gy_sim_action {
    GY_SIM_ACTION_NONE = 0,   /* rebalance: nothing about a request */
    GY_SIM_ACTION_PLACE = 1,  /* queue it on inst[target] */
    GY_SIM_ACTION_DEFER = 2,  /* it waits at the cluster for `group` (reconsidered after every
                                 transformation) */
    GY_SIM_ACTION_REJECT = 3, /* never served; counted */
} gy_sim_action;

typedef enum gy_sim_op_kind {
    GY_SIM_OP_MERGE = 0,  /* group [gpu_first, +size): its two halves, TP size/2 each, become one */
    GY_SIM_OP_SPLIT = 1,  /* the instance at gpu_first becomes its two halves */
    GY_SIM_OP_HOLD = 2,   /* the instance at gpu_first takes no new requests from the policy */
    GY_SIM_OP_UNHOLD = 3,
    GY_SIM_OP_BIND = 4,   /* replicated: the unbound instances of group [gpu_first, +size) become
                             one bound TP-size instance (their requests pause, TP work moves) */
    GY_SIM_OP_RELEASE = 5,/* replicated: the bound instance at gpu_first becomes its members
                             again (their paused requests resume; its own requests, which must
                             fit the members, are recomputed there) */
    GY_SIM_OP_RESPLIT = 6,/* pipelines: the pipeline at gpu_first (size: its stages) moves to the
                             split `layers` over the same GPUs: live migration at the old split
                             with B_shrink blocks, then a stop at the commit (pipeline.h);
                             refused when its KV in use exceeds B_shrink */
    GY_SIM_OP_DROP = 7,   /* buddy: the replicas [gpu_first, +size) (2 <= size <= gpus_per_host,
                             one host, each a whole replica, nothing under way) drop into one
                             buddy group (a pipeline of size stages, layers split evenly) */
    GY_SIM_OP_RESTORE = 8,/* buddy: the group at gpu_first (size: its stages) gets its weights
                             back and dissolves; refused while its exchange runs or when its
                             requests do not fit the members' own KV (packed, largest first) */
    GY_SIM_OP_MIGRATE = 9,/* Llumnix: one running request of the instance at gpu_first moves
                             live, with its KV, to the instance at `target` (the executor picks
                             the one cheapest to move that fits there; it keeps running while
                             its KV crosses the link and switches between two steps); refused
                             when none fits or the executor cannot move requests */
    GY_SIM_OP_PARK = 10,  /* Seesaw's tiered KV buffer: the TP instance at gpu_first serves
                             prompts only, each request's KV parked in host memory once it is
                             prefilled (sched/batch.h: prefill only), until UNPARK or until it
                             transforms (its new instances serve everything); refused by an
                             executor without a host link (the simulator without swap_bw, the
                             CPU host) */
    GY_SIM_OP_UNPARK = 11,
} gy_sim_op_kind;

typedef struct gy_sim_op {
    int32_t kind, gpu_first, size;
    int32_t layers[GY_SIM_MAX_STAGES]; /* RESPLIT: (size) layers of each stage in the target */
    int32_t target;                    /* MIGRATE: the destination instance's gpu_first */
} gy_sim_op;

typedef struct gy_sim_decision {
    int32_t action;         /* gy_sim_action */
    int32_t target;         /* PLACE: index into view.inst */
    gy_sim_group group;     /* DEFER */
    int32_t blocked;        /* DEFER on no group, no ops: 1 when this view would defer so every
                               request of the same min_tp and at least this footprint (nothing
                               can hold it, no scale-up can start); a stateless policy's
                               controller then skips those while nothing changes */
    int32_t tp_work;        /* PLACE on a replicated cluster: the request is TP work: when a
                               group around its instance binds, it moves to the bound instance
                               and is recomputed there instead of pausing (soft preemption) */
    int32_t n_ops;
    gy_sim_op ops[GY_SIM_MAX_OPS]; /* carried out in order; an op the state no longer allows is
                                      skipped and counted */
} gy_sim_decision;

typedef struct gy_sim_policy_config {
    double decode_weight;    /* load = (pending_prefill + decode_weight * pending_output) / tp */
    double scale_down_free;  /* gyges: a held instance splits once this fraction of its KV is
                                free (AMOEBAs 3.3: 0.5) */
    double scale_up_cap;     /* gyges: while an instance can hold a long request, a new scale-up
                                may not take the cluster beyond this fraction of its GPUs at
                                TP > 1 (short requests keep TP1 instances) */
    double merge_wait;       /* gyges: seconds a reserved group may drain (its instances finish
                                their requests, taking no new ones) before its merge starts
                                anyway; 0 = merge at once */
    double scale_up_load;    /* gyges: a long request scales up a new group rather than queue on
                                an instance that can hold it when that instance's load exceeds
                                the group's by more than this (tokens per GPU, as the load) */
    int32_t eager_scale_up;  /* baselines: 1 = the instance the rule picks scales up with its
                                neighbours when it cannot hold the request (Gyges 6.2.4); 0 = go
                                to an instance that can hold it, scale up only when none can */
    int32_t flying_tp;       /* flying: the size of the group priority and light-load requests
                                bind (0: the largest group of a host) */
    double light_load;       /* flying: the load is light while the cluster's outstanding work
                                per GPU (as gy_sim_policy_load counts it, in tokens) is at most
                                this; new arrivals then go to TP groups (0: never). gyges: the
                                base TP is 2 while the load is at most this (latency mode) */
    double idle_load;        /* gyges: the base TP is 4 while the load is at most this (0: never) */
    int32_t buddy_strategy;  /* kunserve: gy_buddy_strategy (0 throughput-greedy, 1 memory-greedy) */
    int32_t max_migrations;  /* llumnix: live migrations one rebalance may start */
    double restore_wait;     /* kunserve: seconds a group's demand must fit its members' own KV
                                before it restores */
    double sp_min_prompt;    /* loongserve: the shortest prompt (tokens) whose prefill may be
                                spread over more instances than its KV needs, for speed */
    int32_t decode_tp;       /* seesaw: the TP of its decode phase, each unit of that many GPUs
                                merging into one instance (0: the largest a host forms;
                                gyges.cluster.seesaw_search picks it by Seesaw's search) */
    int32_t prefill_tp;      /* seesaw: the TP of its prefill instances, at least the smallest
                                that holds the weights (0: that one; seesaw_search.prefill_tp
                                picks it so that prompts needing more are rare) */
} gy_sim_policy_config;

/* The contract the controller relies on to decide waiting requests again only when it can
 * matter: a request deferred on a group (DEFER with group.size > 0) is decided the same until an
 * instance inside that group changes, an instance of TP >= its min_tp frees room, time passes,
 * or the topology changes; a request deferred on no group, until any instance frees room or the
 * topology changes (time alone does not change it, save that gyges queues such a request on an
 * instance once it has waited merge_wait: decided again after the next step that ends, soon
 * on a cluster without room). Every policy here keeps it (a deferred request resumes its group:
 * gy_sim_policy_resume; time only gates merges and that queueing: merge_wait). */
typedef struct gy_sim_policy_ops {
    const char *name;
    size_t state_size; /* bytes of per-run state the simulator allocates zeroed (may be 0) */
    /* A new or deferred request: PLACE, DEFER or REJECT, plus ops. Required. */
    gy_status (*place)(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                       const gy_sim_req_view *r, gy_sim_decision *out);
    /* Optional (NULL: the policy never transforms on its own): after steps of TP > 1 or held
     * instances and after transformations; only ops, action NONE. */
    gy_status (*rebalance)(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                           gy_sim_decision *out);
    int32_t monitor; /* 1: rebalance also at every tick (a policy that watches time: kunserve) */
    int32_t pass_stable; /* 1: its state changes only with new arrivals (never while deferred
                            requests are decided again), so it keeps a stateless policy's
                            promise about blocked requests (decision.blocked) within one pass */
} gy_sim_policy_ops;

/* The policy called `name`, or NULL. */
const gy_sim_policy_ops *gy_sim_policy_find(const char *name);
/* "gyges, round_robin, ..., kunserve, llumnix" (for error messages). */
const char *gy_sim_policy_names(void);
gy_sim_policy_config gy_sim_policy_config_default(void);

extern const gy_sim_policy_ops gy_sim_policy_gyges;
extern const gy_sim_policy_ops gy_sim_policy_round_robin;
extern const gy_sim_policy_ops gy_sim_policy_least_load;
extern const gy_sim_policy_ops gy_sim_policy_static;
extern const gy_sim_policy_ops gy_sim_policy_flying;
extern const gy_sim_policy_ops gy_sim_policy_pipelive;
extern const gy_sim_policy_ops gy_sim_policy_kunserve;
extern const gy_sim_policy_ops gy_sim_policy_llumnix;
extern const gy_sim_policy_ops gy_sim_policy_loongserve;
extern const gy_sim_policy_ops gy_sim_policy_seesaw;

/* ---- helpers the policies share ---- */

/* log2(tp) for a power of two, else -1. */
int gy_sim_level(int32_t tp);
/* GPUs an instance owns: its stages (a pipeline) or its TP degree. */
int32_t gy_sim_inst_gpus(const gy_sim_inst_view *i);
/* Outstanding work per GPU (see decode_weight). */
double gy_sim_policy_load(const gy_sim_policy_config *cfg, const gy_sim_inst_view *i);
/* Seconds until a prompt of `prompt` tokens placed on i now is prefilled, were i to prefill its
 * waiting prompt tokens first at view.prefill_rate (its decodes ignored: a step's prefill chunk
 * is priced mostly by its own tokens). Compares where a request gets its first token soonest. */
double gy_sim_policy_prefill_wait(const gy_sim_view *v, const gy_sim_inst_view *i, int64_t prompt);
/* Seconds of one decode step of `batch` requests with `context` tokens of KV each on a TP-tp
 * instance, by view.cost with the host's other workers busy; -1 without a cost model or batch. */
double gy_sim_policy_decode_step(const gy_sim_view *v, int32_t tp, int64_t batch, double context);
/* 1 when the simulator would accept the request on i: placeable and footprint <= kv_total. */
int gy_sim_policy_fits(const gy_sim_inst_view *i, const gy_sim_req_view *r);
/* 1 when GPU range [g, g + size) is one aligned group inside a host. */
int gy_sim_group_valid(const gy_sim_view *v, int32_t g, int32_t size);
/* Index of the instance owning exactly the group, or -1. */
int32_t gy_sim_group_instance(const gy_sim_view *v, int32_t g, int32_t size);
/* Appends the ops that move the aligned group [g, g + size) towards one instance by x2 merges
 * of halves that are ready (one instance each, same TP, nothing under way). Returns 1 when the
 * group already is one instance, 0 when merges were added or must wait for something under way,
 * -1 when it cannot become one (an instance spans beyond it, or the ops do not fit). */
int gy_sim_policy_build_group(const gy_sim_view *v, int32_t g, int32_t size, gy_sim_decision *d);
/* 1 when i's requests could fit in its two halves (footprints; the simulator's exact check may
 * still refuse the split). */
int gy_sim_policy_split_plausible(const gy_sim_view *v, const gy_sim_inst_view *i);
/* 1 when GPU ranges [a, a + na) and [b, b + nb) overlap. */
int gy_sim_ranges_overlap(int32_t a, int32_t na, int32_t b, int32_t nb);
/* 1 when a deferred request waits for a group (view.pending) of at least min_size GPUs that
 * overlaps [g, g + size) (min_size 0: any group). */
int gy_sim_pending_overlaps(const gy_sim_view *v, int32_t g, int32_t size, int32_t min_size);
/* For a request deferred on a group (replicated clusters): the index of the bound instance that
 * the group is now, when it holds r; else -1. */
int32_t gy_sim_policy_bound_group(const gy_sim_view *v, const gy_sim_req_view *r);
/* 1 when an instance owning a GPU of [g, g + size) is under `xform` (a gy_sim_xform): a bind or
 * a drop of a group a request waits for is on its way. */
int gy_sim_group_under(const gy_sim_view *v, int32_t g, int32_t size, int32_t xform);
/* Appends an op; 0 when the decision is full. */
int gy_sim_decision_add_op(gy_sim_decision *d, int32_t kind, int32_t gpu_first, int32_t size);
/* For a deferred request whose group is now one instance that holds it: PLACE there and 1;
 * when the group still needs merges: the ops, DEFER on it, and 1; else 0 (decide afresh). */
int gy_sim_policy_resume(const gy_sim_view *v, const gy_sim_req_view *r, gy_sim_decision *d);
/* The baselines' last word on the instance their rule picked (k; -1: none placeable): PLACE when
 * it holds r, else DEFER on the aligned group of min_tp GPUs around it, with its merges. */
void gy_sim_policy_place_or_scale(const gy_sim_view *v, int32_t k, const gy_sim_req_view *r,
                                  gy_sim_decision *d);
/* Appends a SPLIT of every instance above TP `floor` of the aligned group [g, g + size) that
 * nothing under way or reserved touches, that no request needs at its TP, and whose requests
 * plausibly fit its halves; 0 when the decision is full. */
int gy_sim_policy_split_unneeded_in(const gy_sim_view *v, int32_t g, int32_t size,
                                    int32_t floor, gy_sim_decision *d);
/* The baselines' rebalance: gy_sim_policy_split_unneeded_in over the whole cluster. */
gy_status gy_sim_policy_split_unneeded(void *state, const gy_sim_policy_config *cfg,
                                       const gy_sim_view *v, gy_sim_decision *d);

#ifdef __cplusplus
}
#endif
#endif
