/* test_sim.c: the simulator's parts. The event queue against a sorted reference; the roofline
 * against numbers worked out by hand; every policy's decisions on hand-built cluster views
 * (placement, reservation, x2 scale-up plans, holding and scale-down); the instance's movable
 * capacity and carry-over of progress; and whole simulations on random traces under every
 * policy, checked against the simulator's invariants after every slice of time. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gytest.h"
#include "policy/buddy.h"
#include "policy/cost.h"
#include "policy/policy.h"
#include "sim/event_queue.h"
#include "sim/instance.h"
#include "sim/sim.h"

/* ---- event queue ---- */

typedef struct {
    double t;
    int32_t rank;
    uint64_t seq;
} ref_key;

static int ref_cmp(const void *a, const void *b) {
    const ref_key *x = a, *y = b;
    if (x->t != y->t) return x->t < y->t ? -1 : 1;
    if (x->rank != y->rank) return x->rank < y->rank ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

GYTEST(sim_eventq_order_ties_and_random) {
    gy_sim_eventq q = {0};
    CHECK(gy_sim_eventq_peek(&q) == NULL);
    gy_sim_event e;
    CHECK(!gy_sim_eventq_pop(&q, &e));
    CHECK_STATUS(gy_sim_eventq_push(&q, NAN, 0, 0, 0, 0), GY_ERR_INVALID);
    CHECK_STATUS(gy_sim_eventq_push(&q, INFINITY, 0, 0, 0, 0), GY_ERR_INVALID);
    /* equal times: rank first, then push order */
    CHECK_OK(gy_sim_eventq_push(&q, 1.0, 2, 7, 1, 0));
    CHECK_OK(gy_sim_eventq_push(&q, 1.0, 0, 7, 2, 0));
    CHECK_OK(gy_sim_eventq_push(&q, 0.5, 3, 7, 3, 0));
    CHECK_OK(gy_sim_eventq_push(&q, 1.0, 0, 7, 4, 0));
    const int64_t want[] = {3, 2, 4, 1};
    for (int i = 0; i < 4; i++) {
        CHECK(gy_sim_eventq_pop(&q, &e));
        CHECK(e.a == want[i] && e.kind == 7);
    }
    CHECK(q.n == 0);
    /* random pushes and pops interleaved, against a sorted array */
    srand(12345);
    ref_key ref[3000];
    int n_ref = 0;
    uint64_t seq = q.next_seq;
    for (int step = 0; step < 6000; step++) {
        if (n_ref < 3000 && (rand() % 3 != 0 || n_ref == 0)) {
            const double t = (double)(rand() % 50) * 0.25; /* many exact ties */
            const int32_t rank = rand() % 3;
            CHECK_OK(gy_sim_eventq_push(&q, t, rank, 0, (int64_t)seq, 0));
            ref[n_ref++] = (ref_key){t, rank, seq++};
        } else {
            qsort(ref, (size_t)n_ref, sizeof ref[0], ref_cmp);
            CHECK(gy_sim_eventq_pop(&q, &e));
            CHECK(e.time == ref[0].t && e.rank == ref[0].rank && (uint64_t)e.a == ref[0].seq);
            memmove(ref, ref + 1, (size_t)(n_ref - 1) * sizeof ref[0]);
            n_ref--;
        }
        CHECK(q.n == n_ref);
    }
    gy_sim_eventq_free(&q);
}

/* ---- cost ---- */

static gy_sim_roofline toy_roofline(void) {
    return (gy_sim_roofline){
        .weight_bytes = 1000, .matmul_params = 10, .lm_head_params = 5,
        .attn_flops_per_pair = 2, .kv_bytes_per_token = 8, .allreduce_bytes_per_token = 4,
        .ffn_bytes = 600, .kv_heads = 2, .n_layers = 3, .hbm_bw = 100, .peak_flops = 50,
        .link_bw = 10, .eff_bw = 0.5, .eff_flops = 0.5, .eff_link = 0.5, .eff_xfer = 0.25,
        .step_overhead = 1, .allreduce_latency = 0.5, .phase_latency_per_layer = 0.1,
        .transform_slowdown = 0.5};
}

GYTEST(sim_cost_roofline_by_hand) {
    gy_sim_roofline p = toy_roofline();
    CHECK_OK(gy_sim_roofline_check(&p));
    /* tp 1: 4 tokens, 2 samples, 10 keys read, 20 pairs.
     * bytes = 1000 + 8 * (10 + 4) = 1112 -> 1112 / 50 = 22.24 s
     * flops = 2*10*4 + 2*5*2 + 2*20 = 140 -> 140 / 25 = 5.6 s; step = 1 + 22.24 */
    gy_sim_step_shape s = {.n_tokens = 4, .n_seqs = 2, .n_samples = 2, .kv_read_tokens = 10,
                           .attn_pairs = 20};
    CHECK(fabs(gy_sim_roofline_step_time(&p, 1, 0, &s) - 23.24) < 1e-12);
    CHECK(fabs(gy_sim_roofline_step_time(&p, 1, 1, &s) - 23.24 * 1.5) < 1e-12);
    /* tp 2: a rank holds one of the two KV heads: kv 4 bytes per token.
     * bytes = 500 + 4 * 14 = 556 -> 11.12 s; comm = 2 layers-per... = 2*3*(1 * 16/5 + 0.5) = 22.2 */
    CHECK(fabs(gy_sim_roofline_step_time(&p, 2, 0, &s) - (1 + 11.12 + 22.2)) < 1e-12);
    /* tp 4 > kv_heads: one head per rank (replicated): kv 4 bytes per token still */
    const double t4 = 1 + (250 + 4 * 14) / 50.0 + 2 * 3 * (1.5 * 16 / 5 + 0.5);
    CHECK(fabs(gy_sim_roofline_step_time(&p, 4, 0, &s) - t4) < 1e-12);
    /* compute-bound: many pairs */
    s.attn_pairs = 2000; /* flops = 80 + 20 + 4000 = 4100 -> 164 s */
    CHECK(fabs(gy_sim_roofline_step_time(&p, 1, 0, &s) - (1 + 164.0)) < 1e-9);
    gy_sim_step_shape none = {0};
    CHECK(gy_sim_roofline_step_time(&p, 1, 0, &none) == 0.0);
    /* phases: KV 1 -> 4 moves 3/4 of 100 tokens * 8 bytes over 4 GPUs = 150 bytes per GPU */
    double bytes = -1;
    gy_sim_phase_shape ph = {.kind = GY_SIM_PHASE_KV_SCATTER, .tp_from = 1, .tp_to = 4,
                             .kv_tokens = 100};
    CHECK(fabs(gy_sim_roofline_phase_time(&p, &ph, &bytes) - (150 / 2.5 + 0.3)) < 1e-12);
    CHECK(bytes == 150);
    ph = (gy_sim_phase_shape){.kind = GY_SIM_PHASE_WEIGHTS_GATHER, .tp_from = 4, .tp_to = 2};
    CHECK(fabs(gy_sim_roofline_phase_time(&p, &ph, &bytes) - (150 / 2.5 + 0.3)) < 1e-12);
    CHECK(bytes == 600 * (0.5 - 0.25));
    ph = (gy_sim_phase_shape){.kind = GY_SIM_PHASE_WEIGHTS_DROP, .tp_from = 1, .tp_to = 2};
    CHECK(fabs(gy_sim_roofline_phase_time(&p, &ph, &bytes) - 0.3) < 1e-12 && bytes == 0);
    p.eff_flops = 0;
    CHECK_STATUS(gy_sim_roofline_check(&p), GY_ERR_INVALID);
    p = toy_roofline();
    p.step_overhead = NAN;
    CHECK_STATUS(gy_sim_roofline_check(&p), GY_ERR_INVALID);
    gy_sim_cost_constant c = {.step_time = 2, .phase_time = 3, .transform_slowdown = 1};
    CHECK_OK(gy_sim_cost_constant_check(&c));
    gy_sim_cost_ops ops = gy_sim_cost_constant_ops(&c);
    s = (gy_sim_step_shape){.n_tokens = 1};
    CHECK(ops.step_time(ops.ctx, 4, 0, &s) == 2 && ops.step_time(ops.ctx, 4, 1, &s) == 4);
    CHECK(ops.step_time(ops.ctx, 4, 0, &none) == 0);
    CHECK(ops.phase_time(ops.ctx, &ph, &bytes) == 3 && bytes == 0);
    c.step_time = 0;
    CHECK_STATUS(gy_sim_cost_constant_check(&c), GY_ERR_INVALID);
}

GYTEST(sim_cost_sequence_parallel_by_hand) {
    gy_sim_roofline p = toy_roofline();
    gy_sim_step_shape s = {.n_tokens = 4, .n_seqs = 2, .n_samples = 2, .kv_read_tokens = 10,
                           .attn_pairs = 20};
    const double tp2 = gy_sim_roofline_step_time(&p, 2, 0, &s);
    p.sequence_parallel = 1; /* two TP1 parts, each of 2 tokens, every KV head:
     * bytes = 1000 + 8 * 14 / 2 = 1056 -> 21.12 s; flops 140 / 2 -> 2.8 s; step 1 + 21.12;
     * ring: 1/2 * 8 * 4 / (10 * 0.25) = 6.4 s, less the attention it hides (40 / 2 / 25 = 0.8);
     * partials combined per layer: 3 * (2 * 1/2 * 16 / 5 + 0.5) = 11.1 */
    CHECK_OK(gy_sim_roofline_check(&p));
    CHECK(fabs(gy_sim_roofline_step_time(&p, 2, 0, &s) - (22.12 + 5.6 + 11.1)) < 1e-12);
    CHECK(fabs(gy_sim_roofline_step_time(&p, 2, 1, &s) - (22.12 + 5.6 + 11.1) * 1.5) < 1e-12);
    CHECK(gy_sim_roofline_step_time(&p, 1, 0, &s) == 23.24); /* one part: TP1 */
    p.sequence_parallel = 2; /* two TP2 parts: a rank holds one head (kv 4 bytes a token).
     * bytes = 500 + 4 * 14 / 2 = 528 -> 10.56 s; TP2 all-reduces of 2 tokens:
     * 2 * 3 * (1/2 * 2 * 8 / 5 + 0.5) = 12.6; ring 1/2 * 4 * 4 / 2.5 = 3.2 less 0.4;
     * partials 3 * (2 * 1/2 * 8 / 5 + 0.5) = 6.3 */
    CHECK(fabs(gy_sim_roofline_step_time(&p, 4, 0, &s) - (11.56 + 12.6 + 2.8 + 6.3)) < 1e-12);
    CHECK(gy_sim_roofline_step_time(&p, 2, 0, &s) == tp2); /* one part: TP2 */
    p.sequence_parallel = 3;
    CHECK_STATUS(gy_sim_roofline_check(&p), GY_ERR_INVALID);
    p.sequence_parallel = -2;
    CHECK_STATUS(gy_sim_roofline_check(&p), GY_ERR_INVALID);
}

GYTEST(sim_cost_pipeline_by_hand) {
    gy_sim_roofline p = toy_roofline();
    gy_sim_step_shape s = {.n_tokens = 4, .n_seqs = 2, .n_samples = 2, .kv_read_tokens = 10,
                           .attn_pairs = 20};
    const double tp4 = gy_sim_roofline_step_time(&p, 4, 0, &s);
    p.pipeline_degree = 2; /* a TP2 instance is a 2-stage pipeline; two micro-batches of 2
     * tokens. A stage per micro-batch: bytes = 1000 / 2 + 8 * 14 / 4 = 528 -> 10.56 s, flops
     * 140 / 4 -> 1.4 s; a hand-off of 2 tokens: 2 * 4 / 10 + 0.5 = 1.3 s;
     * step = 1 + 2 * 10.56 + 1.3 */
    CHECK_OK(gy_sim_roofline_check(&p));
    CHECK(fabs(gy_sim_roofline_step_time(&p, 2, 0, &s) - 23.42) < 1e-12);
    CHECK(fabs(gy_sim_roofline_step_time(&p, 2, 1, &s) - 23.42 * 1.5) < 1e-12);
    CHECK(gy_sim_roofline_step_time(&p, 4, 0, &s) == tp4); /* other sizes stay TP */
    s.n_seqs = 1; /* one micro-batch: bytes 500 + 8 * 14 / 2 = 556 -> 11.12 s; hand-off 2.1 s */
    CHECK(fabs(gy_sim_roofline_step_time(&p, 2, 0, &s) - (1 + 2 * 11.12 + 2.1)) < 1e-12);
    /* a merge of two pipelines into a TP4: a GPU holds 1000 / 8 of its TP4 shard (250);
     * a split back needs 500, of which it holds 125 too; the KV of 100 tokens (800 bytes):
     * 800 / 4 - 800 / 16 = 150 a GPU, either way */
    double bytes = -1;
    gy_sim_phase_shape ph = {.kind = GY_SIM_PHASE_WEIGHTS_DROP, .tp_from = 2, .tp_to = 4};
    CHECK(fabs(gy_sim_roofline_phase_time(&p, &ph, &bytes) - (125 / 2.5 + 0.3)) < 1e-12);
    CHECK(bytes == 125);
    ph = (gy_sim_phase_shape){.kind = GY_SIM_PHASE_WEIGHTS_GATHER, .tp_from = 4, .tp_to = 2};
    CHECK(fabs(gy_sim_roofline_phase_time(&p, &ph, &bytes) - (375 / 2.5 + 0.3)) < 1e-12);
    ph = (gy_sim_phase_shape){.kind = GY_SIM_PHASE_KV_SCATTER, .tp_from = 4, .tp_to = 2,
                              .kv_tokens = 100};
    CHECK(fabs(gy_sim_roofline_phase_time(&p, &ph, &bytes) - (150 / 2.5 + 0.3)) < 1e-12);
    ph = (gy_sim_phase_shape){.kind = GY_SIM_PHASE_WEIGHTS_DROP, .tp_from = 1, .tp_to = 2};
    /* TP1 -> PP2: the pipeline is the larger end, which Seesaw never forms; priced as TP */
    CHECK(fabs(gy_sim_roofline_phase_time(&p, &ph, &bytes) - 0.3) < 1e-12 && bytes == 0);
    p.reshard = 1; /* Seesaw's: the KV all out and the new share in, over the host link */
    p.host_bw = 40;
    ph = (gy_sim_phase_shape){.kind = GY_SIM_PHASE_KV_SCATTER, .tp_from = 2, .tp_to = 4,
                              .kv_tokens = 100};
    CHECK(fabs(gy_sim_roofline_phase_time(&p, &ph, &bytes) - (400 / 10.0 + 0.3)) < 1e-12);
    for (int bad = 0; bad < 3; bad++) {
        p.pipeline_degree = (int32_t[]){1, 3, 4}[bad]; /* 4 stages of a 3-layer model */
        CHECK_STATUS(gy_sim_roofline_check(&p), GY_ERR_INVALID);
    }
}

GYTEST(sim_cost_profiled_by_hand) {
    gy_sim_cost_profiled p = {.n_levels = 2, .base = {1, 2}, .per_token = {0.5, 0.25},
                              .per_sample = {0.1, 0.1}, .per_kv_read = {0.01, 0},
                              .per_pair = {0.001, 0.002}, .transform_slowdown = 0.5,
                              .kv_bytes_per_token = 8, .ffn_bytes = 600, .n_layers = 3,
                              .xfer_bw = 2.5, .phase_latency_per_layer = 0.1};
    CHECK_OK(gy_sim_cost_profiled_check(&p));
    gy_sim_cost_ops ops = gy_sim_cost_profiled_ops(&p);
    /* 4 tokens, 2 samples, 10 keys read, 20 pairs: TP1 1 + 2 + 0.2 + 0.1 + 0.02 = 3.32 */
    gy_sim_step_shape s = {.n_tokens = 4, .n_seqs = 2, .n_samples = 2, .kv_read_tokens = 10,
                           .attn_pairs = 20};
    CHECK(fabs(ops.step_time(ops.ctx, 1, 0, &s) - 3.32) < 1e-12);
    CHECK(fabs(ops.step_time(ops.ctx, 1, 1, &s) - 3.32 * 1.5) < 1e-12);
    /* TP2: 2 + 1 + 0.2 + 0 + 0.04; TP4 is beyond the levels: priced as TP2 */
    CHECK(fabs(ops.step_time(ops.ctx, 2, 0, &s) - 3.24) < 1e-12);
    CHECK(ops.step_time(ops.ctx, 4, 0, &s) == ops.step_time(ops.ctx, 2, 0, &s));
    gy_sim_step_shape none = {0};
    CHECK(ops.step_time(ops.ctx, 1, 0, &none) == 0.0);
    /* the roofline's phase bytes at xfer_bw, plus the latency of 3 layers */
    double bytes = -1;
    gy_sim_phase_shape ph = {.kind = GY_SIM_PHASE_KV_SCATTER, .tp_from = 1, .tp_to = 4,
                             .kv_tokens = 100};
    CHECK(fabs(ops.phase_time(ops.ctx, &ph, &bytes) - (150 / 2.5 + 0.3)) < 1e-12);
    CHECK(bytes == 150);
    p.per_pair[1] = -1e-3;
    CHECK_STATUS(gy_sim_cost_profiled_check(&p), GY_ERR_INVALID);
    p.per_pair[1] = 0;
    p.n_levels = 9;
    CHECK_STATUS(gy_sim_cost_profiled_check(&p), GY_ERR_INVALID);
    p.n_levels = 2;
    p.base[0] = p.per_token[0] = 0;   /* a step that costs nothing */
    CHECK_STATUS(gy_sim_cost_profiled_check(&p), GY_ERR_INVALID);
}

/* ---- hand-built views ---- */

#define MAXI 16
typedef struct {
    gy_sim_inst_view inst[MAXI];
    int32_t gpu_inst[64];
    int64_t capacity[GY_SIM_MAX_LEVELS];
    gy_sim_group pending[4];
    gy_sim_view v;
} world;

/* Instances given by their TPs in GPU order (aligned); capacity 100 blocks per TP1 level, then
 * 250, 600, 1300 (more than the sum of halves, as with real models). */
static void world_init(world *w, int n_gpus, int gpus_per_host, const int32_t *tps, int n) {
    memset(w, 0, sizeof *w);
    const int64_t caps[] = {100, 250, 600, 1300, 2700, 5500, 11000, 22000};
    memcpy(w->capacity, caps, sizeof caps);
    int32_t g = 0;
    for (int k = 0; k < n; k++) {
        const int l = gy_sim_level(tps[k]);
        w->inst[k] = (gy_sim_inst_view){.gpu_first = g, .tp = tps[k], .host = g / gpus_per_host,
                                        .placeable = 1, .kv_total = caps[l]};
        for (int32_t x = g; x < g + tps[k]; x++) w->gpu_inst[x] = k;
        g += tps[k];
    }
    CHECK(g == n_gpus);
    w->v = (gy_sim_view){.n_gpus = n_gpus, .gpus_per_host = gpus_per_host, .max_tp = gpus_per_host,
                         .n_inst = n, .inst = w->inst, .gpu_inst = w->gpu_inst,
                         .capacity = w->capacity, .block_size = 16, .watermark = 0.0,
                         .pending = w->pending};
}

static void set_load(world *w, int k, int64_t prefill, int64_t output) {
    w->inst[k].pending_prefill = prefill;
    w->inst[k].pending_output = output;
}

static gy_sim_req_view req(int64_t footprint, int32_t min_tp) {
    return (gy_sim_req_view){.id = 1, .prompt = footprint * 16 - 10, .output = 10,
                             .footprint = footprint, .min_tp = min_tp};
}

static int has_op(const gy_sim_decision *d, int32_t kind, int32_t g, int32_t size) {
    for (int k = 0; k < d->n_ops; k++)
        if (d->ops[k].kind == kind && d->ops[k].gpu_first == g && d->ops[k].size == size) return 1;
    return 0;
}

static gy_sim_decision place(const gy_sim_policy_ops *p, void *state,
                             const gy_sim_policy_config *cfg, const world *w,
                             const gy_sim_req_view *r) {
    gy_sim_decision d;
    memset(&d, 0x5a, sizeof d); /* the policy must set everything it returns */
    CHECK_OK(p->place(state, cfg, &w->v, r, &d));
    return d;
}

GYTEST(sim_policy_registry_and_groups) {
    CHECK(gy_sim_policy_find("gyges") == &gy_sim_policy_gyges);
    CHECK(gy_sim_policy_find("static") == &gy_sim_policy_static);
    CHECK(gy_sim_policy_find("nope") == NULL && gy_sim_policy_find(NULL) == NULL);
    CHECK(strstr(gy_sim_policy_names(), "round_robin") != NULL);
    CHECK(gy_sim_level(1) == 0 && gy_sim_level(8) == 3 && gy_sim_level(6) == -1);
    world w;
    const int32_t tps[] = {2, 1, 1, 4, 1, 1, 1, 1, 1, 1, 1, 1};
    world_init(&w, 16, 8, tps, 12);
    CHECK(gy_sim_group_valid(&w.v, 0, 4) && gy_sim_group_valid(&w.v, 8, 8));
    CHECK(!gy_sim_group_valid(&w.v, 2, 4) && !gy_sim_group_valid(&w.v, 4, 16));
    CHECK(!gy_sim_group_valid(&w.v, 6, 4)); /* not aligned */
    CHECK(gy_sim_group_instance(&w.v, 0, 2) == 0 && gy_sim_group_instance(&w.v, 2, 1) == 1);
    CHECK(gy_sim_group_instance(&w.v, 0, 4) == -1);
    /* quartet {0..3} = TP2 + TP1 + TP1: first merge the TP1 pair */
    gy_sim_decision d = {0};
    CHECK(gy_sim_policy_build_group(&w.v, 0, 4, &d) == 0);
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_MERGE, 2, 2));
    /* {4..7} is one TP4 already; {4,5} is inside it */
    d = (gy_sim_decision){0};
    CHECK(gy_sim_policy_build_group(&w.v, 4, 4, &d) == 1 && d.n_ops == 0);
    CHECK(gy_sim_policy_build_group(&w.v, 4, 2, &d) == -1);
    /* host 2 (GPUs 8..15), all TP1, to TP8: four pair merges at once */
    d = (gy_sim_decision){0};
    CHECK(gy_sim_policy_build_group(&w.v, 8, 8, &d) == 0 && d.n_ops == 4);
    for (int g = 8; g < 16; g += 2) CHECK(has_op(&d, GY_SIM_OP_MERGE, g, 2));
    /* a half under way: wait, no op */
    w.inst[1].xform = GY_SIM_XFORM_MERGING;
    d = (gy_sim_decision){0};
    CHECK(gy_sim_policy_build_group(&w.v, 2, 2, &d) == 0 && d.n_ops == 0);
    /* split plausibility: halves of a TP2 hold 100 blocks each */
    gy_sim_inst_view t = w.inst[0];
    t.footprint = 190;
    t.max_footprint = 100;
    CHECK(gy_sim_policy_split_plausible(&w.v, &t));
    t.max_footprint = 101;
    CHECK(!gy_sim_policy_split_plausible(&w.v, &t));
    t.max_footprint = 50;
    t.footprint = 191;
    CHECK(!gy_sim_policy_split_plausible(&w.v, &t));
    d = (gy_sim_decision){0};
    for (int k = 0; k < GY_SIM_MAX_OPS; k++) CHECK(gy_sim_decision_add_op(&d, 0, 2 * k, 2));
    CHECK(gy_sim_decision_add_op(&d, 0, 0, 2));  /* a duplicate is not added twice */
    CHECK(!gy_sim_decision_add_op(&d, 0, 64, 2)); /* full */
}

