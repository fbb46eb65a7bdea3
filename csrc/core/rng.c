/* rng.c: Philox4x32 with 10 rounds, checked against Random123's known-answer vectors in
 * tests/c/test_sampler.c. */
#include "rng.h"

#define GY_PHILOX_M0 UINT32_C(0xD2511F53)
#define GY_PHILOX_M1 UINT32_C(0xCD9E8D57)
#define GY_PHILOX_W0 UINT32_C(0x9E3779B9)
#define GY_PHILOX_W1 UINT32_C(0xBB67AE85)

void gy_rng_philox4x32(uint32_t out[4], const uint32_t counter[4], const uint32_t key[2]) {
    uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        const uint64_t p0 = (uint64_t)GY_PHILOX_M0 * c0, p1 = (uint64_t)GY_PHILOX_M1 * c2;
        const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += GY_PHILOX_W0;
        k1 += GY_PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

double gy_rng_uniform(uint64_t seed, int64_t index, uint32_t stream) {
    const uint64_t i = (uint64_t)index;
    const uint32_t counter[4] = {(uint32_t)i, (uint32_t)(i >> 32), stream, 0};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t out[4];
    gy_rng_philox4x32(out, counter, key);
    const uint64_t bits = ((uint64_t)out[0] << 32 | out[1]) >> 11;
    return (double)bits * 0x1.0p-53;
}
