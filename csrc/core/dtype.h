/* dtype.h: the storage types of weights (activations are always fp32) and exact conversions.
 *
 * Widening (bf16/f16 -> f32) is exact, so a kernel that widens weights on the fly computes the
 * same bits as one given the widened fp32 weights. Narrowing rounds to nearest, ties to even, and
 * keeps NaNs quiet NaNs.
 *
 * In core/ because both twins describe their data with it: the CPU kernels (cpu/) and their CUDA
 * versions (kernels/), neither of which includes the other. */
#ifndef GY_CORE_DTYPE_H
#define GY_CORE_DTYPE_H

#include <stdint.h>
#include <string.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gy_dtype {
    GY_DTYPE_F32 = 0,  /* IEEE binary32 */
    GY_DTYPE_F16 = 1,  /* IEEE binary16 */
    GY_DTYPE_BF16 = 2, /* bfloat16: the upper half of a binary32 */
    GY_DTYPE_COUNT
} gy_dtype;

/* Bytes per element; 0 for an unknown dtype. */
int64_t gy_dtype_size(gy_dtype dtype);
const char *gy_dtype_name(gy_dtype dtype);
/* GY_ERR_INVALID naming `what` unless dtype is one of the enum's values. */
gy_status gy_dtype_check(gy_dtype dtype, const char *what);

static inline float gy_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t gy_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float gy_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (mant << 13); /* inf / NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        uint32_t e = 113u;
        while ((mant & 0x400u) == 0) {
            mant <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t gy_f32_to_f16(float f);

/* out[i] = in[i] widened to fp32; in holds n elements of `dtype`. */
gy_status gy_dtype_to_f32(float *out, const void *in, gy_dtype dtype, int64_t n);
/* out[i] = in[i] rounded to `dtype`; out holds n elements of `dtype`. */
gy_status gy_dtype_from_f32(void *out, gy_dtype dtype, const float *in, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
