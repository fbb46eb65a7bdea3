/* argmax.cu: greedy sampling, the index of the largest logit of each row. Ties go to the lowest
 * index and NaN counts as larger than any number (both as torch.argmax does), so the result is
 * one well-defined token whatever the reduction order. One thread block per row. */
#include "common.cuh"

/* Candidate (value, index) a beats b. */
__device__ __forceinline__ bool gy_argmax_better(float av, int64_t ai, float bv, int64_t bi) {
    const bool an = isnan(av), bn = isnan(bv);
    if (an != bn) return an;
    if (!an && av != bv) return av > bv;
    return ai < bi; /* equal, or both NaN */
}

/* out: (rows) int32   logits: (rows, vocab) T */
template <typename T>
__global__ void gy_argmax_kernel(int32_t *__restrict__ out, const T *__restrict__ logits,
                                 int64_t rows, int64_t vocab) {
    __shared__ float best_v[32];
    __shared__ int64_t best_i[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n_warps = (blockDim.x + 31) / 32;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const T *x = logits + row * vocab;
        float v = -INFINITY;
        int64_t idx = vocab; /* loses to every real candidate */
        for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
            const float c = gy_to_float(x[j]);
            if (gy_argmax_better(c, j, v, idx)) {
                v = c;
                idx = j;
            }
        }
        for (int offset = 16; offset > 0; offset /= 2) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
            const int64_t oi = __shfl_xor_sync(0xffffffffu, idx, offset);
            if (gy_argmax_better(ov, oi, v, idx)) {
                v = ov;
                idx = oi;
            }
        }
        __syncthreads(); /* the previous row's winners have been read */
        if (lane == 0) {
            best_v[warp] = v;
            best_i[warp] = idx;
        }
        __syncthreads();
        if (warp == 0) {
            v = lane < n_warps ? best_v[lane] : -INFINITY;
            idx = lane < n_warps ? best_i[lane] : vocab;
            for (int offset = 16; offset > 0; offset /= 2) {
                const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
                const int64_t oi = __shfl_xor_sync(0xffffffffu, idx, offset);
                if (gy_argmax_better(ov, oi, v, idx)) {
                    v = ov;
                    idx = oi;
                }
            }
            if (lane == 0) out[row] = (int32_t)idx;
        }
    }
}

template <typename T>
static gy_status gy_argmax_launch(int32_t *out, const void *logits, int64_t rows, int64_t vocab,
                                  cudaStream_t stream) {
    const int threads = vocab >= 4096 ? 1024 : 256;
    gy_argmax_kernel<T><<<gy_cuda_blocks(rows, 1), threads, 0, stream>>>(out, (const T *)logits,
                                                                          rows, vocab);
    GY_CUDA_CHECK_LAUNCH("gy_argmax_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_argmax(int32_t *out, const void *logits, int64_t rows, int64_t vocab,
                                    gy_dtype dtype, gy_cuda_stream stream) {
    GY_TRY(gy_cuda_check_dtype(dtype, "argmax"));
    if (rows < 0 || vocab <= 0 || vocab > INT32_MAX)
        return GY_FAIL(GY_ERR_INVALID, "argmax: rows=%lld >= 0 and 0 < vocab=%lld < 2^31 needed",
                       (long long)rows, (long long)vocab);
    if (rows == 0) return GY_OK;
    if (out == NULL || logits == NULL) return GY_FAIL(GY_ERR_INVALID, "argmax: NULL out or logits");
    GY_CUDA_DISPATCH_DTYPE(dtype, T, return gy_argmax_launch<T>(out, logits, rows, vocab, stream));
    return GY_OK; /* not reached */
}
