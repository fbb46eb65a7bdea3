/* pipeline.c: the pipeline step, capacity and re-split cost of pipeline.h. */
#include "pipeline.h"

#include <math.h>
#include <stddef.h>

static int gy_sim_pos(double x) { return isfinite(x) && x > 0; }
static int gy_sim_nonneg(double x) { return isfinite(x) && x >= 0; }

gy_status gy_sim_pipeline_check(const gy_sim_pipeline *p) {
    if (p == NULL) return GY_FAIL(GY_ERR_INVALID, "pipeline parameters are NULL");
    if (p->n_stages < 2 || p->n_stages > GY_SIM_MAX_STAGES || p->n_layers < p->n_stages)
        return GY_FAIL(GY_ERR_INVALID, "a pipeline has 2 to %d stages and at least a layer each "
                       "(got %d stages, %d layers)", GY_SIM_MAX_STAGES, (int)p->n_stages,
                       (int)p->n_layers);
    for (int32_t i = 0; i < p->n_stages; i++) {
        const gy_sim_pipe_stage *s = &p->stage[i];
        if (!gy_sim_pos(s->budget_bytes) || !gy_sim_pos(s->hbm_bw) || !gy_sim_pos(s->peak_flops) ||
            !gy_sim_pos(s->eff_bw) || !gy_sim_pos(s->eff_flops))
            return GY_FAIL(GY_ERR_INVALID, "pipeline stage %d: budget_bytes %g, hbm_bw %g, "
                           "peak_flops %g, eff_bw %g, eff_flops %g must all be > 0", (int)i,
                           s->budget_bytes, s->hbm_bw, s->peak_flops, s->eff_bw, s->eff_flops);
    }
    const struct { const char *name; double v; int strict; } f[] = {
        {"layer_bytes", p->layer_bytes, 1},
        {"layer_params", p->layer_params, 1},
        {"attn_flops_per_pair", p->attn_flops_per_pair, 0},
        {"kv_layer", p->kv_layer, 1},
        {"lm_head_params", p->lm_head_params, 0},
        {"head_bytes", p->head_bytes, 0},
        {"act_bytes", p->act_bytes, 0},
        {"link_bw", p->link_bw, 1},
        {"link_latency", p->link_latency, 0},
        {"eff_xfer", p->eff_xfer, 1},
        {"step_overhead", p->step_overhead, 0},
        {"transform_slowdown", p->transform_slowdown, 0},
        {"stop_time", p->stop_time, 0},
        {"host_bw", p->host_bw, 0},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].strict ? !gy_sim_pos(f[i].v) : !gy_sim_nonneg(f[i].v))
            return GY_FAIL(GY_ERR_INVALID, "pipeline: %s must be %s, got %g", f[i].name,
                           f[i].strict ? "> 0" : ">= 0", f[i].v);
    if (p->flush != 0 && p->flush != 1)
        return GY_FAIL(GY_ERR_INVALID, "flush must be 0 or 1, got %d", (int)p->flush);
    if (p->block_size < 1 || p->fixed_blocks < 0 || p->micro_batches < 0)
        return GY_FAIL(GY_ERR_INVALID, "pipeline: block_size must be >= 1, fixed_blocks and "
                       "micro_batches >= 0, got %lld, %lld, %d", (long long)p->block_size,
                       (long long)p->fixed_blocks, (int)p->micro_batches);
    return GY_OK;
}

int gy_sim_pipeline_split_ok(const gy_sim_pipeline *p, const int32_t *layers) {
    int64_t sum = 0;
    for (int32_t i = 0; i < p->n_stages; i++) {
        if (layers[i] < 1) return 0;
        sum += layers[i];
    }
    return sum == p->n_layers;
}

int64_t gy_sim_pipeline_max_blocks(const gy_sim_pipeline *p, int32_t stage, int32_t n_layers) {
    if (n_layers < 1) return 0;
    const double room = p->stage[stage].budget_bytes - (double)n_layers * p->layer_bytes;
    if (!(room > 0)) return 0;
    return (int64_t)floor(room / ((double)n_layers * p->kv_layer * (double)p->block_size));
}

/* Without resizing every split keeps fixed_blocks, if it can. */
static int64_t gy_sim_pipeline_budget(const gy_sim_pipeline *p, int64_t blocks) {
    if (p->fixed_blocks <= 0) return blocks;
    return blocks >= p->fixed_blocks ? p->fixed_blocks : 0;
}

