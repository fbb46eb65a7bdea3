/* kv_scatter.cu: writes a sequence's contiguous K and V into paged KV storage, through the block
 * table and gy_kv_layout_offset (the one description of the three Gyges layouts).
 *
 * A byte-exact copy: rows of head_dim values move as words of W (up to 16 bytes), so the same
 * kernel serves fp32, fp16 and bf16. Every offset is a multiple of head_dim elements, so a word
 * size that divides the row and the pointers' alignment divides every address. */
#include "common.cuh"

/* storage: (layout) in words   k, v: (n_tokens, n_heads, words_per_row)   block_table: int32 */
template <typename W>
__global__ void gy_kv_scatter_kernel(W *__restrict__ storage, const gy_kv_layout layout,
                                     const W *__restrict__ k, const W *__restrict__ v,
                                     const int32_t *__restrict__ block_table, int64_t start,
                                     int64_t n_tokens, int64_t words_per_row) {
    const int64_t total = 2 * n_tokens * layout.n_heads * words_per_row;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t w = i % words_per_row;
        int64_t r = i / words_per_row; /* ((kv * n_tokens + t) * n_heads + h) */
        const int64_t h = r % layout.n_heads;
        r /= layout.n_heads;
        const int64_t t = r % n_tokens;
        const int64_t kv = r / n_tokens;
        const int64_t pos = start + t;
        const int64_t block = block_table[pos / layout.block_size];
        if (block < 0 || block >= layout.n_blocks) continue;
        const int64_t elem = gy_kv_layout_offset(&layout, kv, block, pos % layout.block_size, h);
        const W *src = kv ? v : k;
        storage[elem * layout.elem_size / (int64_t)sizeof(W) + w] =
            src[(t * layout.n_heads + h) * words_per_row + w];
    }
}

template <typename W>
static gy_status gy_kv_scatter_launch(void *storage, const gy_kv_layout &layout, const void *k,
                                      const void *v, const int32_t *block_table, int64_t start,
                                      int64_t n_tokens, cudaStream_t stream) {
    const int64_t words_per_row = layout.head_dim * layout.elem_size / (int64_t)sizeof(W);
    const int64_t total = 2 * n_tokens * layout.n_heads * words_per_row;
    gy_kv_scatter_kernel<W><<<gy_cuda_blocks(total, GY_CUDA_THREADS), GY_CUDA_THREADS, 0, stream>>>(
        (W *)storage, layout, (const W *)k, (const W *)v, block_table, start, n_tokens,
        words_per_row);
    GY_CUDA_CHECK_LAUNCH("gy_kv_scatter_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_kv_scatter(void *storage, const gy_kv_layout *layout, const void *k,
                                        const void *v, const int32_t *block_table, int64_t start,
                                        int64_t n_tokens, gy_cuda_stream stream) {
    GY_TRY(gy_cuda_check_layout(layout, "kv_scatter"));
    if (start < 0 || n_tokens < 0)
        return GY_FAIL(GY_ERR_INVALID, "kv_scatter: start=%lld and n_tokens=%lld must be >= 0",
                       (long long)start, (long long)n_tokens);
    if (n_tokens == 0) return GY_OK;
    if (storage == NULL || k == NULL || v == NULL || block_table == NULL)
        return GY_FAIL(GY_ERR_INVALID, "kv_scatter: NULL storage, k, v or block table");
    const int64_t row_bytes = layout->head_dim * layout->elem_size;
    const int64_t word = gy_cuda_word_bytes(
        row_bytes, (uintptr_t)storage | (uintptr_t)k | (uintptr_t)v);
    GY_CUDA_DISPATCH_WORD(word, W,
                          return gy_kv_scatter_launch<W>(storage, *layout, k, v, block_table,
                                                         start, n_tokens, stream));
    return GY_OK; /* not reached */
}
