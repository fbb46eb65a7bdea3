/* gemm.h: the linear layers of the CUDA forward pass, on cuBLAS (cublasGemmEx), over weights as
 * gyges/weights.py stores them: row-major, the Hugging Face orientation [out, in] for most
 * matrices and the transposed [in, out] for wo_t and down_t (whose tensor-parallel shards are runs
 * of rows). Everything is row-major here; the column-major translation stays inside gemm.cu.
 *
 * cuBLAS is loaded at run time (dlopen libcublas.so.13, else libcublas.so.12) the first time a
 * handle is made, like the driver in csrc/mem/arena_cuda.c, so `import gyges` never needs it; a
 * missing library is GY_ERR_UNAVAILABLE naming what dlopen said.
 *
 * Only declared when gyges is built with CUDA (GY_WITH_CUDA). */
#ifndef GY_KERNELS_GEMM_H
#define GY_KERNELS_GEMM_H

#include <stdint.h>

#include "../core/dtype.h"
#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The runtime's cudaStream_t (the same spelling as kernels.h). */
typedef struct CUstream_st *gy_cuda_stream;

/* A cuBLAS handle bound to one stream: one per worker and stream. Not thread-safe: one thread
 * uses a handle at a time (cuBLAS's own rule). */
typedef struct gy_cuda_blas gy_cuda_blas;

/* Makes a handle on the current device (gy_cuda_set_device first) whose work goes to `stream`.
 * GY_ERR_UNAVAILABLE when cuBLAS cannot be loaded or there is no device. */
gy_status gy_cuda_blas_init(gy_cuda_blas **out, gy_cuda_stream stream);
void gy_cuda_blas_free(gy_cuda_blas *blas);
/* Rebinds the handle to another stream (the caller orders the two streams). */
gy_status gy_cuda_blas_set_stream(gy_cuda_blas *blas, gy_cuda_stream stream);
gy_cuda_stream gy_cuda_blas_stream(const gy_cuda_blas *blas);
/* GY_OK when cuBLAS can be loaded, else GY_ERR_UNAVAILABLE with the reason; touches no device. */
gy_status gy_cuda_blas_available(void);

/* How the weight matrix is stored (row-major, rows contiguous). */
typedef enum gy_gemm_weight {
    GY_GEMM_W_OUT_IN = 0, /* w: [n_out, n_in], the HF orientation:  y = x @ w^T */
    GY_GEMM_W_IN_OUT = 1, /* w: [n_in, n_out], transposed (wo_t):   y = x @ w   */
} gy_gemm_weight;

/* y = x @ W (+ bias) (+ y when accumulate), with fp32 accumulation (CUBLAS_COMPUTE_32F):
 *   y:    (m, n_out) y_dtype, rows ldy >= n_out elements apart (ldy > n_out writes a column
 *         block of a wider matrix, e.g. the gate half of a fused gate_up buffer)
 *   x:    (m, n_in)  x_dtype, rows ldx >= n_in elements apart
 *   w:    as `orientation` says, w_dtype == x_dtype (cuBLAS multiplies like types)
 *   bias: (n_out) fp32, or NULL
 * dtypes: x f32 -> y f32; x f16 -> y f16 or f32; x bf16 -> y bf16 or f32. A 16-bit y is rounded
 * once from the fp32 result; with a bias, the bias is first added to y (rounded to y_dtype) and
 * the product accumulated onto it. accumulate = 1 adds the product to what y holds (beta = 1),
 * so partial products (the FFN shards) sum in place; with an fp32 y that sum is exact fp32.
 * m == 0 is a no-op. Shapes, leading dimensions and dtypes are checked before the device is
 * touched (GY_ERR_INVALID); cuBLAS's own errors are GY_ERR_CUDA with its words. Asynchronous on
 * the handle's stream; y must not overlap x or w. */
/* The checks gy_cuda_gemm makes before it touches the device; GY_ERR_INVALID naming the problem. */
gy_status gy_cuda_gemm_check(gy_dtype y_dtype, int64_t ldy, gy_dtype x_dtype, int64_t ldx,
                             gy_dtype w_dtype, gy_gemm_weight orientation, int64_t m, int64_t n_in,
                             int64_t n_out);

gy_status gy_cuda_gemm(void *y, gy_dtype y_dtype, int64_t ldy, const void *x, gy_dtype x_dtype,
                       int64_t ldx, const void *w, gy_dtype w_dtype, gy_gemm_weight orientation,
                       const float *bias, int64_t m, int64_t n_in, int64_t n_out, int accumulate,
                       gy_cuda_blas *blas);

#ifdef __cplusplus
}
#endif
#endif
