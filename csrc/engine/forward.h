/* forward.h: one forward pass of a batch of tokens through a gy_model on one worker.
 *
 * A batch mixes prefill chunks and decode tokens of several sequences (paged.h describes which
 * token belongs to which sequence at which position, and the sequences' block tables). The new
 * tokens' K/V are written into the worker's KV cache, attention reads it back, and logits are
 * computed for the rows the caller asks for (the last token of each sequence that samples).
 *
 * Tensor parallelism: a worker of rank r in a group of `size` computes the attention heads
 * [r * n_heads / size, ...) and KV heads likewise, and the FFN shards
 * [r * max_tp / size, (r + 1) * max_tp / size). The o_proj and FFN partial sums are combined by
 * the group's all-reduce in the tree order of linear.h, so every TP degree gives the same bits as
 * TP1. The KV cache of a worker holds only its KV heads. An expert-parallel model (model.h:
 * each rank holds a block of whole experts) computes its experts' outputs for every shard and
 * all-reduces them (one rank's rows and zeros elsewhere: exact), then combines its own shards as
 * TP does, so expert parallelism too gives TP1's bits.
 *
 * Backends: the three calls below dispatch on model->backend. A cpu model runs here (forward.c,
 * the CPU kernels, fp32 activations); a cuda model runs in forward_cuda.c on the worker's stream
 * with the same contract, its activations in the weight dtype and its logits copied back to the
 * host (see forward_cuda.h). Callers (the engine, the extension) never need to know which. */
#ifndef GY_ENGINE_FORWARD_H
#define GY_ENGINE_FORWARD_H

#include <stdint.h>

#include "../cpu/paged.h"
#include "../cpu/threadpool.h"
#include "../kv/kv_cache.h"
#include "model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_tp_group {
    int32_t rank;
    int32_t size;  /* 1, 2, 4 or 8, dividing n_kv_heads and max_tp */
    /* Replaces buf [n] on every rank by the pairwise-tree sum over ranks ((r0+r1)+(r2+r3));
     * unused when size == 1. */
    gy_status (*all_reduce)(void *ctx, float *buf, int64_t n);
    void *ctx;
    /* 0: buf is host memory (the CPU pass). 1: buf is device memory of the worker's GPU and the
     * reduction is ordered on the worker's stream (model->stream; e.g. an NCCL communicator on
     * that stream), which the CUDA pass needs when size > 1. */
    int32_t device_buffers;
} gy_tp_group;

/* KunServe's remote attention: one sequence of the batch whose KV for some layers is still in
 * another worker's cache (a buddy group's exchange has not moved it yet). For those layers its
 * rows' new K/V are written there and attention runs there: with that worker's threads (CPU),
 * from this worker's stream (CUDA, one device), or on that device after a peer copy of the
 * rows' q, k and v, the output copied back (CUDA, two devices; forward_cuda.c); the projections
 * and the FFN stay here (attention needs no parameters). The rows are the sequence's
 * tokens [row0, row0 + n_rows) of the batch, positions batch.paged.token_pos[row0 ...]; a real
 * link carries their q, k, v there and the attention output back. */
typedef struct gy_forward_remote {
    gy_kv_cache *kv;           /* the other worker's cache, holding layers [first_layer, end_layer) */
    gy_threadpool *pool;       /* the other worker's threads (may be NULL) */
    int64_t first_layer, end_layer; /* model layers whose attention runs there */
    int64_t row0, n_rows;
    int32_t indptr[2];         /* {0, n_blocks} */
    const int32_t *blocks;     /* [n_blocks] the sequence's blocks in kv */
} gy_forward_remote;

typedef struct gy_forward_batch {
    const int32_t *tokens;     /* [paged.n_tokens] token ids */
    gy_cpu_paged_batch paged;  /* sequences, positions and block tables of the tokens */
    int64_t n_logits;
    const int32_t *logit_rows; /* [n_logits] indices of the tokens whose logits are wanted */
    int64_t n_remote;          /* parts in increasing, disjoint row order */
    const gy_forward_remote *remote; /* [n_remote] */
    const int32_t *zeros;      /* [paged.n_tokens] zeros when n_remote > 0 (the parts' token_seq) */
} gy_forward_batch;

struct gy_forward_cuda_ws;

