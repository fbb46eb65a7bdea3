/* policy_pipelive.c: PipeLive's reconfiguration in use: a pipeline instance keeps the split of its
 * layers that the cost model (the view's gy_sim_pipeline, pipeline.h) predicts best for the mix
 * of prefill and decode work arriving now, and re-splits (GY_SIM_OP_RESPLIT) when that changes.
 * Requests go to the least-loaded instance that holds them (as least_load, without scale-ups);
 * when none does they wait at the cluster (a re-split may give room). The PipeLive paper leaves
 * when to re-split open (its section 4.1); the rule and every threshold here are ours.
 *
 * The mix: the arrivals of the last PL_WINDOW seconds (a ring of PL_RING): mean prompt P and
 * output O, and p = sum prompts / sum (prompts + outputs), the prefill share of the tokens.
 * Profiles of a split s (every split whose stages are multiples of PL_GRANULARITY layers, the
 * last taking the rest; the paper profiles at two-layer granularity):
 *   T_pf(s)  = one step prefilling a prompt of P tokens                        (TTFT's profile)
 *   J_dec(s) = T(s, b decodes at context P + O/2) * D / b, with D the instance's requests
 *              (running and waiting, at least 1) and b = min(D, the requests of P + O tokens
 *              its KV holds): seconds to give every request a token, so a split whose KV
 *              cannot hold the demand pays for the rounds it needs                (TPOT's profile)
 *   J(s)     = p T_pf(s) / min T_pf + (1 - p) J_dec(s) / min J_dec   (1 for the best of both)
 * over the feasible splits: KV for at least PL_MIN_KV_TOKENS tokens, and at least the blocks in
 * use now. The instance re-splits to argmin J when
 *   - J(best) < (1 - PL_GAIN) J(current)  hysteresis: a 4% predicted gain (the splits of one
 *                                         model differ by a few percent in prefill, by 10-30%
 *                                         in decode; 10% never brought a split back; at 3% a
 *                                         2-layer move for more KV in a prefill phase cost
 *                                         seed 1 of Figure 9 its TPOT: 7 of 8 seeds beat the
 *                                         best static split at 3%, 8 of 8 at 4% and 5%; at 5%
 *                                         an 8-layer pipeline never moved back),
 *   - PL_MIN_INTERVAL seconds passed since its last re-split began (none under way),
 *   - the window holds at least PL_MIN_ARRIVALS arrivals,
 *   - its KV in use fits the migration's B_shrink (else the simulator would refuse).
 * It is asked at every arrival and after every reconfiguration (rebalance). State: the ring and
 * the time of each pipeline's last re-split (the first PL_MAX_PIPES pipelines; later ones keep
 * their split). */
#include "policy.h"

#include <math.h>
#include <string.h>

#define PL_WINDOW 10.0          /* s of arrivals the mix is taken over */
#define PL_RING 512             /* arrivals remembered (more in the window: the latest count) */
#define PL_GRANULARITY 2        /* layers: splits at this step, as PipeLive profiles */
#define PL_MAX_CANDIDATES 4096  /* splits profiled at most (the granularity grows beyond) */
#define PL_GAIN 0.04            /* a re-split must promise J 4% below the current split's */
#define PL_MIN_INTERVAL 5.0     /* s between re-splits of one pipeline */
#define PL_MIN_ARRIVALS 8       /* arrivals in the window before the mix is trusted */
#define PL_MIN_KV_TOKENS 8192.0 /* a split must hold this many tokens of KV */
#define PL_MAX_PIPES 64

typedef struct pl_arrival {
    double time;
    double prompt, output;
} pl_arrival;

typedef struct pl_state {
    pl_arrival ring[PL_RING];
    int64_t n_seen;                  /* arrivals recorded */
    double last_change[PL_MAX_PIPES]; /* by instance index (pipelines never change places) */
    int32_t changed[PL_MAX_PIPES];
} pl_state;

