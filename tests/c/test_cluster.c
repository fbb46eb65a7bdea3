/* test_cluster.c: the cluster controller (cluster/controller.h) over a scripted executor: a
 * cluster of 4 GPUs whose instances the test sets, which records every op the controller calls.
 * Checked: a request each policy places, defers and rejects reaches the executor as that
 * action; deferred requests are decided again in the order they were deferred; held instances
 * are the controller's and a reconfiguration that starts on them releases them; refused ops are
 * counted and change nothing; the view carries the executor's prefill rates and cost model, and
 * PARK ops reach the executor; a bad view from the executor and a call from inside an op are
 * refused with GY_ERR_STATE. */
#include <math.h>
#include <string.h>

#include "cluster/controller.h"
#include "gytest.h"

typedef struct script {
    gy_sim_inst_view inst[4];
    int32_t n_inst;
    int accept;            /* reconfigure answers started = accept */
    gy_cluster *self;      /* to call back from inside an op */
    int call_back;
    gy_status call_back_status;
    /* what the controller did */
    int64_t assigned[32];
    int32_t actions[32], gpus[32];
    int n_assigned;
    gy_sim_op ops[32];
    int n_ops;
} script;

static void script_layout(script *s, const int32_t *tps, int n) {
    memset(s->inst, 0, sizeof s->inst);
    int32_t g = 0;
    for (int k = 0; k < n; k++) {
        const int64_t blocks = tps[k] == 1 ? 10 : tps[k] == 2 ? 25 : 60;
        s->inst[k] = (gy_sim_inst_view){.gpu_first = g, .tp = tps[k], .placeable = 1,
                                        .kv_total = blocks};
        g += tps[k];
    }
    s->n_inst = n;
}

static gy_status op_instances(void *ctx, gy_sim_inst_view *rows, int32_t cap, int32_t *n) {
    script *s = ctx;
    if (s->call_back) s->call_back_status = gy_cluster_tick(s->self, 0.0);
    memcpy(rows, s->inst, (size_t)s->n_inst * sizeof *rows);
    *n = s->n_inst <= cap ? s->n_inst : cap;
    return GY_OK;
}

static gy_status op_assign(void *ctx, const gy_cluster_request *r, int32_t action, int32_t g,
                           int32_t tp) {
    script *s = ctx;
    s->assigned[s->n_assigned] = r->id;
    s->actions[s->n_assigned] = action;
    s->gpus[s->n_assigned++] = g;
    /* a placement adds to the instance's footprint, as an executor's view would show */
    for (int k = 0; k < s->n_inst; k++)
        if (action == GY_SIM_ACTION_PLACE && s->inst[k].gpu_first == g) {
            s->inst[k].footprint += r->footprint;
            s->inst[k].n_requests++;
        }
    return GY_OK;
}

static gy_status op_reconfigure(void *ctx, const gy_sim_op *op, int32_t *started) {
    script *s = ctx;
    s->ops[s->n_ops++] = *op;
    *started = s->accept;
    return GY_OK;
}

static const gy_cluster_ops script_ops = {op_instances, op_assign, op_reconfigure, NULL};

static const int64_t CAPS[3] = {10, 25, 60};

/* A controller over the script under `policy` with `config` (NULL: the defaults) and prefill
 * rates `rates` (NULL: proportional to TP). */
static gy_cluster *controller_with(script *s, const char *policy,
                                   const gy_sim_policy_config *config, const double *rates) {
    const gy_cluster_config c = {.n_gpus = 4, .gpus_per_host = 4, .max_tp = 4,
                                 .capacity = CAPS, .block_size = 16, .watermark = 0.0,
                                 .policy = gy_sim_policy_find(policy),
                                 .policy_config = config ? *config
                                                         : gy_sim_policy_config_default(),
                                 .prefill_rate = rates};
    gy_cluster *out = NULL;
    if (gy_cluster_init(&out, &c, &script_ops, s) != GY_OK) return NULL;
    s->self = out;
    return out;
}