GYTEST(sim_policy_gyges_short_requests) {
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    world w;
    const int32_t tps[] = {1, 1, 1, 1, 2, 2};
    world_init(&w, 8, 8, tps, 6);
    for (int k = 0; k < 4; k++) set_load(&w, k, 1000 * (k + 1), 0);
    set_load(&w, 4, 10000, 0);
    set_load(&w, 5, 10000, 0);
    gy_sim_req_view r = req(10, 1);
    gy_sim_decision d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 0 && d.n_ops == 0);
    /* reserved and held instances are skipped for short requests */
    w.inst[0].reserved = 1;
    w.inst[1].held = 1;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 2);
    /* the prompt goes where it is prefilled soonest: (waiting + 150 tokens) / the TP's rate */
    set_load(&w, 2, 3000, 0);
    set_load(&w, 3, 3000, 0);
    set_load(&w, 4, 5800, 0); /* (5800 + 150) / 2 < 3150 (NULL rates: proportional to TP) */
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 4);
    const double rates[4] = {1000, 1400, 1700, 1900}; /* TP2 prefills 1.4x as fast as TP1 */
    w.v.prefill_rate = rates;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 2); /* equal wait: the lower GPU */
    set_load(&w, 4, 4200, 0); /* 4350 / 1400 < 3150 / 1000, though a long prompt is there */
    w.inst[4].max_min_tp = 2;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 4);
    w.v.prefill_rate = NULL;
    set_load(&w, 4, 10000, 0);
    /* decode tokens only break ties (load per GPU, decode_weight each) */
    set_load(&w, 2, 3000, 1000);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 3);
    set_load(&w, 2, 2999, 1000);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 2);
    /* every TP1 reserved or held: the least loaded TP1 all the same */
    for (int k = 0; k < 6; k++) w.inst[k].reserved = 1;
    set_load(&w, 0, 3000, 0);
    set_load(&w, 1, 2500, 0);
    set_load(&w, 4, 0, 0);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 1);
    /* no TP1 can take it: a higher TP, least load per GPU */
    for (int k = 0; k < 4; k++) w.inst[k].placeable = 0;
    set_load(&w, 4, 6000, 0);
    set_load(&w, 5, 4000, 0);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 5);
    /* splitting instances are not placeable */
    for (int k = 0; k < 6; k++) w.inst[k].placeable = 0;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER);
    /* nothing can ever hold it */
    r = req(100000, 0);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_REJECT);
}