typedef struct pl_mix {
    int64_t n;
    double prompt, output, prefill_share; /* means, and the prefill share of the tokens */
} pl_mix;

static pl_mix pl_window(const pl_state *st, double now) {
    pl_mix m = {0};
    double sp = 0, so = 0;
    const int64_t n = st->n_seen < PL_RING ? st->n_seen : PL_RING;
    for (int64_t k = 0; k < n; k++) {
        const pl_arrival *a = &st->ring[(st->n_seen - 1 - k) % PL_RING];
        if (a->time < now - PL_WINDOW) break;
        sp += a->prompt;
        so += a->output;
        m.n++;
    }
    if (m.n > 0) {
        m.prompt = sp / (double)m.n;
        m.output = so / (double)m.n;
        m.prefill_share = sp / (sp + so);
    }
    return m;
}

/* The two profiles of a split (see the header); 0 when it is not feasible. */
static int pl_profile(const gy_sim_pipeline *p, const int32_t *layers, const pl_mix *m,
                      double demand, int64_t used_blocks, double *t_pf, double *j_dec) {
    const int64_t cap = gy_sim_pipeline_capacity(p, layers);
    const double tokens = (double)cap * (double)p->block_size;
    if (cap < 1 || cap < used_blocks || tokens < PL_MIN_KV_TOKENS) return 0;
    const double P = m->prompt > 1 ? m->prompt : 1, O = m->output > 1 ? m->output : 1;
    const gy_sim_step_shape pf = {.n_tokens = (int64_t)llround(P), .n_seqs = 1, .n_samples = 1,
                                  .kv_read_tokens = P, .attn_pairs = P * (P + 1) / 2};
    double b = floor(tokens / (P + O));
    if (b > demand) b = demand;
    if (b < 1) return 0;
    const double ctx = P + O / 2;
    const gy_sim_step_shape dec = {.n_tokens = (int64_t)b, .n_seqs = (int64_t)b,
                                   .n_samples = (int64_t)b, .kv_read_tokens = b * ctx,
                                   .attn_pairs = b * (ctx + 1)};
    *t_pf = gy_sim_pipeline_step_time(p, layers, 0, &pf);
    *j_dec = gy_sim_pipeline_step_time(p, layers, 0, &dec) * demand / b;
    return 1;
}

/* The granularity that keeps the candidates under PL_MAX_CANDIDATES (estimated). */
static int32_t pl_granularity(const gy_sim_pipeline *p) {
    for (int32_t g = PL_GRANULARITY;; g *= 2) {
        double count = 1; /* (layers / g)^(n-1) / (n-1)! */
        for (int32_t k = 1; k < p->n_stages; k++) count *= (double)p->n_layers / g / k;
        if (count <= PL_MAX_CANDIDATES || g >= p->n_layers) return g;
    }
}

/* The best split for instance i and the mix: 1 with it in best[] and J of it and of i's split
 * (INFINITY when i's split is not feasible), 0 when no split is feasible. */
static int pl_best(const gy_sim_pipeline *p, const gy_sim_inst_view *i, const pl_mix *m,
                   int32_t *best, double *j_best, double *j_cur) {
    double demand = (double)(i->n_running + i->n_waiting);
    if (demand < 1) demand = 1;
    const int32_t g = pl_granularity(p);
    double min_pf = INFINITY, min_dec = INFINITY;
    int32_t s[GY_SIM_MAX_STAGES] = {0};
    double t_pf, j_dec;
    for (int any = gy_sim_pipeline_next_split(p, g, s); any; any = gy_sim_pipeline_next_split(p, g, s))
        if (pl_profile(p, s, m, demand, i->kv_used, &t_pf, &j_dec)) {
            if (t_pf < min_pf) min_pf = t_pf;
            if (j_dec < min_dec) min_dec = j_dec;
        }
    if (!isfinite(min_pf) || !(min_pf > 0) || !(min_dec > 0)) return 0;
    const double w = m->prefill_share;
    *j_best = INFINITY;
    memset(s, 0, sizeof s);
    for (int any = gy_sim_pipeline_next_split(p, g, s); any; any = gy_sim_pipeline_next_split(p, g, s))
        if (pl_profile(p, s, m, demand, i->kv_used, &t_pf, &j_dec)) {
            const double j = w * t_pf / min_pf + (1 - w) * j_dec / min_dec;
            if (j < *j_best) {
                *j_best = j;
                memcpy(best, s, sizeof s);
            }
        }
    *j_cur = pl_profile(p, i->layers, m, demand, i->kv_used, &t_pf, &j_dec)
                 ? w * t_pf / min_pf + (1 - w) * j_dec / min_dec
                 : INFINITY;
    return isfinite(*j_best);
}

