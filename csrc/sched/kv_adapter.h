/* kv_adapter.h: the scheduler's KV ops over a real paged KV cache (kv/kv_cache.h), for the CPU
 * engine. Each request gets a KV sequence at its first reserve and loses it at release; the
 * engine finds a request's block table through gy_sched_kv_adapter_seq. */
#ifndef GY_SCHED_KV_ADAPTER_H
#define GY_SCHED_KV_ADAPTER_H

#include <stdint.h>

#include "../core/status.h"
#include "../kv/kv_cache.h"
#include "kv_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_sched_kv_adapter gy_sched_kv_adapter;

/* The cache is borrowed and must outlive the adapter. */
gy_status gy_sched_kv_adapter_init(gy_sched_kv_adapter **out, gy_kv_cache *kv);
/* Frees the sequences of requests still holding KV, then the adapter. */
void gy_sched_kv_adapter_free(gy_sched_kv_adapter *a);
/* The ops table over `a`; `a` must outlive every scheduler using it. */
gy_sched_kv_ops gy_sched_kv_adapter_ops(gy_sched_kv_adapter *a);
/* Makes `seq` (a live sequence of the cache) the KV of request `req`, which must hold none. */
gy_status gy_sched_kv_adapter_adopt(gy_sched_kv_adapter *a, int64_t req, int64_t seq);
/* Forgets every request's sequence without freeing any (they outlive the adapter). */
void gy_sched_kv_adapter_detach_all(gy_sched_kv_adapter *a);
/* Forgets request `req`'s sequence without freeing it (undoes an adopt). */
void gy_sched_kv_adapter_forget(gy_sched_kv_adapter *a, int64_t req);
/* Undo of a step (engine.c), over the request -> sequence map and the cache together (see
 * gy_kv_mark): from a mark on, reserve and release write down what they change, and undo takes
 * it back exactly; a point and undo_to take back only what came after the point. `changes`
 * bounds the reserves and releases to come (each of those that fits cannot fail for want of a
 * record). unmark keeps the changes. */
typedef struct gy_sched_kv_point {
    int64_t map, kv;
} gy_sched_kv_point;
gy_status gy_sched_kv_adapter_mark(gy_sched_kv_adapter *a, int64_t changes);
gy_sched_kv_point gy_sched_kv_adapter_point(const gy_sched_kv_adapter *a);
void gy_sched_kv_adapter_undo_to(gy_sched_kv_adapter *a, gy_sched_kv_point point);
void gy_sched_kv_adapter_undo(gy_sched_kv_adapter *a);
void gy_sched_kv_adapter_unmark(gy_sched_kv_adapter *a);
/* The KV sequence of request `req`, or -1 when it holds none. */
int64_t gy_sched_kv_adapter_seq(const gy_sched_kv_adapter *a, int64_t req);

#ifdef __cplusplus
}
#endif
#endif
