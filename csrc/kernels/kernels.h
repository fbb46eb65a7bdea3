/* kernels.h: the CUDA kernels of gyges, as checked C functions (the third tier of each kernel
 * file; see README.md). Every function returns a gy_status and never aborts: argument errors are
 * GY_ERR_INVALID, a launch or runtime failure GY_ERR_CUDA with the runtime's message and the
 * file and line, and a missing driver or device GY_ERR_UNAVAILABLE.
 *
 * Pointers named in shape comments are device pointers unless said otherwise; launches are
 * asynchronous on `stream` (NULL = the default stream). Outputs come first.
 *
 * dtypes are gy_dtype values (csrc/cpu/dtype.h): GY_DTYPE_F32, GY_DTYPE_F16, GY_DTYPE_BF16.
 * Compute kernels widen to fp32, compute in fp32, and round once to the output dtype.
 *
 * Only declared when gyges is built with CUDA (GY_WITH_CUDA); nothing else may call them. */
#ifndef GY_KERNELS_KERNELS_H
#define GY_KERNELS_KERNELS_H

#include <stdint.h>

#include "../core/status.h"
#include "../cpu/dtype.h"
#include "../kv/kv_layout.h"
#include "../sched/sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The runtime's cudaStream_t, spelled so that C files need no CUDA header. */
typedef struct CUstream_st *gy_cuda_stream;

/* ---- device.cu: devices and the few runtime memory calls the extension needs ---- */

typedef struct gy_cuda_device_info {
    char name[256];
    int32_t major, minor;    /* compute capability */
    int32_t multiprocessors;
    uint64_t total_bytes;    /* device memory */
    uint64_t free_bytes;     /* free now (creates the device's primary context) */
} gy_cuda_device_info;

/* Devices visible to the runtime. No driver or no device: *count = 0 and GY_ERR_UNAVAILABLE
 * with the reason. */
gy_status gy_cuda_device_count(int32_t *count);
gy_status gy_cuda_device_info_get(gy_cuda_device_info *out, int32_t device);
/* Makes `device` current for this thread's following runtime calls and launches. */
gy_status gy_cuda_set_device(int32_t device);
gy_status gy_cuda_malloc(void **ptr, uint64_t bytes);
/* A cleanup call: NULL is a no-op, and a failure (possible only after an earlier error broke the
 * context) is ignored so that the first error's message survives. */
void gy_cuda_free(void *ptr);
gy_status gy_cuda_memcpy_htod(void *dst, const void *src_host, uint64_t bytes);
gy_status gy_cuda_memcpy_dtoh(void *dst_host, const void *src, uint64_t bytes);
gy_status gy_cuda_memset(void *dst, int value, uint64_t bytes);
/* Waits for `stream` and reports any error a kernel hit while running. */
gy_status gy_cuda_stream_synchronize(gy_cuda_stream stream);
/* Device-to-device copy, asynchronous on `stream` (the bandwidth reference of the benchmarks). */
gy_status gy_cuda_memcpy_dtod(void *dst, const void *src, uint64_t bytes, gy_cuda_stream stream);

/* Timing with events: record two on a stream, then the milliseconds between them (waits for
 * `end`). The runtime's cudaEvent_t, spelled so that C files need no CUDA header. */
typedef struct CUevent_st *gy_cuda_event;
gy_status gy_cuda_event_create(gy_cuda_event *out);
void gy_cuda_event_destroy(gy_cuda_event event); /* NULL is a no-op */
gy_status gy_cuda_event_record(gy_cuda_event event, gy_cuda_stream stream);
gy_status gy_cuda_event_elapsed_ms(float *ms, gy_cuda_event start, gy_cuda_event end);

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

/* ---- model kernels (Llama, HF conventions) ---- */

/* rmsnorm.cu: out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), HF LlamaRMSNorm: the normalised row
 * is rounded to the activation dtype before the weight multiplies it.
 *   out, x: (rows, dim) act_dtype (out may be x)   w: (dim) w_dtype */
