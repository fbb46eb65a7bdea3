/* silu_mul.cu: the Llama MLP's activation on a fused gate_up projection:
 *   out[r, j] = silu(x[r, j]) * x[r, dim + j],   silu(g) = g / (1 + exp(-g))
 * computed in fp32 and rounded once. One thread per output element. */
#include "common.cuh"

/* out: (rows, dim) T   x: (rows, 2 * dim) T */
template <typename T>
__global__ void gy_silu_mul_kernel(T *__restrict__ out, const T *__restrict__ x, int64_t rows,
                                   int64_t dim) {
    const int64_t total = rows * dim;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / dim, j = i % dim;
        const float g = gy_to_float(x[r * 2 * dim + j]);
        const float u = gy_to_float(x[r * 2 * dim + dim + j]);
        out[i] = gy_from_float<T>(g / (1.0f + expf(-g)) * u);
    }
}

template <typename T>
static gy_status gy_silu_mul_launch(void *out, const void *x, int64_t rows, int64_t dim,
                                    cudaStream_t stream) {
    gy_silu_mul_kernel<T><<<gy_cuda_blocks(rows * dim, GY_CUDA_THREADS), GY_CUDA_THREADS, 0,
                            stream>>>((T *)out, (const T *)x, rows, dim);
    GY_CUDA_CHECK_LAUNCH("gy_silu_mul_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_silu_mul(void *out, const void *x, int64_t rows, int64_t dim,
                                      gy_dtype dtype, gy_cuda_stream stream) {
    GY_TRY(gy_cuda_check_dtype(dtype, "silu_mul"));
    if (rows < 0 || dim < 0)
        return GY_FAIL(GY_ERR_INVALID, "silu_mul: rows=%lld and dim=%lld must be >= 0",
                       (long long)rows, (long long)dim);
    if (rows == 0 || dim == 0) return GY_OK;
    if (out == NULL || x == NULL) return GY_FAIL(GY_ERR_INVALID, "silu_mul: NULL out or x");
    GY_CUDA_DISPATCH_DTYPE(dtype, T, return gy_silu_mul_launch<T>(out, x, rows, dim, stream));
    return GY_OK; /* not reached */
}
