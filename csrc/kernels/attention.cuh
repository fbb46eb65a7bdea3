/* attention.cuh: what the two paged-attention kernels share: the host-side argument check, the
 * lookup of a sequence position in the paged KV cache, 16-byte loads of KV rows widened to fp32,
 * and loads and stores of activations whose dtype is a run-time value.
 *
 * Conventions (both kernels, see kernels.h): query token t belongs to sequence token_seq[t] and
 * sits at position token_pos[t]; it attends over positions 0..token_pos[t] of its sequence, whose
 * K/V rows are read through gy_kv_layout_offset. Query head h reads KV head h / (n_q_heads /
 * layout->n_heads). Scores, softmax and the weighted sum of V are fp32 (online softmax); the
 * output is rounded once to the activation dtype.
 *
 * Robustness on the device (the host checks the tables; the kernels must still never read out of
 * bounds when a table is stale): a token whose sequence is outside [0, n_seqs) or whose position
 * is negative (or 2^31 - 1) gets an output of zeros; a position past the blocks its sequence owns, or whose
 * block id is outside [0, layout->n_blocks), is skipped (it takes no part in the softmax). */
#ifndef GY_KERNELS_ATTENTION_CUH
#define GY_KERNELS_ATTENTION_CUH

#include <math.h>

#include "common.cuh"

#define GY_ATTN_MAX_HEAD_DIM 256

/* ---- host: the checks of both entry points after gy_cuda_paged_attention_check ---- */

static inline gy_status gy_attn_check_pointers(const char *what, const void *out, const void *q,
                                               const void *layer_base, const int32_t *token_seq,
                                               const int32_t *token_pos,
                                               const int32_t *bt_indptr,
                                               const int32_t *bt_indices, int64_t n_seqs) {
    if (out == NULL || q == NULL || layer_base == NULL || token_seq == NULL ||
        token_pos == NULL || bt_indptr == NULL || (bt_indices == NULL && n_seqs > 0))
        return GY_FAIL(GY_ERR_INVALID, "%s: NULL buffer", what);
    if ((uintptr_t)layer_base % 16 != 0)
        return GY_FAIL(GY_ERR_INVALID, "%s: layer_base %p is not 16-byte aligned", what,
                       layer_base);
    return GY_OK;
}

/* ---- device ---- */

/* The paged-KV view of one query token's sequence. */
struct gy_attn_seq {
    const int32_t *blocks; /* the sequence's block ids, logical order */
    int32_t owned;         /* how many */
    int32_t len;           /* positions attended: token_pos + 1, or 0 for a stale token */
};

__device__ __forceinline__ gy_attn_seq gy_attn_seq_of(int64_t t, const int32_t *token_seq,
                                                      const int32_t *token_pos,
                                                      const int32_t *bt_indptr,
                                                      const int32_t *bt_indices, int64_t n_seqs) {
    gy_attn_seq s = {bt_indices, 0, 0};
    const int32_t seq = token_seq[t], pos = token_pos[t];
    if (seq < 0 || seq >= n_seqs || pos < 0 || pos == INT32_MAX) return s;
    const int32_t first = bt_indptr[seq];
    s.blocks = bt_indices + first;
    s.owned = bt_indptr[seq + 1] - first;
    s.len = pos + 1;
    return s;
}

/* The block holding position j of the sequence (and j's slot in it), or -1 when there is none
 * (stale table). 32-bit division: positions and block sizes are below 2^31. */
__device__ __forceinline__ int64_t gy_attn_block(const gy_attn_seq &s, const gy_kv_layout &L,
                                                 int32_t j, int32_t *slot) {
    const int32_t bs = (int32_t)L.block_size, lb = j / bs;
    *slot = j - lb * bs;
    if (lb >= s.owned) return -1;
    const int64_t block = s.blocks[lb];
    return block >= 0 && block < L.n_blocks ? block : -1;
}

/* 16 bytes of KV values widened to fp32: 4 floats or 8 halves/bfloat16s. */
template <typename KV> struct gy_attn_vec {
    static constexpr int n = 16 / (int)sizeof(KV);
};

__device__ __forceinline__ void gy_attn_unpack(const uint4 &raw, float (&f)[4], float) {
    f[0] = __uint_as_float(raw.x);
    f[1] = __uint_as_float(raw.y);
    f[2] = __uint_as_float(raw.z);
    f[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ void gy_attn_unpack(const uint4 &raw, float (&f)[8], __half) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __half2 h;
        memcpy(&h, &w[i], sizeof h);
        const float2 p = __half22float2(h);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

__device__ __forceinline__ void gy_attn_unpack(const uint4 &raw, float (&f)[8], __nv_bfloat16) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) { /* bf16 is the upper half of a binary32: exact shifts */
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

/* The 16 bytes at element `elem` of a KV storage of KV values (elem a multiple of 16 bytes). */
template <typename KV>
__device__ __forceinline__ uint4 gy_attn_load16(const void *storage, int64_t elem) {
    return __ldg((const uint4 *)((const char *)storage + elem * (int64_t)sizeof(KV)));
}

/* Activations: the dtype is a run-time value (q is read once per work item, out written once,
 * so the switch costs nothing and the kernels need no activation template parameter). */
__device__ __forceinline__ float gy_attn_load_act(const void *p, int dtype, int64_t i) {
    switch (dtype) {
    case GY_DTYPE_F16: return __half2float(((const __half *)p)[i]);
    case GY_DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

__device__ __forceinline__ void gy_attn_store_act(void *p, int dtype, int64_t i, float x) {
    switch (dtype) {
    case GY_DTYPE_F16: ((__half *)p)[i] = __float2half_rn(x); break;
    case GY_DTYPE_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(x); break;
    default: ((float *)p)[i] = x; break;
    }
}

/* The online-softmax update of a running maximum m by a new maximum candidate: the factor the
 * old sums are multiplied by and the new maximum. While nothing has been seen (both -inf) the
 * factor is 1 and weights must be taken as 0 (exp(-inf - -inf) would be NaN). */
__device__ __forceinline__ float gy_attn_weight(float s, float m_new) {
    return m_new == -INFINITY ? 0.0f : expf(s - m_new);
}

#endif
