/* cost.c: the roofline, profiled and constant cost backends of cost.h. */
#include "cost.h"

#include <math.h>
#include <stddef.h>

static int gy_sim_positive(double x) { return isfinite(x) && x > 0; }
static int gy_sim_nonneg(double x) { return isfinite(x) && x >= 0; }

gy_status gy_sim_roofline_check(const gy_sim_roofline *p) {
    if (p == NULL) return GY_FAIL(GY_ERR_INVALID, "roofline parameters are NULL");
    const struct { const char *name; double v; int strict; } f[] = {
        {"weight_bytes", p->weight_bytes, 1},
        {"matmul_params", p->matmul_params, 1},
        {"lm_head_params", p->lm_head_params, 0},
        {"attn_flops_per_pair", p->attn_flops_per_pair, 0},
        {"kv_bytes_per_token", p->kv_bytes_per_token, 1},
        {"allreduce_bytes_per_token", p->allreduce_bytes_per_token, 0},
        {"ffn_bytes", p->ffn_bytes, 0},
        {"expert_bytes", p->expert_bytes, 0},
        {"hbm_bw", p->hbm_bw, 1},
        {"peak_flops", p->peak_flops, 1},
        {"link_bw", p->link_bw, 1},
        {"eff_bw", p->eff_bw, 1},
        {"eff_flops", p->eff_flops, 1},
        {"eff_link", p->eff_link, 1},
        {"eff_xfer", p->eff_xfer, 1},
        {"step_overhead", p->step_overhead, 0},
        {"allreduce_latency", p->allreduce_latency, 0},
        {"phase_latency_per_layer", p->phase_latency_per_layer, 0},
        {"transform_slowdown", p->transform_slowdown, 0},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        if (f[i].strict ? !gy_sim_positive(f[i].v) : !gy_sim_nonneg(f[i].v))
            return GY_FAIL(GY_ERR_INVALID, "cost model: %s must be %s, got %g", f[i].name,
                           f[i].strict ? "> 0" : ">= 0", f[i].v);
    }
    if ((p->reshard != 0 && p->reshard != 1) ||
        (p->reshard == 1 && !gy_sim_positive(p->host_bw)))
        return GY_FAIL(GY_ERR_INVALID, "cost model: reshard must be 0 or 1 (Seesaw's, with host_bw "
                       "> 0), got %d (host_bw %g)", (int)p->reshard, p->host_bw);
    if (p->sequence_parallel < 0 || (p->sequence_parallel & (p->sequence_parallel - 1)))
        return GY_FAIL(GY_ERR_INVALID, "cost model: sequence_parallel must be 0 or a power of two, "
                       "got %d", (int)p->sequence_parallel);
    if (p->pipeline_degree < 0 || p->pipeline_degree == 1 ||
        (p->pipeline_degree & (p->pipeline_degree - 1)) ||
        (p->pipeline_degree > 0 && p->n_layers < p->pipeline_degree))
        return GY_FAIL(GY_ERR_INVALID, "cost model: pipeline_degree must be 0 or a power of two "
                       ">= 2 and at most n_layers (%d), got %d", (int)p->n_layers,
                       (int)p->pipeline_degree);
    if (p->kv_heads < 1 || p->n_layers < 1)
        return GY_FAIL(GY_ERR_INVALID, "cost model: kv_heads and n_layers must be >= 1 (got %d, %d)",
                       (int)p->kv_heads, (int)p->n_layers);
    if (p->n_experts < 0 || (p->n_experts > 0 && (p->experts_per_tok < 1 ||
                                                  p->experts_per_tok > p->n_experts)) ||
        (p->n_experts == 0 && p->expert_bytes > 0) || p->expert_bytes > p->weight_bytes)
        return GY_FAIL(GY_ERR_INVALID,
                       "cost model: %d experts, %d a token, %g of %g weight bytes: experts_per_tok "
                       "must be in [1, n_experts] and expert_bytes within weight_bytes",
                       (int)p->n_experts, (int)p->experts_per_tok, p->expert_bytes,
                       p->weight_bytes);
    return GY_OK;
}

