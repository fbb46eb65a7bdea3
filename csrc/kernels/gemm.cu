/* gemm.cu: row-major linear layers on cuBLAS's cublasGemmEx, with cuBLAS loaded at run time.
 *
 * cuBLAS is column-major. A row-major (r x c) matrix with row stride ld is, in the same memory,
 * the column-major (c x r) matrix of its transpose with leading dimension ld. So the row-major
 *     Y (m x n_out) = X (m x n_in) @ op(W)
 * is computed as the column-major Y^T = op(W)^T X^T:
 *   W [n_out, n_in] (HF, y = x @ W^T): op(W)^T = W, stored column-major as W^T  -> transa = T,
 *                                      lda = n_in
 *   W [n_in, n_out] (y = x @ W):       op(W)^T = W^T, stored column-major as is -> transa = N,
 *                                      lda = n_out
 *   X^T is stored column-major as is (transb = N, ldb = ldx); Y^T likewise (ldc = ldy);
 *   cuBLAS's (m, n, k) = (n_out, m, n_in).
 * The compute type is CUBLAS_COMPUTE_32F: fp32 accumulation for every dtype (split-K partial sums
 * included: CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION), and no TF32 for fp32 inputs,
 * so an fp32 GEMM differs from the CPU's only in the order of its sums.
 *
 * The bias (an fp32 vector, Qwen2's q/k/v) is added by a small kernel that writes it into y
 * (onto y when accumulating), after which the GEMM accumulates onto y with beta = 1. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_api.h>

#include "common.cuh"
#include "gemm.h"

#ifndef GY_CUDA_LIBDIR
#define GY_CUDA_LIBDIR "/usr/local/cuda/lib64"
#endif

/* ---- cuBLAS, resolved once per process ---- */

typedef cublasStatus_t (*gy_cublas_create_fn)(cublasHandle_t *);
typedef cublasStatus_t (*gy_cublas_destroy_fn)(cublasHandle_t);
typedef cublasStatus_t (*gy_cublas_set_stream_fn)(cublasHandle_t, cudaStream_t);
typedef cublasStatus_t (*gy_cublas_set_math_mode_fn)(cublasHandle_t, cublasMath_t);
typedef const char *(*gy_cublas_status_string_fn)(cublasStatus_t);
typedef cublasStatus_t (*gy_cublas_gemm_ex_fn)(cublasHandle_t, cublasOperation_t,
                                               cublasOperation_t, int, int, int, const void *,
                                               const void *, cudaDataType, int, const void *,
                                               cudaDataType, int, const void *, void *,
                                               cudaDataType, int, cublasComputeType_t,
                                               cublasGemmAlgo_t);

typedef struct gy_cublas_lib {
    gy_status status;  /* GY_OK when every entry point below was found */
    char message[768]; /* why not, otherwise */
    gy_cublas_create_fn create;
    gy_cublas_destroy_fn destroy;
    gy_cublas_set_stream_fn set_stream;
    gy_cublas_set_math_mode_fn set_math_mode;
    gy_cublas_status_string_fn status_string; /* optional: numbers are printed without it */
    gy_cublas_gemm_ex_fn gemm_ex;
} gy_cublas_lib;

