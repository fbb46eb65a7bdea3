/* comm_d2d.h: the device side of the d2d and nccl communicators (csrc/comm/): streams at a
 * chosen priority, events that order one rank's stream after another's, device-to-device copies
 * and the fp32 pairwise-tree sum of the all-reduce. Checked like kernels.h: a gy_status, never an
 * abort; GY_ERR_UNAVAILABLE without a driver or device.
 *
 * Every call that touches a stream or allocates works on the calling thread's current device;
 * the communicator makes the rank's device current first (gy_cuda_comm_device_swap).
 *
 * Only declared when gyges is built with CUDA (GY_WITH_CUDA). */
#ifndef GY_KERNELS_COMM_D2D_H
#define GY_KERNELS_COMM_D2D_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The runtime's cudaStream_t and cudaEvent_t, spelled so that C files need no CUDA header
 * (the same spelling as kernels.h's gy_cuda_stream). */
typedef struct CUstream_st *gy_cuda_stream;
typedef struct CUevent_st *gy_cuda_event;

/* Inputs of one tree sum; GY_CUDA_COMM_MAX_INPUTS is GY_COMM_MAX_RANKS. */
#define GY_CUDA_COMM_MAX_INPUTS 16

/* Makes `device` current on this thread; *previous receives the device that was (pass it back
 * to restore). GY_ERR_UNAVAILABLE naming the reason when there is no driver or no such device. */
gy_status gy_cuda_comm_device_swap(int32_t device, int32_t *previous);
/* Devices the runtime sees; no driver or no device: *count = 0 and GY_ERR_UNAVAILABLE. */
gy_status gy_cuda_comm_device_count(int32_t *count);

/* A stream on the current device that does not synchronise with the legacy default stream, at
 * the device's greatest priority (`lowest` = 0) or least priority (`lowest` = 1). */
gy_status gy_cuda_comm_stream_create(gy_cuda_stream *out, int32_t lowest);
/* Cleanup: waits for the stream, then destroys it; errors are dropped (NULL: no-op). */
void gy_cuda_comm_stream_destroy(gy_cuda_stream stream);
gy_status gy_cuda_comm_stream_priority(gy_cuda_stream stream, int32_t *priority);
gy_status gy_cuda_comm_stream_synchronize(gy_cuda_stream stream);

/* An event without timing on the current device. */
gy_status gy_cuda_comm_event_create(gy_cuda_event *out);
void gy_cuda_comm_event_destroy(gy_cuda_event event);
gy_status gy_cuda_comm_event_record(gy_cuda_event event, gy_cuda_stream stream);
/* Work enqueued on `stream` after this waits for the event's last record (any device). */
gy_status gy_cuda_comm_stream_wait(gy_cuda_stream stream, gy_cuda_event event);

/* Device memory on the current device (the d2d all-reduce's scratch). */
gy_status gy_cuda_comm_malloc(void **out, uint64_t bytes);
void gy_cuda_comm_free(void *ptr);

/* comm_d2d.cu: dst [bytes] <- src [bytes], device to device, asynchronous on `stream`; the
 * ranges must not overlap (dst == src is a no-op). */
gy_status gy_cuda_comm_copy(void *dst, const void *src, uint64_t bytes, gy_cuda_stream stream);

/* Host <-> device copies in the order of `stream` (for tools and tests that feed a rank's
 * buffers): from pageable host memory the source has been read when the call returns; to host
 * memory the data is there once the stream has reached the copy. */
gy_status gy_cuda_comm_copy_h2d(void *dst, const void *src_host, uint64_t bytes,
                                gy_cuda_stream stream);
gy_status gy_cuda_comm_copy_d2h(void *dst_host, const void *src, uint64_t bytes,
                                gy_cuda_stream stream);

/* comm_d2d.cu: out[i] = the tree sum of in[0][i] .. in[n_in - 1][i] for i < n,
 * ((in0 + in1) + (in2 + in3)) for n_in = 4, (in0 + in1) + in2 for 3: the order of core/tree.h and
 * comm_shm.c, so both give the same bits
 * (fp32 adds round the same on the host and the device; no FMA can form from adds alone).
 *   out: (n) float32, may be one of the inputs   in: (n_in) host array of (n) float32 device
 *   pointers; n_in in [1, GY_CUDA_COMM_MAX_INPUTS] */
gy_status gy_cuda_comm_sum_tree(float *out, const float *const *in, int32_t n_in, int64_t n,
                                gy_cuda_stream stream);

#ifdef __cplusplus
}
#endif
#endif
