/* pipeline.h: pipeline instances of the simulator (PipeLive): an ordered tuple of stages, stage i
 * running the next layers[i] layers on one GPU of its own kind (heterogeneous: an A100-80GB then
 * an L40S). One description (gy_sim_pipeline) prices a step, sizes the KV cache and costs a
 * re-split; the simulator (sim/) and the pipelive policy (policy_pipelive.c) both read it, and
 * gyges/costmodel.py's PipelineCost computes its fields and holds the float64 reference.
 *
 * Step of a split (layers[0..n)), for the batch shape of cost.h:
 *   stage i:  bytes_i = L_i (W + kv_layer (kv_read_tokens + n_tokens)) [+ head_bytes, last]
 *             flops_i = L_i (2 layer_params n_tokens + attn_layer attn_pairs)
 *                       [+ 2 lm_head_params n_samples, last]
 *             t_i     = max(bytes_i / (hbm_bw_i eff_bw_i), flops_i / (peak_i eff_flops_i))
 *   With m = min(micro_batches, n, n_seqs) micro-batches (at least 1), each carrying 1/m of
 *   the step's tokens, samples, KV reads and pairs (t_i(s/m)), circulating through the stages
 *   (vLLM's virtual engines): a step, every micro-batch moved on by one iteration, takes
 *     step = step_overhead + max(m max_i t_i(s/m), sum_i t_i(s/m) + (n - 1) h(s/m)),
 *     h(s) = n_tokens act_bytes / link_bw + link_latency (one hand-off),
 *   the first when the busiest stage is the bottleneck, the second when one micro-batch's
 *   round trip is (m = 1: one batch in flight, sum_i t_i + (n - 1) h). So a prefill (compute
 *   bound) runs about m times faster than with one batch in flight, and a decode (reading the
 *   weights once per micro-batch) about as fast;
 *   times (1 + transform_slowdown) while a re-split migrates.
 * KV capacity (every stage holds the same blocks, each for its own layers; PipeLive's MaxBlocks):
 *   MaxBlocks(i, L) = floor((budget_i - L W) / (L P)), P = kv_layer * block_size,
 *   capacity(split) = min_i MaxBlocks(i, L_i), 0 when a stage's weights do not fit
 *   (without resizing, fixed_blocks when that fits, else 0).
 * Re-split cur -> tgt (PipeLive Algorithm 1): stage i receives the layers tgt_i \ cur_i (their
 * weights W each and their KV for the live tokens, kv_layer each); stages receive in parallel,
 *   migration = max_i received_i / (link_bw eff_xfer),
 * during which it serves at cur with capacity B_shrink = min_i MaxBlocks(i, |cur_i u tgt_i|)
 * (both layer sets held); then a stop of stop_time at the commit, after which it serves at tgt
 * with capacity(tgt).
 *
 * KunServe's buddy groups (sim/sim.h: a buddy cluster) reuse the description: the first g stages
 * (gy_sim_pipeline_sub) price a group of g instances that keep one copy of the layers, split
 * evenly (gy_sim_pipeline_even), and g = 1 prices one instance with every layer. Their costs:
 *   exchange  (a drop) member k held T_k live tokens of every layer; stage j keeps layers L_j:
 *             k sends T_k kv_layer (n_layers - L_k), j receives sum_{k != j} T_k kv_layer L_j;
 *             seconds = max_j max(sent_j, received_j) / (link_bw eff_xfer);
 *   remote attention  a step whose victim tokens (queries of requests whose KV is still partly
 *             on their old GPU) meet R such layers: R (2 victim_tokens act_bytes / link_bw +
 *             2 link_latency) seconds more (the activation goes to the KV's holder and back);
 *   restore   member k gets back the n_layers - L_k layers it dropped, from its peers over the
 *             link and from the host copy over host_bw at once:
 *             seconds = max_k (n_layers - L_k) W / (link_bw eff_xfer + host_bw);
 *   gather    then member k receives its requests' KV (T_k tokens) of the layers it did not hold:
 *             max_k T_k kv_layer (n_layers - L_k) / (link_bw eff_xfer). */
#ifndef GY_POLICY_PIPELINE_H
#define GY_POLICY_PIPELINE_H

#include <stdint.h>

#include "../core/status.h"
#include "cost.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_SIM_MAX_STAGES 8 /* as gyges/layout.py's MAX_STAGES */

typedef struct gy_sim_pipe_stage {
    double budget_bytes; /* > 0: memory * mem_util - activations - the stage's fixed weights
                            (the embedding on the first, final norm and LM head on the last):
                            what its layers' weights and KV share */
    double hbm_bw;       /* bytes/s */
    double peak_flops;   /* dense FLOP/s */
    double eff_bw, eff_flops; /* > 0: achieved fractions */
} gy_sim_pipe_stage;