static gy_cublas_lib gy_cublas_load(void) {
    gy_cublas_lib lib;
    memset(&lib, 0, sizeof lib);
    lib.status = GY_ERR_UNAVAILABLE;
    /* The plain names go through the loader's search path; the toolkit gyges was built against
     * is the fallback (its lib64 is often not in ld.so.conf). cuBLAS 12 talks to the same driver,
     * so it serves a CUDA 13 build too. */
    static const char *const names[] = {"libcublas.so.13", "libcublas.so.12",
                                        GY_CUDA_LIBDIR "/libcublas.so.13",
                                        GY_CUDA_LIBDIR "/libcublas.so.12"};
    void *handle = NULL;
    size_t used = (size_t)snprintf(lib.message, sizeof lib.message, "cuBLAS is not available (");
    for (size_t i = 0; i < sizeof names / sizeof names[0] && handle == NULL; i++) {
        handle = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (handle == NULL && used < sizeof lib.message) {
            const char *why = dlerror();
            used += (size_t)snprintf(lib.message + used, sizeof lib.message - used, "%s%s",
                                     i ? "; " : "", why ? why : names[i]);
        }
    }
    if (handle == NULL) {
        if (used < sizeof lib.message) snprintf(lib.message + used, sizeof lib.message - used, ")");
        return lib;
    }
    lib.create = (gy_cublas_create_fn)dlsym(handle, "cublasCreate_v2");
    lib.destroy = (gy_cublas_destroy_fn)dlsym(handle, "cublasDestroy_v2");
    lib.set_stream = (gy_cublas_set_stream_fn)dlsym(handle, "cublasSetStream_v2");
    lib.set_math_mode = (gy_cublas_set_math_mode_fn)dlsym(handle, "cublasSetMathMode");
    lib.status_string = (gy_cublas_status_string_fn)dlsym(handle, "cublasGetStatusString");
    lib.gemm_ex = (gy_cublas_gemm_ex_fn)dlsym(handle, "cublasGemmEx");
    if (lib.create == NULL || lib.destroy == NULL || lib.set_stream == NULL ||
        lib.gemm_ex == NULL || lib.set_math_mode == NULL) {
        snprintf(lib.message, sizeof lib.message,
                 "cuBLAS is not available: the library found lacks cublasCreate_v2, "
                 "cublasDestroy_v2, cublasSetStream_v2, cublasSetMathMode or cublasGemmEx");
        dlclose(handle);
        return lib;
    }
    lib.status = GY_OK; /* the library stays loaded for the life of the process */
    return lib;
}

static const gy_cublas_lib *gy_cublas(void) {
    static const gy_cublas_lib lib = gy_cublas_load(); /* thread-safe initialisation (C++11) */
    return &lib;
}

static gy_status gy_cublas_require(void) {
    const gy_cublas_lib *lib = gy_cublas();
    if (lib->status != GY_OK) return GY_FAIL(lib->status, "%s", lib->message);
    return GY_OK;
}

/* cublasStatus_t -> gy_status: GY_ERR_UNAVAILABLE when cuBLAS found no usable device. */
static gy_status gy_cublas_status(cublasStatus_t r, const char *what, const char *file, int line) {
    const gy_cublas_lib *lib = gy_cublas();
    const char *words = lib->status_string ? lib->status_string(r) : "cuBLAS error";
    if (r == CUBLAS_STATUS_NOT_INITIALIZED)
        return gy_error_set(GY_ERR_UNAVAILABLE, file, line,
                            "CUDA is not available: %s failed: %s (cublasStatus_t %d)", what,
                            words, (int)r);
    return gy_error_set(GY_ERR_CUDA, file, line, "%s failed: %s (cublasStatus_t %d)", what, words,
                        (int)r);
}

#define GY_CUBLAS_CHECK(what, call)                                                                \
    do {                                                                                           \
        cublasStatus_t gy_cublas_r_ = (call);                                                      \
        if (gy_cublas_r_ != CUBLAS_STATUS_SUCCESS)                                                 \
            return gy_cublas_status(gy_cublas_r_, what, __FILE__, __LINE__);                      \
    } while (0)

struct gy_cuda_blas {
    cublasHandle_t handle;
    cudaStream_t stream;
};

extern "C" gy_status gy_cuda_blas_available(void) { return gy_cublas_require(); }