int64_t gy_sim_pipeline_capacity(const gy_sim_pipeline *p, const int32_t *layers) {
    int64_t least = INT64_MAX;
    for (int32_t i = 0; i < p->n_stages; i++) {
        const int64_t b = gy_sim_pipeline_max_blocks(p, i, layers[i]);
        if (b < least) least = b;
    }
    return gy_sim_pipeline_budget(p, least);
}

int64_t gy_sim_pipeline_max_capacity(const gy_sim_pipeline *p) {
    if (p->fixed_blocks > 0) return p->fixed_blocks;
    int64_t least = INT64_MAX;
    for (int32_t i = 0; i < p->n_stages; i++) {
        const int64_t b = gy_sim_pipeline_max_blocks(p, i, 1);
        if (b < least) least = b;
    }
    return least;
}

/* First layer of each stage: stage i runs [first_i, first_i + layers_i). */
static void gy_sim_pipeline_firsts(const gy_sim_pipeline *p, const int32_t *layers,
                                   int32_t *first) {
    int32_t at = 0;
    for (int32_t i = 0; i < p->n_stages; i++) {
        first[i] = at;
        at += layers[i];
    }
}

/* Layers stage i holds in both splits: the overlap of its two ranges. */
static int32_t gy_sim_pipeline_overlap(int32_t a, int32_t na, int32_t b, int32_t nb) {
    const int32_t lo = a > b ? a : b, hi = a + na < b + nb ? a + na : b + nb;
    return hi > lo ? hi - lo : 0;
}

int64_t gy_sim_pipeline_shrink_capacity(const gy_sim_pipeline *p, const int32_t *cur,
                                        const int32_t *tgt) {
    int32_t fc[GY_SIM_MAX_STAGES], ft[GY_SIM_MAX_STAGES];
    gy_sim_pipeline_firsts(p, cur, fc);
    gy_sim_pipeline_firsts(p, tgt, ft);
    int64_t least = INT64_MAX;
    for (int32_t i = 0; i < p->n_stages; i++) {
        const int32_t both = cur[i] + tgt[i] - gy_sim_pipeline_overlap(fc[i], cur[i], ft[i], tgt[i]);
        const int64_t b = gy_sim_pipeline_max_blocks(p, i, both);
        if (b < least) least = b;
    }
    return gy_sim_pipeline_budget(p, least);
}

double gy_sim_pipeline_step_time(const gy_sim_pipeline *p, const int32_t *layers,
                                 int transforming, const gy_sim_step_shape *s) {
    if (s->n_tokens <= 0) return 0.0;
    int64_t m = p->micro_batches > 1 ? p->micro_batches : 1;
    if (m > p->n_stages) m = p->n_stages;
    if (m > s->n_seqs) m = s->n_seqs > 1 ? s->n_seqs : 1;
    /* one micro-batch's share of the step */
    const double tokens = (double)s->n_tokens / (double)m, samples = (double)s->n_samples / (double)m;
    const double kv_read = s->kv_read_tokens / (double)m, pairs = s->attn_pairs / (double)m;
    double sum = 0.0, busiest = 0.0;
    for (int32_t i = 0; i < p->n_stages; i++) {
        const gy_sim_pipe_stage *g = &p->stage[i];
        const double L = layers[i];
        const int last = i == p->n_stages - 1;
        const double bytes = L * (p->layer_bytes + p->kv_layer * (kv_read + tokens)) +
                             (last ? p->head_bytes : 0.0);
        const double flops = L * (2.0 * p->layer_params * tokens + p->attn_flops_per_pair * pairs) +
                             (last ? 2.0 * p->lm_head_params * samples : 0.0);
        const double t_mem = bytes / (g->hbm_bw * g->eff_bw);
        const double t_flop = flops / (g->peak_flops * g->eff_flops);
        const double t = t_mem > t_flop ? t_mem : t_flop;
        sum += t;
        if (t > busiest) busiest = t;
    }
    const double hops = (double)(p->n_stages - 1) * (tokens * p->act_bytes / p->link_bw +
                                                      p->link_latency);
    const double round_trip = sum + hops;
    const double bound = (double)m * busiest;
    const double time =
        p->step_overhead + (p->flush ? (double)(m + p->n_stages - 1) * busiest + hops
                                     : (bound > round_trip ? bound : round_trip));
    return transforming ? time * (1.0 + p->transform_slowdown) : time;
}

