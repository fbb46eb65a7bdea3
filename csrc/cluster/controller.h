/* controller.h: the cluster controller: one policy (policy/policy.h) driving one executor through
 * an ops table, the way sched/batch.h drives its KV backend. The simulator (sim/sim.c: cost
 * models, discrete events) and gyges.experiment (a real gyges.Host, through the Python binding)
 * are the two executors; the controller is the same code for both, so a policy measured at paper
 * scale is the very code that places requests on workers. So cluster/ sits between them: it
 * includes policy/ (below) and nothing of its executors (sim/ and the extension, above).
 *
 * What the controller owns: the policy and its per-run state, the requests waiting at the cluster
 * (deferred, in the order they were deferred, with the group each waits for), the instances the
 * policy holds out of placements, and the counts of its decisions. What the executor owns:
 * instances, their requests and how a reconfiguration runs. The executor tells the controller
 * what happened (a request arrived, an instance's step ended, a reconfiguration ended, time
 * passed); the controller asks the policy and calls the executor's ops:
 *
 *   instances    the instances now, in GPU order: every field of gy_sim_inst_view but `held` and
 *                `reserved`, which the controller fills from its own state;
 *   assign       a request's decision: PLACE on the instance at (gpu_first, tp), DEFER (it waits
 *                here, reconsidered later) or REJECT (never served); before the decision's ops;
 *   reconfigure  start one reconfiguration op (MERGE of a group's two halves, SPLIT of an
 *                instance into its halves; BIND / RELEASE on a replicated cluster; RESPLIT of
 *                a pipeline to a new split of its layers; DROP / RESTORE of KunServe's buddy
 *                groups on a buddy cluster); *started = 0 when the executor's
 *                state refuses it (nothing changed; the controller counts it);
 *   decided      optional: a decision and all its ops are carried out (the simulator starts the
 *                placed request's instance stepping here).
 * The topology does not change inside a decision (a reconfiguration switches instances later,
 * when the executor says it ended), so HOLD / UNHOLD are checked against the instances the
 * decision was taken on.
 *
 * When the policy is asked (the rules both executors used to carry separately):
 *   arrive          the new request: place, defer or reject;
 *   step_ended      the deferred requests again when the step finished a request (room freed),
 *                   then the policy's rebalance when the step finished a request on an instance
 *                   of TP > 1, or the instance is held;
 *   reconfigured    the deferred requests again, then the rebalance when `rebalance` (the end of
 *                   a scale-up, or of a scale-down's last phase);
 *   tick            the deferred requests waiting for a group again (a merge may wait for
 *                   time alone: merge_wait), then the rebalance of a policy that monitors
 *                   (gy_sim_policy_ops.monitor: kunserve).
 * A step or a tick decides again only the waiting requests it can concern (policy.h's contract);
 * the others keep their place in the order. With a stateless policy, a pass also skips the
 * requests a blocked one shows cannot be placed either (gy_sim_decision.blocked: same min_tp, at
 * least its footprint) until a decision changes the cluster: an overloaded cluster's waiting
 * list then costs a comparison per request, not a decision.
 * The calls are not re-entrant: an op that calls back into the controller is refused. */
#ifndef GY_CLUSTER_CONTROLLER_H
#define GY_CLUSTER_CONTROLLER_H

#include <stdint.h>

#include "../core/status.h"
#include "../policy/policy.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_cluster_request {
    int64_t id;             /* the executor's name for it (a trace index) */
    int64_t prompt, output; /* tokens */
    int64_t footprint;      /* KV blocks it holds at its end */
    int32_t min_tp;         /* the smallest TP whose fresh instance holds it; 0: none */
    int32_t priority;
    double arrival;
    int32_t tp_work;        /* set by the controller for assign: the decision's tp_work */
    int32_t pad_;
} gy_cluster_request;

