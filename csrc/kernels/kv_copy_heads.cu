/* kv_copy_heads.cu: copies a range of heads of a list of blocks from one KV storage and layout to
 * another: the building block of a TP transformation (a worker keeps some heads of each block and
 * sends or receives the others), and of a layout change (raw -> head).
 *
 * A byte-exact copy in words of W (see kv_scatter.cu). Work is ordered block, head, K/V, token,
 * word, which is storage order for the head layout: the layout Gyges uses for transformations
 * reads and writes long contiguous runs. */
#include "common.cuh"

/* dst, src: (their layouts) in words   dst_blocks, src_blocks: (n_blocks) int32 */
template <typename W>
__global__ void gy_kv_copy_heads_kernel(W *dst, const gy_kv_layout dst_layout,
                                        const int32_t *__restrict__ dst_blocks, int64_t dst_head0,
                                        const W *src, const gy_kv_layout src_layout,
                                        const int32_t *__restrict__ src_blocks, int64_t src_head0,
                                        int64_t n_heads, int64_t n_blocks, int64_t words_per_row) {
    const int64_t block_size = src_layout.block_size;
    const int64_t total = n_blocks * n_heads * 2 * block_size * words_per_row;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t w = i % words_per_row;
        int64_t r = i / words_per_row; /* (((b * n_heads + h) * 2 + kv) * block_size + token) */
        const int64_t token = r % block_size;
        r /= block_size;
        const int64_t kv = r % 2;
        r /= 2;
        const int64_t h = r % n_heads;
        const int64_t b = r / n_heads;
        const int64_t sb = src_blocks[b], db = dst_blocks[b];
        if (sb < 0 || sb >= src_layout.n_blocks || db < 0 || db >= dst_layout.n_blocks) continue;
        const int64_t s_elem = gy_kv_layout_offset(&src_layout, kv, sb, token, src_head0 + h);
        const int64_t d_elem = gy_kv_layout_offset(&dst_layout, kv, db, token, dst_head0 + h);
        const int64_t es = src_layout.elem_size;
        dst[d_elem * es / (int64_t)sizeof(W) + w] = src[s_elem * es / (int64_t)sizeof(W) + w];
    }
}

template <typename W>
static gy_status gy_kv_copy_heads_launch(void *dst, const gy_kv_layout &dst_layout,
                                         const int32_t *dst_blocks, int64_t dst_head0,
                                         const void *src, const gy_kv_layout &src_layout,
                                         const int32_t *src_blocks, int64_t src_head0,
                                         int64_t n_heads, int64_t n_blocks, cudaStream_t stream) {
    const int64_t words_per_row = src_layout.head_dim * src_layout.elem_size / (int64_t)sizeof(W);
    const int64_t total = n_blocks * n_heads * 2 * src_layout.block_size * words_per_row;
    gy_kv_copy_heads_kernel<W>
        <<<gy_cuda_blocks(total, GY_CUDA_THREADS), GY_CUDA_THREADS, 0, stream>>>(
            (W *)dst, dst_layout, dst_blocks, dst_head0, (const W *)src, src_layout, src_blocks,
            src_head0, n_heads, n_blocks, words_per_row);
    GY_CUDA_CHECK_LAUNCH("gy_kv_copy_heads_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_kv_copy_heads(void *dst, const gy_kv_layout *dst_layout,
                                           const int32_t *dst_blocks, int64_t dst_head0,
                                           const void *src, const gy_kv_layout *src_layout,
                                           const int32_t *src_blocks, int64_t src_head0,
                                           int64_t n_heads, int64_t n_blocks,
                                           gy_cuda_stream stream) {
    GY_TRY(gy_cuda_check_layout(dst_layout, "kv_copy_heads (destination)"));
    GY_TRY(gy_cuda_check_layout(src_layout, "kv_copy_heads (source)"));
    if (dst_layout->block_size != src_layout->block_size ||
        dst_layout->head_dim != src_layout->head_dim ||
        dst_layout->elem_size != src_layout->elem_size)
        return GY_FAIL(GY_ERR_INVALID,
                       "kv_copy_heads: layouts differ in block_size (%lld vs %lld), head_dim "
                       "(%lld vs %lld) or elem_size (%lld vs %lld)",
                       (long long)dst_layout->block_size, (long long)src_layout->block_size,
                       (long long)dst_layout->head_dim, (long long)src_layout->head_dim,
                       (long long)dst_layout->elem_size, (long long)src_layout->elem_size);
    if (n_heads < 0 || n_blocks < 0)
        return GY_FAIL(GY_ERR_INVALID, "kv_copy_heads: n_heads=%lld and n_blocks=%lld must be >= 0",
                       (long long)n_heads, (long long)n_blocks);
    if (src_head0 < 0 || src_head0 + n_heads > src_layout->n_heads || dst_head0 < 0 ||
        dst_head0 + n_heads > dst_layout->n_heads)
        return GY_FAIL(GY_ERR_INVALID,
                       "kv_copy_heads: heads [%lld, %lld) of %lld -> [%lld, %lld) of %lld are out "
                       "of range",
                       (long long)src_head0, (long long)(src_head0 + n_heads),
                       (long long)src_layout->n_heads, (long long)dst_head0,
                       (long long)(dst_head0 + n_heads), (long long)dst_layout->n_heads);
    if (n_heads == 0 || n_blocks == 0) return GY_OK;
    if (dst == NULL || src == NULL || dst_blocks == NULL || src_blocks == NULL)
        return GY_FAIL(GY_ERR_INVALID, "kv_copy_heads: NULL storage or block list");
    const int64_t row_bytes = src_layout->head_dim * src_layout->elem_size;
    const int64_t word = gy_cuda_word_bytes(row_bytes, (uintptr_t)dst | (uintptr_t)src);
    GY_CUDA_DISPATCH_WORD(word, W,
                          return gy_kv_copy_heads_launch<W>(dst, *dst_layout, dst_blocks,
                                                            dst_head0, src, *src_layout,
                                                            src_blocks, src_head0, n_heads,
                                                            n_blocks, stream));
    return GY_OK; /* not reached */
}
