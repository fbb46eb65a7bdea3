/* buddy.c: KunServe's buddy-group plans (buddy.h). */
#include "buddy.h"

#include <math.h>
#include <stddef.h>

gy_status gy_buddy_plan(int32_t n, double required, double param_bytes, int32_t strategy,
                        double kv_bytes, int32_t *group_of, int32_t *met, double *freed) {
    if (n < 1 || group_of == NULL || met == NULL || freed == NULL)
        return GY_FAIL(GY_ERR_INVALID, "a buddy plan needs at least one instance, got %d", (int)n);
    if (!(required >= 0) || !isfinite(required) || !(param_bytes > 0) || !isfinite(param_bytes) ||
        !isfinite(kv_bytes))
        return GY_FAIL(GY_ERR_INVALID, "required bytes (%g) must be >= 0 and parameter bytes (%g) "
                       "> 0, both finite", required, param_bytes);
    if (strategy != GY_BUDDY_THROUGHPUT && strategy != GY_BUDDY_MEMORY)
        return GY_FAIL(GY_ERR_INVALID, "unknown buddy strategy %d", (int)strategy);
    /* groups as contiguous ranges: start[k] of group k, group k spans [start[k], start[k + 1]) */
    for (int32_t j = 0; j < n; j++) group_of[j] = j;
    int32_t groups = n;
    double got = 0;
    if (strategy == GY_BUDDY_THROUGHPUT) {
        while (groups > 1 && got < required) {
            /* neighbours to merge: the pair with the smallest larger member, then the smallest
             * sum, the leftmost of equals (with singletons: the two smallest groups) */
            int64_t best = INT64_MAX;
            int32_t pick = 0;
            for (int32_t g = 0, j = 0; g < groups; g++) {
                int32_t size = 0;
                while (j < n && group_of[j] == g) j++, size++;
                if (g + 1 < groups) {
                    int32_t next = 0;
                    for (int32_t i = j; i < n && group_of[i] == g + 1; i++) next++;
                    const int64_t larger = size > next ? size : next;
                    const int64_t key = larger * (2 * (int64_t)n + 2) + size + next;
                    if (key < best) {
                        best = key;
                        pick = g;
                    }
                }
            }
            for (int32_t j = 0; j < n; j++) /* merge pick + 1 into pick, renumber the rest */
                if (group_of[j] > pick) group_of[j]--;
            groups--;
            got += param_bytes;
        }
    } else {
        /* one group from instance 0, one instance at a time */
        const double cap = kv_bytes > 0 ? kv_bytes : INFINITY;
        while (groups > 1 && got < required && got + param_bytes <= cap) {
            for (int32_t j = 0; j < n; j++)
                if (group_of[j] > 0) group_of[j]--;
            groups--;
            got += param_bytes;
        }
    }
    *met = got >= required;
    *freed = got;
    return GY_OK;
}
