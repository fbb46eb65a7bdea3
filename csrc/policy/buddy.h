/* buddy.h: KunServe's buddy groups (section 4.1, Algorithm 1): which instances drop parameters
 * together. A group of g instances keeps one copy of the model's parameters (P bytes) spread
 * over its members, so it frees (g - 1) * P bytes for KV. Given the KV bytes R the cluster lacks:
 *
 *   throughput-greedy (Algorithm 1)  start from singletons and repeatedly merge the two smallest
 *                                    groups (ties: the lowest first instance) until the freed
 *                                    memory reaches R or one group is left; small groups keep
 *                                    pipelines short (fewer stages, fewer bubbles).
 *   memory-greedy                    grow one group, instance by instance, while the freed memory
 *                                    stays within the original KV region (kv_bytes: KunServe
 *                                    stops there, as KV beyond it does not raise throughput) and
 *                                    until it reaches R.
 * Groups are contiguous ranges of instances in this implementation: merging the two smallest
 * groups picks adjacent ones among the smallest (so a group is a pipeline of neighbours). */
#ifndef GY_POLICY_BUDDY_H
#define GY_POLICY_BUDDY_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gy_buddy_strategy {
    GY_BUDDY_THROUGHPUT = 0,
    GY_BUDDY_MEMORY = 1,
} gy_buddy_strategy;

/* group_of[j] (n entries) receives the group of instance j, numbered 0.. in instance order;
 * *met whether the freed memory reaches `required`; *freed the bytes freed. kv_bytes <= 0: no
 * cap (memory-greedy then grows until R is met). */
gy_status gy_buddy_plan(int32_t n, double required, double param_bytes, int32_t strategy,
                        double kv_bytes, int32_t *group_of, int32_t *met, double *freed);

#ifdef __cplusplus
}
#endif
#endif
