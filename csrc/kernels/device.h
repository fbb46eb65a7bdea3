/* device.h: devices, streams, events and the few runtime memory calls the extension needs (device.cu).
 * The conventions of every kernel header are in kernels.h. Only declared when gyges is built with
 * CUDA (GY_WITH_CUDA). */
#ifndef GY_KERNELS_DEVICE_H
#define GY_KERNELS_DEVICE_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The runtime's cudaStream_t, spelled so that C files need no CUDA header. */
typedef struct CUstream_st *gy_cuda_stream;

/* ---- device.cu: devices and the few runtime memory calls the extension needs ---- */

typedef struct gy_cuda_device_info {
    char name[256];
    int32_t major, minor;    /* compute capability */
    int32_t multiprocessors;
    uint64_t total_bytes;    /* device memory */
    uint64_t free_bytes;     /* free now (creates the device's primary context) */
} gy_cuda_device_info;

/* Devices visible to the runtime. No driver or no device: *count = 0 and GY_ERR_UNAVAILABLE
 * with the reason. */
gy_status gy_cuda_device_count(int32_t *count);
gy_status gy_cuda_device_info_get(gy_cuda_device_info *out, int32_t device);
/* Makes `device` current for this thread's following runtime calls and launches. */
gy_status gy_cuda_set_device(int32_t device);
gy_status gy_cuda_malloc(void **ptr, uint64_t bytes);
/* A cleanup call: NULL is a no-op, and a failure (possible only after an earlier error broke the
 * context) is ignored so that the first error's message survives. */
void gy_cuda_free(void *ptr);
gy_status gy_cuda_memcpy_htod(void *dst, const void *src_host, uint64_t bytes);
gy_status gy_cuda_memcpy_dtoh(void *dst_host, const void *src, uint64_t bytes);
gy_status gy_cuda_memset(void *dst, int value, uint64_t bytes);
/* Waits for `stream` and reports any error a kernel hit while running. */
gy_status gy_cuda_stream_synchronize(gy_cuda_stream stream);
/* Device-to-device copy, asynchronous on `stream` (the bandwidth reference of the benchmarks). */
gy_status gy_cuda_memcpy_dtod(void *dst, const void *src, uint64_t bytes, gy_cuda_stream stream);

/* Timing with events: record two on a stream, then the milliseconds between them (waits for
 * `end`). The runtime's cudaEvent_t, spelled so that C files need no CUDA header. */
typedef struct CUevent_st *gy_cuda_event;
gy_status gy_cuda_event_create(gy_cuda_event *out);
void gy_cuda_event_destroy(gy_cuda_event event); /* NULL is a no-op */
gy_status gy_cuda_event_record(gy_cuda_event event, gy_cuda_stream stream);
gy_status gy_cuda_event_elapsed_ms(float *ms, gy_cuda_event start, gy_cuda_event end);

#ifdef __cplusplus
}
#endif
#endif