typedef struct gy_cluster_ops {
    /* rows: (cap) filled with the instances in GPU order, *n of them (1 <= *n <= cap). */
    gy_status (*instances)(void *ctx, gy_sim_inst_view *rows, int32_t cap, int32_t *n);
    /* action: GY_SIM_ACTION_PLACE (gpu_first, tp name the instance), DEFER or REJECT (-1, 0). */
    gy_status (*assign)(void *ctx, const gy_cluster_request *r, int32_t action,
                        int32_t gpu_first, int32_t tp);
    /* op->kind: GY_SIM_OP_MERGE or GY_SIM_OP_SPLIT, on a replicated cluster BIND or RELEASE,
     * on a pipeline cluster RESPLIT (op->layers); MIGRATE, PARK, UNPARK, DROP and RESTORE where
     * the executor has them (*started 0: refused). */
    gy_status (*reconfigure)(void *ctx, const gy_sim_op *op, int32_t *started);
    /* May be NULL. */
    gy_status (*decided)(void *ctx, const gy_cluster_request *r, int32_t action);
} gy_cluster_ops;

typedef struct gy_cluster_config {
    int32_t n_gpus, gpus_per_host; /* gpus_per_host a power of two dividing n_gpus */
    int32_t max_tp;                /* a power of two <= gpus_per_host */
    const int64_t *capacity;       /* (log2(max_tp) + 1) KV blocks of a fresh TP-2^l instance */
    int64_t block_size;            /* tokens per KV block */
    double watermark;              /* fraction of an instance's blocks admission keeps free */
    const gy_sim_policy_ops *policy;
    gy_sim_policy_config policy_config;
    int32_t replicated;            /* Flying Serving's cluster: BIND / RELEASE (policy.h) */
    int32_t base_tp;               /* replicated: the TP of an unbound instance */
    const gy_sim_pipeline *pipeline; /* pipelines' cost model for the view (must outlive the
                                        controller); NULL: none */
    int32_t buddy;                 /* KunServe's cluster: DROP / RESTORE (policy.h) */
    int32_t pad_;
    const double *prefill_rate;    /* (log2(max_tp) + 1) prompt tokens/s of a TP-2^l instance,
                                      each > 0 (the view's, policy.h); NULL: proportional to TP */
    const gy_sim_cost_ops *cost;   /* the view's cost model (must outlive the controller); NULL:
                                      none */
} gy_cluster_config;

typedef struct gy_cluster_stats {
    int64_t n_decisions;   /* requests decided (arrivals and reconsiderations) */
    int64_t n_rebalances;  /* rebalance calls */
    int64_t n_ops;         /* ops the policy returned */
    int64_t n_ops_refused; /* of those, refused by the state (the executor's or no instance) */
    int64_t n_merges_started, n_splits_started;
    int64_t n_binds_started, n_releases_started;
    int64_t n_resplits_started;
    int64_t n_drops_started, n_restores_started;
    int64_t n_migrations_started; /* MIGRATE ops the executor started */
    int64_t n_rejected;
    int64_t n_deferred;    /* waiting now */
} gy_cluster_stats;

typedef struct gy_cluster gy_cluster;

/* The config is copied (capacity and prefill_rate too); ops and ctx must outlive the
 * controller. */
gy_status gy_cluster_init(gy_cluster **out, const gy_cluster_config *config,
                          const gy_cluster_ops *ops, void *ctx);
void gy_cluster_free(gy_cluster *c);

gy_status gy_cluster_arrive(gy_cluster *c, const gy_cluster_request *r, double now);
gy_status gy_cluster_step_ended(gy_cluster *c, int32_t gpu_first, int32_t tp, int finished,
                                double now);
gy_status gy_cluster_reconfigured(gy_cluster *c, int rebalance, double now);
gy_status gy_cluster_tick(gy_cluster *c, double now);

/* 1 when the policy holds the instance at (gpu_first, tp) out of new placements. */
int gy_cluster_held(const gy_cluster *c, int32_t gpu_first, int32_t tp);
void gy_cluster_stats_get(const gy_cluster *c, gy_cluster_stats *out);
/* The requests waiting at the cluster, in the order they were deferred (valid until the next
 * call); with the group each waits for in groups (may be NULL). */
const gy_cluster_request *gy_cluster_deferred(const gy_cluster *c, int64_t *n,
                                              const gy_sim_group **groups);

/* Checks a view as the policies will follow it: aligned power-of-two groups up to max_tp (or
 * pipelines of 2 to GY_SIM_MAX_STAGES one-GPU stages, each with a layer) in GPU order without
 * overlap covering every GPU, each with blocks, the GPU map, the capacity levels and the pending
 * groups. GY_ERR_INVALID names the first fault. */
gy_status gy_cluster_view_check(const gy_sim_view *v);

#ifdef __cplusplus
}
#endif
#endif
