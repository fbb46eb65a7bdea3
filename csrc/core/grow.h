/* grow.h: scratch buffers kept between calls, grown by doubling (contents kept). */
#ifndef GY_CORE_GROW_H
#define GY_CORE_GROW_H

#include <stdint.h>
#include "alloc.h"
#include <stdlib.h>

#include "status.h"

/* Grows *buf to hold at least n elements of `size` bytes; `what` names the buffer's use in the
 * error message. */
static inline gy_status gy_grow(void **buf, int64_t *cap, int64_t n, size_t size, const char *what) {
    if (n <= *cap) return GY_OK;
    int64_t c = *cap ? *cap : 64;
    while (c < n) c *= 2;
    void *p = gy_realloc(*buf, (size_t)c * size);
    if (p == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for %s (%lld elements)", what,
                                  (long long)n);
    *buf = p;
    *cap = c;
    return GY_OK;
}

#endif
