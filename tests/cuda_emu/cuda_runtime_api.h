/* cuda_runtime_api.h (emulated): the few runtime calls csrc/engine/forward_cuda.c makes, for
 * the no-GPU harness in this folder. "Device" memory is host memory; streams are tokens; copies
 * are memcpy. Found before the real header because the harness puts this folder first. */
#ifndef EMU_CUDA_RUNTIME_API_H
#define EMU_CUDA_RUNTIME_API_H
#include <stddef.h>
typedef enum cudaError { cudaSuccess = 0, cudaErrorNoDevice = 100, cudaErrorInsufficientDriver = 35,
  cudaErrorStubLibrary = 34, cudaErrorCallRequiresNewerDriver = 36, cudaErrorSystemDriverMismatch = 803,
  cudaErrorDevicesUnavailable = 46, cudaErrorMemoryAllocation = 2 } cudaError_t;
typedef struct CUstream_st *cudaStream_t;
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };
#define cudaStreamNonBlocking 1
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned f);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
#endif
