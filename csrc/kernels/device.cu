/* device.cu: CUDA devices through the runtime API (count, properties) and the few memory calls
 * the extension needs to feed the kernels; plus gy_cuda_status, the one place a cudaError_t
 * becomes a gy_status.
 *
 * The runtime is linked statically and finds the driver itself when first used, so on a machine
 * without a driver or device these calls answer GY_ERR_UNAVAILABLE instead of failing to load. */
#include <stdio.h>
#include <string.h>

#include "common.cuh"

static int gy_cuda_is_unavailable(cudaError_t error) {
    switch (error) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemNotReady:
        return 1;
    default:
        return 0;
    }
}

gy_status gy_cuda_status(cudaError_t error, const char *what, const char *file, int line) {
    if (gy_cuda_is_unavailable(error))
        return gy_error_set(GY_ERR_UNAVAILABLE, file, line,
                            "CUDA is not available: %s (%s, from %s)", cudaGetErrorString(error),
                            cudaGetErrorName(error), what);
    return gy_error_set(GY_ERR_CUDA, file, line, "%s failed: %s (%s)", what,
                        cudaGetErrorString(error), cudaGetErrorName(error));
}

extern "C" gy_status gy_cuda_device_count(int32_t *count) {
    if (count == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cuda_device_count: NULL count");
    *count = 0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* not sticky: leave no error behind for the next launch check */
        return gy_cuda_status(e, "cudaGetDeviceCount", __FILE__, __LINE__);
    }
    if (n == 0) return GY_FAIL(GY_ERR_UNAVAILABLE, "CUDA is not available: no CUDA device");
    *count = (int32_t)n;
    return GY_OK;
}

static gy_status gy_cuda_check_device(int32_t device) {
    int32_t count = 0;
    GY_TRY(gy_cuda_device_count(&count));
    if (device < 0 || device >= count)
        return GY_FAIL(GY_ERR_INVALID, "CUDA device %d does not exist (this machine has %d)",
                       (int)device, (int)count);
    return GY_OK;
}

extern "C" gy_status gy_cuda_device_info_get(gy_cuda_device_info *out, int32_t device) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cuda_device_info_get: NULL out");
    memset(out, 0, sizeof *out);
    GY_TRY(gy_cuda_check_device(device));
    cudaDeviceProp prop;
    GY_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    snprintf(out->name, sizeof out->name, "%s", prop.name);
    out->major = prop.major;
    out->minor = prop.minor;
    out->multiprocessors = prop.multiProcessorCount;
    out->total_bytes = (uint64_t)prop.totalGlobalMem;
    /* cudaMemGetInfo answers for the current device: switch to it and back. */
    int previous = 0;
    GY_CUDA_CHECK(cudaGetDevice(&previous));
    GY_CUDA_CHECK(cudaSetDevice(device));
    size_t free_bytes = 0, total_bytes = 0;
    cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes);
    cudaSetDevice(previous);
    GY_CUDA_CHECK(e);
    out->free_bytes = (uint64_t)free_bytes;
    return GY_OK;
}

extern "C" gy_status gy_cuda_set_device(int32_t device) {
    GY_TRY(gy_cuda_check_device(device));
    GY_CUDA_CHECK(cudaSetDevice(device));
    return GY_OK;
}

extern "C" gy_status gy_cuda_malloc(void **ptr, uint64_t bytes) {
    if (ptr == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cuda_malloc: NULL ptr");
    *ptr = NULL;
    /* cudaMalloc(0) may hand back NULL; one byte keeps "allocated" and "NULL" apart. */
    GY_CUDA_CHECK(cudaMalloc(ptr, bytes ? (size_t)bytes : 1));
    return GY_OK;
}

extern "C" void gy_cuda_free(void *ptr) {
    if (ptr != NULL && cudaFree(ptr) != cudaSuccess) cudaGetLastError();
}

extern "C" gy_status gy_cuda_memcpy_htod(void *dst, const void *src_host, uint64_t bytes) {
    if (bytes != 0) GY_CUDA_CHECK(cudaMemcpy(dst, src_host, (size_t)bytes, cudaMemcpyHostToDevice));
    return GY_OK;
}

extern "C" gy_status gy_cuda_memcpy_dtoh(void *dst_host, const void *src, uint64_t bytes) {
    if (bytes != 0) GY_CUDA_CHECK(cudaMemcpy(dst_host, src, (size_t)bytes, cudaMemcpyDeviceToHost));
    return GY_OK;
}

extern "C" gy_status gy_cuda_memset(void *dst, int value, uint64_t bytes) {
    if (bytes != 0) GY_CUDA_CHECK(cudaMemset(dst, value, (size_t)bytes));
    return GY_OK;
}

extern "C" gy_status gy_cuda_stream_synchronize(gy_cuda_stream stream) {
    GY_CUDA_CHECK(cudaStreamSynchronize(stream));
    return GY_OK;
}

extern "C" gy_status gy_cuda_memcpy_dtod(void *dst, const void *src, uint64_t bytes,
                                         gy_cuda_stream stream) {
    if (bytes != 0)
        GY_CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyDeviceToDevice, stream));
    return GY_OK;
}

/* ---- events, for timing ---- */

extern "C" gy_status gy_cuda_event_create(gy_cuda_event *out) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cuda_event_create: NULL out");
    *out = NULL;
    cudaEvent_t event;
    GY_CUDA_CHECK(cudaEventCreate(&event));
    *out = event;
    return GY_OK;
}

extern "C" void gy_cuda_event_destroy(gy_cuda_event event) {
    if (event != NULL && cudaEventDestroy(event) != cudaSuccess) cudaGetLastError();
}

extern "C" gy_status gy_cuda_event_record(gy_cuda_event event, gy_cuda_stream stream) {
    GY_CUDA_CHECK(cudaEventRecord(event, stream));
    return GY_OK;
}

extern "C" gy_status gy_cuda_event_elapsed_ms(float *ms, gy_cuda_event start, gy_cuda_event end) {
    if (ms == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cuda_event_elapsed_ms: NULL ms");
    GY_CUDA_CHECK(cudaEventSynchronize(end));
    GY_CUDA_CHECK(cudaEventElapsedTime(ms, start, end));
    return GY_OK;
}
