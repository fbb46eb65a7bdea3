/* model.h: a Llama/Qwen2/Qwen3 decoder, dense or mixture-of-experts (Mixtral, Qwen2-MoE,
 * Qwen3-MoE), whose weights live in a worker's arena.
 *
 * The weights are placed by gyges/weights.py: replicated tensors packed together, the FFN cut
 * into max_tp page-aligned shards (Gyges eq. 2). This struct only points into that memory.
 * Matrices are stored in weight_dtype, norms and biases in fp32. Two matrices are stored
 * transposed so that a tensor-parallel shard of their reduction dimension is a run of rows:
 *   wo_t   [n_heads * head_dim, hidden]   (o_proj.weight.T)
 *   down_t [intermediate, hidden]         (down_proj.weight.T), one pointer per shard
 * and the rest keep the Hugging Face orientation [out, in].
 *
 * A mixture-of-experts layer (its `router` set) has n_experts FFNs cut into max_tp shards like
 * the dense one (expert_rows a shard), each expert's shards in pages of their own; its
 * gate/up/down_t hold the shared expert when the model has one (shared_rows a shard, Qwen2-MoE).
 *
 * Where the pointers point is the model's backend: host memory (cpu, the default of a zeroed
 * struct) or the device memory of a CUDA arena (cuda), in which case the model also names its
 * device and the worker's stream (forward_cuda.h sets them up). */
#ifndef GY_ENGINE_MODEL_H
#define GY_ENGINE_MODEL_H

#include <stdint.h>

#include "../core/dtype.h"
#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_MODEL_MAX_TP 8

/* One expert's FFN, cut like the dense one; shard s: [expert_rows, hidden]. */
typedef struct gy_expert_weights {
    const void *gate[GY_MODEL_MAX_TP];
    const void *up[GY_MODEL_MAX_TP];
    const void *down_t[GY_MODEL_MAX_TP];
} gy_expert_weights;

typedef struct gy_layer_weights {
    const float *attn_norm;           /* [hidden] */
    const float *ffn_norm;            /* [hidden] */
    const void *wq;                   /* [n_heads * head_dim, hidden] */
    const void *wk;                   /* [n_kv_heads * head_dim, hidden] */
    const void *wv;                   /* [n_kv_heads * head_dim, hidden] */
    const float *bq, *bk, *bv;        /* [rows of wq / wk / wv] or NULL (Qwen2 has them) */
    const void *wo_t;                 /* [n_heads * head_dim, hidden] */
    const void *gate[GY_MODEL_MAX_TP];   /* shard s: [shard_rows, hidden]; NULL if not held */
    const void *up[GY_MODEL_MAX_TP];     /* shard s: [shard_rows, hidden] */
    const void *down_t[GY_MODEL_MAX_TP]; /* shard s: [shard_rows, hidden] */
    /* (gate, up, down_t of an MoE layer: the shared expert's shards [shared_rows, hidden].) */
    const float *q_norm, *k_norm;     /* [head_dim] or NULL: Qwen3's RMSNorm of each q / k head */
    const float *router;              /* [n_experts, hidden] or NULL: a dense FFN */
    const float *shared_gate;         /* [hidden] or NULL: the shared expert's sigmoid gate */
    gy_expert_weights *experts;       /* [n_experts] (the model's array) when n_experts > 0 */
} gy_layer_weights;

typedef enum gy_model_backend {
    GY_MODEL_BACKEND_CPU = 0,  /* weights in host memory; forward.c's CPU kernels */
    GY_MODEL_BACKEND_CUDA = 1, /* weights in device memory; forward_cuda.c */
} gy_model_backend;

