/* rope.c: the rotary embedding tables and their application. */
#include "rope.h"

#include <math.h>
#include <stddef.h>

gy_status gy_cpu_rope_inv_freq(double *inv_freq, int64_t head_dim, double theta) {
    if (head_dim <= 0 || head_dim % 2 != 0)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rope_inv_freq: need an even head_dim > 0 "
                       "(head_dim=%lld)", (long long)head_dim);
    if (!(theta > 0.0) || !isfinite(theta))
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rope_inv_freq: theta=%g must be finite and > 0",
                       theta);
    if (inv_freq == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rope_inv_freq: NULL buffer");
    for (int64_t i = 0; i < head_dim / 2; i++)
        inv_freq[i] = pow(theta, -(double)(2 * i) / (double)head_dim);
    return GY_OK;
}

gy_status gy_cpu_rope_table(float *cos_table, float *sin_table, int64_t max_pos, int64_t head_dim,
                            const double *inv_freq, double mscale) {
    if (max_pos < 0 || head_dim <= 0 || head_dim % 2 != 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "gy_cpu_rope_table: need max_pos >= 0 and an even head_dim > 0 "
                       "(max_pos=%lld head_dim=%lld)", (long long)max_pos, (long long)head_dim);
    if (!(mscale > 0.0) || !isfinite(mscale))
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rope_table: mscale=%g must be finite and > 0",
                       mscale);
    if (inv_freq == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rope_table: NULL inv_freq");
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++)
        if (!(inv_freq[i] > 0.0) || !isfinite(inv_freq[i]))
            return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rope_table: inv_freq[%lld]=%g must be finite "
                           "and > 0", (long long)i, inv_freq[i]);
    if (max_pos == 0) return GY_OK;
    if (cos_table == NULL || sin_table == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rope_table: NULL buffer");
    for (int64_t i = 0; i < half; i++) {
        for (int64_t p = 0; p < max_pos; p++) {
            const double angle = (double)p * inv_freq[i];
            /* mscale = 1 multiplies exactly: an unscaled table is what it always was. */
            cos_table[p * half + i] = (float)(cos(angle) * mscale);
            sin_table[p * half + i] = (float)(sin(angle) * mscale);
        }
    }
    return GY_OK;
}

gy_status gy_cpu_rope(float *x, const int32_t *positions, const float *cos_table,
                      const float *sin_table, int64_t n, int64_t n_heads, int64_t head_dim,
                      int64_t max_pos) {
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0 || max_pos < 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "gy_cpu_rope: need n >= 0, n_heads > 0 and an even head_dim > 0 "
                       "(n=%lld n_heads=%lld head_dim=%lld)", (long long)n, (long long)n_heads,
                       (long long)head_dim);
    if (n == 0) return GY_OK;
    if (x == NULL || positions == NULL || cos_table == NULL || sin_table == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rope: NULL buffer");
    for (int64_t t = 0; t < n; t++)
        if (positions[t] < 0 || positions[t] >= max_pos)
            return GY_FAIL(GY_ERR_INVALID, "gy_cpu_rope: token %lld has position %d outside the "
                           "table [0, %lld)", (long long)t, (int)positions[t], (long long)max_pos);
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos_table + (int64_t)positions[t] * half;
        const float *s = sin_table + (int64_t)positions[t] * half;
        for (int64_t h = 0; h < n_heads; h++) {
            float *v = x + (t * n_heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                /* One rounded product inside an fma: no compiler contraction can change it. */
                v[i] = fmaf(a, c[i], -(b * s[i]));
                v[i + half] = fmaf(b, c[i], a * s[i]);
            }
        }
    }
    return GY_OK;
}