GYTEST(sim_policy_gyges_long_requests) {
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    world w;
    const int32_t tps[] = {1, 1, 1, 1, 1, 1, 1, 1};
    world_init(&w, 8, 8, tps, 8);
    for (int k = 0; k < 8; k++) set_load(&w, k, 100, 0);
    set_load(&w, 2, 10, 0);
    set_load(&w, 3, 10, 0);
    /* needs TP2: the least-loaded pair {2,3} merges */
    gy_sim_req_view r = req(200, 2);
    gy_sim_decision d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 2 && d.group.size == 2);
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_MERGE, 2, 2));
    /* needs TP4: x2 steps, both pairs of the least-loaded quartet now */
    r = req(500, 4);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 0 && d.group.size == 4);
    CHECK(d.n_ops == 2 && has_op(&d, GY_SIM_OP_MERGE, 0, 2) && has_op(&d, GY_SIM_OP_MERGE, 2, 2));
    /* a pending scale-up of {4..7} with room joins; without room, another group */
    w.pending[0] = (gy_sim_group){4, 4, 0};
    w.v.n_pending = 1;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 4 && d.group.size == 4);
    w.pending[0].footprint = 200; /* 200 + 500 > 600 */
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 0 && d.group.size == 4);
    w.v.n_pending = 0;
    /* a TP2 instance with room takes a TP2 request instead of a new scale-up */
    const int32_t tps2[] = {2, 1, 1, 1, 1, 1, 1};
    world_init(&w, 8, 8, tps2, 7);
    set_load(&w, 0, 1000, 0);
    for (int k = 1; k < 7; k++) set_load(&w, k, 100, 0);
    w.inst[0].held = 1;
    r = req(200, 2);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 0);
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_UNHOLD, 0, 2)); /* held: reused, un-held */
    /* ... unless its committed footprint leaves no room for this one */
    w.inst[0].footprint = 100;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 2 && d.group.gpu_first != 0);
    /* ... or it is far busier than a fresh group (scale_up_load) */
    w.inst[0].footprint = 0;
    set_load(&w, 0, 2 * (int64_t)cfg.scale_up_load + 1000, 0);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 2 && d.group.gpu_first != 0);
    /* the group of a new scale-up is reserved at once, but each merge waits for its halves to
     * drain (no requests left) unless the request has waited merge_wait */
    const int32_t tps4[] = {1, 1, 1, 1, 1, 1, 1, 1};
    world_init(&w, 8, 8, tps4, 8);
    for (int k = 0; k < 8; k++) {
        set_load(&w, k, 100, 0);
        w.inst[k].n_requests = k == 2 ? 0 : 1;
    }
    set_load(&w, 2, 10, 0);
    set_load(&w, 3, 10, 0);
    r = req(200, 2);
    r.arrival = 5.0;
    w.v.now = 5.0;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 2 && d.group.size == 2);
    CHECK(d.n_ops == 0); /* GPU 3 still serves a request */
    w.inst[3].n_requests = 0;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_MERGE, 2, 2));
    w.inst[3].n_requests = 1;
    w.v.now = 5.0 + cfg.merge_wait;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_MERGE, 2, 2));
    w.v.now = 0;
    /* scale_up_cap: with half the GPUs at TP2 already, a busy TP2 with room takes it */
    const int32_t tps5[] = {2, 2, 1, 1, 1, 1};
    world_init(&w, 8, 8, tps5, 6);
    set_load(&w, 0, 1 << 20, 0);
    set_load(&w, 1, 1 << 21, 0);
    r = req(200, 2);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 0);
    cfg.scale_up_cap = 0.75;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 2 && d.group.gpu_first >= 4);
    cfg = gy_sim_policy_config_default();
    /* a deferred request whose group is now one instance goes there */
    const int32_t tps3[] = {1, 1, 2, 1, 1, 1, 1};
    world_init(&w, 8, 8, tps3, 7);
    r = req(200, 2);
    r.deferred = 1;
    r.group = (gy_sim_group){2, 2, 0};
    set_load(&w, 2, 1 << 30, 0); /* busy does not matter: its group is ready */
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 2);
}

GYTEST(sim_policy_gyges_rebalance) {
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    cfg.light_load = cfg.idle_load = 0; /* the paper's rules alone (no latency mode) */
    world w;
    const int32_t tps[] = {2, 1, 1, 4};
    world_init(&w, 8, 8, tps, 4);
    gy_sim_decision d;
    /* TP2 still needed by a request: nothing */
    w.inst[0].max_min_tp = 2;
    w.inst[3].max_min_tp = 4;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.action == GY_SIM_ACTION_NONE && d.n_ops == 0);
    /* no longer needed, KV 80% used: hold only */
    w.inst[0].max_min_tp = 1;
    w.inst[0].kv_used = 200;
    w.inst[0].footprint = 150;
    w.inst[0].max_footprint = 10;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_HOLD, 0, 2));
    /* held, half free, fits the halves: split */
    w.inst[0].held = 1;
    w.inst[0].kv_used = 125;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_SPLIT, 0, 2));
    /* ... but not while a pending scale-up reserves it, nor while transforming */
    w.inst[0].reserved = 1;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    w.inst[0].reserved = 0;
    w.inst[0].xform = GY_SIM_XFORM_SPLIT_TAIL;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    /* the TP4 with only TP2-sized requests: hold, and split (x2 step down) when empty enough */
    w.inst[0].xform = GY_SIM_XFORM_NONE;
    w.inst[0].max_min_tp = 2;
    w.inst[3].max_min_tp = 2;
    w.inst[3].footprint = 400;
    w.inst[3].max_footprint = 200;
    w.inst[3].kv_used = 100;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 2 && has_op(&d, GY_SIM_OP_HOLD, 4, 4) && has_op(&d, GY_SIM_OP_SPLIT, 4, 4));
    /* the baselines split without holding and without the 50% rule */
    w.inst[3].kv_used = 590;
    CHECK_OK(gy_sim_policy_round_robin.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_SPLIT, 4, 4));
    CHECK(gy_sim_policy_static.rebalance == NULL);
}

/* The latency mode: the base TP follows the cluster's outstanding work per GPU (4 up to
 * idle_load, 2 up to light_load); pairs below it merge, instances above it split only past 4x
 * the threshold that merged them. */
GYTEST(sim_policy_gyges_latency_mode) {
    const gy_sim_policy_config cfg = gy_sim_policy_config_default(); /* 250, 4000 tokens */
    CHECK(cfg.idle_load == 250 && cfg.light_load == 4000);
    world w;
    gy_sim_decision d;
    /* idle: every pair merges, TP1 -> TP2 (the next rebalance goes on to TP4) */
    const int32_t tp1[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    world_init(&w, 8, 8, tp1, 8);
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 4);
    for (int g = 0; g < 8; g += 2) CHECK(has_op(&d, GY_SIM_OP_MERGE, g, 2));
    /* nothing merges a held, reserved, transforming or unplaceable half, or a pending group */
    w.inst[0].held = 1;
    w.inst[3].reserved = 1;
    w.inst[4].xform = GY_SIM_XFORM_SPLIT_TAIL;
    w.inst[7].placeable = 0;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    world_init(&w, 8, 8, tp1, 8);
    const gy_sim_group pending[1] = {{4, 4, 10}};
    w.v.pending = pending;
    w.v.n_pending = 1;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 2 && has_op(&d, GY_SIM_OP_MERGE, 0, 2) && has_op(&d, GY_SIM_OP_MERGE, 2, 2));
    w.v.n_pending = 0;
    /* at most max_tp, and not on replicated clusters (they bind instead) */
    const int32_t tp2[4] = {2, 2, 2, 2};
    world_init(&w, 8, 8, tp2, 4);
    w.v.max_tp = 2;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    w.v.max_tp = 8;
    w.v.replicated = 1;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(!has_op(&d, GY_SIM_OP_MERGE, 0, 4) && !has_op(&d, GY_SIM_OP_MERGE, 4, 4));
    w.v.replicated = 0;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 2 && has_op(&d, GY_SIM_OP_MERGE, 0, 4) && has_op(&d, GY_SIM_OP_MERGE, 4, 4));
    /* 1000 tokens per GPU (2000 prompt tokens on each TP2): base 2, and no split of a TP2 */
    for (int k = 0; k < 4; k++) set_load(&w, k, 2000, 0);
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    /* TP4s stay up to 4 x 250 tokens per GPU, and split past it */
    const int32_t tp4[2] = {4, 4};
    world_init(&w, 8, 8, tp4, 2);
    set_load(&w, 0, 4000, 0);
    set_load(&w, 1, 4000, 0); /* 1000 per GPU */
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    set_load(&w, 1, 4000, 1); /* 8 more tokens: 1001 per GPU */
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 4 && has_op(&d, GY_SIM_OP_HOLD, 0, 4) && has_op(&d, GY_SIM_OP_SPLIT, 0, 4) &&
          has_op(&d, GY_SIM_OP_SPLIT, 4, 4));
    /* TP2s split only past 4 x 4000 tokens per GPU */
    world_init(&w, 8, 8, tp2, 4);
    for (int k = 0; k < 4; k++) set_load(&w, k, 32000, 0); /* 16000 per GPU */
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    set_load(&w, 3, 32008, 0);
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 8 && has_op(&d, GY_SIM_OP_SPLIT, 6, 2));
    /* a request that needs more than the base (served, or waiting for its group): base 1, so
     * pairs do not merge and unneeded TP2s split (the paper's regime). 1000 tokens per GPU:
     * base 2 (splits above 4) */
    const int32_t mixed[5] = {4, 1, 1, 1, 1};
    world_init(&w, 8, 8, mixed, 5);
    set_load(&w, 0, 8000, 0);
    w.inst[0].max_min_tp = 4; /* a long request on the TP4 */
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    w.inst[0].max_min_tp = 2; /* it needs only TP2: the pairs merge (and the TP4 stays) */
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 2 && has_op(&d, GY_SIM_OP_MERGE, 4, 2) && has_op(&d, GY_SIM_OP_MERGE, 6, 2));
    world_init(&w, 8, 8, tp1, 8);
    for (int k = 0; k < 8; k++) set_load(&w, k, 1000, 0);
    const gy_sim_group waiting[1] = {{0, 4, 10}}; /* a long request waits for GPUs 0-3 */
    w.v.pending = waiting;
    w.v.n_pending = 1;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    w.v.n_pending = 0;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 4); /* without it, every pair merges */
    /* 2000 tokens per GPU on TP2s (base 2 even for splits) and a long request waiting for the
     * reserved GPUs 4-7: the other TP2s, which nothing needs, split */
    world_init(&w, 8, 8, tp2, 4);
    for (int k = 0; k < 4; k++) set_load(&w, k, 4000, 0);
    const gy_sim_group quartet[1] = {{4, 4, 10}};
    w.v.pending = quartet;
    w.v.n_pending = 1;
    w.inst[2].reserved = w.inst[3].reserved = 1;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 4 && has_op(&d, GY_SIM_OP_SPLIT, 0, 2) && has_op(&d, GY_SIM_OP_SPLIT, 2, 2));
    w.v.n_pending = 0;
    w.inst[2].reserved = w.inst[3].reserved = 0;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
}

GYTEST(sim_policy_baselines) {
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    world w;
    const int32_t tps[] = {1, 1, 2, 4};
    world_init(&w, 8, 8, tps, 4);
    int32_t rr_state[4] = {0};
    gy_sim_req_view r = req(10, 1);
    /* round robin: 0, 1, 2 (TP2), 3 (TP4), 0, then it is GPU 1's turn */
    const int32_t order[] = {0, 1, 2, 3, 0};
    for (int k = 0; k < 5; k++) {
        gy_sim_decision d = place(&gy_sim_policy_round_robin, rr_state, &cfg, &w, &r);
        CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == order[k]);
    }
    /* eager: the TP1 whose turn it is cannot hold a TP2 request: its pair {0,1} merges */
    r = req(200, 2);
    gy_sim_decision d = place(&gy_sim_policy_round_robin, rr_state, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 0 && d.group.size == 2);
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_MERGE, 0, 2));
    /* not eager: the turn skips to an instance that can hold it */
    cfg.eager_scale_up = 0;
    memset(rr_state, 0, sizeof rr_state);
    d = place(&gy_sim_policy_round_robin, rr_state, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 2);
    d = place(&gy_sim_policy_round_robin, rr_state, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 3);
    /* least load */
    cfg.eager_scale_up = 1;
    set_load(&w, 0, 500, 0);
    set_load(&w, 1, 100, 0);
    set_load(&w, 2, 300, 0);  /* 150 per GPU */
    set_load(&w, 3, 1000, 0); /* 250 per GPU */
    r = req(10, 1);
    d = place(&gy_sim_policy_least_load, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 1);
    r = req(500, 4); /* eager: GPU 1 is least loaded -> its quartet {0..3} = TP1 TP1 TP2 */
    d = place(&gy_sim_policy_least_load, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 0 && d.group.size == 4);
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_MERGE, 0, 2));
    cfg.eager_scale_up = 0; /* the TP4 holds it */
    d = place(&gy_sim_policy_least_load, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 3);
    /* static: least loaded that fits, never transforms, rejects what fits nowhere */
    r = req(200, 2);
    d = place(&gy_sim_policy_static, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 2 && d.n_ops == 0);
    r = req(1000, 8);
    d = place(&gy_sim_policy_static, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_REJECT);
    d = place(&gy_sim_policy_round_robin, rr_state, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 0 && d.group.size == 8);
}

/* ---- instance ---- */

static const gy_sim_sched_params small_sched = {.block_size = 4, .max_batch_tokens = 64,
                                                .max_running = 8, .max_prefill_chunk = 0,
                                                .watermark = 0.0};

