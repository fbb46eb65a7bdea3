/* vexp.h: the deterministic single-precision exponential the kernels use (softmax, SiLU).
 *
 * libm's expf is not vectorisable and differs between libm versions; this one is a fixed
 * sequence of IEEE operations (Cephes' range reduction and degree-6 polynomial, a few ulp), so
 * the scalar definition below and the AVX-512 version in simd.h return the same bits on every
 * build. exp(+-inf, NaN) behave as expected; results below 2^-126 are gradual (subnormal). */
#ifndef GY_CPU_VEXP_H
#define GY_CPU_VEXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_EXP_HI 88.8f       /* exp(88.8) overflows to inf anyway; keeps n in range */
#define GY_EXP_LO (-104.0f)   /* exp(-104) rounds to 0 */
#define GY_EXP_LOG2E 1.44269504088896341f
#define GY_EXP_C1 0.693359375f      /* ln 2 = C1 - C2, C1 exact in few bits */
#define GY_EXP_C2 2.12194440e-4f
#define GY_EXP_P0 1.9875691500e-4f
#define GY_EXP_P1 1.3981999507e-3f
#define GY_EXP_P2 8.3334519073e-3f
#define GY_EXP_P3 4.1665795894e-2f
#define GY_EXP_P4 1.6666665459e-1f
#define GY_EXP_P5 5.0000001201e-1f

static inline float gy_exp_bits_to_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The definition. */
static inline float gy_exp_ref(float x) {
    float xc = x < GY_EXP_HI ? x : GY_EXP_HI; /* NaN -> HI here, restored at the end */
    xc = xc > GY_EXP_LO ? xc : GY_EXP_LO;
    const float n = rintf(xc * GY_EXP_LOG2E);
    float r = fmaf(n, -GY_EXP_C1, xc);
    r = fmaf(n, GY_EXP_C2, r);
    const float z = r * r;
    float p = fmaf(GY_EXP_P0, r, GY_EXP_P1);
    p = fmaf(p, r, GY_EXP_P2);
    p = fmaf(p, r, GY_EXP_P3);
    p = fmaf(p, r, GY_EXP_P4);
    p = fmaf(p, r, GY_EXP_P5);
    p = fmaf(p, z, r);
    p = p + 1.0f;
    /* 2^n in two normal factors, so that subnormal results are rounded once. */
    const int32_t ni = (int32_t)n; /* in [-150, 128] */
    const int32_t n1 = ni >> 1, n2 = ni - n1;
    const float s1 = gy_exp_bits_to_f32((uint32_t)(n1 + 127) << 23);
    const float s2 = gy_exp_bits_to_f32((uint32_t)(n2 + 127) << 23);
    const float res = (p * s1) * s2;
    return x != x ? x : res;
}

/* out[i] = gy_exp_ref(in[i]) for i < n (out may alias in). */
gy_status gy_cpu_exp(float *out, const float *in, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
