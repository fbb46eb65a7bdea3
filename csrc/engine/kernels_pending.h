/* kernels_pending.h (temporary): the paged-KV kernels the CUDA forward pass calls, declared with
 * exactly the signatures being added to csrc/kernels/kernels.h on the kernels branch. Delete this
 * file, and include "../kernels/kernels.h" in forward_cuda.c (and tests/cuda_emu/emu.c) instead,
 * once that branch is merged;
 * until then setup.py keeps forward_cuda.c's pass out of the build (kernels.h does not declare
 * gy_cuda_paged_attention_decode), so nothing refers to these symbols.
 *
 * All index arrays are device int32 in the CSR form of csrc/cpu/paged.h; out and q are
 * (n_tokens, n_q_heads, head_dim) act_dtype; max_len is a host upper bound on token_pos + 1.
 * Both attention entry points are correct for any batch; prefill is faster when a sequence has
 * many query tokens. */
#ifndef GY_ENGINE_KERNELS_PENDING_H
#define GY_ENGINE_KERNELS_PENDING_H

#include "../kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

gy_status gy_cuda_kv_write(void *storage, const gy_kv_layout *layout, gy_dtype kv_dtype,
                           const void *k, const void *v, gy_dtype act_dtype,
                           const int32_t *token_seq, const int32_t *token_pos, int64_t n_tokens,
                           const int32_t *bt_indptr, const int32_t *bt_indices, int64_t n_seqs,
                           gy_cuda_stream stream);

gy_status gy_cuda_paged_attention_decode(void *out, const void *q, gy_dtype act_dtype,
                                         const void *layer_base, const gy_kv_layout *layout,
                                         gy_dtype kv_dtype, const int32_t *token_seq,
                                         const int32_t *token_pos, int64_t n_tokens,
                                         const int32_t *bt_indptr, const int32_t *bt_indices,
                                         int64_t n_seqs, int64_t n_q_heads, int64_t max_len,
                                         float scale, void *workspace, int64_t workspace_bytes,
                                         gy_cuda_stream stream);

gy_status gy_cuda_paged_attention_prefill(void *out, const void *q, gy_dtype act_dtype,
                                          const void *layer_base, const gy_kv_layout *layout,
                                          gy_dtype kv_dtype, const int32_t *token_seq,
                                          const int32_t *token_pos, int64_t n_tokens,
                                          const int32_t *bt_indptr, const int32_t *bt_indices,
                                          int64_t n_seqs, int64_t n_q_heads, int64_t max_len,
                                          float scale, void *workspace, int64_t workspace_bytes,
                                          gy_cuda_stream stream);

int64_t gy_cuda_paged_attention_workspace_bytes(int64_t n_tokens, int64_t n_q_heads,
                                                int64_t head_dim, int64_t max_len);

#ifdef __cplusplus
}
#endif
#endif
