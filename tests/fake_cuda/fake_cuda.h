/* fake_cuda.h: the pretend GPU of fake_cuda.c (it implements csrc/kernels/comm_d2d.h), and the
 * few extra calls the fake NCCL and the tests use. */
#ifndef GY_TESTS_FAKE_CUDA_H
#define GY_TESTS_FAKE_CUDA_H

#include <stdint.h>

#include "kernels/comm_d2d.h"

/* Enqueues fn(arg) on `stream` (of the current device): it runs on the stream's thread, in
 * order with the rest of the stream. */
gy_status fake_cuda_host_fn(gy_cuda_stream stream, void (*fn)(void *), void *arg);
int fake_cuda_current_device(void);
int fake_cuda_stream_device(gy_cuda_stream stream);
/* Operations the streams have run so far. */
uint64_t fake_cuda_ops_run(void);
/* Destroys the legacy default streams (the rest belongs to whoever made it). */
void fake_cuda_shutdown(void);

#endif
