/* alloc.h: the core's host allocations, one place for them so that fault injection
 * (fault.h, site GY_FAULT_ALLOC) can make any of them fail. Same contracts as the C library's;
 * release with free(). */
#ifndef GY_CORE_ALLOC_H
#define GY_CORE_ALLOC_H

#include <stdlib.h>

#include "fault.h"

static inline void *gy_malloc(size_t n) { return gy_fault_hit(GY_FAULT_ALLOC) ? NULL : malloc(n); }
static inline void *gy_calloc(size_t n, size_t size) {
    return gy_fault_hit(GY_FAULT_ALLOC) ? NULL : calloc(n, size);
}
static inline void *gy_realloc(void *p, size_t n) {
    return gy_fault_hit(GY_FAULT_ALLOC) ? NULL : realloc(p, n);
}

#endif
