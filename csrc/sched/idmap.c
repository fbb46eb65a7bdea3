/* idmap.c: open addressing with linear probing; deletion shifts the following run back so no
 * tombstones accumulate over millions of simulated requests. */
#include "idmap.h"
#include "../core/alloc.h"

#include <stdlib.h>

static uint64_t gy_idmap_hash(int64_t key) {
    uint64_t x = (uint64_t)key; /* splitmix64's finaliser: ids are often consecutive */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

void gy_idmap_free(gy_idmap *m) {
    if (m == NULL) return;
    free(m->keys);
    free(m->values);
    free(m->used);
    m->keys = m->values = NULL;
    m->used = NULL;
    m->capacity = m->count = 0;
}

static int64_t gy_idmap_find(const gy_idmap *m, int64_t key) {
    if (m->capacity == 0) return -1;
    const uint64_t mask = (uint64_t)m->capacity - 1;
    for (uint64_t i = gy_idmap_hash(key) & mask;; i = (i + 1) & mask) {
        if (!m->used[i]) return -1;
        if (m->keys[i] == key) return (int64_t)i;
    }
}

static void gy_idmap_place(int64_t *keys, int64_t *values, uint8_t *used, int64_t capacity,
                           int64_t key, int64_t value) {
    const uint64_t mask = (uint64_t)capacity - 1;
    uint64_t i = gy_idmap_hash(key) & mask;
    while (used[i]) i = (i + 1) & mask;
    used[i] = 1;
    keys[i] = key;
    values[i] = value;
}

static gy_status gy_idmap_rehash(gy_idmap *m, int64_t capacity) {
    int64_t *keys = gy_malloc((size_t)capacity * sizeof *keys);
    int64_t *values = gy_malloc((size_t)capacity * sizeof *values);
    uint8_t *used = gy_calloc((size_t)capacity, 1);
    if (keys == NULL || values == NULL || used == NULL) {
        free(keys);
        free(values);
        free(used);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory growing an id map to %lld entries",
                       (long long)capacity);
    }
    for (int64_t i = 0; i < m->capacity; i++)
        if (m->used[i]) gy_idmap_place(keys, values, used, capacity, m->keys[i], m->values[i]);
    free(m->keys);
    free(m->values);
    free(m->used);
    m->keys = keys;
    m->values = values;
    m->used = used;
    m->capacity = capacity;
    return GY_OK;
}

gy_status gy_idmap_put(gy_idmap *m, int64_t key, int64_t value) {
    const int64_t at = gy_idmap_find(m, key);
    if (at >= 0) {
        m->values[at] = value;
        return GY_OK;
    }
    /* keep the load factor at most 1/2 so probe runs stay short */
    if (2 * (m->count + 1) > m->capacity)
        GY_TRY(gy_idmap_rehash(m, m->capacity ? 2 * m->capacity : 16));
    gy_idmap_place(m->keys, m->values, m->used, m->capacity, key, value);
    m->count++;
    return GY_OK;
}

int gy_idmap_get(const gy_idmap *m, int64_t key, int64_t *value) {
    const int64_t at = gy_idmap_find(m, key);
    if (at < 0) return 0;
    *value = m->values[at];
    return 1;
}

int gy_idmap_remove(gy_idmap *m, int64_t key) {
    int64_t at = gy_idmap_find(m, key);
    if (at < 0) return 0;
    const uint64_t mask = (uint64_t)m->capacity - 1;
    uint64_t hole = (uint64_t)at;
    for (uint64_t i = (hole + 1) & mask; m->used[i]; i = (i + 1) & mask) {
        /* an entry may move back into the hole only if its home is not in (hole, i] */
        const uint64_t home = gy_idmap_hash(m->keys[i]) & mask;
        const uint64_t dist_home = (i - home) & mask, dist_hole = (i - hole) & mask;
        if (dist_home >= dist_hole) {
            m->keys[hole] = m->keys[i];
            m->values[hole] = m->values[i];
            hole = i;
        }
    }
    m->used[hole] = 0;
    m->count--;
    return 1;
}
