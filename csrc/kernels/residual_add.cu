/* residual_add.cu: out = a + b elementwise (the residual stream), in fp32, rounded once.
 * out may be a or b: each element is read before it is written by the same thread. */
#include "common.cuh"

/* out, a, b: (n) T */
template <typename T>
__global__ void gy_residual_add_kernel(T *out, const T *a, const T *b, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = gy_from_float<T>(gy_to_float(a[i]) + gy_to_float(b[i]));
}

template <typename T>
static gy_status gy_residual_add_launch(void *out, const void *a, const void *b, int64_t n,
                                        cudaStream_t stream) {
    gy_residual_add_kernel<T><<<gy_cuda_blocks(n, GY_CUDA_THREADS), GY_CUDA_THREADS, 0, stream>>>(
        (T *)out, (const T *)a, (const T *)b, n);
    GY_CUDA_CHECK_LAUNCH("gy_residual_add_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_residual_add(void *out, const void *a, const void *b, int64_t n,
                                          gy_dtype dtype, gy_cuda_stream stream) {
    GY_TRY(gy_cuda_check_dtype(dtype, "residual_add"));
    if (n < 0) return GY_FAIL(GY_ERR_INVALID, "residual_add: n=%lld must be >= 0", (long long)n);
    if (n == 0) return GY_OK;
    if (out == NULL || a == NULL || b == NULL)
        return GY_FAIL(GY_ERR_INVALID, "residual_add: NULL out, a or b");
    GY_CUDA_DISPATCH_DTYPE(dtype, T, return gy_residual_add_launch<T>(out, a, b, n, stream));
    return GY_OK; /* not reached */
}