static gy_cluster *controller(script *s, const char *policy) {
    return controller_with(s, policy, NULL, NULL);
}

/* Four TP1 instances under `policy`; reconfigurations start when `accept`. */
static gy_cluster *four_tp1(script *s, int accept, const char *policy) {
    const int32_t tps[4] = {1, 1, 1, 1};
    script_layout(s, tps, 4);
    s->accept = accept;
    return controller(s, policy);
}

static gy_cluster_request req(int64_t id, int64_t blocks, int32_t min_tp) {
    return (gy_cluster_request){.id = id, .prompt = blocks * 16 - 4, .output = 4,
                                .footprint = blocks, .min_tp = min_tp};
}

GYTEST(cluster_places_defers_and_rejects_through_the_executor) {
    script s = {0};
    gy_cluster *c = four_tp1(&s, 1, "least_load");
    CHECK(c != NULL);
    gy_cluster_request a = req(7, 5, 1), b = req(8, 20, 2), z = req(9, 100, 0);
    CHECK_OK(gy_cluster_arrive(c, &a, 0.0));
    CHECK(s.n_assigned == 1 && s.assigned[0] == 7 && s.actions[0] == GY_SIM_ACTION_PLACE);
    /* a TP2-sized request: least_load defers it on a pair and merges the pair */
    CHECK_OK(gy_cluster_arrive(c, &b, 0.0));
    CHECK(s.actions[1] == GY_SIM_ACTION_DEFER && s.n_ops >= 1);
    CHECK(s.ops[0].kind == GY_SIM_OP_MERGE && s.ops[0].size == 2);
    gy_cluster_stats st;
    gy_cluster_stats_get(c, &st);
    CHECK(st.n_deferred == 1 && st.n_merges_started == 1);
    int64_t n = 0;
    const gy_sim_group *groups = NULL;
    const gy_cluster_request *waiting = gy_cluster_deferred(c, &n, &groups);
    CHECK(n == 1 && waiting[0].id == 8 && groups[0].size == 2);
    /* nothing any TP holds: rejected */
    CHECK_OK(gy_cluster_arrive(c, &z, 0.0));
    CHECK(s.actions[2] == GY_SIM_ACTION_REJECT);
    /* the merge ended: the pair is one TP2 instance, the deferred request goes there */
    const int32_t merged[3] = {2, 1, 1};
    script_layout(&s, merged, 3);
    const int32_t pair = groups[0].gpu_first;
    if (pair != 0) { /* the merge chose GPUs 2,3: list the TP2 there */
        const int32_t other[3] = {1, 1, 2};
        script_layout(&s, other, 3);
    }
    CHECK_OK(gy_cluster_reconfigured(c, 1, 1.0));
    CHECK(s.assigned[3] == 8 && s.actions[3] == GY_SIM_ACTION_PLACE && s.gpus[3] == pair);
    gy_cluster_stats_get(c, &st);
    CHECK(st.n_deferred == 0 && st.n_rejected == 1);
    gy_cluster_free(c);
}

GYTEST(cluster_reconsiders_in_deferral_order_and_counts_refused_ops) {
    script s = {0};
    gy_cluster *c = four_tp1(&s, 0, "least_load"); /* every reconfiguration refused */
    CHECK(c != NULL);
    for (int64_t id = 0; id < 3; id++) {
        gy_cluster_request r = req(id, 20, 2);
        CHECK_OK(gy_cluster_arrive(c, &r, 0.0));
    }
    gy_cluster_stats st;
    gy_cluster_stats_get(c, &st);
    CHECK(st.n_deferred == 3 && st.n_ops_refused == st.n_ops && st.n_ops >= 3);
    CHECK(st.n_merges_started == 0);
    s.n_assigned = 0;
    CHECK_OK(gy_cluster_tick(c, 1.0));
    CHECK(s.n_assigned == 3);
    for (int k = 0; k < 3; k++) CHECK(s.assigned[k] == k && s.actions[k] == GY_SIM_ACTION_DEFER);
    int64_t n = 0;
    const gy_cluster_request *waiting = gy_cluster_deferred(c, &n, NULL);
    CHECK(n == 3 && waiting[0].id == 0 && waiting[1].id == 1 && waiting[2].id == 2);
    gy_cluster_free(c);
}

