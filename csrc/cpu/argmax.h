/* argmax.h: greedy sampling, the index of the largest logit of each row.
 *
 * Ties go to the lowest index; NaNs are ignored (a row of only NaNs gives 0). */
#ifndef GY_CPU_ARGMAX_H
#define GY_CPU_ARGMAX_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out [n] = argmax over each row of logits [n, vocab]. */
gy_status gy_cpu_argmax(int32_t *out, const float *logits, int64_t n, int64_t vocab);

/* The sampler's greedy scan of one row v [vocab] in one pass: returns 0 and sets *argmax to the
 * lowest index of the largest logit when every logit is finite or -inf and one is finite; returns
 * 1 (leaving *argmax alone) when the row holds a NaN or +inf or only -inf. */
int gy_cpu_argmax_checked(const float *v, int64_t vocab, int64_t *argmax);

#ifdef __cplusplus
}
#endif
#endif