extern "C" gy_status gy_cuda_blas_init(gy_cuda_blas **out, gy_cuda_stream stream) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cuda_blas_init: NULL out");
    *out = NULL;
    GY_TRY(gy_cublas_require());
    const gy_cublas_lib *lib = gy_cublas();
    gy_cuda_blas *b = (gy_cuda_blas *)calloc(1, sizeof *b);
    if (b == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a cuBLAS handle");
    cublasStatus_t r = lib->create(&b->handle);
    if (r != CUBLAS_STATUS_SUCCESS) {
        free(b);
        return gy_cublas_status(r, "cublasCreate", __FILE__, __LINE__);
    }
    /* Split-K partial sums of fp16/bf16 outputs stay fp32: by default cuBLAS may round them to
     * the output dtype before adding them up (on an H200, bf16 64x96x256 results were off by
     * up to 0.02 on values near 0.02 without this, and within the test's bound with it). */
    const int math = CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
    r = lib->set_math_mode(b->handle, (cublasMath_t)math);
    const char *failed = "cublasSetMathMode";
    if (r == CUBLAS_STATUS_SUCCESS) {
        r = lib->set_stream(b->handle, (cudaStream_t)stream);
        failed = "cublasSetStream";
    }
    if (r != CUBLAS_STATUS_SUCCESS) {
        lib->destroy(b->handle);
        free(b);
        return gy_cublas_status(r, failed, __FILE__, __LINE__);
    }
    b->stream = (cudaStream_t)stream;
    *out = b;
    return GY_OK;
}

extern "C" void gy_cuda_blas_free(gy_cuda_blas *b) {
    if (b == NULL) return;
    gy_cublas()->destroy(b->handle); /* a cleanup: nothing useful to do with a failure */
    free(b);
}

extern "C" gy_status gy_cuda_blas_set_stream(gy_cuda_blas *b, gy_cuda_stream stream) {
    if (b == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cuda_blas_set_stream: NULL handle");
    if (b->stream == (cudaStream_t)stream) return GY_OK;
    GY_CUBLAS_CHECK("cublasSetStream", gy_cublas()->set_stream(b->handle, (cudaStream_t)stream));
    b->stream = (cudaStream_t)stream;
    return GY_OK;
}

extern "C" gy_cuda_stream gy_cuda_blas_stream(const gy_cuda_blas *b) {
    return b ? (gy_cuda_stream)b->stream : NULL;
}

/* ---- the bias ---- */

/* y[r, j] = bias[j] (+ y[r, j] when accumulate), rounded once to T.
 *   y: (m, n_out) T, rows ldy apart   bias: (n_out) fp32 */
template <typename T>
__global__ void gy_gemm_bias_kernel(T *y, int64_t ldy, const float *__restrict__ bias, int64_t m,
                                    int64_t n_out, int accumulate) {
    const int64_t total = m * n_out;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = idx / n_out, j = idx % n_out;
        T *p = y + r * ldy + j;
        const float base = accumulate ? gy_to_float(*p) : 0.0f;
        *p = gy_from_float<T>(base + bias[j]);
    }
}

template <typename T>
static gy_status gy_gemm_bias_launch(void *y, int64_t ldy, const float *bias, int64_t m,
                                     int64_t n_out, int accumulate, cudaStream_t stream) {
    gy_gemm_bias_kernel<T><<<gy_cuda_blocks(m * n_out, GY_CUDA_THREADS), GY_CUDA_THREADS, 0,
                             stream>>>((T *)y, ldy, bias, m, n_out, accumulate);
    GY_CUDA_CHECK_LAUNCH("gy_gemm_bias_kernel");
    return GY_OK;
}

/* ---- the GEMM ---- */

static cudaDataType gy_gemm_cuda_type(gy_dtype dtype) {
    switch (dtype) {
    case GY_DTYPE_F16: return CUDA_R_16F;
    case GY_DTYPE_BF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
    }
}