GYTEST(cluster_held_instances_are_released_by_their_reconfiguration) {
    script s = {0};
    const int32_t tps[2] = {2, 2};
    script_layout(&s, tps, 2);
    s.accept = 1;
    gy_sim_policy_config paper = gy_sim_policy_config_default();
    paper.light_load = paper.idle_load = 0; /* no latency mode: an idle cluster would merge */
    gy_cluster *c = controller_with(&s, "gyges", &paper, NULL);
    CHECK(c != NULL);
    /* a TP2 instance whose requests all left: gyges holds it, then splits it (releasing it) */
    CHECK(!gy_cluster_held(c, 0, 2));
    CHECK_OK(gy_cluster_step_ended(c, 0, 2, 1, 0.0));
    int split = 0;
    for (int k = 0; k < s.n_ops; k++) split |= s.ops[k].kind == GY_SIM_OP_SPLIT;
    CHECK(split);
    CHECK(!gy_cluster_held(c, 0, 2) && !gy_cluster_held(c, 2, 2));
    gy_cluster_free(c);
}

GYTEST(cluster_gives_the_policies_its_prefill_rates) {
    /* TP1, TP1, TP2 with 300, 500 and 650 prompt tokens waiting: a short request (76 tokens)
     * is prefilled soonest where (waiting + prompt) / rate is least */
    script s = {0};
    const int32_t tps[3] = {1, 1, 2};
    script_layout(&s, tps, 3);
    s.inst[0].pending_prefill = 300;
    s.inst[1].pending_prefill = 500;
    s.inst[2].pending_prefill = 650;
    gy_sim_policy_config paper = gy_sim_policy_config_default();
    paper.light_load = paper.idle_load = 0;
    /* NULL: TP2 twice as fast, 726 / 2 < 376; TP2 1.5x: 726 / 1500 > 376 / 1000; 3x: < */
    const double slow[3] = {1000.0, 1500.0, 2000.0}, fast[3] = {500.0, 1500.0, 2000.0};
    const double *cases[3] = {NULL, slow, fast};
    const int32_t expect[3] = {2, 0, 2};
    for (int k = 0; k < 3; k++) {
        s.n_assigned = 0;
        gy_cluster *c = controller_with(&s, "gyges", &paper, cases[k]);
        CHECK(c != NULL);
        gy_cluster_request r = req(k, 5, 1);
        CHECK_OK(gy_cluster_arrive(c, &r, 0.0));
        CHECK(s.n_assigned == 1 && s.actions[0] == GY_SIM_ACTION_PLACE && s.gpus[0] == expect[k]);
        gy_cluster_free(c);
    }
    /* rates are checked, each level */
    const double zero[3] = {1000.0, 0.0, 1.0}, nan[3] = {NAN, 1.0, 1.0};
    const double inf[3] = {1.0, 1.0, INFINITY};
    const double *bad[3] = {zero, nan, inf};
    for (int k = 0; k < 3; k++) {
        const gy_cluster_config cc = {.n_gpus = 4, .gpus_per_host = 4, .max_tp = 4,
                                      .capacity = CAPS, .block_size = 16,
                                      .policy = gy_sim_policy_find("gyges"),
                                      .policy_config = paper, .prefill_rate = bad[k]};
        gy_cluster *c = NULL;
        CHECK_STATUS(gy_cluster_init(&c, &cc, &script_ops, &s), GY_ERR_INVALID);
        CHECK(c == NULL);
    }
}