GYTEST(sim_instance_capacity_and_carry) {
    gy_sim_instance a, b;
    CHECK_STATUS(gy_sim_instance_init(&a, &small_sched, 0, 10), GY_ERR_INVALID);
    CHECK_OK(gy_sim_instance_init(&a, &small_sched, 10, 20));
    CHECK(a.capacity == 10 && gy_sim_instance_used(&a) == 0);
    CHECK(gy_sched_block_counter_free_blocks(a.bc) == 10);
    /* request 1: 10 prompt tokens, 5 new; request 2: 6 + 3 */
    gy_sim_carry c1 = {.prompt = 10, .max_new = 5}, c2 = {.prompt = 6, .max_new = 3};
    CHECK_OK(gy_sim_instance_put(&a, 1, &c1, 0.0, 0));
    CHECK_OK(gy_sim_instance_put(&a, 2, &c2, 0.0, 0));
    gy_sched_batch bt;
    CHECK_OK(gy_sched_schedule(a.sched, 0.0, &bt)); /* both prefills: 3 + 2 blocks */
    CHECK(bt.n_entries == 2);
    CHECK_OK(gy_sched_commit(a.sched, 1.0, NULL, bt.n_entries, NULL));
    CHECK(gy_sim_instance_used(&a) == 5);
    CHECK_STATUS(gy_sim_instance_set_capacity(&a, 4), GY_ERR_STATE);  /* below used */
    CHECK_STATUS(gy_sim_instance_set_capacity(&a, 21), GY_ERR_STATE); /* above the counter */
    CHECK_OK(gy_sim_instance_set_capacity(&a, 16));
    CHECK(gy_sched_block_counter_free_blocks(a.bc) == 11 && gy_sim_instance_used(&a) == 5);
    CHECK_OK(gy_sched_schedule(a.sched, 1.0, &bt)); /* two decodes */
    CHECK(bt.n_entries == 2 && bt.n_decode == 2);
    CHECK_OK(gy_sched_commit(a.sched, 2.0, NULL, bt.n_entries, NULL));
    /* request 1 decodes: G = 2, C = 11 -> prompt' 11, max_new' 4, kept 11, shift 1 */
    gy_sim_carry c;
    CHECK_OK(gy_sim_instance_take(&a, 1, &c));
    CHECK(c.prompt == 11 && c.max_new == 4 && c.kept == 11 && c.gen_shift == 1);
    CHECK(gy_sim_instance_used(&a) == 2); /* its blocks are back */
    CHECK_STATUS(gy_sim_instance_take(&a, 1, &c), GY_ERR_INVALID); /* gone */
    CHECK_OK(gy_sim_instance_init(&b, &small_sched, 30, 30));
    CHECK_OK(gy_sim_instance_put(&b, 1, &c, 0.0, 0));
    /* in b: the prefill of the 11 known tokens samples token index 0 = its G 1 again */
    CHECK_OK(gy_sched_schedule(b.sched, 2.0, &bt));
    CHECK(bt.n_entries == 1 && bt.entries[0].n_tokens == 11 && bt.entries[0].samples &&
          bt.entries[0].sample_index == 0);
    CHECK_OK(gy_sched_commit(b.sched, 2.0, NULL, 1, NULL));
    gy_sched_info in;
    CHECK_OK(gy_sched_info_get(b.sched, 1, &in));
    CHECK(in.n_computed == 11 && in.n_generated == 1 && in.prefill_end == 11);
    /* request 3 mid-prefill: chunk cap 64 tokens, prompt 100 -> C 64 after one step */
    CHECK_OK(gy_sim_instance_set_capacity(&a, 20));
    gy_sim_carry c3 = {.prompt = 70, .max_new = 2};
    CHECK_OK(gy_sim_instance_put(&a, 3, &c3, 0.0, 0));
    CHECK_OK(gy_sched_schedule(a.sched, 2.0, &bt));
    CHECK_OK(gy_sched_commit(a.sched, 3.0, NULL, bt.n_entries, NULL));
    CHECK_OK(gy_sched_info_get(a.sched, 3, &in));
    CHECK(in.state == GY_SCHED_STATE_RUNNING && in.n_computed < 70);
    const int64_t computed = in.n_computed;
    CHECK_OK(gy_sim_instance_take(&a, 3, &c));
    CHECK(c.prompt == 70 && c.max_new == 2 && c.kept == computed && c.gen_shift == 0);
    /* a queued request carries nothing computed */
    gy_sim_carry c4 = {.prompt = 5, .max_new = 1};
    CHECK_OK(gy_sim_instance_put(&a, 4, &c4, 0.0, 0));
    CHECK_OK(gy_sim_instance_take(&a, 4, &c));
    CHECK(c.prompt == 5 && c.max_new == 1 && c.kept == 0 && c.gen_shift == 0);
    gy_sim_instance_free(&a);
    gy_sim_instance_free(&b);
}

/* ---- whole simulations ---- */

static uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

static void run_random(const char *policy, const int32_t *layout, int n_layout, uint64_t seed,
                       int hosts, int replicated) {
    const int64_t n = 400;
    double *arr = malloc(n * sizeof *arr);
    int64_t *in = malloc(n * sizeof *in), *out = malloc(n * sizeof *out);
    int32_t *prio = malloc(n * sizeof *prio);
    double t = 0;
    for (int64_t k = 0; k < n; k++) {
        t += (double)(lcg(&seed) % 1000) / 400.0;
        arr[k] = t;
        /* mostly short, some needing TP2 / TP4 / TP8, a few that fit nothing */
        const uint64_t kind = lcg(&seed) % 100;
        in[k] = kind < 80 ? 1 + (int64_t)(lcg(&seed) % 300)
              : kind < 92 ? 400 + (int64_t)(lcg(&seed) % 500)
              : kind < 97 ? 1100 + (int64_t)(lcg(&seed) % 1000)
              : kind < 99 ? 2500 + (int64_t)(lcg(&seed) % 2000)
                          : 50000;
        out[k] = 1 + (int64_t)(lcg(&seed) % 60);
        prio[k] = replicated && lcg(&seed) % 10 == 0;
    }
    /* blocks of 4 tokens: TP1 holds 640 tokens, TP2 1600, TP4 4000, TP8 8800; replicated: a
     * bound group pools its members' 160 */
    const int64_t cap_sharded[] = {160, 400, 1000, 2200}, mid_sharded[] = {200, 480, 1150, 2200};
    const int64_t cap_replicated[] = {160, 320, 640, 1280};
    const int64_t *cap = replicated ? cap_replicated : cap_sharded;
    const int64_t *mid = replicated ? cap_replicated : mid_sharded;
    gy_sim_cost_constant cc = {.step_time = 0.05, .phase_time = 0.3, .transform_slowdown = 0.1};
    gy_sim_config c = {
        .hosts = hosts, .gpus_per_host = 8, .max_tp = 8, .n_layout = n_layout, .layout = layout,
        .capacity = cap, .capacity_mid = mid,
        .sched = {.block_size = 4, .max_batch_tokens = 128, .max_running = 16,
                  .max_prefill_chunk = 0, .watermark = 0.01},
        .cost = gy_sim_cost_constant_ops(&cc),
        .policy = gy_sim_policy_find(policy),
        .policy_config = gy_sim_policy_config_default(),
        .sample_interval = 1.0,
        .record_tokens = 1,
        .replicated = replicated,
        .switch_time = 0.015,
    };
    gy_sim_trace tr = {.n = n, .arrival = arr, .input_tokens = in, .output_tokens = out,
                       .priority = prio};
    gy_sim *s = NULL;
    CHECK_OK(gy_sim_init(&s, &c, &tr));
    gy_sim_stats st;
    for (double until = 0; until < 1e6; until += 7.3) {
        CHECK_OK(gy_sim_run(s, until));
        CHECK_OK(gy_sim_check(s));
        gy_sim_stats_get(s, &st);
        if (st.done) break;
        if (st.n_events > 2000000) break; /* a livelock (bind/release churn): fails below */
    }
    gy_sim_stats_get(s, &st);
    CHECK(st.done);
    CHECK(st.n_finished + st.n_rejected == n); /* each exactly once (statuses are exclusive) */
    int64_t m = 0;
    const gy_sim_request_out *o = gy_sim_requests(s, &m);
    int64_t tokens = 0, rejected_long = 0;
    for (int64_t k = 0; k < m; k++) {
        if (o[k].status == GY_SIM_REQ_FINISHED) {
            CHECK(o[k].arrival <= o[k].scheduled && o[k].scheduled <= o[k].first_token &&
                  o[k].first_token <= o[k].finish);
            tokens += o[k].output_tokens;
        } else {
            CHECK(o[k].status == GY_SIM_REQ_REJECTED && isnan(o[k].scheduled));
            rejected_long += o[k].input_tokens >= 50000 || o[k].min_tp > 1;
        }
    }
    CHECK(rejected_long == st.n_rejected); /* only what fits nowhere (or not the layout) */
    int64_t n_tok = 0;
    gy_sim_tokens(s, &n_tok);
    CHECK(n_tok == tokens); /* every output token exactly once */
    double binned = 0;
    int64_t n_bins = 0;
    const double *bins = gy_sim_bins(s, &n_bins, NULL);
    for (int64_t k = 0; k < n_bins; k++) binned += bins[k];
    CHECK(binned == (double)tokens);
    if (replicated) CHECK(st.n_binds > 0 && st.n_merges == 0 && st.n_splits == 0);
    else if (strcmp(policy, "static") != 0) CHECK(st.n_merges > 0);
    gy_sim_free(s);
    free(arr);
    free(in);
    free(out);
    free(prio);
}

GYTEST(sim_random_runs_keep_invariants) {
    const int32_t all_tp1[] = {1, 1, 1, 1, 1, 1, 1, 1};
    const int32_t mixed[] = {4, 1, 1, 1, 1};
    const char *policies[] = {"gyges", "round_robin", "least_load"};
    for (int p = 0; p < 3; p++)
        for (uint64_t seed = 1; seed <= 3; seed++)
            run_random(policies[p], all_tp1, 8, seed, 1 + (int)(seed % 2), 0);
    run_random("gyges", mixed, 5, 7, 1, 0);
    run_random("static", mixed, 5, 8, 2, 0);
    for (uint64_t seed = 1; seed <= 3; seed++)
        run_random("flying", all_tp1, 8, seed, 1 + (int)(seed % 2), 1);
}

GYTEST(sim_bad_configs) {
    const int32_t layout[] = {1, 1, 2, 4};
    const int64_t cap[] = {10, 30, 70, 150}, mid[] = {12, 34, 75, 150};
    gy_sim_cost_constant cc = {.step_time = 1};
    double arr[2] = {0, 1};
    int64_t in[2] = {5, 5}, out[2] = {1, 1};
    gy_sim_config c = {
        .hosts = 1, .gpus_per_host = 8, .max_tp = 8, .n_layout = 4, .layout = layout,
        .capacity = cap, .capacity_mid = mid,
        .sched = {.block_size = 4, .max_batch_tokens = 16, .max_running = 4},
        .cost = gy_sim_cost_constant_ops(&cc), .policy = &gy_sim_policy_gyges,
        .policy_config = gy_sim_policy_config_default(), .sample_interval = 1};
    gy_sim_trace tr = {.n = 2, .arrival = arr, .input_tokens = in, .output_tokens = out};
    gy_sim *s = NULL;
    CHECK_OK(gy_sim_init(&s, &c, &tr));
    CHECK_OK(gy_sim_run(s, INFINITY));
    CHECK_OK(gy_sim_check(s));
    gy_sim_free(s);
    const int32_t misaligned[] = {1, 2, 1, 4};
    c.layout = misaligned;
    CHECK_STATUS(gy_sim_init(&s, &c, &tr), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "multiple") != NULL && s == NULL);
    c.layout = layout;
    c.n_layout = 3; /* covers 4 of 8 GPUs */
    CHECK_STATUS(gy_sim_init(&s, &c, &tr), GY_ERR_INVALID);
    c.n_layout = 4;
    c.gpus_per_host = 6;
    CHECK_STATUS(gy_sim_init(&s, &c, &tr), GY_ERR_INVALID);
    c.gpus_per_host = 8;
    const int64_t bad_mid[] = {9, 34, 75, 150};
    c.capacity_mid = bad_mid;
    CHECK_STATUS(gy_sim_init(&s, &c, &tr), GY_ERR_INVALID);
    c.capacity_mid = mid;
    arr[1] = -1; /* not sorted */
    CHECK_STATUS(gy_sim_init(&s, &c, &tr), GY_ERR_INVALID);
    arr[1] = 1;
    out[0] = 0;
    CHECK_STATUS(gy_sim_init(&s, &c, &tr), GY_ERR_INVALID);
    out[0] = 1;
    c.sample_interval = 0;
    CHECK_STATUS(gy_sim_init(&s, &c, &tr), GY_ERR_INVALID);
    CHECK(s == NULL);
}

/* A cost model by hand for the view: a step costs 20 ms / tp of weights plus 2 ms a sequence, a
 * TP2's sequences 1.5x as much (its all-reduces): a TP2 decodes 2n requests faster than its
 * halves decode n each up to n = 5 (25 ms against 30), more slowly beyond. */
static double decode_cost_step(void *ctx, int32_t tp, int transforming, const gy_sim_step_shape *s) {
    (void)ctx;
    (void)transforming;
    return 0.02 / tp + 0.002 * (double)s->n_seqs * (tp > 1 ? 0.75 * tp : 1.0);
}

