/* dtype.c: sizes, names and array conversions of the weight storage types. */
#include "dtype.h"

int64_t gy_dtype_size(gy_dtype dtype) {
    switch (dtype) {
    case GY_DTYPE_F32: return 4;
    case GY_DTYPE_F16: return 2;
    case GY_DTYPE_BF16: return 2;
    default: return 0;
    }
}

const char *gy_dtype_name(gy_dtype dtype) {
    switch (dtype) {
    case GY_DTYPE_F32: return "f32";
    case GY_DTYPE_F16: return "f16";
    case GY_DTYPE_BF16: return "bf16";
    default: return "unknown";
    }
}

gy_status gy_dtype_check(gy_dtype dtype, const char *what) {
    if ((int)dtype < 0 || dtype >= GY_DTYPE_COUNT)
        return GY_FAIL(GY_ERR_INVALID, "%s: unknown dtype %d (expected 0=f32, 1=f16, 2=bf16)", what,
                       (int)dtype);
    return GY_OK;
}

uint16_t gy_f32_to_f16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((abs >> 13) & 0x3ffu)); /* NaN */
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (abs < 0x38800000u) {
        /* Result is subnormal (or zero): value = abs_float / 2^-24 rounded to an integer. */
        if (abs < 0x33000000u) return sign; /* below half the smallest subnormal */
        const uint32_t exp = abs >> 23;
        const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - exp; /* 14..24 */
        uint32_t half = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1u);
        const uint32_t mid = 1u << (shift - 1u);
        if (rest > mid || (rest == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    /* Normal: rebias the exponent and round the 13 dropped bits to nearest even. */
    uint32_t h = ((abs >> 13) - (112u << 10));
    const uint32_t rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

gy_status gy_dtype_to_f32(float *out, const void *in, gy_dtype dtype, int64_t n) {
    GY_TRY(gy_dtype_check(dtype, "gy_dtype_to_f32"));
    if (n < 0) return GY_FAIL(GY_ERR_INVALID, "gy_dtype_to_f32: negative count %lld", (long long)n);
    if (n > 0 && (out == NULL || in == NULL))
        return GY_FAIL(GY_ERR_INVALID, "gy_dtype_to_f32: NULL buffer");
    const uint16_t *h = (const uint16_t *)in;
    switch (dtype) {
    case GY_DTYPE_F32: memmove(out, in, (size_t)n * sizeof(float)); break;
    case GY_DTYPE_F16:
        for (int64_t i = 0; i < n; i++) out[i] = gy_f16_to_f32(h[i]);
        break;
    case GY_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++) out[i] = gy_bf16_to_f32(h[i]);
        break;
    default: break;
    }
    return GY_OK;
}

gy_status gy_dtype_from_f32(void *out, gy_dtype dtype, const float *in, int64_t n) {
    GY_TRY(gy_dtype_check(dtype, "gy_dtype_from_f32"));
    if (n < 0)
        return GY_FAIL(GY_ERR_INVALID, "gy_dtype_from_f32: negative count %lld", (long long)n);
    if (n > 0 && (out == NULL || in == NULL))
        return GY_FAIL(GY_ERR_INVALID, "gy_dtype_from_f32: NULL buffer");
    uint16_t *h = (uint16_t *)out;
    switch (dtype) {
    case GY_DTYPE_F32: memmove(out, in, (size_t)n * sizeof(float)); break;
    case GY_DTYPE_F16:
        for (int64_t i = 0; i < n; i++) h[i] = gy_f32_to_f16(in[i]);
        break;
    case GY_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++) h[i] = gy_f32_to_bf16(in[i]);
        break;
    default: break;
    }
    return GY_OK;
}