typedef struct gy_sim_pipeline {
    int32_t n_stages;    /* 2 .. GY_SIM_MAX_STAGES */
    int32_t n_layers;    /* >= n_stages */
    gy_sim_pipe_stage stage[GY_SIM_MAX_STAGES]; /* (n_stages) in pipeline order */
    double layer_bytes;  /* W: weight bytes of one decoder layer */
    double layer_params; /* matmul parameters of one layer: 2 FLOPs per token each */
    double attn_flops_per_pair; /* one layer: 4 * query heads * head_dim */
    double kv_layer;     /* K and V bytes of one token in one layer (all KV heads) */
    double lm_head_params; /* >= 0: hidden * vocab, on the last stage */
    double head_bytes;   /* >= 0: weight bytes the last stage reads beyond its layers */
    double act_bytes;    /* >= 0: bytes of one token's hidden state sent between stages */
    double link_bw;      /* bytes/s between consecutive stages */
    double link_latency; /* >= 0: seconds per hand-off between stages */
    double eff_xfer;     /* > 0: achieved fraction of link_bw for a re-split's copies */
    double step_overhead;      /* >= 0: seconds per step */
    double transform_slowdown; /* >= 0: a step during a migration takes (1 + this) longer */
    double stop_time;    /* >= 0: seconds serving stops at a re-split's commit (PipeLive: ~10 ms) */
    int64_t block_size;  /* tokens per KV block */
    int64_t fixed_blocks;/* >= 0. 0: the KV cache is resized with each split (PipeLive's
                            ResizeKV); > 0: every split keeps this many blocks (no resizing),
                            and a split or intermediate whose MaxBlocks fall below it has none */
    double host_bw;      /* >= 0: bytes/s a GPU reads the host's copy of the weights at (PCIe;
                            a buddy restore's second source); 0: no host copy */
    int32_t micro_batches; /* >= 0: batches in flight at once, at most one per stage counts
                              (0 and 1: one batch; the step formula above) */
    int32_t flush;       /* 1: every step fills and drains the pipeline (synchronous steps, the
                            GPipe bubble): step = step_overhead + (m + n - 1) max_i t_i(s/m)
                            + (n - 1) h(s/m); 0: micro-batches circulate without a drain */
} gy_sim_pipeline;

/* Checks the fields (GY_ERR_INVALID naming the first bad one). */
gy_status gy_sim_pipeline_check(const gy_sim_pipeline *p);
/* 1 when layers (n_stages entries) is a split of the model: each >= 1, summing to n_layers. */
int gy_sim_pipeline_split_ok(const gy_sim_pipeline *p, const int32_t *layers);
/* MaxBlocks(i, L): 0 when L layers' weights leave no room (L >= 1). */
int64_t gy_sim_pipeline_max_blocks(const gy_sim_pipeline *p, int32_t stage, int32_t n_layers);
/* KV blocks of a split: min over its stages (or fixed_blocks, above). */
int64_t gy_sim_pipeline_capacity(const gy_sim_pipeline *p, const int32_t *layers);
/* An upper bound of every split's capacity (the counter's size): fixed_blocks, or
 * min_i MaxBlocks(i, 1). */
int64_t gy_sim_pipeline_max_capacity(const gy_sim_pipeline *p);
/* B_shrink of a re-split cur -> tgt: min_i MaxBlocks(i, |cur_i u tgt_i|). */
int64_t gy_sim_pipeline_shrink_capacity(const gy_sim_pipeline *p, const int32_t *cur,
                                        const int32_t *tgt);
/* Seconds of one step at a split; 0 when the shape computes nothing. */
double gy_sim_pipeline_step_time(const gy_sim_pipeline *p, const int32_t *layers,
                                 int transforming, const gy_sim_step_shape *s);
/* Seconds of a re-split's migration with kv_tokens live tokens; *weight_bytes and *kv_bytes
 * (never NULL) receive the bytes moved in all. */
double gy_sim_pipeline_migration_time(const gy_sim_pipeline *p, const int32_t *cur,
                                      const int32_t *tgt, double kv_tokens,
                                      double *weight_bytes, double *kv_bytes);
/* The first g stages as a pipeline of their own (1 <= g <= n_stages; g = 1 allowed here
 * though gy_sim_pipeline_check wants 2): stage g - 1 takes the last stage's budget (the LM
 * head), and with g = 1 the one stage also pays the embedding (stage 0's) when n_stages >= 3
 * shows what a middle stage keeps. */
gy_sim_pipeline gy_sim_pipeline_sub(const gy_sim_pipeline *p, int32_t g);
/* The even split of p's n_layers over its n_stages: the first n_layers % n_stages get one more. */
void gy_sim_pipeline_even(const gy_sim_pipeline *p, int32_t *layers);
/* Buddy costs (the header comment); tokens (n_stages) per member; *bytes never NULL. */
double gy_sim_pipeline_exchange_time(const gy_sim_pipeline *p, const int32_t *layers,
                                     const double *tokens, double *kv_bytes);
double gy_sim_pipeline_remote_time(const gy_sim_pipeline *p, double remote_layers,
                                   double victim_tokens);
double gy_sim_pipeline_restore_time(const gy_sim_pipeline *p, const int32_t *layers,
                                    double *weight_bytes);
double gy_sim_pipeline_gather_time(const gy_sim_pipeline *p, const int32_t *layers,
                                   const double *tokens, double *kv_bytes);
/* Enumerates splits whose stages are multiples of `granularity` layers (the last stage takes the
 * remainder, >= 1): start with layers[0] = 0 (it writes the first); returns 0 after the last. */
int gy_sim_pipeline_next_split(const gy_sim_pipeline *p, int32_t granularity, int32_t *layers);

#ifdef __cplusplus
}
#endif
#endif
