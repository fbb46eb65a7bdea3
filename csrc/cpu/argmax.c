/* argmax.c: two passes per row, both vectorisable: the maximum (exact whatever the order), then
 * the first index holding it. */
#include "argmax.h"

#include <math.h>
#include <stddef.h>

gy_status gy_cpu_argmax(int32_t *out, const float *logits, int64_t n, int64_t vocab) {
    if (n < 0 || vocab <= 0 || vocab > INT32_MAX)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_argmax: need n >= 0 and vocab in [1, 2^31) "
                       "(n=%lld vocab=%lld)", (long long)n, (long long)vocab);
    if (n == 0) return GY_OK;
    if (out == NULL || logits == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_argmax: NULL buffer");
    for (int64_t r = 0; r < n; r++) {
        const float *v = logits + r * vocab;
        float best = -INFINITY;
        for (int64_t i = 0; i < vocab; i++) best = v[i] > best ? v[i] : best; /* NaN never wins */
        int32_t idx = 0;
        for (int64_t i = 0; i < vocab; i++)
            if (v[i] == best) {
                idx = (int32_t)i;
                break;
            }
        out[r] = idx;
    }
    return GY_OK;
}
