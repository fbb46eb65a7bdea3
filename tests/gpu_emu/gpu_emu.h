/* gpu_emu.h: what the pieces of tests/gpu_emu/ offer one another beyond the CUDA runtime API
 * itself (runtime.c emulates that, declared by the toolkit's own cuda_runtime_api.h). */
#ifndef GY_TESTS_GPU_EMU_H
#define GY_TESTS_GPU_EMU_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- runtime.c ---- */

/* Devices of the emulation: GYGES_EMU_DEVICES (default 1; 0 is a machine without any), read at
 * every call, so that a test may change it. libcuda.c answers the same. */
int gy_emu_device_count(void);
/* Device memory, pinned host memory, streams and events made and not yet freed. */
long gy_emu_live_allocations(void);
/* Enqueues a kernel launch on `stream` (kernel_emu.cpp): run(launch) in the stream's order, on
 * the current device; an error is also left for cudaGetLastError, as a launch leaves it. */
cudaError_t gy_emu_launch(cudaStream_t stream, void (*run)(void *), void *launch);
/* A naive model kernel (naive_kernels.c) is about to run on `stream`, on the calling thread: waits
 * for the stream's earlier work and remembers the stream. */
void gy_emu_kernel_on(cudaStream_t stream);
/* Copies and launches a thread put on another stream than the one of its last naive model
 * kernel: on a GPU nothing would order them after that kernel. */
extern long gy_emu_stream_mismatches;
/* Device-to-device copies between two devices' cudaMalloc'ed memory without peer access
 * (cudaDeviceEnablePeerAccess either way); cudaMemcpyPeer(Async) is not counted. */
extern long gy_emu_peer_misuses;
/* Destroys the legacy default streams (and their threads), for a clean exit under sanitizers. */
void gy_emu_shutdown(void);

/* ---- naive_kernels.c ---- */

/* Calls of the decode and the prefill attention entry points so far. */
extern int gy_emu_decode_calls, gy_emu_prefill_calls;

#ifdef __cplusplus
}
#endif
#endif
