/* peak.h: the FMA-throughput probe, the compute roofline the batched benchmarks are measured
 * against (as stream.h gives the read-bandwidth one).
 *
 * Every thread of the pool runs independent chains acc = fma(acc, a, b) on 12 vector accumulators
 * (AVX-512: 12 zmm; portable: 12 arrays of 16 floats the compiler may vectorise), enough to cover
 * the FMA latency on two FMA ports. Not for model math. */
#ifndef GY_CPU_PEAK_H
#define GY_CPU_PEAK_H

#include <stdint.h>

#include "threadpool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* *flops_out = fp32 FLOP/s (2 per lane per FMA) of every pool thread running FMA chains together
 * for about `seconds` (best of three runs after a warm-up); seconds in (0, 10]. */
gy_status gy_cpu_fma_peak(double *flops_out, double seconds, gy_threadpool *pool);

#ifdef __cplusplus
}
#endif
#endif