GYTEST(sim_policy_gyges_latency_mode_weighs_decode_steps) {
    const gy_sim_policy_config cfg = gy_sim_policy_config_default();
    const gy_sim_cost_ops cost = {.step_time = decode_cost_step};
    const int32_t tp1[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    world w;
    gy_sim_decision d;
    /* light load, a request decoding on each TP1: the pairs merge (a TP2 steps 16 ms, its
     * halves 22) */
    world_init(&w, 8, 8, tp1, 8);
    w.v.cost = &cost;
    for (int k = 0; k < 8; k++) {
        w.inst[k].n_running = 1;
        w.inst[k].kv_used = 4;
        set_load(&w, k, 0, 50);
    }
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 4 && has_op(&d, GY_SIM_OP_MERGE, 0, 2) && has_op(&d, GY_SIM_OP_MERGE, 6, 2));
    /* 12 decoding on each (a TP2 would step 82 ms against its halves' 44): no merge; without a
     * cost model in the view, the pairs merge as before */
    for (int k = 0; k < 8; k++) w.inst[k].n_running = 12;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    w.v.cost = NULL;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 4);
    /* TP2s at the base (light load) that no request needs: kept while their decode steps beat
     * their halves', held and split once they do not (their requests fit the halves) */
    const int32_t tp2[4] = {2, 2, 2, 2};
    world_init(&w, 8, 8, tp2, 4);
    w.v.cost = &cost;
    for (int k = 0; k < 4; k++) {
        w.inst[k].n_running = 2;
        w.inst[k].kv_used = w.inst[k].footprint = w.inst[k].max_footprint = 8;
        set_load(&w, k, 0, 100);
    }
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    w.inst[1].n_running = 24;
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 2 && has_op(&d, GY_SIM_OP_HOLD, 2, 2) && has_op(&d, GY_SIM_OP_SPLIT, 2, 2));
    w.inst[1].max_min_tp = 2; /* a request needs the TP2: it stays */
    CHECK_OK(gy_sim_policy_gyges.rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
}

GYTEST(sim_policy_gyges_waits_for_room_rather_than_scale_beyond_the_cap) {
    gy_sim_policy_config cfg = gy_sim_policy_config_default(); /* scale_up_cap 0.5 */
    world w;
    const int32_t tps[] = {4, 1, 1, 1, 1};
    world_init(&w, 8, 8, tps, 5);
    /* the TP4 is full of a long request; a second one would need GPUs 4..7 at TP4 as well */
    w.inst[0].footprint = w.inst[0].max_footprint = 500;
    w.inst[0].max_min_tp = 4;
    gy_sim_req_view r = req(400, 4);
    gy_sim_decision d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 0 && d.n_ops == 0);
    /* once it has waited merge_wait it queues on the TP4, which admits in order: requests
     * placed there later no longer take the room it waits for */
    w.v.now = cfg.merge_wait;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 0 && d.n_ops == 0);
    w.inst[0].held = 1; /* draining towards a split: not there */
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 0 && d.n_ops == 0);
    w.inst[0].held = 0;
    w.v.now = 0;
    /* room frees on the TP4: it goes there */
    w.inst[0].footprint = 100;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 0);
    /* with the cap lifted, the full TP4 no longer stops a second scale-up */
    w.inst[0].footprint = 500;
    cfg.scale_up_cap = 1.0;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 4 && d.group.size == 4);
    CHECK(has_op(&d, GY_SIM_OP_MERGE, 4, 2) && has_op(&d, GY_SIM_OP_MERGE, 6, 2));
}

GYTEST(sim_policy_gyges_places_a_short_request_where_its_kv_has_room_first) {
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    world w;
    const int32_t tps[] = {1, 1, 2, 4};
    world_init(&w, 8, 8, tps, 4);
    set_load(&w, 0, 0, 0);     /* prefills soonest, but its KV is committed to others */
    w.inst[0].footprint = 80;
    set_load(&w, 1, 500, 0);
    set_load(&w, 2, 5000, 0);
    set_load(&w, 3, 10000, 0);
    gy_sim_req_view r = req(30, 1);
    gy_sim_decision d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 1);
    /* no room anywhere (a memory burst): it waits for the TP1 pair to merge, whose TP2 holds
     * more than the two (the cap on TP > 1 does not hold it back: no TP1 has room for it) */
    w.inst[1].footprint = 90;
    w.inst[2].footprint = 240;
    w.inst[3].footprint = 590;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 0 && d.group.size == 2 &&
          has_op(&d, GY_SIM_OP_MERGE, 0, 2));
    /* nothing to merge (TP1 is the largest): where it is prefilled soonest, as before */
    w.v.max_tp = 1;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 0);
}

GYTEST(sim_policy_gyges_cap_follows_the_long_share_of_the_work) {
    gy_sim_policy_config cfg = gy_sim_policy_config_default(); /* scale_up_cap 0.5 */
    world w;
    const int32_t tps[] = {4, 1, 1, 1, 1};
    world_init(&w, 8, 8, tps, 5);
    w.inst[0].footprint = w.inst[0].max_footprint = 500; /* a full TP4 */
    w.inst[0].max_min_tp = 4;
    struct { double t, long_tokens, all_tokens; } state = {0, 0, 0}; /* gyges_state */
    CHECK(gy_sim_policy_gyges.state_size == sizeof state);
    /* short requests were most of the prompt tokens: the cap holds the second TP4 back */
    gy_sim_req_view shorts = req(100, 1);
    for (int k = 0; k < 10; k++) place(&gy_sim_policy_gyges, &state, &cfg, &w, &shorts);
    gy_sim_req_view r = req(400, 4);
    gy_sim_decision d = place(&gy_sim_policy_gyges, &state, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 0 && d.n_ops == 0);
    /* a deferred request is not counted again */
    const double all = state.all_tokens;
    r.deferred = 1;
    place(&gy_sim_policy_gyges, &state, &cfg, &w, &r);
    CHECK(state.all_tokens == all);
    r.deferred = 0;
    /* long prompts became most of the work (6 of 7 tokens): the GPUs at TP > 1 may follow */
    for (int k = 0; k < 20; k++) d = place(&gy_sim_policy_gyges, &state, &cfg, &w, &r);
    CHECK(state.long_tokens / state.all_tokens > 0.75);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 4 && d.group.size == 4);
    /* the mix decays: 10 minutes later a burst of short requests is the recent work */
    w.v.now = r.arrival = 600;
    for (int k = 0; k < 10; k++) place(&gy_sim_policy_gyges, &state, &cfg, &w, &shorts);
    d = place(&gy_sim_policy_gyges, &state, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 0 && d.n_ops == 0);
}

/* A replicated cluster of 8 GPUs (DP units of TP1, 100 blocks each; a bound group pools its
 * members' blocks): instances of `tps`, those above TP1 bound. */
static void replicated_world(world *w, const int32_t *tps, int n) {
    world_init(w, 8, 8, tps, n);
    w->v.replicated = 1;
    w->v.base_tp = 1;
    const int64_t pooled[] = {100, 200, 400, 800};
    memcpy(w->capacity, pooled, sizeof pooled);
    for (int k = 0; k < n; k++) {
        w->inst[k].kv_total = 100 * tps[k];
        w->inst[k].bound = tps[k] > 1;
    }
}

GYTEST(sim_policy_loongserve_decisions) {
    const gy_sim_policy_ops *p = gy_sim_policy_find("loongserve");
    CHECK(p != NULL && p->monitor);
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    const int32_t dp[] = {1, 1, 1, 1, 1, 1, 1, 1};
    world w;
    replicated_world(&w, dp, 8);
    for (int k = 0; k < 8; k++) set_load(&w, k, 100 + k, 0);
    /* a short prompt: the least-loaded instance */
    gy_sim_req_view r = req(50, 1);
    gy_sim_decision d = place(p, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 0 && d.n_ops == 0);
    set_load(&w, 0, 1000, 0);
    d = place(p, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 1);
    /* KV beyond one instance, a short prompt: only a pair, which binds */
    r = req(150, 2);
    d = place(p, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 2 &&
          has_op(&d, GY_SIM_OP_BIND, d.group.gpu_first, 2) && d.n_ops == 1);
    /* a long prompt, every instance idle: the whole host binds, its prefill 8x as fast */
    cfg.sp_min_prompt = 500;
    for (int k = 0; k < 8; k++) set_load(&w, k, 0, 0);
    r = req(50, 1);
    d = place(p, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 0 && d.group.size == 8 &&
          has_op(&d, GY_SIM_OP_BIND, 0, 8));
    /* the second half busy with prompts of its own: the idle quartet ends it sooner */
    for (int k = 4; k < 8; k++) set_load(&w, k, 10000, 0);
    d = place(p, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 0 && d.group.size == 4);
    cfg = gy_sim_policy_config_default();
    /* a request deferred on a group that has bound goes there */
    const int32_t bound[] = {2, 1, 1, 1, 1, 1, 1};
    replicated_world(&w, bound, 7);
    r = req(150, 2);
    r.deferred = 1;
    r.group = (gy_sim_group){.gpu_first = 0, .size = 2};
    d = place(p, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 0);
    /* scale-down: released once its prompts are done and its requests fit the members */
    w.inst[0].n_requests = 2;
    w.inst[0].footprint = 120;
    w.inst[0].max_footprint = 70;
    set_load(&w, 0, 20000, 100);
    CHECK_OK(p->rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0); /* a long prompt still prefilling */
    set_load(&w, 0, 0, 100);
    CHECK_OK(p->rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_RELEASE, 0, 2));
    w.inst[0].max_footprint = 110; /* one fits no member: multi-master decoding goes on */
    CHECK_OK(p->rebalance(NULL, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    w.inst[0].n_requests = 0; /* empty: released */
    CHECK_OK(p->rebalance(NULL, &cfg, &w.v, &d));
    CHECK(has_op(&d, GY_SIM_OP_RELEASE, 0, 2));
}

GYTEST(sim_policy_seesaw_decisions) {
    const gy_sim_policy_ops *p = gy_sim_policy_find("seesaw");
    CHECK(p != NULL && p->monitor && p->state_size > 0);
    void *st = calloc(1, p->state_size);
    CHECK(st != NULL);
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    const int32_t dp[] = {1, 1, 1, 1, 1, 1, 1, 1};
    world w;
    world_init(&w, 8, 8, dp, 8);
    for (int k = 0; k < 8; k++) set_load(&w, k, 0, 100 - k);
    /* prefill phase: a short request goes to a TP1 with room, the least loaded */
    gy_sim_req_view r = req(30, 1);
    gy_sim_decision d = place(p, st, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 7);
    w.inst[7].footprint = 90; /* no room there now: the next least loaded */
    d = place(p, st, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 6);
    /* settled in its prefill phase: its TP1s are asked once to park (Seesaw's host buffer) */
    for (int k = 0; k < 8; k++) w.inst[k].n_requests = 3;
    set_load(&w, 3, 500, 100);
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d));
    CHECK(d.n_ops == 8 && has_op(&d, GY_SIM_OP_PARK, 0, 1) && has_op(&d, GY_SIM_OP_PARK, 7, 1));
    for (int k = 0; k < 8; k++) w.inst[k].prefill_only = 1; /* (the executor did) */
    /* parked, a TP1 needs room for the prompt only: instance 7 again (it has committed 90 of
     * its 100 blocks, but holds 5), and the unit gathers what its TP8 holds (1300 blocks) */
    w.inst[7].kv_used = 5;
    d = place(p, st, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 7);
    w.inst[0].footprint = 1300 - 90 - 30 + 1;
    d = place(p, st, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.blocked);
    w.inst[0].footprint = 0;
    /* a prompt still to prefill: the unit stays as it is (and is not asked to park again) */
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    for (int k = 0; k < 8; k++) w.inst[k].prefill_only = 0;
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    for (int k = 0; k < 8; k++) w.inst[k].prefill_only = 1;
    /* every prompt prefilled, but fewer requests than GPUs: not worth a re-sharding, so its
     * instances take their parked requests back and decode them (else they would wait for a
     * decode phase that does not come) */
    set_load(&w, 3, 0, 100);
    for (int k = 0; k < 8; k++) w.inst[k].n_requests = k < 7;
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d));
    CHECK(d.n_ops == 8 && has_op(&d, GY_SIM_OP_UNPARK, 0, 1) && has_op(&d, GY_SIM_OP_UNPARK, 7, 1));
    CHECK(!has_op(&d, GY_SIM_OP_MERGE, 0, 2));
    /* a batch of a request a GPU or more: the pairs merge towards one TP8 */
    for (int k = 0; k < 8; k++) w.inst[k].n_requests = 3;
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d));
    CHECK(d.n_ops == 4 && has_op(&d, GY_SIM_OP_MERGE, 0, 2) && has_op(&d, GY_SIM_OP_MERGE, 6, 2));
    /* ... and new requests wait at the cluster meanwhile, blocked */
    d = place(p, st, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.blocked && d.n_ops == 0);
    /* decode phase at TP8 (24 requests when it began): prompts wait, it keeps decoding ... */
    const int32_t one[] = {8};
    world_init(&w, 8, 8, one, 1);
    w.v.n_deferred = 3;
    w.inst[0].n_requests = 13;
    w.inst[0].footprint = w.inst[0].max_footprint = 30;
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d));
    CHECK(d.n_ops == 0);
    /* ... until its batch has halved: it splits, its requests along */
    w.inst[0].n_requests = 12;
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d));
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_SPLIT, 0, 8));
    /* back in the prefill phase, halfway down (TP4 pair): no placement until it has settled */
    const int32_t half[] = {4, 4};
    world_init(&w, 8, 8, half, 2);
    d = place(p, st, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.blocked);
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d));
    CHECK(d.n_ops == 2 && has_op(&d, GY_SIM_OP_SPLIT, 0, 4) && has_op(&d, GY_SIM_OP_SPLIT, 4, 4));
    /* a request no TP1 holds, no room anywhere: the pair around the least loaded merges */
    world_init(&w, 8, 8, dp, 8);
    for (int k = 0; k < 8; k++) set_load(&w, k, 100 + k, 0);
    r = req(200, 2);
    d = place(p, st, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 0 && d.group.size == 2 &&
          has_op(&d, GY_SIM_OP_MERGE, 0, 2));
    /* decode_tp 2 (its search's pick): units of two GPUs, each gathered pair merges on its
     * own, and a request that needs TP4 is beyond every unit */
    cfg.decode_tp = 2;
    memset(st, 0, p->state_size);
    world_init(&w, 8, 8, dp, 8);
    for (int k = 0; k < 8; k++) w.inst[k].n_requests = k < 2 ? 1 : 0;
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d)); /* (the other units park) */
    CHECK(d.n_ops == 7 && has_op(&d, GY_SIM_OP_MERGE, 0, 2) && has_op(&d, GY_SIM_OP_PARK, 2, 1) &&
          !has_op(&d, GY_SIM_OP_PARK, 0, 1));
    r = req(200, 4);
    d = place(p, st, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_REJECT);
    /* weights that no TP1 holds (capacity 0 at TP1): the prefill phase is 4xTP2, its short
     * requests go there, its TP2s park, and it merges into the TP8 */
    cfg.decode_tp = 0;
    memset(st, 0, p->state_size);
    const int32_t tp2s[] = {2, 2, 2, 2};
    world_init(&w, 8, 8, tp2s, 4);
    w.capacity[0] = 0;
    for (int k = 0; k < 4; k++) set_load(&w, k, 50, 10 * k);
    r = req(30, 2);
    d = place(p, st, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 0);
    for (int k = 0; k < 4; k++) w.inst[k].n_requests = 2;
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d));
    CHECK(d.n_ops == 4 && has_op(&d, GY_SIM_OP_PARK, 0, 2) && has_op(&d, GY_SIM_OP_PARK, 6, 2));
    for (int k = 0; k < 4; k++) {
        w.inst[k].prefill_only = 1;
        set_load(&w, k, 0, 10);
    }
    CHECK_OK(p->rebalance(st, &cfg, &w.v, &d));
    CHECK(d.n_ops == 2 && has_op(&d, GY_SIM_OP_MERGE, 0, 4) && has_op(&d, GY_SIM_OP_MERGE, 4, 4));
    free(st);
}