double gy_sim_roofline_weight_read(const gy_sim_roofline *p, int32_t n_tokens) {
    if (p->n_experts <= 0) return p->weight_bytes;
    const double miss = 1.0 - (double)p->experts_per_tok / (double)p->n_experts;
    const double touched = 1.0 - pow(miss, (double)n_tokens);
    return p->weight_bytes - p->expert_bytes + p->expert_bytes * touched;
}

gy_status gy_sim_cost_constant_check(const gy_sim_cost_constant *p) {
    if (p == NULL) return GY_FAIL(GY_ERR_INVALID, "constant cost parameters are NULL");
    if (!gy_sim_positive(p->step_time))
        return GY_FAIL(GY_ERR_INVALID, "constant cost model: step_time must be > 0, got %g",
                       p->step_time);
    if (!gy_sim_nonneg(p->phase_time) || !gy_sim_nonneg(p->transform_slowdown))
        return GY_FAIL(GY_ERR_INVALID,
                       "constant cost model: phase_time and transform_slowdown must be >= 0 "
                       "(got %g, %g)", p->phase_time, p->transform_slowdown);
    return GY_OK;
}

/* The roofline of one GPU: the slower of reading `bytes` and computing `flops`. */
static double gy_sim_roofline_bound(const gy_sim_roofline *p, double bytes, double flops) {
    const double t_mem = bytes / (p->hbm_bw * p->eff_bw);
    const double t_flop = flops / (p->peak_flops * p->eff_flops);
    return t_mem > t_flop ? t_mem : t_flop;
}

/* A step of `sp` sequence-parallel parts, each a TP-`tp` group (a TP instance is one part):
 * each part computes 1/sp of the tokens, their KV (every head) kept on the part that made it.
 * Each rank reads its TP shard of the weights its tokens touch, its heads of its part's KV, and
 * does 1/(sp tp) of the FLOPs. The TP all-reduces (two per layer, ring) carry its part's tokens;
 * between parts, the new tokens' KV goes around the ring (bulk copies, hidden behind the
 * attention they feed) and the partial attention of every query is combined once per layer. */
static double gy_sim_parts_step_time(const gy_sim_roofline *p, int32_t sp, int32_t tp,
                                     const gy_sim_step_shape *s) {
    const double t = tp, parts = sp;
    const int32_t heads = p->kv_heads / tp > 1 ? p->kv_heads / tp : 1;
    const double kv_rank = p->kv_bytes_per_token * heads / p->kv_heads; /* one token, one rank */
    const int32_t part_tokens = (int32_t)((s->n_tokens + sp - 1) / sp);
    const double bytes = gy_sim_roofline_weight_read(p, part_tokens) / t +
                         kv_rank * (s->kv_read_tokens + (double)s->n_tokens) / parts;
    const double flops = (2.0 * p->matmul_params * (double)s->n_tokens +
                          2.0 * p->lm_head_params * (double)s->n_samples +
                          p->attn_flops_per_pair * s->attn_pairs) / (t * parts);
    const double flop_rate = p->peak_flops * p->eff_flops;
    double time = p->step_overhead + gy_sim_roofline_bound(p, bytes, flops);
    const double payload = p->allreduce_bytes_per_token * (double)s->n_tokens / parts;
    if (tp > 1) {
        const double one = 2.0 * (t - 1.0) / t * payload / (p->link_bw * p->eff_link) +
                           p->allreduce_latency;
        time += 2.0 * p->n_layers * one;
    }
    if (sp > 1) {
        const double ring = (parts - 1.0) / parts * kv_rank * (double)s->n_tokens /
                            (p->link_bw * p->eff_xfer);
        const double hidden = p->attn_flops_per_pair * s->attn_pairs / (t * parts) / flop_rate;
        if (ring > hidden) time += ring - hidden;
        const double partials = p->allreduce_bytes_per_token * (double)s->n_tokens / t;
        time += p->n_layers * (2.0 * (parts - 1.0) / parts * partials /
                                   (p->link_bw * p->eff_link) +
                               p->allreduce_latency);
    }
    return time;
}