gy_status gy_cuda_rmsnorm(void *out, const void *x, const void *w, int64_t rows, int64_t dim,
                          float eps, gy_dtype act_dtype, gy_dtype w_dtype, gy_cuda_stream stream);

/* rope.cu: rotary embedding in place, HF rotate_half convention (the two halves of a head are
 * the pairs): for i < half = head_dim/2, angle = position * theta^(-2i/head_dim),
 *   x[i] <- x[i] cos - x[i + half] sin,   x[i + half] <- x[i + half] cos + x[i] sin
 *   q: (n_tokens, n_q_heads, head_dim)  k: (n_tokens, n_kv_heads, head_dim), dtype; k may be NULL
 *   positions: (n_tokens) int32; head_dim even */
gy_status gy_cuda_rope(void *q, void *k, const int32_t *positions, int64_t n_tokens,
                       int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim, float theta,
                       gy_dtype dtype, gy_cuda_stream stream);

/* silu_mul.cu: out[r, j] = silu(x[r, j]) * x[r, dim + j], the fused gate_up convention.
 *   out: (rows, dim)  x: (rows, 2 * dim), both dtype */
gy_status gy_cuda_silu_mul(void *out, const void *x, int64_t rows, int64_t dim, gy_dtype dtype,
                           gy_cuda_stream stream);

/* residual_add.cu: out[i] = a[i] + b[i]; out may be a or b.  out, a, b: (n) dtype */
gy_status gy_cuda_residual_add(void *out, const void *a, const void *b, int64_t n, gy_dtype dtype,
                               gy_cuda_stream stream);

/* embedding.cu: out[t] = table[ids[t]], widened or rounded to out_dtype; ids outside [0, vocab)
 * give a row of zeros.
 *   out: (n_tokens, dim) out_dtype  table: (vocab, dim) table_dtype  ids: (n_tokens) int32 */
gy_status gy_cuda_embedding(void *out, const void *table, const int32_t *ids, int64_t n_tokens,
                            int64_t vocab, int64_t dim, gy_dtype out_dtype, gy_dtype table_dtype,
                            gy_cuda_stream stream);

/* argmax.cu: out[r] = index of the largest logits[r, :]; the first one on ties; NaN counts as
 * larger than any number (like torch.argmax).
 *   out: (rows) int32  logits: (rows, vocab) dtype, vocab < 2^31 */
gy_status gy_cuda_argmax(int32_t *out, const void *logits, int64_t rows, int64_t vocab,
                         gy_dtype dtype, gy_cuda_stream stream);

/* sample.cu: the next token of each row, with the algorithm, order of operations and random
 * stream of csrc/sched/sampler.c (temperature, min-p, top-k, top-p, Philox draw at (seed,
 * token_index)): for fp32 logits the same token as gy_sampler_sample_batch except when a draw or a
 * top-p boundary lies within a few double ulps (sample.cu says why); 16-bit logits are widened.
 *   tokens:      (rows) int32; -1 for a row the CPU sampler would refuse (NaN or +inf logit, only
 *                -inf, parameters out of range) and for a sampled row without a workspace
 *   logits:      (rows, vocab) dtype, vocab < 2^31
 *   params:      (rows) gy_sampler_params, device (check them with gy_sampler_check first)
 *   token_index: (rows) int64, the index of the token being sampled in its request
 *   workspace:   gy_cuda_sample_workspace_bytes(rows, vocab) bytes, 8-byte aligned; may be NULL
 *                when every row is greedy (temperature 0) */
gy_status gy_cuda_sample_check(gy_dtype dtype, int64_t rows, int64_t vocab);
int64_t gy_cuda_sample_workspace_bytes(int64_t rows, int64_t vocab);
gy_status gy_cuda_sample(int32_t *tokens, const void *logits, gy_dtype dtype, int64_t rows,
                         int64_t vocab, const gy_sampler_params *params,
                         const int64_t *token_index, void *workspace, int64_t workspace_bytes,
                         gy_cuda_stream stream);

#ifdef __cplusplus
}
#endif
#endif