extern "C" gy_status gy_cuda_gemm_check(gy_dtype y_dtype, int64_t ldy, gy_dtype x_dtype,
                                        int64_t ldx, gy_dtype w_dtype, gy_gemm_weight orientation,
                                        int64_t m, int64_t n_in, int64_t n_out) {
    GY_TRY(gy_cuda_check_dtype(y_dtype, "gemm y"));
    GY_TRY(gy_cuda_check_dtype(x_dtype, "gemm x"));
    GY_TRY(gy_cuda_check_dtype(w_dtype, "gemm w"));
    if (x_dtype != w_dtype)
        return GY_FAIL(GY_ERR_INVALID,
                       "gemm: x is %s but w is %s; cuBLAS multiplies matrices of one dtype",
                       gy_dtype_name(x_dtype), gy_dtype_name(w_dtype));
    if (y_dtype != x_dtype && y_dtype != GY_DTYPE_F32)
        return GY_FAIL(GY_ERR_INVALID, "gemm: the product of %s inputs is written as %s%s, not %s",
                       gy_dtype_name(x_dtype), gy_dtype_name(x_dtype),
                       x_dtype == GY_DTYPE_F32 ? "" : " or f32", gy_dtype_name(y_dtype));
    if (orientation != GY_GEMM_W_OUT_IN && orientation != GY_GEMM_W_IN_OUT)
        return GY_FAIL(GY_ERR_INVALID, "gemm: unknown weight orientation %d", (int)orientation);
    if (m < 0 || n_in <= 0 || n_out <= 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "gemm: needs m >= 0, n_in > 0 and n_out > 0 (got m=%lld n_in=%lld "
                       "n_out=%lld)",
                       (long long)m, (long long)n_in, (long long)n_out);
    if (ldx < n_in || ldy < n_out)
        return GY_FAIL(GY_ERR_INVALID,
                       "gemm: leading dimensions ldx=%lld and ldy=%lld must be at least n_in=%lld "
                       "and n_out=%lld",
                       (long long)ldx, (long long)ldy, (long long)n_in, (long long)n_out);
    /* cublasGemmEx takes int sizes. */
    if (m > INT32_MAX || ldx > INT32_MAX || ldy > INT32_MAX || n_in > INT32_MAX ||
        n_out > INT32_MAX)
        return GY_FAIL(GY_ERR_INVALID,
                       "gemm: sizes past 2^31 (m=%lld n_in=%lld n_out=%lld ldx=%lld ldy=%lld)",
                       (long long)m, (long long)n_in, (long long)n_out, (long long)ldx,
                       (long long)ldy);
    return GY_OK;
}

extern "C" gy_status gy_cuda_gemm(void *y, gy_dtype y_dtype, int64_t ldy, const void *x,
                                  gy_dtype x_dtype, int64_t ldx, const void *w, gy_dtype w_dtype,
                                  gy_gemm_weight orientation, const float *bias, int64_t m,
                                  int64_t n_in, int64_t n_out, int accumulate,
                                  gy_cuda_blas *blas) {
    GY_TRY(gy_cuda_gemm_check(y_dtype, ldy, x_dtype, ldx, w_dtype, orientation, m, n_in, n_out));
    if (blas == NULL) return GY_FAIL(GY_ERR_INVALID, "gemm: NULL cuBLAS handle");
    if (m == 0) return GY_OK;
    if (y == NULL || x == NULL || w == NULL) return GY_FAIL(GY_ERR_INVALID, "gemm: NULL y, x or w");
    if (bias != NULL) {
        GY_CUDA_DISPATCH_DTYPE(y_dtype, T,
                               GY_TRY(gy_gemm_bias_launch<T>(y, ldy, bias, m, n_out, accumulate,
                                                             blas->stream)));
        accumulate = 1;
    }
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    const int w_out_in = orientation == GY_GEMM_W_OUT_IN;
    const cudaDataType in_type = gy_gemm_cuda_type(x_dtype);
    GY_CUBLAS_CHECK("cublasGemmEx",
                    gy_cublas()->gemm_ex(blas->handle, w_out_in ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         CUBLAS_OP_N, (int)n_out, (int)m, (int)n_in, &alpha, w,
                                         in_type, (int)(w_out_in ? n_in : n_out), x, in_type,
                                         (int)ldx, &beta, y, gy_gemm_cuda_type(y_dtype), (int)ldy,
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return GY_OK;
}
