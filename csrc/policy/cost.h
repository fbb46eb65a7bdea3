/* cost.h: how long things take in the simulator. A cost model is a small table of function
 * pointers (the simulator's "backend"): the time of one step of one instance given the shape of
 * its batch, and the time of one phase of a parallelism transformation. Two backends:
 *
 * - roofline: per TP rank, max(bytes / (HBM bw * eff_bw), FLOPs / (peak * eff_flops)), plus the
 *   TP all-reduces (two per layer, ring: 2 (tp-1)/tp * bytes / (link * eff_link) + latency),
 *   plus a fixed per-step overhead. Transformation phases: bytes moved per GPU / (link *
 *   eff_xfer) + a driver latency per layer. gyges/costmodel.py computes every parameter from a
 *   GPU preset and a ModelConfig, and holds the float64 reference of these formulas.
 * - profiled: measured on a real engine (gyges.cluster.profile.ProfiledCost): per TP level, a
 *   step is linear in its shape, base + per_token * n_tokens + per_sample * n_samples +
 *   per_kv_read * kv_read_tokens + per_pair * attn_pairs, the coefficients fitted to step times
 *   measured over a grid of shapes; phases move the roofline's bytes at a measured rate plus a
 *   measured latency per layer.
 * - constant: every non-empty step and every phase takes a fixed time (hand-checked tests).
 *
 * Token counts exclude tokens whose KV a request kept through a transformation: the scheduler
 * recomputes them as a prefill, but the KV is already there, so no work is charged for them.
 *
 * It lives in policy/, below cluster/ and sim/, because more than the simulator reads it: the
 * policies' pipeline model (pipeline.h) prices this batch shape, and gyges.experiment gives a
 * real host's controller the prefill rates of its cost model. */
#ifndef GY_POLICY_COST_H
#define GY_POLICY_COST_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_SIM_COST_LEVELS 8 /* TP 1, 2, ..., 128: policy.h's GY_SIM_MAX_LEVELS */

/* What one step computes (all of it charged). */
typedef struct gy_sim_step_shape {
    int64_t n_tokens;      /* query tokens computed */
    int64_t n_seqs;        /* batch entries with at least one computed token */
    int64_t n_samples;     /* entries that sample a token (rows of the LM head) */
    double kv_read_tokens; /* sum over those entries of the tokens whose KV attention reads */
    double attn_pairs;     /* sum of causal (query, key) pairs: sum over queries of keys seen */
    double busy_share;     /* 0..1: the share of the host's other workers stepping when it
                              starts (read only by a cost model whose ops say host_shared) */
} gy_sim_step_shape;

typedef enum gy_sim_phase_kind {
    GY_SIM_PHASE_WEIGHTS_DROP = 0,   /* scale-up: unmap the FFN shards a rank no longer needs
                                        (with padded weights: no bytes move) */
    GY_SIM_PHASE_KV_SCATTER = 1,     /* KV heads move to the rank that owns them in the new TP */
    GY_SIM_PHASE_WEIGHTS_GATHER = 2, /* scale-down: each rank receives the FFN shards it lacks */
    GY_SIM_PHASE_KIND_COUNT
} gy_sim_phase_kind;

typedef struct gy_sim_phase_shape {
    int32_t kind;          /* gy_sim_phase_kind */
    int32_t tp_from, tp_to;/* GPUs per instance before and after the transformation */
    double kv_tokens;      /* tokens whose KV the GPUs of the group hold when the phase starts */
} gy_sim_phase_shape;

typedef struct gy_sim_cost_ops {
    void *ctx;
    /* Seconds for one step of a TP-`tp` instance (`transforming`: 1 while a transformation of
     * it is under way); 0 when the shape computes nothing. */
    double (*step_time)(void *ctx, int32_t tp, int transforming, const gy_sim_step_shape *s);
    /* Seconds for one phase; *bytes_per_gpu (never NULL) receives what each GPU receives. */
    double (*phase_time)(void *ctx, const gy_sim_phase_shape *p, double *bytes_per_gpu);
    int32_t host_shared;   /* 1: a step's time depends on its shape's busy_share (the workers of
                              a host share cores and memory bandwidth); the executor sets it */
    int32_t pad_;
} gy_sim_cost_ops;