/* A step of a q-stage pipeline of equal stages, one GPU each (cost.h: pipeline_degree). */
static double gy_sim_pipeline_stages_time(const gy_sim_roofline *p, int32_t q,
                                          const gy_sim_step_shape *s) {
    const int64_t m = s->n_seqs < 1 ? 1 : s->n_seqs < q ? s->n_seqs : q; /* micro-batches */
    const double stages = q, share = 1.0 / ((double)m * stages); /* of the step, one stage */
    const int32_t micro_tokens = (int32_t)((s->n_tokens + m - 1) / m);
    const double bytes = gy_sim_roofline_weight_read(p, micro_tokens) / stages +
                         p->kv_bytes_per_token * (s->kv_read_tokens + (double)s->n_tokens) *
                             share;
    const double flops = (2.0 * p->matmul_params * (double)s->n_tokens +
                          2.0 * p->lm_head_params * (double)s->n_samples +
                          p->attn_flops_per_pair * s->attn_pairs) * share;
    const double hand_off = p->allreduce_bytes_per_token * (double)s->n_tokens / (double)m /
                                p->link_bw + p->allreduce_latency;
    return p->step_overhead + stages * gy_sim_roofline_bound(p, bytes, flops) +
           (stages - 1.0) * hand_off;
}

double gy_sim_roofline_step_time(const gy_sim_roofline *p, int32_t tp, int transforming,
                                 const gy_sim_step_shape *s) {
    if (s->n_tokens <= 0) return 0.0;
    const int32_t unit = p->sequence_parallel;
    const double time = p->pipeline_degree > 1 && tp == p->pipeline_degree
                            ? gy_sim_pipeline_stages_time(p, tp, s)
                        : unit > 0 && tp > unit ? gy_sim_parts_step_time(p, tp / unit, unit, s)
                                                : gy_sim_parts_step_time(p, 1, tp, s);
    return transforming ? time * (1.0 + p->transform_slowdown) : time;
}

/* Bytes each GPU of the group receives in one phase (the same for every backend). */
static double gy_sim_phase_bytes(const gy_sim_phase_shape *ph, double kv_bytes_per_token,
                                 double ffn_bytes) {
    const double lo = ph->tp_from < ph->tp_to ? ph->tp_from : ph->tp_to;
    const double hi = ph->tp_from < ph->tp_to ? ph->tp_to : ph->tp_from;
    switch (ph->kind) {
    case GY_SIM_PHASE_KV_SCATTER:
        /* Header-centric layout: of each token's heads, a fraction lo/hi stays where it is; the
         * rest moves. The group has `hi` GPUs sharing the traffic. */
        return (1.0 - lo / hi) * ph->kv_tokens * kv_bytes_per_token / hi;
    case GY_SIM_PHASE_WEIGHTS_GATHER:
        return ffn_bytes * (1.0 / lo - 1.0 / hi);
    default: /* GY_SIM_PHASE_WEIGHTS_DROP: padded shards are simply unmapped */
        return 0.0;
    }
}

