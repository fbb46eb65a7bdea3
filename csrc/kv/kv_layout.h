/* kv_layout.h: the one description of how a layer's KV cache is laid out in memory.
 *
 * Gyges (Table 2) compares three orders of the same five logical indices
 * (kv in {K,V}, block, token-in-block, head, d in head_dim); d is always innermost:
 *
 *   GY_KV_LAYOUT_RAW   [K/V, Block, Token, Head, d]  vLLM's token-first layout: all K blocks, then
 *                      all V blocks, so adding blocks moves every V block (growth shifts data).
 *   GY_KV_LAYOUT_PAGE  [Block, K/V, Token, Head, d]  page-friendly: a block's K and V sit together,
 *                      consecutive blocks are adjacent, so appending pages moves nothing.
 *   GY_KV_LAYOUT_HEAD  [Block, Head, K/V, Token, d]  page-friendly and header-centric: inside a
 *                      block the heads are outermost, so the heads a TP worker keeps form one
 *                      contiguous run and the rest can be sent away and reused without trimming.
 *
 * Strides are computed once by gy_kv_layout_init and every reader and writer (the C kernels, the
 * CUDA kernels, the migration code, the NumPy views) goes through gy_kv_layout_offset. */
#ifndef GY_KV_LAYOUT_H
#define GY_KV_LAYOUT_H

#include <stdint.h>

#include "../core/status.h"

#if defined(__CUDACC__)
#define GY_HOST_DEVICE __host__ __device__
#else
#define GY_HOST_DEVICE
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gy_kv_layout_kind {
    GY_KV_LAYOUT_RAW = 0,
    GY_KV_LAYOUT_PAGE = 1,
    GY_KV_LAYOUT_HEAD = 2,
    GY_KV_LAYOUT_COUNT
} gy_kv_layout_kind;

/* Logical dimensions, named for gy_kv_layout_stride_order. */
typedef enum gy_kv_dim {
    GY_KV_DIM_KV = 0,
    GY_KV_DIM_BLOCK = 1,
    GY_KV_DIM_TOKEN = 2,
    GY_KV_DIM_HEAD = 3,
    GY_KV_DIM_COUNT = 4
} gy_kv_dim;

typedef struct gy_kv_layout {
    int32_t kind;        /* gy_kv_layout_kind */
    int64_t block_size;  /* tokens per block */
    int64_t n_heads;     /* KV heads held by this worker */
    int64_t head_dim;    /* values per head */
    int64_t n_blocks;    /* block capacity of the layer (the raw layout's V offset depends on it) */
    int64_t elem_size;   /* bytes per value */
    /* Strides in elements for the logical indices; d has stride 1. */
    int64_t stride_kv;
    int64_t stride_block;
    int64_t stride_token;
    int64_t stride_head;
    int64_t block_elems; /* elements of one block, K and V together: 2 * block_size * n_heads * head_dim */
} gy_kv_layout;

/* Fills `out`; refuses non-positive sizes and unknown kinds. */
gy_status gy_kv_layout_init(gy_kv_layout *out, gy_kv_layout_kind kind, int64_t block_size,
                            int64_t n_heads, int64_t head_dim, int64_t elem_size, int64_t n_blocks);

/* The logical dimensions in storage order, outermost first (Gyges' kv_stride_order()). */
void gy_kv_layout_stride_order(gy_kv_layout_kind kind, int32_t order[GY_KV_DIM_COUNT]);

const char *gy_kv_layout_name(gy_kv_layout_kind kind);

/* Total elements of a layer holding n_blocks blocks. */
static inline int64_t gy_kv_layout_layer_elems(const gy_kv_layout *layout) {
    return layout->n_blocks * layout->block_elems;
}

/* Element offset, inside the layer's storage, of value d = 0 of (kv, block, token, head). */
GY_HOST_DEVICE static inline int64_t gy_kv_layout_offset(const gy_kv_layout *layout, int64_t kv,
                                                         int64_t block, int64_t token,
                                                         int64_t head) {
    return kv * layout->stride_kv + block * layout->stride_block + token * layout->stride_token +
           head * layout->stride_head;
}

#ifdef __cplusplus
}
#endif
#endif
