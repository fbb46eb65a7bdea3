/* common.cuh: what the kernel files share: the CHECK macros that turn a cudaError_t into a
 * gy_status, grid sizing, dtype conversions, and the dtype and word-size dispatch. */
#ifndef GY_KERNELS_COMMON_CUH
#define GY_KERNELS_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels.h"

/* cudaError_t -> gy_status: GY_ERR_UNAVAILABLE when there is no usable driver or device,
 * GY_ERR_CUDA otherwise; the message names `what`, the runtime's words, file and line. */
gy_status gy_cuda_status(cudaError_t error, const char *what, const char *file, int line);

#define GY_CUDA_CHECK(call)                                                                        \
    do {                                                                                           \
        cudaError_t gy_cuda_e_ = (call);                                                           \
        if (gy_cuda_e_ != cudaSuccess)                                                             \
            return gy_cuda_status(gy_cuda_e_, #call, __FILE__, __LINE__);                          \
    } while (0)

/* After a <<<...>>> launch: configuration errors and missing kernel images show up here. */
#define GY_CUDA_CHECK_LAUNCH(kernel_name)                                                          \
    do {                                                                                           \
        cudaError_t gy_cuda_e_ = cudaGetLastError();                                               \
        if (gy_cuda_e_ != cudaSuccess)                                                             \
            return gy_cuda_status(gy_cuda_e_, "launch of " kernel_name, __FILE__, __LINE__);      \
    } while (0)

#define GY_CUDA_THREADS 256
/* Grid-stride loops cover the rest; this many blocks fill an H100 many times over. */
#define GY_CUDA_MAX_BLOCKS ((int64_t)65536)

static inline unsigned gy_cuda_blocks(int64_t work, int64_t per_block) {
    int64_t blocks = (work + per_block - 1) / per_block;
    if (blocks < 1) blocks = 1;
    return (unsigned)(blocks < GY_CUDA_MAX_BLOCKS ? blocks : GY_CUDA_MAX_BLOCKS);
}

/* ---- dtypes ---- */

__device__ __forceinline__ float gy_to_float(float x) { return x; }
__device__ __forceinline__ float gy_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float gy_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T gy_from_float(float x);
template <> __device__ __forceinline__ float gy_from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half gy_from_float<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 gy_from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

/* Rounds x to T and back: what storing an intermediate in T does to it (HF rounds between
 * some steps; matching that keeps 16-bit results close to the reference model's). */
template <typename T> __device__ __forceinline__ float gy_round_to(float x) {
    return gy_to_float(gy_from_float<T>(x));
}

/* ---- block reductions (blockDim.x a multiple of 32, at most 1024) ---- */

__device__ __forceinline__ float gy_warp_sum(float x) {
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

/* Sum over the block, returned to every thread. `scratch` holds 32 floats of shared memory. */
__device__ __forceinline__ float gy_block_sum(float x, float *scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n_warps = (blockDim.x + 31) / 32;
    x = gy_warp_sum(x);
    __syncthreads(); /* scratch may still be read from a previous call */
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < n_warps ? scratch[lane] : 0.0f;
    return gy_warp_sum(x);
}

/* GY_ERR_INVALID naming `what` unless dtype is f32, f16 or bf16. */
static inline gy_status gy_cuda_check_dtype(gy_dtype dtype, const char *what) {
    if (dtype == GY_DTYPE_F32 || dtype == GY_DTYPE_F16 || dtype == GY_DTYPE_BF16) return GY_OK;
    return GY_FAIL(GY_ERR_INVALID, "%s: unknown dtype %d (expected 0=f32, 1=f16, 2=bf16)", what,
                   (int)dtype);
}

/* Runs the statement(s) in __VA_ARGS__ with T the C++ type of `dtype` (checked beforehand);
 * nests, for kernels with separate activation and weight dtypes. */
#define GY_CUDA_DISPATCH_DTYPE(dtype, T, ...)                                                      \
    do {                                                                                           \
        switch (dtype) {                                                                           \
        case GY_DTYPE_F16: {                                                                       \
            typedef __half T;                                                                      \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        case GY_DTYPE_BF16: {                                                                      \
            typedef __nv_bfloat16 T;                                                               \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        default: {                                                                                 \
            typedef float T;                                                                       \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        }                                                                                          \
    } while (0)

/* ---- KV layouts ---- */

/* A layout the kernels can index without dividing by zero (gy_kv_layout_init made sure). */
static inline gy_status gy_cuda_check_layout(const gy_kv_layout *layout, const char *what) {
    if (layout == NULL) return GY_FAIL(GY_ERR_INVALID, "%s: NULL layout", what);
    if (layout->block_size <= 0 || layout->n_heads <= 0 || layout->head_dim <= 0 ||
        layout->elem_size <= 0 || layout->n_blocks < 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "%s: layout sizes must be positive (block_size=%lld n_heads=%lld "
                       "head_dim=%lld elem_size=%lld n_blocks=%lld); use gy_kv_layout_init",
                       what, (long long)layout->block_size, (long long)layout->n_heads,
                       (long long)layout->head_dim, (long long)layout->elem_size,
                       (long long)layout->n_blocks);
    return GY_OK;
}

/* ---- word-size dispatch for the byte-exact KV copies ---- */

/* Widest word (16, 8, 4, 2 or 1 bytes) dividing row_bytes and the alignment of every pointer. */
static inline int64_t gy_cuda_word_bytes(int64_t row_bytes, uintptr_t pointers_or) {
    for (int64_t w = 16; w > 1; w /= 2)
        if (row_bytes % w == 0 && pointers_or % (uintptr_t)w == 0) return w;
    return 1;
}

/* Runs __VA_ARGS__ with W an unsigned type of `word_bytes` bytes. */
#define GY_CUDA_DISPATCH_WORD(word_bytes, W, ...)                                                  \
    do {                                                                                           \
        switch (word_bytes) {                                                                      \
        case 16: {                                                                                 \
            typedef uint4 W;                                                                       \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        case 8: {                                                                                  \
            typedef uint2 W;                                                                       \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        case 4: {                                                                                  \
            typedef uint32_t W;                                                                    \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        case 2: {                                                                                  \
            typedef uint16_t W;                                                                    \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        default: {                                                                                 \
            typedef uint8_t W;                                                                     \
            __VA_ARGS__;                                                                           \
        } break;                                                                                   \
        }                                                                                          \
    } while (0)

#endif