double gy_sim_roofline_phase_time(const gy_sim_roofline *p, const gy_sim_phase_shape *ph,
                                  double *bytes_per_gpu) {
    double bytes = gy_sim_phase_bytes(ph, p->kv_bytes_per_token, p->ffn_bytes);
    const int32_t lo = ph->tp_from < ph->tp_to ? ph->tp_from : ph->tp_to;
    const int32_t hi = ph->tp_from < ph->tp_to ? ph->tp_to : ph->tp_from;
    if (p->pipeline_degree > 1 && lo == p->pipeline_degree && hi > lo) {
        /* between a pipeline's layout (layers, every head) and TP-hi's (heads, every layer):
         * a GPU receives its new share but what of it it holds already. Weights: TP-hi's shard
         * is W/hi, the pipeline's W/q, and a GPU holds 1/hi of its q-th of the layers in both.
         * KV of the group's T tokens, spread evenly: T/hi a GPU in both layouts, of which it
         * keeps its tokens' (q/hi of them) heads' (1/hi) KV of its layers (1/q): T/hi^2 */
        const double q = lo, h = hi;
        if (ph->kind == GY_SIM_PHASE_KV_SCATTER) {
            const double whole = ph->kv_tokens * p->kv_bytes_per_token;
            bytes = whole / h - whole / (h * h);
        } else {
            const double w = p->weight_bytes;
            bytes = (ph->tp_to == hi ? w / h : w / q) - w / (q * h);
        }
    }
    double link = p->link_bw;
    if (p->reshard == 1) { /* Seesaw: through host memory */
        link = p->host_bw;
        if (ph->kind == GY_SIM_PHASE_KV_SCATTER) { /* all of a GPU's KV out, its new share in */
            const double hi = ph->tp_from > ph->tp_to ? ph->tp_from : ph->tp_to;
            bytes = 2.0 * ph->kv_tokens * p->kv_bytes_per_token / hi;
        }
    }
    *bytes_per_gpu = bytes;
    return bytes / (link * p->eff_xfer) + p->n_layers * p->phase_latency_per_layer;
}

static double gy_sim_roofline_step(void *ctx, int32_t tp, int transforming,
                                   const gy_sim_step_shape *s) {
    return gy_sim_roofline_step_time(ctx, tp, transforming, s);
}
static double gy_sim_roofline_phase(void *ctx, const gy_sim_phase_shape *p, double *bytes) {
    return gy_sim_roofline_phase_time(ctx, p, bytes);
}

/* One level's coefficients c (base, per_token, per_sample, per_kv_read, per_pair) of the set
 * named `set` ("" or "alone "): each >= 0, and a step that computes something costs time. */
static gy_status gy_sim_profiled_level_check(const char *set, int32_t l, const double c[5]) {
    static const char *names[] = {"base", "per_token", "per_sample", "per_kv_read", "per_pair"};
    for (size_t k = 0; k < 5; k++)
        if (!gy_sim_nonneg(c[k]))
            return GY_FAIL(GY_ERR_INVALID, "profiled cost model: %s%s of TP%d must be >= 0, "
                           "got %g", set, names[k], 1 << l, c[k]);
    if (!(c[0] + c[1] > 0))
        return GY_FAIL(GY_ERR_INVALID, "profiled cost model: a TP%d step costs nothing (%sbase "
                       "and per_token are 0)", 1 << l, set);
    return GY_OK;
}

gy_status gy_sim_cost_profiled_check(const gy_sim_cost_profiled *p) {
    if (p == NULL) return GY_FAIL(GY_ERR_INVALID, "profiled cost parameters are NULL");
    if (p->n_levels < 1 || p->n_levels > GY_SIM_COST_LEVELS)
        return GY_FAIL(GY_ERR_INVALID, "profiled cost model: n_levels must be in [1, %d], got %d",
                       GY_SIM_COST_LEVELS, (int)p->n_levels);
    if (p->has_alone != 0 && p->has_alone != 1)
        return GY_FAIL(GY_ERR_INVALID, "profiled cost model: has_alone must be 0 or 1, got %d",
                       (int)p->has_alone);
    const gy_sim_profiled_alone *a = &p->alone;
    for (int32_t l = 0; l < p->n_levels; l++) {
        const double busy[] = {p->base[l], p->per_token[l], p->per_sample[l], p->per_kv_read[l],
                               p->per_pair[l]};
        const double alone[] = {a->base[l], a->per_token[l], a->per_sample[l], a->per_kv_read[l],
                                a->per_pair[l]};
        GY_TRY(gy_sim_profiled_level_check("", l, busy));
        if (p->has_alone) GY_TRY(gy_sim_profiled_level_check("alone ", l, alone));
    }
    if (!gy_sim_nonneg(p->transform_slowdown) || !gy_sim_positive(p->kv_bytes_per_token) ||
        !gy_sim_nonneg(p->ffn_bytes) || !gy_sim_positive(p->xfer_bw) ||
        !gy_sim_nonneg(p->phase_latency_per_layer) || p->n_layers < 1)
        return GY_FAIL(GY_ERR_INVALID, "profiled cost model: transform_slowdown %g, "
                       "kv_bytes_per_token %g, ffn_bytes %g, xfer_bw %g, phase_latency_per_layer "
                       "%g, n_layers %d out of range", p->transform_slowdown,
                       p->kv_bytes_per_token, p->ffn_bytes, p->xfer_bw,
                       p->phase_latency_per_layer, (int)p->n_layers);
    return GY_OK;
}

