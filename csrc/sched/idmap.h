/* idmap.h: a map from caller-chosen int64 ids to int64 values (open addressing, linear probing,
 * backward-shift deletion). The scheduler and the block counter use it to find a request by the
 * id its caller gave it. Lookups only: nothing iterates it, so its order never reaches a batch. */
#ifndef GY_SCHED_IDMAP_H
#define GY_SCHED_IDMAP_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_idmap {
    int64_t *keys;    /* (capacity) */
    int64_t *values;  /* (capacity) */
    uint8_t *used;    /* (capacity) 1 where keys[i] holds an entry */
    int64_t capacity; /* a power of two, or 0 before the first put */
    int64_t count;
} gy_idmap;

/* An empty map needs no allocation: `gy_idmap m = {0};` is ready. */
void gy_idmap_free(gy_idmap *m);
/* Inserts or overwrites; fails only when host memory runs out (the map is then unchanged). */
gy_status gy_idmap_put(gy_idmap *m, int64_t key, int64_t value);
/* 1 and *value when present, else 0 (value untouched). */
int gy_idmap_get(const gy_idmap *m, int64_t key, int64_t *value);
/* 1 when it was present. */
int gy_idmap_remove(gy_idmap *m, int64_t key);

#ifdef __cplusplus
}
#endif
#endif
