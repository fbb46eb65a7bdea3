/* kv_ops.h: the kernels that write, read and move paged KV (kv_scatter.cu, kv_gather.cu,
 * kv_copy_heads.cu, kv_write.cu).
 * The conventions of every kernel header are in kernels.h. Only declared when gyges is built with
 * CUDA (GY_WITH_CUDA). */
#ifndef GY_KERNELS_KV_OPS_H
#define GY_KERNELS_KV_OPS_H

#include "../core/dtype.h"
#include "../kv/kv_layout.h"
#include "device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- KV movement: bit-exact copies, so they work for any elem_size (fp32/fp16/bf16 alike) ----
 *
 * `storage` is one layer's paged KV storage: gy_kv_layout_layer_elems(layout) elements laid out
 * as `layout` says, always addressed through gy_kv_layout_offset. Block ids outside
 * [0, layout->n_blocks) are skipped (scatter and copy_heads write nothing for them, gather writes
 * zeros), so a stale table cannot write out of bounds; callers validate tables on the host. */

/* kv_scatter.cu: writes the K and V of n_tokens consecutive tokens of one sequence.
 *   storage:     (layout) written at the tokens' places only
 *   k, v:        (n_tokens, layout->n_heads, layout->head_dim) contiguous
 *   block_table: (>= ceil((start + n_tokens) / block_size)) int32 physical block of each logical
 *                block of the sequence
 * Token t goes to sequence position start + t, i.e. block block_table[(start+t) / block_size],
 * token (start+t) % block_size. */
gy_status gy_cuda_kv_scatter(void *storage, const gy_kv_layout *layout, const void *k,
                             const void *v, const int32_t *block_table, int64_t start,
                             int64_t n_tokens, gy_cuda_stream stream);

/* kv_gather.cu: the inverse of kv_scatter.
 *   k, v: (n_tokens, layout->n_heads, layout->head_dim) contiguous, fully written */
gy_status gy_cuda_kv_gather(void *k, void *v, const void *storage, const gy_kv_layout *layout,
                            const int32_t *block_table, int64_t start, int64_t n_tokens,
                            gy_cuda_stream stream);

/* kv_copy_heads.cu: the building block of a TP transformation. For i < n_blocks, copies heads
 * [src_head0, src_head0 + n_heads) of block src_blocks[i] (both K and V, every token) into heads
 * [dst_head0, dst_head0 + n_heads) of block dst_blocks[i]. The two layouts may differ in kind,
 * n_heads and n_blocks, but not in block_size, head_dim or elem_size. dst and src may be the same
 * storage as long as the regions copied from and to do not overlap.
 *   dst_blocks, src_blocks: (n_blocks) int32 */
gy_status gy_cuda_kv_copy_heads(void *dst, const gy_kv_layout *dst_layout,
                                const int32_t *dst_blocks, int64_t dst_head0, const void *src,
                                const gy_kv_layout *src_layout, const int32_t *src_blocks,
                                int64_t src_head0, int64_t n_heads, int64_t n_blocks,
                                gy_cuda_stream stream);

/* kv_write.cu: the batch twin of cpu/kv_write.h. For every token t and KV head h, K[t, h, :] and
 * V[t, h, :] go to the slot of position token_pos[t] of sequence token_seq[t], converted from
 * act_dtype to kv_dtype (widened to fp32, rounded once to nearest even: equal dtypes copy exactly).
 *   storage: (layout) kv_dtype; layout->elem_size must be gy_dtype_size(kv_dtype)
 *   k, v:    (n_tokens, layout->n_heads, layout->head_dim) act_dtype
 *   token_seq, token_pos: (n_tokens) int32   bt_indptr: (n_seqs + 1) int32
 *   bt_indices: (bt_indptr[n_seqs]) int32 block ids: the CSR block tables of cpu/paged.h
 * Tokens whose sequence, position or block is out of range are skipped (validate the tables on
 * the host with gy_cpu_paged_batch_check). A slot named by two tokens of one call gets either. */
/* Its argument checks alone (no pointer, no device): callers that copy buffers to the device
 * first (the Python entry point) refuse bad arguments before touching it. The same pattern for
 * the attention and sampling kernels below. */
gy_status gy_cuda_kv_write_check(const gy_kv_layout *layout, gy_dtype kv_dtype,
                                 gy_dtype act_dtype, int64_t n_tokens, int64_t n_seqs);
gy_status gy_cuda_kv_write(void *storage, const gy_kv_layout *layout, gy_dtype kv_dtype,
                           const void *k, const void *v, gy_dtype act_dtype,
                           const int32_t *token_seq, const int32_t *token_pos, int64_t n_tokens,
                           const int32_t *bt_indptr, const int32_t *bt_indices, int64_t n_seqs,
                           gy_cuda_stream stream);

#ifdef __cplusplus
}
#endif
#endif
