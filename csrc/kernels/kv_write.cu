/* kv_write.cu: the batch twin of cpu/kv_write.h: the new K and V rows of a batch of tokens of
 * several sequences (the CSR form of cpu/paged.h) go to their slots of one layer's paged storage,
 * through gy_kv_layout_offset, converted from the activation dtype to the KV dtype (widened to
 * fp32 and rounded once to nearest even, so equal dtypes copy exactly).
 *
 * One warp per (K or V, token, head) row, its lanes over head_dim (coalesced on both sides).
 * Entries the host did not validate cannot write out of bounds: a token whose sequence is outside
 * [0, n_seqs), whose position is negative or past its sequence's blocks, or whose block id is
 * outside [0, layout->n_blocks) is skipped (kv_scatter's convention).
 *
 * Unlike gy_cpu_kv_write, which writes tokens in order so that the later of two tokens naming
 * the same slot wins, the rows are written in parallel: a slot named twice in one call gets one
 * of them. The engine never names a slot twice in a step. */
#include "common.cuh"

/* storage: (layout) KV   k, v: (n_tokens, n_heads, head_dim) ACT
 * Rows: (kv * n_tokens + t) * n_heads + h, one warp each, grid-stride. */
template <typename KV, typename ACT>
__global__ void gy_kv_write_kernel(KV *__restrict__ storage, const gy_kv_layout L,
                                   const ACT *__restrict__ k, const ACT *__restrict__ v,
                                   const int32_t *__restrict__ token_seq,
                                   const int32_t *__restrict__ token_pos, int64_t n_tokens,
                                   const int32_t *__restrict__ bt_indptr,
                                   const int32_t *__restrict__ bt_indices, int64_t n_seqs) {
    const int64_t H = L.n_heads, D = L.head_dim;
    const int64_t rows = 2 * n_tokens * H;
    const int lane = threadIdx.x % 32;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows;
         row += warps) {
        const int64_t h = row % H, r = row / H;
        const int64_t t = r % n_tokens, kv = r / n_tokens;
        const int64_t seq = token_seq[t], pos = token_pos[t];
        if (seq < 0 || seq >= n_seqs || pos < 0) continue;
        const int64_t first = bt_indptr[seq], logical = pos / L.block_size;
        if (logical >= bt_indptr[seq + 1] - first) continue;
        const int64_t block = bt_indices[first + logical];
        if (block < 0 || block >= L.n_blocks) continue;
        KV *dst = storage + gy_kv_layout_offset(&L, kv, block, pos % L.block_size, h);
        const ACT *src = (kv ? v : k) + (t * H + h) * D;
        for (int64_t d = lane; d < D; d += 32) dst[d] = gy_from_float<KV>(gy_to_float(src[d]));
    }
}

template <typename KV, typename ACT>
static gy_status gy_kv_write_launch(void *storage, const gy_kv_layout &layout, const void *k,
                                    const void *v, const int32_t *token_seq,
                                    const int32_t *token_pos, int64_t n_tokens,
                                    const int32_t *bt_indptr, const int32_t *bt_indices,
                                    int64_t n_seqs, cudaStream_t stream) {
    const int64_t rows = 2 * n_tokens * layout.n_heads;
    gy_kv_write_kernel<KV, ACT>
        <<<gy_cuda_blocks(rows, GY_CUDA_THREADS / 32), GY_CUDA_THREADS, 0, stream>>>(
            (KV *)storage, layout, (const ACT *)k, (const ACT *)v, token_seq, token_pos, n_tokens,
            bt_indptr, bt_indices, n_seqs);
    GY_CUDA_CHECK_LAUNCH("gy_kv_write_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_kv_write_check(const gy_kv_layout *layout, gy_dtype kv_dtype,
                                            gy_dtype act_dtype, int64_t n_tokens,
                                            int64_t n_seqs) {
    GY_TRY(gy_cuda_check_dtype(kv_dtype, "kv_write"));
    GY_TRY(gy_cuda_check_dtype(act_dtype, "kv_write"));
    GY_TRY(gy_cuda_check_layout(layout, "kv_write"));
    if (layout->elem_size != gy_dtype_size(kv_dtype))
        return GY_FAIL(GY_ERR_INVALID,
                       "kv_write: the layout's elem_size=%lld does not match kv_dtype %s (%lld "
                       "bytes)",
                       (long long)layout->elem_size, gy_dtype_name(kv_dtype),
                       (long long)gy_dtype_size(kv_dtype));
    if (n_tokens < 0 || n_seqs < 0)
        return GY_FAIL(GY_ERR_INVALID, "kv_write: n_tokens=%lld and n_seqs=%lld must be >= 0",
                       (long long)n_tokens, (long long)n_seqs);
    return GY_OK;
}

extern "C" gy_status gy_cuda_kv_write(void *storage, const gy_kv_layout *layout, gy_dtype kv_dtype,
                                      const void *k, const void *v, gy_dtype act_dtype,
                                      const int32_t *token_seq, const int32_t *token_pos,
                                      int64_t n_tokens, const int32_t *bt_indptr,
                                      const int32_t *bt_indices, int64_t n_seqs,
                                      gy_cuda_stream stream) {
    GY_TRY(gy_cuda_kv_write_check(layout, kv_dtype, act_dtype, n_tokens, n_seqs));
    if (n_tokens == 0) return GY_OK;
    if (storage == NULL || k == NULL || v == NULL || token_seq == NULL || token_pos == NULL ||
        bt_indptr == NULL || (bt_indices == NULL && n_seqs > 0))
        return GY_FAIL(GY_ERR_INVALID, "kv_write: NULL buffer");
    GY_CUDA_DISPATCH_DTYPE(kv_dtype, KV, {
        GY_CUDA_DISPATCH_DTYPE(act_dtype, ACT,
                               return gy_kv_write_launch<KV, ACT>(
                                   storage, *layout, k, v, token_seq, token_pos, n_tokens,
                                   bt_indptr, bt_indices, n_seqs, stream));
    });
    return GY_OK; /* not reached */
}
