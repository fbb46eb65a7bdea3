/* kv_move_device.c: the device backend of KV moves (kv_move_device.h). */
#include "kv_move_device.h"

#ifdef GY_WITH_CUDA

#include <stdlib.h>

#include "../core/alloc.h"
#include "kv_ops.h"

/* Whether item i and item j copy between the same caches and heads (one launch serves both). */
static int gy_kv_move_device_same(const gy_kv_move_item *a, const gy_kv_move_item *b) {
    return a->src == b->src && a->dst == b->dst && a->src_head == b->src_head &&
           a->dst_head == b->dst_head && a->n_heads == b->n_heads;
}

/* Consecutive items between the same caches and heads form a group: their pairs that hold a slot
 * to copy go up once, as (2, pairs) destination then source ids, and each group is one kernel
 * per layer on the legacy default stream (the workers' streams are non-blocking and idle between
 * steps, when moves run); the host waits before the lists are freed. A pair's block goes whole,
 * every slot: the slots past a token limit or clean in the bitmap hold what the destination
 * has already or what no one reads yet. */
static gy_status gy_kv_move_device_copy(const gy_kv_move *mv, gy_kv_move_stats *st) {
    (void)st;
    int64_t total = 0;
    for (int64_t i = 0; i < mv->n_items; i++) {
        const int32_t *sb, *db;
        total += gy_kv_move_item_pairs(&mv->items[i], &sb, &db);
    }
    /* groups: (n_items + 1) first pair of each group, group_item: (n_items + 1) its first item,
     * lists: (2, total) int32, in one allocation */
    int64_t *groups = gy_malloc((size_t)(2 * (mv->n_items + 1)) * sizeof(int64_t) +
                                (size_t)(2 * total) * sizeof(int32_t));
    if (groups == NULL)
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the block lists of a KV move of "
                       "%lld pairs", (long long)total);
    int64_t *group_item = groups + mv->n_items + 1;
    int32_t *lists = (int32_t *)(group_item + mv->n_items + 1);
    int64_t m = 0, n_groups = 0;
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kv_move_item *it = &mv->items[i];
        if (i == 0 || !gy_kv_move_device_same(it, &mv->items[group_item[n_groups - 1]])) {
            groups[n_groups] = m;
            group_item[n_groups++] = i;
        }
        const int64_t B = gy_kv_config_of(it->src)->block_size;
        const int32_t *sb, *db;
        const int64_t n = gy_kv_move_item_pairs(it, &sb, &db);
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = gy_kv_move_pair_tokens(it, j, B);
            int any = t > 0 && it->n_heads > 0;
            if (any && mv->dirty != NULL) {
                any = 0;
                for (int64_t k = 0; k < t && !any; k++)
                    any = gy_kv_move_dirty_at(mv->dirty, (int64_t)sb[j] * B + k);
            }
            if (!any) continue;
            lists[m] = db[j];
            lists[total + m++] = sb[j];
        }
    }
    groups[n_groups] = m;
    gy_status s = GY_OK;
    int32_t *dev = NULL;
    if (m > 0) {
        s = gy_cuda_set_device(gy_arena_device(gy_kv_arena(mv->items[0].dst)));
        if (s == GY_OK) s = gy_cuda_malloc((void **)&dev, (uint64_t)(2 * m) * sizeof *dev);
        if (s == GY_OK) s = gy_cuda_memcpy_htod(dev, lists, (uint64_t)m * sizeof *dev);
        if (s == GY_OK) s = gy_cuda_memcpy_htod(dev + m, lists + total, (uint64_t)m * sizeof *dev);
    }
    for (int64_t l = mv->first_layer; l < mv->end_layer && m > 0 && s == GY_OK; l++)
        for (int64_t g = 0; g < n_groups && s == GY_OK; g++) {
            const int64_t count = groups[g + 1] - groups[g];
            if (count == 0) continue;
            const gy_kv_move_item *it = &mv->items[group_item[g]];
            s = gy_cuda_kv_copy_heads(
                (void *)gy_kv_layer_address(it->dst, gy_kv_move_layer(it->dst, l)),
                gy_kv_layout_of(it->dst), dev + groups[g], it->dst_head,
                (const void *)gy_kv_layer_address(it->src, gy_kv_move_layer(it->src, l)),
                gy_kv_layout_of(it->src), dev + m + groups[g], it->src_head, it->n_heads, count,
                NULL);
        }
    /* Also where an error a copy hit while running surfaces. */
    if (s == GY_OK && m > 0) s = gy_cuda_stream_synchronize(NULL);
    gy_cuda_free(dev);
    free(groups);
    return s;
}

const gy_kv_move_backend gy_kv_move_device_backend = {
    .name = "cuda",
    .copy = gy_kv_move_device_copy,
    .copy_overlapping = NULL, /* a shadow's moves are the host's (layer-staggered, CPU only) */
};

gy_status gy_kv_move_device_register(void) {
    return gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_DEVICE, &gy_kv_move_device_backend);
}

#else

gy_status gy_kv_move_device_register(void) { return GY_OK; }

#endif