/* Scratch buffers, grown on demand and reused from step to step (a zeroed struct is empty). */
/* A rank's scratch for one step of n <= capacity_tokens tokens, grown on demand. The CPU
 * backend's buffers, fp32, row-major, with this rank's local sizes (qd = n_heads * head_dim,
 * kvd = n_kv_heads * head_dim; a TP rank uses its share of each row):
 *   x, h, o   (n, hidden)        the residual stream, the normed input, the output of a block
 *   q, attn   (n, qd)            queries, attention output
 *   k, v      (n, kvd)           this step's keys and values
 *   g, u      (n, rows)          gate and up of one FFN shard (rows: the widest of shard_rows,
 *                                expert_rows and shared_rows; an expert's tokens are at most n)
 *   parts     (n, max_tp*hidden) partial sums before the fixed-order reduction
 *   sel       (n, hidden)        the rows whose logits are asked for
 * and for a mixture of experts (E = n_experts, k = n_experts_used; cpu/moe.h):
 *   logits    (n, E)             router logits        choice (n, k) int32, weight (n, k)
 *   xs        (n*k, hidden)      the tokens' rows grouped by expert
 *   ys        (P, n*k, hidden)   the experts' outputs (P = max_tp when expert-parallel: every
 *                                shard's, exchanged by the all-reduce; else 1: one shard's)
 *   token_of, slot_of (n*k) int32, offsets (E+1) int64: the grouping;  sg (n) shared gate logit
 * A CUDA model keeps its own device buffers in `cuda` (forward_cuda.c lists them). */
typedef struct gy_forward_ws {
    int64_t capacity_tokens;
    float *x, *h, *q, *k, *v, *attn, *o, *g, *u, *parts, *sel;
    float *logits, *weight, *xs, *ys, *sg;
    int32_t *choice, *token_of, *slot_of;
    int64_t *offsets;
    int64_t ys_parts;  /* P that ys was sized for (an expert-parallel model needs max_tp) */
    struct gy_forward_cuda_ws *cuda; /* a cuda model's device workspace, made on first use */
} gy_forward_ws;

void gy_forward_ws_free(gy_forward_ws *ws);

/* The checks every backend makes before touching memory: the TP group fits the model, the KV
 * cache matches the model's layers and this rank's KV heads, the batch's tokens, positions and
 * block tables fit the cache (*max_len gets the largest position + 1), and the logit rows exist. */
gy_status gy_forward_check(const gy_model *model, const gy_tp_group *tp, const gy_kv_cache *kv,
                           const gy_forward_batch *batch, int64_t *max_len);

/* The pass in three parts, so that a layer-staggered transformation can run some layers in one
 * configuration and the rest in another: begin checks the batch and sizes the workspace, and
 * embeds the tokens into ws->x when `embed` (else the caller fills ws->x); layers runs
 * [first_layer, end_layer) on ws->x; end computes the logits of batch->logit_rows. */
/* GY_ERR_INVALID unless layers [first_layer, end_layer) are the model's and all in the cache
 * (a stage's cache may hold only the stage's layers: kv_cache.h's first_layer). */
gy_status gy_forward_check_layers(const gy_model *model, const gy_kv_cache *kv,
                                  int64_t first_layer, int64_t end_layer);
gy_status gy_forward_begin(const gy_model *model, const gy_tp_group *tp, gy_kv_cache *kv,
                           const gy_forward_batch *batch, gy_forward_ws *ws, int embed);
gy_status gy_forward_layers(const gy_model *model, const gy_tp_group *tp, gy_kv_cache *kv,
                            const gy_forward_batch *batch, gy_forward_ws *ws, gy_threadpool *pool,
                            int64_t first_layer, int64_t end_layer);
gy_status gy_forward_end(float *logits, const gy_model *model, const gy_forward_batch *batch,
                         gy_forward_ws *ws, gy_threadpool *pool);

/* A pipeline stage's hidden states through host memory (forward_backend.h says how): after
 * gy_forward_begin without embedding, x_in fills the workspace's x; after gy_forward_layers,
 * x_out reads it back. Rows of row_bytes; row i is host row map[i] (i when map is NULL). */
gy_status gy_forward_x_in(const gy_model *model, gy_forward_ws *ws, const void *host,
                          size_t row_bytes, const int32_t *map, int64_t n);
gy_status gy_forward_x_out(const gy_model *model, gy_forward_ws *ws, void *host, size_t row_bytes,
                           const int32_t *map, int64_t n);

/* All three: logits [n_logits, vocab] (may be NULL when n_logits is 0, e.g. on ranks > 0). */
gy_status gy_forward(float *logits, const gy_model *model, const gy_tp_group *tp, gy_kv_cache *kv,
                     const gy_forward_batch *batch, gy_forward_ws *ws, gy_threadpool *pool);

#ifdef __cplusplus
}
#endif
#endif
