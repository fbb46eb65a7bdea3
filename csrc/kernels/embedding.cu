/* embedding.cu: token embedding lookup, out[t] = table[ids[t]], converted from the table's dtype
 * to the output's (an exact copy when they are the same; widening is always exact). Ids outside
 * [0, vocab) give a row of zeros rather than a read out of bounds. */
#include "common.cuh"

/* out: (n_tokens, dim) O   table: (vocab, dim) Tt   ids: (n_tokens) int32 */
template <typename O, typename Tt>
__global__ void gy_embedding_kernel(O *__restrict__ out, const Tt *__restrict__ table,
                                    const int32_t *__restrict__ ids, int64_t n_tokens,
                                    int64_t vocab, int64_t dim) {
    const int64_t total = n_tokens * dim;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / dim, j = i % dim;
        const int64_t id = ids[t];
        out[i] = gy_from_float<O>(id >= 0 && id < vocab ? gy_to_float(table[id * dim + j]) : 0.0f);
    }
}

template <typename O, typename Tt>
static gy_status gy_embedding_launch(void *out, const void *table, const int32_t *ids,
                                     int64_t n_tokens, int64_t vocab, int64_t dim,
                                     cudaStream_t stream) {
    gy_embedding_kernel<O, Tt><<<gy_cuda_blocks(n_tokens * dim, GY_CUDA_THREADS), GY_CUDA_THREADS,
                                 0, stream>>>((O *)out, (const Tt *)table, ids, n_tokens, vocab,
                                              dim);
    GY_CUDA_CHECK_LAUNCH("gy_embedding_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_embedding(void *out, const void *table, const int32_t *ids,
                                       int64_t n_tokens, int64_t vocab, int64_t dim,
                                       gy_dtype out_dtype, gy_dtype table_dtype,
                                       gy_cuda_stream stream) {
    GY_TRY(gy_cuda_check_dtype(out_dtype, "embedding output"));
    GY_TRY(gy_cuda_check_dtype(table_dtype, "embedding table"));
    if (n_tokens < 0 || vocab < 0 || dim < 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "embedding: n_tokens=%lld, vocab=%lld, dim=%lld must be >= 0",
                       (long long)n_tokens, (long long)vocab, (long long)dim);
    if (n_tokens == 0 || dim == 0) return GY_OK;
    if (out == NULL || ids == NULL || (table == NULL && vocab > 0))
        return GY_FAIL(GY_ERR_INVALID, "embedding: NULL out, table or ids");
    GY_CUDA_DISPATCH_DTYPE(out_dtype, O,
        GY_CUDA_DISPATCH_DTYPE(table_dtype, Tt,
            return gy_embedding_launch<O, Tt>(out, table, ids, n_tokens, vocab, dim, stream)));
    return GY_OK; /* not reached */
}
