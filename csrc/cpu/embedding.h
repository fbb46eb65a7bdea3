/* embedding.h: token embedding lookup from an fp32, bf16 or f16 table (widened exactly). */
#ifndef GY_CPU_EMBEDDING_H
#define GY_CPU_EMBEDDING_H

#include <stdint.h>

#include "../core/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out [n, dim] = table [vocab, dim] rows tokens [n]; every token must be in [0, vocab). */
gy_status gy_cpu_embedding(float *out, const void *table, gy_dtype dtype, const int32_t *tokens,
                           int64_t n, int64_t vocab, int64_t dim);

#ifdef __cplusplus
}
#endif
#endif
