/* embedding.c: row lookup with on-the-fly widening. */
#include "embedding.h"

gy_status gy_cpu_embedding(float *out, const void *table, gy_dtype dtype, const int32_t *tokens,
                           int64_t n, int64_t vocab, int64_t dim) {
    GY_TRY(gy_dtype_check(dtype, "gy_cpu_embedding"));
    if (n < 0 || vocab <= 0 || dim <= 0)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_embedding: need n >= 0, vocab > 0, dim > 0 "
                       "(n=%lld vocab=%lld dim=%lld)", (long long)n, (long long)vocab, (long long)dim);
    if (n == 0) return GY_OK;
    if (out == NULL || table == NULL || tokens == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_embedding: NULL buffer");
    for (int64_t t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= vocab)
            return GY_FAIL(GY_ERR_INVALID, "gy_cpu_embedding: token %lld is %d, outside [0, %lld)",
                           (long long)t, (int)tokens[t], (long long)vocab);
    const int64_t esize = gy_dtype_size(dtype);
    for (int64_t t = 0; t < n; t++)
        GY_TRY(gy_dtype_to_f32(out + t * dim, (const char *)table + (int64_t)tokens[t] * dim * esize,
                               dtype, dim));
    return GY_OK;
}