/* A cost model by hand: a step costs 20 ms / tp plus 2 ms a sequence, 1.5x that at TP > 1. */
static double script_step(void *ctx, int32_t tp, int transforming, const gy_sim_step_shape *sh) {
    (void)ctx;
    (void)transforming;
    return 0.02 / tp + 0.002 * (double)sh->n_seqs * (tp > 1 ? 0.75 * tp : 1.0);
}

GYTEST(cluster_hands_the_policies_its_cost_model_and_the_executor_park_ops) {
    /* gyges' latency mode at light load: 12 requests decoding on each TP1 would step more
     * slowly merged (by the view's cost model), so no merge; with no cost model, the pairs
     * merge (the executor is asked to) */
    script s = {0};
    const int32_t tps[4] = {1, 1, 1, 1};
    const gy_sim_cost_ops cost = {.step_time = script_step};
    for (int with_cost = 0; with_cost < 2; with_cost++) {
        script_layout(&s, tps, 4);
        s.n_ops = 0;
        s.accept = 0;
        for (int k = 0; k < 4; k++) {
            s.inst[k].n_running = s.inst[k].n_requests = 12;
            s.inst[k].kv_used = 4;
            s.inst[k].pending_output = 20;
        }
        const gy_cluster_config cc = {.n_gpus = 4, .gpus_per_host = 4, .max_tp = 4,
                                      .capacity = CAPS, .block_size = 16,
                                      .policy = gy_sim_policy_find("gyges"),
                                      .policy_config = gy_sim_policy_config_default(),
                                      .cost = with_cost ? &cost : NULL};
        gy_cluster *c = NULL;
        CHECK_OK(gy_cluster_init(&c, &cc, &script_ops, &s));
        CHECK_OK(gy_cluster_tick(c, 1.0));
        CHECK(s.n_ops == (with_cost ? 0 : 2));
        for (int k = 0; k < s.n_ops; k++) CHECK(s.ops[k].kind == GY_SIM_OP_MERGE);
        gy_cluster_free(c);
    }
    /* Seesaw's settled prefill phase asks each TP1 to park, once a phase: the executor gets
     * the ops, and its refusals are counted and change nothing */
    script_layout(&s, tps, 4);
    s.n_ops = 0;
    for (int k = 0; k < 4; k++) {
        s.inst[k].n_requests = 2;
        s.inst[k].pending_prefill = 100;
    }
    gy_cluster *c = controller(&s, "seesaw");
    CHECK(c != NULL);
    CHECK_OK(gy_cluster_tick(c, 1.0));
    CHECK(s.n_ops == 4);
    for (int k = 0; k < 4; k++) CHECK(s.ops[k].kind == GY_SIM_OP_PARK && s.ops[k].gpu_first == k);
    gy_cluster_stats st;
    gy_cluster_stats_get(c, &st);
    CHECK(st.n_ops == 4 && st.n_ops_refused == 4);
    CHECK_OK(gy_cluster_tick(c, 2.0));
    CHECK(s.n_ops == 4);
    gy_cluster_free(c);
}

GYTEST(cluster_refuses_bad_views_and_calls_from_its_ops) {
    script s = {0};
    const int32_t tps[4] = {1, 1, 1, 1};
    gy_cluster *c = four_tp1(&s, 0, "round_robin");
    CHECK(c != NULL);
    gy_cluster_request r = req(1, 5, 1);
    s.inst[2].gpu_first = 1; /* overlaps instance 1 */
    CHECK_STATUS(gy_cluster_arrive(c, &r, 0.0), GY_ERR_STATE);
    CHECK(s.n_assigned == 0);
    script_layout(&s, tps, 4);
    s.inst[1].kv_total = 0;
    CHECK_STATUS(gy_cluster_arrive(c, &r, 0.0), GY_ERR_STATE);
    script_layout(&s, tps, 4);
    s.call_back = 1;
    CHECK_OK(gy_cluster_arrive(c, &r, 0.0));
    CHECK(s.call_back_status == GY_ERR_STATE);
    s.call_back = 0;
    CHECK_OK(gy_cluster_arrive(c, &r, 0.0)); /* and the controller works on */
    r.min_tp = 3;
    CHECK_STATUS(gy_cluster_arrive(c, &r, 0.0), GY_ERR_INVALID);
    gy_cluster_free(c);
}