typedef struct gy_model {
    int64_t vocab;
    int64_t hidden;
    int64_t intermediate;
    int64_t n_layers;
    int64_t n_heads;
    int64_t n_kv_heads;
    int64_t head_dim;
    int64_t max_tp;      /* FFN shards; o_proj's reduction is cut into as many chunks */
    int64_t shard_rows;  /* intermediate / max_tp */
    int64_t max_pos;     /* rotary table length: positions [0, max_pos), max_pos <= INT32_MAX */
    /* Mixture of experts (n_experts 0: every layer dense). Each token of an MoE layer goes to its
     * n_experts_used experts of highest router logit (ties: the lower index), weighted by their
     * softmax probabilities over all experts, renormalised over the chosen when norm_topk_prob. */
    int64_t n_experts, n_experts_used;
    int64_t expert_intermediate;  /* an expert's FFN width; expert_rows = it / max_tp */
    int64_t shared_intermediate;  /* the shared expert's (0: none); shared_rows = it / max_tp */
    int64_t expert_rows, shared_rows;
    int32_t norm_topk_prob;
    /* The experts this model holds (gy_model_init: all, which TP shards like the dense FFN).
     * Expert parallelism: rank r of a TP group of t holds experts [r*E/t, (r+1)*E/t), each with
     * every shard, while attention, dense layers and the shared expert stay TP-sharded. */
    int64_t expert_begin, expert_end;
    float rms_eps;
    gy_dtype weight_dtype;
    gy_model_backend backend;
    int32_t device;               /* cuda: the device ordinal */
    struct CUstream_st *stream;   /* cuda: the worker's stream (a cudaStream_t), owned */
    const void *embed;        /* [vocab, hidden] */
    const float *final_norm;  /* [hidden] */
    const void *lm_head;      /* [vocab, hidden]; equals embed when tied */
    gy_layer_weights *layers; /* [n_layers], owned */
    gy_expert_weights *experts; /* [n_layers * n_experts], owned; layer l's from l * n_experts */
    /* What this worker holds (gy_model_init: everything): the layers [layer_begin, layer_end)
     * (a pipeline stage holds its own), the embedding, the final norm and LM head. Only what
     * it holds is checked, and the forward pass refuses to run anything else. */
    int64_t layer_begin, layer_end;
    int32_t has_embed, has_head;
    /* The rotary embedding as data (gyges/models/rope.py: scaled or not, from the config):
     * angle = position * rope_inv_freq[i], and cos and sin are multiplied by rope_mscale. */
    double *rope_inv_freq;    /* [head_dim / 2], owned (gy_model_init) */
    double rope_mscale;       /* YaRN's attention factor; 1 otherwise */
    float *rope_cos;          /* [max_pos, head_dim / 2], owned (host; the cpu backend's) */
    float *rope_sin;
    float *rope_inv_freq_dev; /* cuda: [head_dim / 2] fp32 on the device, owned (the attach's) */
} gy_model;

#define GY_MODEL_MAX_EXPERTS 1024

/* Checks the shape fields (the expert ones too), copies the rotary frequencies (inv_freq [head_dim / 2], each finite
 * and > 0; mscale finite and > 0) and allocates `layers`, `experts` and the rotary tables; the caller fills
 * the weight pointers afterwards. The tables are refused (GY_ERR_INVALID past int32 positions,
 * GY_ERR_OUT_OF_MEMORY past the machine's physical memory) before anything is allocated. They
 * are copied from `tables_from` when it has the same max_pos, head_dim, frequencies and mscale
 * (computing them costs ~1 ms for 4096 positions, which a transformation pays for every new
 * rank's model), else computed; it may be NULL. */
gy_status gy_model_init(gy_model *model, const double *inv_freq, double mscale,
                        const gy_model *tables_from);
void gy_model_free(gy_model *model);
/* GY_ERR_INVALID naming the first missing tensor of what the model holds (shard pointers are
 * checked for `shards`, a bitmask of the FFN shards this worker must hold; in an MoE layer, every
 * expert's and the shared expert's). */
gy_status gy_model_check(const gy_model *model, uint32_t shards);

#ifdef __cplusplus
}
#endif
#endif
