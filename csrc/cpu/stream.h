/* stream.h: a read-bandwidth probe, the roofline the linear benchmarks are measured against.
 *
 * It reads every float once with wide loads and several accumulators, the access pattern of a
 * batch-1 linear layer without the arithmetic. Not for model math: its summation order depends
 * on the pool size. */
#ifndef GY_CPU_STREAM_H
#define GY_CPU_STREAM_H

#include <stdint.h>

#include "threadpool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* *out = sum of x [n], read once, split into one contiguous range per pool thread. */
gy_status gy_cpu_stream_read(float *out, const float *x, int64_t n, gy_threadpool *pool);

#ifdef __cplusplus
}
#endif
#endif