double gy_sim_pipeline_migration_time(const gy_sim_pipeline *p, const int32_t *cur,
                                      const int32_t *tgt, double kv_tokens,
                                      double *weight_bytes, double *kv_bytes) {
    int32_t fc[GY_SIM_MAX_STAGES], ft[GY_SIM_MAX_STAGES];
    gy_sim_pipeline_firsts(p, cur, fc);
    gy_sim_pipeline_firsts(p, tgt, ft);
    double most = 0.0, w = 0.0, kv = 0.0;
    for (int32_t i = 0; i < p->n_stages; i++) {
        const double gained = tgt[i] - gy_sim_pipeline_overlap(fc[i], cur[i], ft[i], tgt[i]);
        const double wi = gained * p->layer_bytes, ki = gained * p->kv_layer * kv_tokens;
        w += wi;
        kv += ki;
        if (wi + ki > most) most = wi + ki;
    }
    *weight_bytes = w;
    *kv_bytes = kv;
    return most / (p->link_bw * p->eff_xfer);
}

int gy_sim_pipeline_next_split(const gy_sim_pipeline *p, int32_t granularity, int32_t *layers) {
    const int32_t n = p->n_stages, g = granularity > 0 ? granularity : 1;
    int64_t sum = 0;
    if (layers[0] == 0) {
        for (int32_t k = 0; k < n - 1; k++) layers[k] = g;
    } else {
        for (int32_t k = n - 2;; k--) {
            layers[k] += g;
            for (int32_t j = k + 1; j < n - 1; j++) layers[j] = g;
            sum = 0;
            for (int32_t j = 0; j < n - 1; j++) sum += layers[j];
            if (p->n_layers - sum >= 1) break;
            if (k == 0) return 0;
            layers[k] = g;
        }
    }
    sum = 0;
    for (int32_t j = 0; j < n - 1; j++) sum += layers[j];
    if (p->n_layers - sum < 1) return 0;
    layers[n - 1] = (int32_t)(p->n_layers - sum);
    return 1;
}

/* ---- KunServe's buddy groups ---- */

gy_sim_pipeline gy_sim_pipeline_sub(const gy_sim_pipeline *p, int32_t g) {
    gy_sim_pipeline q = *p;
    const int32_t n = p->n_stages;
    q.n_stages = g;
    q.stage[g - 1] = p->stage[n - 1];
    if (g == 1 && n >= 3) /* the last stage's budget less the embedding stage 0 keeps */
        q.stage[0].budget_bytes -= p->stage[1].budget_bytes - p->stage[0].budget_bytes;
    return q;
}

void gy_sim_pipeline_even(const gy_sim_pipeline *p, int32_t *layers) {
    for (int32_t i = 0; i < p->n_stages; i++)
        layers[i] = p->n_layers / p->n_stages + (i < p->n_layers % p->n_stages);
}

double gy_sim_pipeline_exchange_time(const gy_sim_pipeline *p, const int32_t *layers,
                                     const double *tokens, double *kv_bytes) {
    double all = 0.0, most = 0.0, total = 0.0;
    for (int32_t k = 0; k < p->n_stages; k++) all += tokens[k];
    for (int32_t j = 0; j < p->n_stages; j++) {
        const double sent = tokens[j] * p->kv_layer * (double)(p->n_layers - layers[j]);
        const double recv = (all - tokens[j]) * p->kv_layer * (double)layers[j];
        total += sent;
        if (sent > most) most = sent;
        if (recv > most) most = recv;
    }
    *kv_bytes = total;
    return most / (p->link_bw * p->eff_xfer);
}

double gy_sim_pipeline_remote_time(const gy_sim_pipeline *p, double remote_layers,
                                   double victim_tokens) {
    if (!(remote_layers > 0) || !(victim_tokens > 0)) return 0.0;
    return remote_layers * (2.0 * victim_tokens * p->act_bytes / p->link_bw +
                            2.0 * p->link_latency);
}

double gy_sim_pipeline_restore_time(const gy_sim_pipeline *p, const int32_t *layers,
                                    double *weight_bytes) {
    double most = 0.0, total = 0.0;
    for (int32_t k = 0; k < p->n_stages; k++) {
        const double w = (double)(p->n_layers - layers[k]) * p->layer_bytes;
        total += w;
        if (w > most) most = w;
    }
    *weight_bytes = total;
    return most / (p->link_bw * p->eff_xfer + p->host_bw);
}

double gy_sim_pipeline_gather_time(const gy_sim_pipeline *p, const int32_t *layers,
                                   const double *tokens, double *kv_bytes) {
    double most = 0.0, total = 0.0;
    for (int32_t k = 0; k < p->n_stages; k++) {
        const double b = tokens[k] * p->kv_layer * (double)(p->n_layers - layers[k]);
        total += b;
        if (b > most) most = b;
    }
    *kv_bytes = total;
    return most / (p->link_bw * p->eff_xfer);
}
