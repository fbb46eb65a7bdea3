/* attention.h: paged attention over a layer's KV cache (attention.cuh,
 * paged_attention_decode.cu, paged_attention_prefill.cu).
 * The conventions of every kernel header are in kernels.h. Only declared when gyges is built with
 * CUDA (GY_WITH_CUDA). */
#ifndef GY_KERNELS_ATTENTION_H
#define GY_KERNELS_ATTENTION_H

#include "../core/dtype.h"
#include "../kv/kv_layout.h"
#include "device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- paged attention (attention.cuh, paged_attention_decode.cu, paged_attention_prefill.cu) ----
 *
 * Causal attention of query tokens over a layer's paged KV cache, any of the three layouts: query
 * token t (sequence token_seq[t], position token_pos[t], the CSR tables of cpu/paged.h) attends
 * over positions 0..token_pos[t] of its sequence, whose K/V must already be in the cache (write a
 * chunk's K/V with gy_cuda_kv_write first). Query head h reads KV head h / (n_q_heads /
 * layout->n_heads) (GQA). Scores q.k * scale, online softmax and the weighted sum of V are fp32;
 * the output is rounded once to act_dtype.
 *   out, q:     (n_tokens, n_q_heads, layout->head_dim) act_dtype; out must not overlap q
 *   layer_base: (layout) kv_dtype, 16-byte aligned; layout->elem_size = gy_dtype_size(kv_dtype)
 *   head_dim:   a multiple of 8, at most 256; n_q_heads: a multiple of layout->n_heads
 *   max_len:    a host upper bound on token_pos[t] + 1 over the batch (it sizes the split of the
 *               KV length; a token past it is still right, only slower)
 *   workspace:  device scratch of gy_cuda_paged_attention_workspace_bytes(n_tokens, n_q_heads,
 *               head_dim, max_len) bytes, 4-byte aligned (NULL when that is 0)
 * Both entry points are correct for any batch; the caller picks the faster one: decode splits
 * each token's KV length into partitions (flash-decoding) so that a few long sequences fill the
 * GPU; prefill shares K/V tiles among 32 consecutive query tokens of a sequence. Stale entries
 * (sequence or position out of range) give zeros; positions without a valid block are skipped. */
gy_status gy_cuda_paged_attention_check(gy_dtype act_dtype, const gy_kv_layout *layout,
                                        gy_dtype kv_dtype, int64_t n_tokens, int64_t n_seqs,
                                        int64_t n_q_heads, int64_t max_len, float scale);
int64_t gy_cuda_paged_attention_workspace_bytes(int64_t n_tokens, int64_t n_q_heads,
                                                int64_t head_dim, int64_t max_len);
gy_status gy_cuda_paged_attention_decode(void *out, const void *q, gy_dtype act_dtype,
                                         const void *layer_base, const gy_kv_layout *layout,
                                         gy_dtype kv_dtype, const int32_t *token_seq,
                                         const int32_t *token_pos, int64_t n_tokens,
                                         const int32_t *bt_indptr, const int32_t *bt_indices,
                                         int64_t n_seqs, int64_t n_q_heads, int64_t max_len,
                                         float scale, void *workspace, int64_t workspace_bytes,
                                         gy_cuda_stream stream);
/* The same contract; needs no workspace (it is ignored). */
gy_status gy_cuda_paged_attention_prefill(void *out, const void *q, gy_dtype act_dtype,
                                          const void *layer_base, const gy_kv_layout *layout,
                                          gy_dtype kv_dtype, const int32_t *token_seq,
                                          const int32_t *token_pos, int64_t n_tokens,
                                          const int32_t *bt_indptr, const int32_t *bt_indices,
                                          int64_t n_seqs, int64_t n_q_heads, int64_t max_len,
                                          float scale, void *workspace, int64_t workspace_bytes,
                                          gy_cuda_stream stream);

#ifdef __cplusplus
}
#endif
#endif