GYTEST(sim_policy_gyges_says_when_a_request_is_blocked) {
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    world w;
    const int32_t tps[] = {4, 4};
    world_init(&w, 8, 8, tps, 2);
    /* both TP4s committed in full: a TP4-sized request has no room and no group */
    w.inst[0].footprint = w.inst[1].footprint = 600;
    gy_sim_req_view r = req(400, 4);
    r.deferred = 1;
    gy_sim_decision d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 0 && d.n_ops == 0 && d.blocked);
    /* room on one: placed, not blocked */
    w.inst[1].footprint = 100;
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && !d.blocked);
    /* short requests with everything splitting: blocked too */
    w.inst[0].placeable = w.inst[1].placeable = 0;
    gy_sim_req_view s = req(10, 1);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &s);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.blocked);
    /* a scale-up it waits for is not blocked */
    const int32_t ones[] = {1, 1, 1, 1, 1, 1, 1, 1};
    world_init(&w, 8, 8, ones, 8);
    gy_sim_req_view big = req(200, 2);
    d = place(&gy_sim_policy_gyges, NULL, &cfg, &w, &big);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 2 && !d.blocked);
}


/* ---- Flying Serving: bind and release on a replicated cluster ---- */

/* A priority request binds the pair at once (hard): the DP request there pauses with its KV,
 * gains no token while the pair serves the priority one, and resumes without recompute after
 * the release. */
GYTEST(sim_flying_hard_bind_pauses_and_release_resumes) {
    const double arr[] = {0.0, 1.0};
    const int64_t in[] = {10, 10}, out[] = {200, 20};
    const int32_t prio[] = {0, 1}, layout[] = {1, 1};
    const int64_t cap[] = {100, 200};
    gy_sim_cost_constant cc = {.step_time = 0.05, .phase_time = 0.3, .transform_slowdown = 0};
    gy_sim_policy_config pc = gy_sim_policy_config_default();
    pc.light_load = 0; /* never light: only the priority request binds */
    gy_sim_config c = {
        .hosts = 1, .gpus_per_host = 2, .max_tp = 2, .n_layout = 2, .layout = layout,
        .capacity = cap, .capacity_mid = cap,
        .sched = {.block_size = 4, .max_batch_tokens = 64, .max_running = 8, .watermark = 0},
        .cost = gy_sim_cost_constant_ops(&cc), .policy = gy_sim_policy_find("flying"),
        .policy_config = pc, .sample_interval = 0.5, .record_tokens = 1, .replicated = 1,
        .switch_time = 0.015};
    gy_sim_trace tr = {.n = 2, .arrival = arr, .input_tokens = in, .output_tokens = out,
                       .priority = prio};
    gy_sim *s = NULL;
    CHECK_OK(gy_sim_init(&s, &c, &tr));
    for (double until = 0.5; until < 100; until += 0.5) {
        CHECK_OK(gy_sim_run(s, until));
        CHECK_OK(gy_sim_check(s));
    }
    gy_sim_stats st;
    gy_sim_stats_get(s, &st);
    CHECK(st.done && st.n_finished == 2 && st.n_binds == 1 && st.n_releases == 1 &&
          st.n_paused == 1 && st.n_recomputed == 0 && st.n_preemptions == 0);
    int64_t n = 0, n_tok = 0;
    const gy_sim_request_out *o = gy_sim_requests(s, &n);
    CHECK(o[1].tp == 2 && o[0].tp == 1 && o[0].preemptions == 0);
    int64_t n_xf = 0;
    const gy_sim_transform_out *x = gy_sim_transforms(s, &n_xf);
    CHECK(n_xf == 2 && x[0].kind == GY_SIM_OP_BIND && x[1].kind == GY_SIM_OP_RELEASE &&
          x[0].kv_bytes == 0 && x[0].weight_bytes == 0 && x[0].end - x[0].start >= 0.015);
    /* bound from the bind's end to the release's: the pair serves the priority request alone */
    CHECK(x[0].end <= o[1].first_token && o[1].finish <= x[1].start);
    const gy_sim_token *tok = gy_sim_tokens(s, &n_tok);
    int64_t during = 0, total0 = 0;
    for (int64_t k = 0; k < n_tok; k++) {
        if (tok[k].request != 0) continue;
        total0++;
        during += tok[k].time > x[0].end && tok[k].time <= x[1].end;
    }
    CHECK(total0 == 200 && during == 0);
    CHECK(o[0].finish > o[1].finish && o[1].first_token >= 1.0 + 0.015);
    gy_sim_free(s);
}

/* The flying policy on hand-built replicated views (8 GPUs, DP units of TP1). */
GYTEST(sim_policy_flying_decisions) {
    const gy_sim_policy_ops *p = gy_sim_policy_find("flying");
    CHECK(p != NULL);
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    const int32_t dp[] = {1, 1, 1, 1, 1, 1, 1, 1};
    world w;
    replicated_world(&w, dp, 8);
    /* a request no DP unit holds, all idle: waits on a pair that binds at once */
    gy_sim_req_view r = req(150, 2);
    gy_sim_decision d = place(p, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 2 &&
          has_op(&d, GY_SIM_OP_BIND, d.group.gpu_first, 2));
    /* the same with busy members: they are held to drain, no bind yet */
    for (int k = 0; k < 8; k++) {
        w.inst[k].n_requests = 3;
        set_load(&w, k, 0, 5000);
    }
    d = place(p, NULL, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 2 &&
          !has_op(&d, GY_SIM_OP_BIND, d.group.gpu_first, 2) &&
          has_op(&d, GY_SIM_OP_HOLD, d.group.gpu_first, 1) &&
          has_op(&d, GY_SIM_OP_HOLD, d.group.gpu_first + 1, 1));
    /* a heavy load: a short request goes to the least-loaded DP unit, not as TP work */
    set_load(&w, 5, 0, 10);
    gy_sim_req_view small = req(10, 1);
    d = place(p, NULL, &cfg, &w, &small);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 5 && !d.tp_work && d.n_ops == 0);
    /* a priority request binds half a host now (hard), pausing the members' work */
    small.priority = 1;
    d = place(p, NULL, &cfg, &w, &small);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.size == 4 &&
          has_op(&d, GY_SIM_OP_BIND, d.group.gpu_first, 4));
    small.priority = 0;
    /* light load with a bound quartet that has room: TP work there */
    const int32_t mixed[] = {4, 1, 1, 1, 1};
    replicated_world(&w, mixed, 5);
    d = place(p, NULL, &cfg, &w, &small);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 0 && d.tp_work);
    /* a burst: the quartet goes back to DP at once (its requests fit DP units), the request DP */
    for (int k = 0; k < 5; k++) set_load(&w, k, 0, 100000);
    w.inst[0].n_requests = 4;
    w.inst[0].max_min_tp = 1;
    w.inst[1].n_waiting = 2; /* a queue on a DP unit */
    d = place(p, NULL, &cfg, &w, &small);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target >= 1 && !d.tp_work &&
          has_op(&d, GY_SIM_OP_RELEASE, 0, 4));
    /* ... unless it serves a long request: then it drains (held) */
    w.inst[0].max_min_tp = 2;
    d = place(p, NULL, &cfg, &w, &small);
    CHECK(!has_op(&d, GY_SIM_OP_RELEASE, 0, 4) && has_op(&d, GY_SIM_OP_HOLD, 0, 4));
    /* rebalance: a held, drained pair a request waits for binds */
    replicated_world(&w, dp, 8);
    w.inst[2].held = w.inst[3].held = 1;
    w.pending[0] = (gy_sim_group){.gpu_first = 2, .size = 2, .footprint = 150};
    w.v.n_pending = 1;
    w.v.n_deferred = 1;
    CHECK_OK(p->rebalance(NULL, &cfg, &w.v, &d));
    CHECK(has_op(&d, GY_SIM_OP_BIND, 2, 2));
    w.inst[3].n_requests = 1; /* not drained yet: no bind */
    CHECK_OK(p->rebalance(NULL, &cfg, &w.v, &d));
    CHECK(!has_op(&d, GY_SIM_OP_BIND, 2, 2));
}

/* KunServe's Algorithm 1: 8 instances, R = P gives one pair, R = 5P gives {4, 2, 2}; 8P is
 * unmet even with one group (it frees 7P). */
GYTEST(sim_buddy_plans) {
    int32_t g[8], met = 0;
    double freed = 0;
    CHECK_OK(gy_buddy_plan(8, 1.0, 1.0, GY_BUDDY_THROUGHPUT, 0, g, &met, &freed));
    CHECK(met && freed == 1.0 && g[0] == 0 && g[1] == 0 && g[2] == 1 && g[7] == 6);
    CHECK_OK(gy_buddy_plan(8, 5.0, 1.0, GY_BUDDY_THROUGHPUT, 0, g, &met, &freed));
    const int32_t want[] = {0, 0, 0, 0, 1, 1, 2, 2};
    CHECK(met && freed == 5.0 && memcmp(g, want, sizeof want) == 0);
    CHECK_OK(gy_buddy_plan(8, 8.0, 1.0, GY_BUDDY_THROUGHPUT, 0, g, &met, &freed));
    CHECK(!met && freed == 7.0 && g[7] == 0);
    CHECK_OK(gy_buddy_plan(8, 6.0, 1.0, GY_BUDDY_MEMORY, 4.5, g, &met, &freed));
    CHECK(!met && freed == 4.0 && g[4] == 0 && g[5] == 1);
    CHECK_STATUS(gy_buddy_plan(0, 1.0, 1.0, GY_BUDDY_THROUGHPUT, 0, g, &met, &freed),
                 GY_ERR_INVALID);
    CHECK_STATUS(gy_buddy_plan(8, 1.0, 0.0, GY_BUDDY_THROUGHPUT, 0, g, &met, &freed),
                 GY_ERR_INVALID);
    CHECK_STATUS(gy_buddy_plan(8, 1.0, 1.0, 7, 0, g, &met, &freed), GY_ERR_INVALID);
}

/* ---- pipelines (PipeLive) ---- */

/* Two heterogeneous stages over 10 layers: stage 0 has the bandwidth and the memory, stage 1
 * the FLOPs. W = 1 GB a layer, 1000 bytes of KV a token a layer, blocks of 16 tokens:
 * P = 16000 bytes a block a layer. */
