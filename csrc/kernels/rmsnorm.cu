/* rmsnorm.cu: RMS normalisation of rows, as HF's LlamaRMSNorm computes it:
 *   r = 1 / sqrt(mean(x^2) + eps)   (fp32)
 *   out = w * round_to_act(x * r)   (the normalised row is cast to the activation dtype first)
 * One thread block per row; the sum of squares is accumulated in fp32. */
#include "common.cuh"

/* out, x: (rows, dim) A   w: (dim) Wt */
template <typename A, typename Wt>
__global__ void gy_rmsnorm_kernel(A *out, const A *x, const Wt *__restrict__ w, int64_t rows,
                                  int64_t dim, float eps) {
    __shared__ float scratch[32];
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const A *xr = x + row * dim;
        A *yr = out + row * dim;
        float sum = 0.0f;
        for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
            const float v = gy_to_float(xr[j]);
            sum += v * v;
        }
        sum = gy_block_sum(sum, scratch);
        const float r = rsqrtf(sum / (float)dim + eps);
        for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
            const float normed = gy_round_to<A>(gy_to_float(xr[j]) * r);
            yr[j] = gy_from_float<A>(gy_to_float(w[j]) * normed);
        }
    }
}

template <typename A, typename Wt>
static gy_status gy_rmsnorm_launch(void *out, const void *x, const void *w, int64_t rows,
                                   int64_t dim, float eps, cudaStream_t stream) {
    const unsigned blocks = gy_cuda_blocks(rows, 1);
    const int threads = dim >= 1024 ? 1024 : dim >= 512 ? 512 : 256;
    gy_rmsnorm_kernel<A, Wt><<<blocks, threads, 0, stream>>>((A *)out, (const A *)x,
                                                            (const Wt *)w, rows, dim, eps);
    GY_CUDA_CHECK_LAUNCH("gy_rmsnorm_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_rmsnorm(void *out, const void *x, const void *w, int64_t rows,
                                     int64_t dim, float eps, gy_dtype act_dtype, gy_dtype w_dtype,
                                     gy_cuda_stream stream) {
    GY_TRY(gy_cuda_check_dtype(act_dtype, "rmsnorm activations"));
    GY_TRY(gy_cuda_check_dtype(w_dtype, "rmsnorm weight"));
    if (rows < 0 || dim <= 0 || !(eps >= 0.0f))
        return GY_FAIL(GY_ERR_INVALID, "rmsnorm: rows=%lld >= 0, dim=%lld > 0, eps=%g >= 0 needed",
                       (long long)rows, (long long)dim, (double)eps);
    if (rows == 0) return GY_OK;
    if (out == NULL || x == NULL || w == NULL)
        return GY_FAIL(GY_ERR_INVALID, "rmsnorm: NULL out, x or w");
    GY_CUDA_DISPATCH_DTYPE(act_dtype, A,
        GY_CUDA_DISPATCH_DTYPE(w_dtype, Wt,
            return gy_rmsnorm_launch<A, Wt>(out, x, w, rows, dim, eps, stream)));
    return GY_OK; /* not reached */
}