/* Every field is > 0 unless it says >= 0. */
typedef struct gy_sim_roofline {
    /* the model (whole model, bf16 or whatever dtype the bytes were computed for) */
    double weight_bytes;          /* every weight; each rank reads weight_bytes / tp per step */
    double matmul_params;         /* parameters of the decoder layers: 2 FLOPs per token each */
    double lm_head_params;        /* hidden * vocab: 2 FLOPs per sampled token each */
    double attn_flops_per_pair;   /* 4 * layers * query heads * head_dim */
    double kv_bytes_per_token;    /* K and V of one token, all layers, all KV heads */
    double allreduce_bytes_per_token; /* hidden * dtype bytes: one token's all-reduce payload */
    double ffn_bytes;             /* the FFN weights (what a scale-down gathers) */
    /* a mixture of experts (n_experts 0: a dense model). matmul_params counts the parameters
     * a token uses (experts_per_tok experts a layer); a step reads the experts its tokens are
     * routed to: expert_bytes * (1 - (1 - k/E)^n_tokens), n tokens routed uniformly and
     * independently. With attention in TP, an expert-parallel rank computes its experts for the
     * tokens it already has and the combine is the FFN's all-reduce: EP's traffic is TP's. */
    double expert_bytes;          /* >= 0: the experts' share of weight_bytes */
    int32_t n_experts;            /* >= 0: experts of an MoE layer */
    int32_t experts_per_tok;      /* 1..n_experts when n_experts > 0 */
    int32_t kv_heads;             /* KV heads: a rank holds max(1, kv_heads / tp) of them */
    int32_t n_layers;
    /* the GPU */
    double hbm_bw;                /* bytes/s */
    double peak_flops;            /* dense bf16 FLOP/s */
    double link_bw;               /* bytes/s one GPU sends (NVLink, one direction) */
    /* calibration: achieved fractions of the peaks, and times no peak explains */
    double eff_bw, eff_flops, eff_link;   /* > 0; normally <= 1 (a fitted factor above 1 says
                                             the spec's peak is conservative). eff_link prices
                                             the all-reduces of a step: it absorbs whatever TP
                                             costs beyond the roofline */
    double eff_xfer;              /* > 0: achieved fraction of link_bw for transformation
                                     transfers (bulk copies on their own stream) */
    double step_overhead;         /* >= 0: seconds per step (scheduling, launches, sampling) */
    double allreduce_latency;     /* >= 0: seconds per all-reduce, two per layer when tp > 1 */
    double phase_latency_per_layer; /* >= 0: seconds of driver calls per layer per phase */
    double transform_slowdown;    /* >= 0: a step of an instance under transformation takes
                                     (1 + this) times longer (layer-staggered overlap) */
    /* how an instance of tp > 1 GPUs splits its work */
    int32_t sequence_parallel;    /* 0: tensor parallel (above). u > 0 (a power of two): an
                                     instance of tp > u GPUs is sequence parallel over tp / u
                                     TP-u parts (LoongServe's elastic instances): each part
                                     computes 1/(tp/u) of the step's tokens and keeps their KV,
                                     every head; a step passes its new tokens' KV around the
                                     parts' ring (bulk copies at eff_xfer, hidden behind the
                                     attention they feed) and combines the parts' partial
                                     attention once per layer (an all-reduce of the queries) */
    int32_t pipeline_degree;      /* 0: every instance as above. q >= 2 (a power of two): an
                                     instance of exactly q GPUs is a q-stage pipeline instead
                                     (Seesaw's prefill phase): stage i holds layers
                                     [i L/q, (i+1) L/q) whole, every head, and m = min(q,
                                     n_seqs) micro-batches circulate, each with 1/m of the
                                     step (vLLM's virtual engines); with equal stages a step
                                     is step_overhead + q t(s/m) + (q - 1) h(s/m) (pipeline.h's
                                     formula, whose round trip is the longer term when m <= q),
                                     t the roofline of one stage on one GPU (1/q of the weights,
                                     of the KV and of the FLOPs), h = n_tokens
                                     allreduce_bytes_per_token / link_bw + allreduce_latency
                                     (one hand-off). So it prefills a batch of q prompts as
                                     fast as TP-q without its all-reduces, one prompt only as
                                     fast as TP1, and decodes reading its weights m times. A
                                     weights phase between it and a TP-hi instance (hi > q)
                                     moves the layout's difference: a GPU of the pipeline
                                     already holds 1/(q hi) of the weights of TP-hi's shard
                                     (its layers' share), so a merge receives W/hi - W/(q hi)
                                     and a split W/q - W/(q hi) */
    /* how a transformation's phases move their bytes */
    int32_t reshard;              /* 0: Gyges' (the heads that change owner and the FFN shards
                                     a rank lacks, GPU to GPU over link_bw); 1: Seesaw's (every
                                     GPU offloads the KV it holds to host memory and loads its
                                     share in the new geometry back, and reads the FFN shards it
                                     lacks from the host copy, over host_bw) */
    double host_bw;               /* bytes/s one GPU moves to or from host memory (PCIe); > 0
                                     when reshard is 1 */
} gy_sim_roofline;