static gy_sim_pipeline test_pipeline(void) {
    gy_sim_pipeline p = {
        .n_stages = 2, .n_layers = 10,
        .stage = {{.budget_bytes = 10e9, .hbm_bw = 2e12, .peak_flops = 300e12, .eff_bw = 0.5,
                   .eff_flops = 0.5},
                  {.budget_bytes = 6e9, .hbm_bw = 1e12, .peak_flops = 400e12, .eff_bw = 0.5,
                   .eff_flops = 0.5}},
        .layer_bytes = 1e9, .layer_params = 0.5e9, .attn_flops_per_pair = 1000, .kv_layer = 1000,
        .lm_head_params = 1e8, .head_bytes = 2e8, .act_bytes = 1000, .link_bw = 10e9,
        .link_latency = 1e-5, .eff_xfer = 0.5, .step_overhead = 1e-3, .transform_slowdown = 0.1,
        .stop_time = 0.01, .block_size = 16, .fixed_blocks = 0};
    return p;
}

static int near(double a, double b) { return fabs(a - b) <= 1e-12 * fabs(b) + 1e-15; }

GYTEST(sim_pipeline_step_time_and_capacity_by_hand) {
    gy_sim_pipeline p = test_pipeline();
    CHECK_OK(gy_sim_pipeline_check(&p));
    const int32_t a[2] = {6, 4}, b[2] = {7, 3}, c[2] = {4, 6}, bad[2] = {6, 5};
    CHECK(gy_sim_pipeline_split_ok(&p, a) && !gy_sim_pipeline_split_ok(&p, bad));
    /* MaxBlocks(0, 6) = floor((10e9 - 6e9) / (6 * 16000)) = 41666; (1, 4): 2e9 / 64000 = 31250 */
    CHECK(gy_sim_pipeline_max_blocks(&p, 0, 6) == 41666);
    CHECK(gy_sim_pipeline_max_blocks(&p, 1, 4) == 31250);
    CHECK(gy_sim_pipeline_capacity(&p, a) == 31250);
    CHECK(gy_sim_pipeline_capacity(&p, b) == 26785); /* 3e9 / 112000 on stage 0 */
    CHECK(gy_sim_pipeline_capacity(&p, c) == 0);     /* 6 layers fill stage 1's 6 GB */
    /* a re-split 6/4 -> 7/3 holds layers 0..6 on stage 0 meanwhile: MaxBlocks(0, 7) */
    CHECK(gy_sim_pipeline_shrink_capacity(&p, a, b) == 26785);
    CHECK(gy_sim_pipeline_shrink_capacity(&p, a, c) == 0); /* stage 1 would hold 6 */
    /* decode of 4 requests (1000 keys read): stage 0 memory-bound 6 (1e9 + 1000 * 1004) /
     * 1e12 = 6.006024 ms, stage 1 (4 (1e9 + 1004000) + 2e8) / 5e11 = 8.408032 ms, one hand-off
     * 4 * 1000 / 1e10 + 1e-5 s, overhead 1 ms */
    const gy_sim_step_shape dec = {.n_tokens = 4, .n_seqs = 4, .n_samples = 4,
                                   .kv_read_tokens = 1000, .attn_pairs = 1000};
    CHECK(near(gy_sim_pipeline_step_time(&p, a, 0, &dec),
               1e-3 + 6.006024e-3 + 8.408032e-3 + 1.04e-5));
    CHECK(near(gy_sim_pipeline_step_time(&p, a, 1, &dec),
               1.1 * (1e-3 + 6.006024e-3 + 8.408032e-3 + 1.04e-5)));
    /* prefill of 1000 tokens: compute-bound, stage 0 6 (1e12 + 1000 * 500500) / 1.5e14,
     * stage 1 (4 (1e12 + 5.005e8) + 2e8) / 2e14 */
    const gy_sim_step_shape pf = {.n_tokens = 1000, .n_seqs = 1, .n_samples = 1,
                                  .kv_read_tokens = 1000, .attn_pairs = 500500};
    CHECK(near(gy_sim_pipeline_step_time(&p, a, 0, &pf),
               1e-3 + 0.04002002 + 0.02001101 + 1.1e-4));
    const gy_sim_step_shape none = {0};
    CHECK(gy_sim_pipeline_step_time(&p, a, 0, &none) == 0.0);
    /* 6/4 -> 7/3: stage 0 receives layer 6 (1 GB) and its KV of 1e5 tokens (1e8 B) at 5 GB/s */
    double wb = 0, kb = 0;
    CHECK(near(gy_sim_pipeline_migration_time(&p, a, b, 1e5, &wb, &kb), 0.22));
    CHECK(wb == 1e9 && kb == 1e8);
    /* without KV resizing every split keeps fixed_blocks, or none when they do not fit */
    p.fixed_blocks = 30000;
    CHECK(gy_sim_pipeline_capacity(&p, a) == 30000 && gy_sim_pipeline_capacity(&p, b) == 0);
    CHECK(gy_sim_pipeline_max_capacity(&p) == 30000);
    /* the splits at granularity 2: 2/8, 4/6, 6/4, 8/2 */
    int32_t s[2] = {0}, n = 0, firsts[4];
    while (gy_sim_pipeline_next_split(&p, 2, s)) {
        CHECK(s[0] + s[1] == 10 && n < 4);
        if (n < 4) firsts[n] = s[0];
        n++;
    }
    CHECK(n == 4 && firsts[0] == 2 && firsts[3] == 8);
    p.stage[1].eff_bw = 0;
    CHECK_STATUS(gy_sim_pipeline_check(&p), GY_ERR_INVALID);
}

/* A scripted policy: every request to instance 0 (or it waits), and on the arrival of request
 * id k a RESPLIT to script_layers[k] when script_layers[k][0] > 0. */
static int32_t script_layers[8][2];

static gy_status script_place(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                              const gy_sim_req_view *r, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    d->action = gy_sim_policy_fits(&v->inst[0], r) ? GY_SIM_ACTION_PLACE : GY_SIM_ACTION_DEFER;
    d->target = 0;
    if (!r->deferred && r->id < 8 && script_layers[r->id][0] > 0) {
        d->ops[0] = (gy_sim_op){.kind = GY_SIM_OP_RESPLIT, .gpu_first = 0, .size = 2,
                                .layers = {script_layers[r->id][0], script_layers[r->id][1]}};
        d->n_ops = 1;
    }
    return GY_OK;
}

static const gy_sim_policy_ops script_policy = {.name = "script", .place = script_place};

static gy_sim_config pipeline_config(const gy_sim_pipeline *p, const int32_t *split,
                                     const gy_sim_policy_ops *policy) {
    return (gy_sim_config){
        .hosts = 1, .gpus_per_host = 2, .max_tp = 1,
        .sched = {.block_size = p->block_size, .max_batch_tokens = 2048, .max_running = 64,
                  .watermark = 0.0},
        .policy = policy, .policy_config = gy_sim_policy_config_default(),
        .sample_interval = 1.0, .pipeline = p, .pipe_layers = split};
}

GYTEST(sim_pipeline_resplit_cost_and_refusal) {
    /* 1 MB of KV a token a layer, blocks of 4: 6/4 holds min(4e9 / 24e6, 2e9 / 16e6) = 125
     * blocks, 7/3 holds 107; 7/3 -> 8/2 has B_shrink MaxBlocks(0, 8) = 62 */
    gy_sim_pipeline p = test_pipeline();
    p.kv_layer = 1e6;
    p.block_size = 4;
    const int32_t first[2] = {6, 4}, b[2] = {7, 3}, e[2] = {8, 2};
    CHECK(gy_sim_pipeline_capacity(&p, first) == 125 && gy_sim_pipeline_capacity(&p, b) == 107);
    CHECK(gy_sim_pipeline_shrink_capacity(&p, b, e) == 62);
    memset(script_layers, 0, sizeof script_layers);
    script_layers[1][0] = 7, script_layers[1][1] = 3; /* idle: starts */
    script_layers[3][0] = 8, script_layers[3][1] = 2; /* 75+ blocks in use: refused */
    script_layers[4][0] = 8, script_layers[4][1] = 2; /* idle again: starts */
    double arr[5] = {0, 100, 200, 200.05, 300};
    int64_t in[5] = {8, 8, 300, 8, 8}, out[5] = {2, 2, 20, 2, 2};
    gy_sim_trace tr = {.n = 5, .arrival = arr, .input_tokens = in, .output_tokens = out};
    gy_sim_config c = pipeline_config(&p, first, &script_policy);
    gy_sim *s = NULL;
    CHECK_OK(gy_sim_init(&s, &c, &tr));
    CHECK_OK(gy_sim_run(s, 150.0));
    CHECK_OK(gy_sim_check(s));
    int64_t nx = 0;
    const gy_sim_transform_out *x = gy_sim_transforms(s, &nx);
    CHECK(nx == 1 && x[0].kind == GY_SIM_OP_RESPLIT);
    CHECK(x[0].layers_from[0] == 6 && x[0].layers_to[0] == 7 && x[0].layers_to[1] == 3);
    /* nothing live: one layer's weights, 1 GB at 10 GB/s * 0.5 = 0.2 s, then the 10 ms stop */
    CHECK(x[0].weight_bytes == 1e9 && x[0].kv_bytes == 0);
    CHECK(near(x[0].phase_end - x[0].start, 0.2) && near(x[0].end - x[0].phase_end, 0.01));
    gy_sim_stats st;
    gy_sim_stats_get(s, &st);
    CHECK(st.n_resplits == 1 && near(st.resplit_migration_s, 0.2) &&
          near(st.resplit_stop_s, 0.01));
    CHECK_OK(gy_sim_run(s, 250.0));
    CHECK_OK(gy_sim_check(s));
    gy_sim_stats_get(s, &st);
    x = gy_sim_transforms(s, &nx);
    CHECK(nx == 1 && st.n_resplits == 1 && st.n_ops_refused == 1); /* refused, nothing moved */
    int64_t ns = 0;
    const gy_sim_sample *sm = gy_sim_samples(s, &ns);
    CHECK(ns > 0 && sm[ns - 1].kv_total == 107 && sm[ns - 1].xform == GY_SIM_XFORM_NONE);
    CHECK_OK(gy_sim_run(s, INFINITY));
    CHECK_OK(gy_sim_check(s));
    gy_sim_stats_get(s, &st);
    CHECK(st.done && st.n_finished == 5 && st.n_resplits == 2 && st.n_ops_refused == 1);
    gy_sim_free(s);
    /* a split that does not fit, and a TP op on a pipeline cluster, are refused too */
    const int32_t bad[2] = {4, 6};
    c.pipe_layers = bad;
    CHECK_STATUS(gy_sim_init(&s, &c, &tr), GY_ERR_INVALID);
    c.pipe_layers = first;
    c.gpus_per_host = 4;
    CHECK_STATUS(gy_sim_init(&s, &c, &tr), GY_ERR_INVALID);
    CHECK(s == NULL);
}

GYTEST(sim_pipelive_random_run_loses_no_request) {
    /* stage 0 decodes faster, stage 1 (twice the FLOPs here) prefills faster: the mix decides
     * the split (6/4 or 8/2 at two-layer granularity; 2/8 and 4/6 do not fit stage 1) */
    gy_sim_pipeline p = test_pipeline();
    p.stage[1].peak_flops = 800e12;
    const int32_t first[2] = {6, 4};
    for (uint64_t seed = 1; seed <= 3; seed++) {
        const int64_t n = 300;
        double *arr = malloc((size_t)n * sizeof *arr);
        int64_t *in = malloc((size_t)n * sizeof *in), *out = malloc((size_t)n * sizeof *out);
        uint64_t state = seed;
        double t = 0;
        for (int64_t k = 0; k < n; k++) {
            t += (double)(lcg(&state) % 1000) / 1000.0; /* ~2 requests/s */
            arr[k] = t;
            const int prefill_phase = ((int64_t)(t / 30.0)) % 2 == 0; /* 30 s phases */
            in[k] = prefill_phase ? 400 + (int64_t)(lcg(&state) % 200)
                                  : 64 + (int64_t)(lcg(&state) % 128);
            out[k] = prefill_phase ? 1 + (int64_t)(lcg(&state) % 32)
                                   : 256 + (int64_t)(lcg(&state) % 512);
        }
        gy_sim_trace tr = {.n = n, .arrival = arr, .input_tokens = in, .output_tokens = out};
        gy_sim_config c = pipeline_config(&p, first, gy_sim_policy_find("pipelive"));
        gy_sim *s = NULL;
        CHECK_OK(gy_sim_init(&s, &c, &tr));
        gy_sim_stats st;
        for (double until = 0; until < 1e5; until += 3.7) {
            CHECK_OK(gy_sim_run(s, until));
            CHECK_OK(gy_sim_check(s));
            gy_sim_stats_get(s, &st);
            if (st.done) break;
        }
        CHECK(st.done && st.n_finished == n && st.n_rejected == 0 && st.n_deferred == 0);
        CHECK(st.n_resplits >= 2); /* at least there and back */
        int64_t m = 0, tokens = 0;
        const gy_sim_request_out *o = gy_sim_requests(s, &m);
        for (int64_t k = 0; k < m; k++) {
            CHECK(o[k].status == GY_SIM_REQ_FINISHED && o[k].first_token <= o[k].finish);
            tokens += o[k].output_tokens;
        }
        double binned = 0;
        int64_t n_bins = 0;
        const double *bins = gy_sim_bins(s, &n_bins, NULL);
        for (int64_t k = 0; k < n_bins; k++) binned += bins[k];
        CHECK(binned == (double)tokens); /* every output token exactly once */
        gy_sim_free(s);
        free(arr);
        free(in);
        free(out);
    }
}