/* Appends the re-splits the mix calls for. */
static void pl_resplits(pl_state *st, const gy_sim_view *v, gy_sim_decision *d) {
    const gy_sim_pipeline *p = v->pipeline;
    if (p == NULL) return;
    const pl_mix m = pl_window(st, v->now);
    if (m.n < PL_MIN_ARRIVALS) return;
    for (int32_t k = 0; k < v->n_inst && k < PL_MAX_PIPES; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (i->n_stages != p->n_stages || i->xform != GY_SIM_XFORM_NONE) continue;
        if (st->changed[k] && v->now - st->last_change[k] < PL_MIN_INTERVAL) continue;
        int32_t best[GY_SIM_MAX_STAGES] = {0};
        double j_best, j_cur;
        if (!pl_best(p, i, &m, best, &j_best, &j_cur)) continue;
        if (!(j_best < (1 - PL_GAIN) * j_cur)) continue;
        if (gy_sim_pipeline_shrink_capacity(p, i->layers, best) < i->kv_used) continue;
        if (d->n_ops >= GY_SIM_MAX_OPS) return;
        gy_sim_op *op = &d->ops[d->n_ops++];
        *op = (gy_sim_op){.kind = GY_SIM_OP_RESPLIT, .gpu_first = i->gpu_first,
                          .size = i->n_stages};
        memcpy(op->layers, best, sizeof best);
        st->last_change[k] = v->now;
        st->changed[k] = 1;
    }
}

static gy_status pl_place(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                          const gy_sim_req_view *r, gy_sim_decision *d) {
    pl_state *st = state;
    memset(d, 0, sizeof *d);
    if (!r->deferred) {
        st->ring[st->n_seen % PL_RING] = (pl_arrival){.time = r->arrival,
                                                      .prompt = (double)r->prompt,
                                                      .output = (double)r->output};
        st->n_seen++;
    }
    if (r->min_tp == 0 || r->min_tp > v->max_tp) {
        d->action = GY_SIM_ACTION_REJECT;
        return GY_OK;
    }
    int32_t best = -1;
    for (int32_t k = 0; k < v->n_inst; k++) {
        const gy_sim_inst_view *i = &v->inst[k];
        if (gy_sim_policy_fits(i, r) &&
            (best < 0 || gy_sim_policy_load(cfg, i) < gy_sim_policy_load(cfg, &v->inst[best])))
            best = k;
    }
    if (best >= 0) {
        d->action = GY_SIM_ACTION_PLACE;
        d->target = best;
    } else {
        d->action = GY_SIM_ACTION_DEFER; /* on no group: a re-split or a finish makes room */
    }
    pl_resplits(st, v, d);
    return GY_OK;
}

static gy_status pl_rebalance(void *state, const gy_sim_policy_config *cfg, const gy_sim_view *v,
                              gy_sim_decision *d) {
    memset(d, 0, sizeof *d);
    pl_resplits(state, v, d);
    return GY_OK;
}

const gy_sim_policy_ops gy_sim_policy_pipelive = {
    .name = "pipelive",
    .state_size = sizeof(pl_state),
    .place = pl_place,
    .rebalance = pl_rebalance,
};
