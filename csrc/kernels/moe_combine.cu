/* moe_combine.cu: a mixture-of-experts layer's combine on the device, the twin of cpu/moe.h's
 * gy_cpu_moe_combine and gy_cpu_moe_add_gated (model_ops.h states the contract). One thread per
 * output element, k rows in the token's rank order from +0: a token's bits depend on its own
 * rows and weights only, never on the rest of the batch. */
#include "common.cuh"

/* out: (n, dim) fp32   ys: (rows, dim) fp32   weight, slot: (n, k)   shared: (n, dim) fp32 or
 * NULL   gate: (n) fp32 or NULL */
__global__ void gy_moe_combine_kernel(float *out, const float *__restrict__ ys,
                                      const float *__restrict__ weight,
                                      const int32_t *__restrict__ slot, const float *shared,
                                      const float *gate, int64_t n, int64_t k, int64_t dim,
                                      int accumulate) {
    const int64_t total = n * dim;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / dim, j = i % dim;
        float acc = 0.0f;
        for (int64_t r = 0; r < k; r++) acc += weight[t * k + r] * ys[(int64_t)slot[t * k + r] * dim + j];
        if (shared != NULL) acc += (gate != NULL ? 1.0f / (1.0f + expf(-gate[t])) : 1.0f) * shared[i];
        out[i] = accumulate ? out[i] + acc : acc;
    }
}

extern "C" gy_status gy_cuda_moe_combine(float *out, const float *ys, const float *weight,
                                         const int32_t *slot, const float *shared,
                                         const float *gate, int64_t n, int64_t k, int64_t dim,
                                         int accumulate, gy_cuda_stream stream) {
    if (n < 0 || k < 1 || dim < 0)
        return GY_FAIL(GY_ERR_INVALID, "moe_combine: n=%lld >= 0, k=%lld >= 1, dim=%lld >= 0 "
                       "needed", (long long)n, (long long)k, (long long)dim);
    if (n == 0 || dim == 0) return GY_OK;
    if (out == NULL || ys == NULL || weight == NULL || slot == NULL)
        return GY_FAIL(GY_ERR_INVALID, "moe_combine: NULL out, ys, weight or slot");
    gy_moe_combine_kernel<<<gy_cuda_blocks(n * dim, GY_CUDA_THREADS), GY_CUDA_THREADS, 0,
                            (cudaStream_t)stream>>>(out, ys, weight, slot, shared, gate, n, k,
                                                    dim, accumulate);
    GY_CUDA_CHECK_LAUNCH("gy_moe_combine_kernel");
    return GY_OK;
}