/* ---- buddy clusters (KunServe) ---- */

/* Two equal stages of 16 GB over 10 layers of 1 GB (1000 bytes of KV a token a layer, blocks
 * of 16): a replica keeps (16e9 - 10e9) / (10 * 16000) = 37500 blocks, a group of two at 5/5
 * (16e9 - 5e9) / (5 * 16000) = 137500. */
static gy_sim_pipeline buddy_pipeline(void) {
    gy_sim_pipeline p = test_pipeline();
    p.stage[0].budget_bytes = p.stage[1].budget_bytes = 16e9;
    p.stage[1] = (gy_sim_pipe_stage){.budget_bytes = 16e9, .hbm_bw = 2e12, .peak_flops = 300e12,
                                     .eff_bw = 0.5, .eff_flops = 0.5};
    p.host_bw = 5e9;
    return p;
}

GYTEST(sim_buddy_costs_by_hand) {
    const gy_sim_pipeline p = buddy_pipeline();
    CHECK_OK(gy_sim_pipeline_check(&p));
    const gy_sim_pipeline one = gy_sim_pipeline_sub(&p, 1);
    int32_t all[1], half[2];
    gy_sim_pipeline_even(&one, all);
    gy_sim_pipeline_even(&p, half);
    CHECK(all[0] == 10 && half[0] == 5 && half[1] == 5);
    CHECK(gy_sim_pipeline_capacity(&one, all) == 37500);
    CHECK(gy_sim_pipeline_capacity(&p, half) == 137500);
    /* exchange: member 0 held 1e5 tokens, member 1 2e5; each sends half its layers' KV and
     * receives the other's: max(5e8, 1e9) B at 10e9 * 0.5 B/s = 0.2 s, 1.5e9 B sent in all */
    const double tokens[2] = {1e5, 2e5};
    double kv = 0, w = 0;
    CHECK(near(gy_sim_pipeline_exchange_time(&p, half, tokens, &kv), 0.2) && kv == 1.5e9);
    /* remote attention: 5 layers, 4 victim tokens: 5 (2 * 4 * 1000 / 1e10 + 2e-5) s */
    CHECK(near(gy_sim_pipeline_remote_time(&p, 5, 4), 5 * (8e-7 + 2e-5)));
    CHECK(gy_sim_pipeline_remote_time(&p, 0, 4) == 0 && gy_sim_pipeline_remote_time(&p, 5, 0) == 0);
    /* restore: 5 GB each, from the peer (5 GB/s) and the host (5 GB/s) at once: 0.5 s */
    CHECK(near(gy_sim_pipeline_restore_time(&p, half, &w), 0.5) && w == 1e10);
    /* gather: member 0's requests (1e5 tokens) lack 5 layers' KV: 5e8 B at 5 GB/s */
    const double packed[2] = {1e5, 0};
    CHECK(near(gy_sim_pipeline_gather_time(&p, half, packed, &kv), 0.1) && kv == 5e8);
}

GYTEST(sim_policy_kunserve_drops_a_group_for_a_request_no_replica_holds) {
    gy_sim_pipeline p = buddy_pipeline(); /* a replica holds 37500 blocks, a pair 137500 */
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    const gy_sim_policy_ops *ks = gy_sim_policy_find("kunserve");
    world w;
    const int32_t tps[] = {1, 1, 1, 1};
    world_init(&w, 4, 4, tps, 4);
    w.v.max_tp = 1;
    w.v.buddy = 1;
    w.v.pipeline = &p;
    for (int k = 0; k < 4; k++) w.inst[k].kv_total = 37500;
    set_load(&w, 0, 5000, 0); /* the least-loaded pair is {1, 2} (any run of one host) */
    set_load(&w, 3, 5000, 0);
    unsigned char state[sizeof(double) * 8192 + 8192];
    CHECK(ks->state_size <= sizeof state);
    memset(state, 0, sizeof state);
    gy_sim_req_view r = req(50000, 0); /* min_tp 0: no replica holds it */
    gy_sim_decision d = place(ks, state, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 1 && d.group.size == 2);
    CHECK(d.n_ops == 1 && has_op(&d, GY_SIM_OP_DROP, 1, 2));
    /* asked again while its pair drops: it keeps waiting for that pair, no second drop */
    w.inst[1].xform = w.inst[2].xform = GY_SIM_XFORM_DROPPING;
    w.inst[1].placeable = w.inst[2].placeable = 0;
    r.deferred = 1;
    r.group = d.group;
    d = place(ks, state, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_DEFER && d.group.gpu_first == 1 && d.n_ops == 0);
    /* the pair is a group now: it goes there */
    const int32_t grouped[] = {1, 2, 1}; /* (the middle one made a 2-stage pipeline below) */
    world_init(&w, 4, 4, grouped, 3);
    w.v.max_tp = 1;
    w.v.buddy = 1;
    w.v.pipeline = &p;
    w.inst[0].kv_total = w.inst[2].kv_total = 37500;
    w.inst[1].tp = 1;
    w.inst[1].n_stages = 2;
    w.inst[1].layers[0] = w.inst[1].layers[1] = 5;
    w.inst[1].kv_total = 137500;
    d = place(ks, state, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_PLACE && d.target == 1);
    /* more than the host's largest group holds: rejected */
    r = req(200000, 0);
    d = place(ks, state, &cfg, &w, &r);
    CHECK(d.action == GY_SIM_ACTION_REJECT);
}

/* A scripted buddy policy: every request to the least-used placeable instance, and on the
 * arrival of request k the op buddy_ops[k] (kind -1: none). */
static gy_sim_op buddy_ops[8];

static gy_status buddy_place(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                             const gy_sim_req_view *r, gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    d->action = GY_SIM_ACTION_DEFER;
    for (int32_t k = 0; k < v->n_inst; k++)
        if (gy_sim_policy_fits(&v->inst[k], r)) {
            d->action = GY_SIM_ACTION_PLACE;
            d->target = k;
            break;
        }
    if (!r->deferred && r->id < 8 && buddy_ops[r->id].kind >= 0) {
        d->ops[0] = buddy_ops[r->id];
        d->n_ops = 1;
    }
    return GY_OK;
}

static const gy_sim_policy_ops buddy_script = {.name = "buddy_script", .place = buddy_place};

GYTEST(sim_buddy_drop_restore_and_refusals) {
    const gy_sim_pipeline p = buddy_pipeline();
    const int32_t even[2] = {5, 5};
    for (int k = 0; k < 8; k++) buddy_ops[k] = (gy_sim_op){.kind = -1};
    buddy_ops[0] = (gy_sim_op){.kind = GY_SIM_OP_DROP, .gpu_first = 0, .size = 2};
    buddy_ops[1] = (gy_sim_op){.kind = GY_SIM_OP_DROP, .gpu_first = 0, .size = 2}; /* a group */
    buddy_ops[2] = (gy_sim_op){.kind = GY_SIM_OP_RESPLIT, .gpu_first = 0, .size = 2,
                               .layers = {6, 4}};                               /* not here */
    buddy_ops[3] = (gy_sim_op){.kind = GY_SIM_OP_RESTORE, .gpu_first = 0, .size = 2};
    buddy_ops[4] = (gy_sim_op){.kind = GY_SIM_OP_RESTORE, .gpu_first = 0, .size = 2}; /* none */
    double arr[5] = {0, 10, 20, 30, 40};
    int64_t in[5] = {8, 8, 8, 8, 8}, out[5] = {2, 2, 2, 2, 2};
    gy_sim_trace tr = {.n = 5, .arrival = arr, .input_tokens = in, .output_tokens = out};
    gy_sim_config c = pipeline_config(&p, even, &buddy_script);
    c.buddy = 1;
    c.buddy_group = 1;
    c.live_restore = 1;
    gy_sim *s = NULL;
    CHECK_OK(gy_sim_init(&s, &c, &tr));
    CHECK_OK(gy_sim_run(s, 5.0));
    CHECK_OK(gy_sim_check(s));
    gy_sim_stats st;
    gy_sim_stats_get(s, &st);
    int64_t nx = 0, ns = 0;
    const gy_sim_transform_out *x = gy_sim_transforms(s, &nx);
    CHECK(nx == 1 && x[0].kind == GY_SIM_OP_DROP && st.n_drops == 1);
    /* request 0 was placed before the drop and started stepping: the switch waits for that
     * step, then it moves in as a victim */
    CHECK(x[0].n_migrated == 1 && x[0].start == 0 && x[0].phase_end > 0 && st.n_victims <= 1);
    const gy_sim_sample *sm = gy_sim_samples(s, &ns);
    CHECK(ns > 0 && sm[ns - 1].kv_total == 137500 && sm[ns - 1].xform == GY_SIM_XFORM_NONE);
    CHECK_OK(gy_sim_run(s, 25.0));
    CHECK_OK(gy_sim_check(s));
    gy_sim_stats_get(s, &st);
    x = gy_sim_transforms(s, &nx);
    CHECK(nx == 1 && st.n_ops_refused == 2); /* the second drop and the re-split: nothing */
    CHECK_OK(gy_sim_run(s, 35.0));
    CHECK_OK(gy_sim_check(s));
    gy_sim_stats_get(s, &st);
    x = gy_sim_transforms(s, &nx);
    /* the restore: 5 GB of weights each over peer + host (0.5 s), then no KV left to gather */
    CHECK(nx == 2 && x[1].kind == GY_SIM_OP_RESTORE && st.n_restores == 1);
    CHECK(x[1].weight_bytes == 1e10 && near(x[1].phase_end - x[1].start, 0.5));
    CHECK(near(st.restore_s, x[1].end - x[1].start) && x[1].end - x[1].start >= 0.5);
    sm = gy_sim_samples(s, &ns);
    CHECK(ns >= 2 && sm[ns - 1].kv_total == 37500 && sm[ns - 2].kv_total == 37500);
    CHECK_OK(gy_sim_run(s, INFINITY));
    CHECK_OK(gy_sim_check(s));
    gy_sim_stats_get(s, &st);
    CHECK(st.done && st.n_finished == 5 && st.n_ops_refused == 3 && st.n_drops == 1);
    gy_sim_free(s);
    /* a buddy cluster starting grouped, and one whose group does not divide the host */
    c.buddy_group = 2;
    CHECK_OK(gy_sim_init(&s, &c, &tr));
    CHECK_OK(gy_sim_run(s, INFINITY));
    CHECK_OK(gy_sim_check(s));
    gy_sim_free(s);
    c.buddy_group = 3;
    s = NULL;
    CHECK_STATUS(gy_sim_init(&s, &c, &tr), GY_ERR_INVALID);
    CHECK(s == NULL);
}

GYTEST(sim_kunserve_random_run_loses_no_request) {
    /* 100 KB of KV a token a layer: a replica keeps 375 blocks, a group of two 1375: a burst of
     * 200-800-token requests overflows the replicas and fits the groups */
    gy_sim_pipeline p = buddy_pipeline();
    p.kv_layer = 1e5;
    const int32_t even[2] = {5, 5};
    for (uint64_t seed = 1; seed <= 3; seed++) {
        const int64_t n = 400;
        double *arr = malloc((size_t)n * sizeof *arr);
        int64_t *in = malloc((size_t)n * sizeof *in), *out = malloc((size_t)n * sizeof *out);
        uint64_t state = seed;
        double t = 0;
        for (int64_t k = 0; k < n; k++) {
            const int burst = t > 20 && t < 25;
            t += (double)(lcg(&state) % 1000) / (burst ? 20000.0 : 1000.0);
            arr[k] = t;
            in[k] = 100 + (int64_t)(lcg(&state) % 400);
            out[k] = 100 + (int64_t)(lcg(&state) % 400);
        }
        gy_sim_trace tr = {.n = n, .arrival = arr, .input_tokens = in, .output_tokens = out};
        gy_sim_config c = pipeline_config(&p, even, gy_sim_policy_find("kunserve"));
        c.hosts = 2;
        c.buddy = 1;
        c.buddy_group = 1;
        c.live_restore = (int32_t)(seed % 2);
        c.sample_interval = 0.5;
        gy_sim *s = NULL;
        CHECK_OK(gy_sim_init(&s, &c, &tr));
        gy_sim_stats st;
        for (double until = 0; until < 1e5; until += 1.3) {
            CHECK_OK(gy_sim_run(s, until));
            CHECK_OK(gy_sim_check(s));
            gy_sim_stats_get(s, &st);
            if (st.done) break;
        }
        CHECK(st.done && st.n_finished == n && st.n_rejected == 0 && st.n_deferred == 0);
        CHECK(st.n_drops >= 1 && st.n_restores == st.n_drops); /* freed, then all given back */
        int64_t ns = 0;
        const gy_sim_sample *sm = gy_sim_samples(s, &ns);
        int64_t most = 0;
        for (int64_t k = 0; k < ns; k++) {
            CHECK(sm[k].kv_total == 375 || sm[k].kv_total == 1375 ||
                  sm[k].xform == GY_SIM_XFORM_RESTORING);
            if (sm[k].kv_total > most) most = sm[k].kv_total;
        }
        CHECK(most == 1375 && sm[ns - 1].kv_total == 375);
        gy_sim_free(s);
        free(arr);
        free(in);
        free(out);
    }
}