GYTEST(cluster_a_step_concerns_the_requests_waiting_on_its_group_only) {
    script s = {0};
    gy_cluster *c = four_tp1(&s, 0, "least_load");
    CHECK(c != NULL);
    /* loads steer each TP2-sized request to a pair: the first to GPUs 2-3, the second to 0-1 */
    s.inst[0].pending_prefill = s.inst[1].pending_prefill = 1000;
    gy_cluster_request a = req(1, 20, 2), b = req(2, 20, 2);
    CHECK_OK(gy_cluster_arrive(c, &a, 0.0));
    s.inst[0].pending_prefill = s.inst[1].pending_prefill = 0;
    s.inst[2].pending_prefill = s.inst[3].pending_prefill = 1000;
    CHECK_OK(gy_cluster_arrive(c, &b, 0.0));
    int64_t n = 0;
    const gy_sim_group *groups = NULL;
    gy_cluster_deferred(c, &n, &groups);
    CHECK(n == 2 && groups[0].gpu_first == 2 && groups[1].gpu_first == 0);
    /* a TP1 step on GPU 0 ends: only the request waiting on GPUs 0-1 is decided again */
    s.n_assigned = 0;
    CHECK_OK(gy_cluster_step_ended(c, 0, 1, 1, 1.0));
    CHECK(s.n_assigned == 1 && s.assigned[0] == 2);
    /* ... and both keep their order */
    const gy_cluster_request *w = gy_cluster_deferred(c, &n, NULL);
    CHECK(n == 2 && w[0].id == 1 && w[1].id == 2);
    /* a tick decides every one */
    s.n_assigned = 0;
    CHECK_OK(gy_cluster_tick(c, 2.0));
    CHECK(s.n_assigned == 2);
    gy_cluster_free(c);
}

GYTEST(cluster_skips_requests_a_blocked_one_shows_cannot_be_placed_either) {
    script s = {0};
    gy_cluster *c = four_tp1(&s, 1, "least_load");
    CHECK(c != NULL);
    for (int k = 0; k < 4; k++) s.inst[k].placeable = 0; /* all splitting: nothing can take any */
    const int64_t blocks[3] = {5, 8, 3};
    for (int k = 0; k < 3; k++) {
        gy_cluster_request r = req(k, blocks[k], 1);
        CHECK_OK(gy_cluster_arrive(c, &r, 0.0));
    }
    /* a step ends: the first is blocked; the second (larger) is skipped, the third (smaller)
     * is decided; the order stays */
    s.n_assigned = 0;
    CHECK_OK(gy_cluster_step_ended(c, 0, 1, 1, 1.0));
    CHECK(s.n_assigned == 2 && s.assigned[0] == 0 && s.assigned[1] == 2);
    int64_t n = 0;
    const gy_cluster_request *w = gy_cluster_deferred(c, &n, NULL);
    CHECK(n == 3 && w[0].id == 0 && w[1].id == 1 && w[2].id == 2);
    /* once an instance can take requests, every one is decided and placed */
    for (int k = 0; k < 4; k++) s.inst[k].placeable = 1;
    s.n_assigned = 0;
    CHECK_OK(gy_cluster_step_ended(c, 0, 1, 1, 2.0));
    CHECK(s.n_assigned == 3);
    for (int k = 0; k < 3; k++) CHECK(s.actions[k] == GY_SIM_ACTION_PLACE);
    gy_cluster_free(c);
}