/* A step's time from one level's coefficients: linear in the step's shape. */
static double gy_sim_profiled_sum(double base, double per_token, double per_sample,
                                  double per_kv_read, double per_pair,
                                  const gy_sim_step_shape *s) {
    return base + per_token * (double)s->n_tokens + per_sample * (double)s->n_samples +
           per_kv_read * s->kv_read_tokens + per_pair * s->attn_pairs;
}

double gy_sim_profiled_step_time(const gy_sim_cost_profiled *p, int32_t tp, int transforming,
                                 const gy_sim_step_shape *s) {
    if (s->n_tokens <= 0) return 0.0;
    int32_t l = 0;
    while (l + 1 < p->n_levels && (INT32_C(1) << (l + 1)) <= tp) l++;
    double time = gy_sim_profiled_sum(p->base[l], p->per_token[l], p->per_sample[l],
                                      p->per_kv_read[l], p->per_pair[l], s);
    if (p->has_alone) { /* from alone (no other worker busy) to the all-busy time */
        const gy_sim_profiled_alone *a = &p->alone;
        const double alone = gy_sim_profiled_sum(a->base[l], a->per_token[l], a->per_sample[l],
                                                 a->per_kv_read[l], a->per_pair[l], s);
        const double share = s->busy_share < 0 ? 0 : s->busy_share > 1 ? 1 : s->busy_share;
        time = alone + share * (time - alone);
    }
    return transforming ? time * (1.0 + p->transform_slowdown) : time;
}

static double gy_sim_profiled_step(void *ctx, int32_t tp, int transforming,
                                   const gy_sim_step_shape *s) {
    return gy_sim_profiled_step_time(ctx, tp, transforming, s);
}
static double gy_sim_profiled_phase(void *ctx, const gy_sim_phase_shape *ph, double *bytes) {
    const gy_sim_cost_profiled *p = ctx;
    *bytes = gy_sim_phase_bytes(ph, p->kv_bytes_per_token, p->ffn_bytes);
    return *bytes / p->xfer_bw + p->n_layers * p->phase_latency_per_layer;
}

static double gy_sim_constant_step(void *ctx, int32_t tp, int transforming,
                                   const gy_sim_step_shape *s) {
    const gy_sim_cost_constant *p = ctx;
    if (s->n_tokens <= 0) return 0.0;
    return transforming ? p->step_time * (1.0 + p->transform_slowdown) : p->step_time;
}
static double gy_sim_constant_phase(void *ctx, const gy_sim_phase_shape *ph, double *bytes) {
    const gy_sim_cost_constant *p = ctx;
    *bytes = 0.0;
    return p->phase_time;
}

gy_sim_cost_ops gy_sim_cost_roofline_ops(const gy_sim_roofline *p) {
    return (gy_sim_cost_ops){.ctx = (void *)p, .step_time = gy_sim_roofline_step,
                             .phase_time = gy_sim_roofline_phase};
}

gy_sim_cost_ops gy_sim_cost_profiled_ops(const gy_sim_cost_profiled *p) {
    return (gy_sim_cost_ops){.ctx = (void *)p, .step_time = gy_sim_profiled_step,
                             .phase_time = gy_sim_profiled_phase, .host_shared = p->has_alone};
}

gy_sim_cost_ops gy_sim_cost_constant_ops(const gy_sim_cost_constant *p) {
    return (gy_sim_cost_ops){.ctx = (void *)p, .step_time = gy_sim_constant_step,
                             .phase_time = gy_sim_constant_phase};
}