/* Level l is TP 2^l; a TP above the last level measured is priced as the last (the Python side
 * refuses such a max_tp). Every coefficient is >= 0, so a step never gets cheaper with more
 * work. */
/* A step's coefficients per level, as measured with the host's other workers idle. */
typedef struct gy_sim_profiled_alone {
    double base[GY_SIM_COST_LEVELS], per_token[GY_SIM_COST_LEVELS],
        per_sample[GY_SIM_COST_LEVELS], per_kv_read[GY_SIM_COST_LEVELS],
        per_pair[GY_SIM_COST_LEVELS];
} gy_sim_profiled_alone;

typedef struct gy_sim_cost_profiled {
    int32_t n_levels;                           /* 1..GY_SIM_COST_LEVELS levels measured */
    double base[GY_SIM_COST_LEVELS];            /* seconds per step that computes something */
    double per_token[GY_SIM_COST_LEVELS];       /* seconds per computed (query) token */
    double per_sample[GY_SIM_COST_LEVELS];      /* seconds per sampled token (LM head, sampler) */
    double per_kv_read[GY_SIM_COST_LEVELS];     /* seconds per token of KV attention reads */
    double per_pair[GY_SIM_COST_LEVELS];        /* seconds per causal (query, key) pair */
    double transform_slowdown;                  /* >= 0, as the roofline's */
    /* transformation phases: the roofline's bytes per GPU at xfer_bw, plus a latency per layer */
    double kv_bytes_per_token;                  /* > 0: K and V of one token, every layer */
    double ffn_bytes;                           /* >= 0: the FFN weights */
    int32_t n_layers;                           /* >= 1 */
    double xfer_bw;                             /* > 0: bytes/s a GPU receives in a phase */
    double phase_latency_per_layer;             /* >= 0: seconds per layer per phase */
    /* 1: the coefficients above were measured with every instance of the host stepping and
     * `alone` with the others idle; a step interpolates between them by its shape's
     * busy_share (its ops say host_shared). 0: the above for every step. */
    int32_t has_alone;
    gy_sim_profiled_alone alone;
} gy_sim_cost_profiled;

typedef struct gy_sim_cost_constant {
    double step_time;          /* > 0: every step that computes something */
    double phase_time;         /* >= 0: every transformation phase */
    double transform_slowdown; /* >= 0, as above */
} gy_sim_cost_constant;

/* Room for any backend's parameters: a caller that picks the backend by name at run time keeps
 * one of these alive as long as the ops over it. */
typedef struct gy_sim_cost_store {
    gy_sim_roofline roofline;
    gy_sim_cost_constant constant;
    gy_sim_cost_profiled profiled;
} gy_sim_cost_store;

/* Checks the fields (GY_ERR_INVALID naming the first bad one). */
gy_status gy_sim_roofline_check(const gy_sim_roofline *p);
/* Bytes of weights a step of n_tokens reads (every rank together): all of them for a dense
 * model, the dense part and the experts its tokens touch (expected) for a mixture of experts. */
double gy_sim_roofline_weight_read(const gy_sim_roofline *p, int32_t n_tokens);
gy_status gy_sim_cost_constant_check(const gy_sim_cost_constant *p);
gy_status gy_sim_cost_profiled_check(const gy_sim_cost_profiled *p);
/* The ops over `p`, which must outlive them. */
gy_sim_cost_ops gy_sim_cost_roofline_ops(const gy_sim_roofline *p);
gy_sim_cost_ops gy_sim_cost_constant_ops(const gy_sim_cost_constant *p);
gy_sim_cost_ops gy_sim_cost_profiled_ops(const gy_sim_cost_profiled *p);

/* Exposed for the tests and the Python reference check. */
double gy_sim_roofline_step_time(const gy_sim_roofline *p, int32_t tp, int transforming,
                                 const gy_sim_step_shape *s);
double gy_sim_roofline_phase_time(const gy_sim_roofline *p, const gy_sim_phase_shape *ph,
                                  double *bytes_per_gpu);
double gy_sim_profiled_step_time(const gy_sim_cost_profiled *p, int32_t tp, int transforming,
                                 const gy_sim_step_shape *s);

#ifdef __cplusplus
}
#endif
#endif
