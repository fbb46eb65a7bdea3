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
 * TP1. The KV cache of a worker holds only its KV heads. */
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
} gy_tp_group;

typedef struct gy_forward_batch {
    const int32_t *tokens;     /* [paged.n_tokens] token ids */
    gy_cpu_paged_batch paged;  /* sequences, positions and block tables of the tokens */
    int64_t n_logits;
    const int32_t *logit_rows; /* [n_logits] indices of the tokens whose logits are wanted */
} gy_forward_batch;

/* Scratch buffers, grown on demand and reused from step to step. */
typedef struct gy_forward_ws {
    int64_t capacity_tokens;
    float *x, *h, *q, *k, *v, *attn, *o, *g, *u, *parts, *sel;
} gy_forward_ws;

void gy_forward_ws_free(gy_forward_ws *ws);

/* The pass in three parts, so that a layer-staggered transformation can run some layers in one
 * configuration and the rest in another: begin checks the batch and sizes the workspace, and
 * embeds the tokens into ws->x when `embed` (else the caller fills ws->x); layers runs
 * [first_layer, end_layer) on ws->x; end computes the logits of batch->logit_rows. */
gy_status gy_forward_begin(const gy_model *model, const gy_tp_group *tp, gy_kv_cache *kv,
                           const gy_forward_batch *batch, gy_forward_ws *ws, int embed);
gy_status gy_forward_layers(const gy_model *model, const gy_tp_group *tp, gy_kv_cache *kv,
                            const gy_forward_batch *batch, gy_forward_ws *ws, gy_threadpool *pool,
                            int64_t first_layer, int64_t end_layer);
gy_status gy_forward_end(float *logits, const gy_model *model, const gy_forward_batch *batch,
                         gy_forward_ws *ws, gy_threadpool *pool);

/* All three: logits [n_logits, vocab] (may be NULL when n_logits is 0, e.g. on ranks > 0). */
gy_status gy_forward(float *logits, const gy_model *model, const gy_tp_group *tp, gy_kv_cache *kv,
                     const gy_forward_batch *batch, gy_forward_ws *ws, gy_threadpool *pool);

#ifdef __cplusplus
}
#endif
#endif
