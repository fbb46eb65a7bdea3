/* rng.h: counter-based random numbers (Philox4x32-10, Salmon et al., SC'11). A draw is a pure
 * function of (key, counter), so a request's samples depend only on its seed and the index of the
 * token being sampled: not on batch composition, batch position, threads or preemption.
 *
 * In core/ because the CPU sampler (sched/sampler.c) and its CUDA twin (kernels/sample.cu) must
 * draw the same numbers from it, and kernels/ sits below sched/. */
#ifndef GY_CORE_RNG_H
#define GY_CORE_RNG_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The raw block function: out = philox4x32_10(counter, key). */
void gy_rng_philox4x32(uint32_t out[4], const uint32_t counter[4], const uint32_t key[2]);
/* A uniform double in [0, 1) with 53 random bits, for draw `stream` of (seed, index). */
double gy_rng_uniform(uint64_t seed, int64_t index, uint32_t stream);

/* The stream the sampler draws from (an arbitrary constant: "samp"). */
#define GY_RNG_STREAM_SAMPLE UINT32_C(0x73616d70)

#ifdef __cplusplus
}
#endif
#endif
