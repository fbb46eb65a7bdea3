/* kv_move_device.c: the device backend of KV moves (kv_move_device.h). */
#include "kv_move_device.h"

#ifdef GY_WITH_CUDA

#include <stdlib.h>

#include "../core/alloc.h"
#include "../core/fault.h"
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
        const int32_t *sb, *db;
        const int64_t n = gy_kv_move_item_pairs(it, &sb, &db);
        for (int64_t j = 0; j < n; j++) {
            if (!gy_kv_move_pair_moves(mv, it, j, sb, db, 0, NULL)) continue;
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

/* ---- OVERLAP moves: a layer-staggered transformation's shadow over the owner's pages ----
 *
 * Every source of a layer is read into a device stage before anything of that layer is written:
 * per layer, each group's pairs go up into its part of the stage (a header-layout block per pair,
 * of the group's heads), then down into their destinations, all on the legacy default stream,
 * whose order is the guarantee. Layers do not overlap one another (a shadow keeps its owner's
 * slots per layer), so one layer's stage serves every layer. A pair already where it goes (a
 * rank's own heads of a header-centric block: the same address and strides at both ends, in
 * every layer) is neither read nor written, as on the host. Early reads are the host's
 * (gy_kv_move_plan); a device move reads everything here: a layer's KV is copied at device
 * bandwidth, a small part of a step. */

static gy_status gy_kv_move_device_copy_overlapping(const gy_kv_move *mv, gy_kv_move_stage *stage,
                                                    gy_kv_move_stats *st) {
    (void)stage; /* host memory: nothing a device move can use */
    int64_t total = 0;
    for (int64_t i = 0; i < mv->n_items; i++) {
        const int32_t *sb, *db;
        total += gy_kv_move_item_pairs(&mv->items[i], &sb, &db);
    }
    /* groups: (n_items + 1) first pair of each group, group_item: (n_items + 1) its first item,
     * stage_at: (n_items + 1) byte offset of its part of the stage, lists: (2, total) int32
     * destination then source ids, iota: (total) int32 the stage's block ids */
    const int64_t n1 = mv->n_items + 1;
    int64_t *groups = gy_malloc((size_t)(3 * n1) * sizeof(int64_t) + (size_t)(3 * total) * sizeof(int32_t));
    if (groups == NULL)
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the block lists of an overlapping "
                       "KV move of %lld pairs", (long long)total);
    int64_t *group_item = groups + n1, *stage_at = group_item + n1;
    int32_t *lists = (int32_t *)(stage_at + n1), *iota = lists + 2 * total;
    int64_t m = 0, n_groups = 0, stage_bytes = 0, most = 0;
    uint64_t in_place = 0;
    int same_place = 0;
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kv_move_item *it = &mv->items[i];
        if (i == 0 || !gy_kv_move_device_same(it, &mv->items[group_item[n_groups - 1]])) {
            if (n_groups > 0) {
                const gy_kv_move_item *g = &mv->items[group_item[n_groups - 1]];
                stage_bytes += (m - groups[n_groups - 1]) * gy_kv_move_token_bytes(g->src, g->n_heads) *
                               gy_kv_config_of(g->src)->block_size;
            }
            groups[n_groups] = m;
            stage_at[n_groups] = stage_bytes;
            group_item[n_groups++] = i;
            same_place = gy_kv_move_same_place(mv, it);
        }
        const int32_t *sb, *db;
        const int64_t n = gy_kv_move_item_pairs(it, &sb, &db);
        for (int64_t j = 0; j < n; j++) {
            if (!gy_kv_move_pair_moves(mv, it, j, sb, db, same_place, &in_place)) continue;
            lists[m] = db[j];
            lists[total + m++] = sb[j];
        }
    }
    if (n_groups > 0) {
        const gy_kv_move_item *g = &mv->items[group_item[n_groups - 1]];
        stage_bytes += (m - groups[n_groups - 1]) * gy_kv_move_token_bytes(g->src, g->n_heads) *
                       gy_kv_config_of(g->src)->block_size;
    }
    groups[n_groups] = m;
    for (int64_t g = 0; g < n_groups; g++)
        if (groups[g + 1] - groups[g] > most) most = groups[g + 1] - groups[g];
    for (int64_t j = 0; j < most; j++) iota[j] = (int32_t)j;
    gy_status s = GY_OK;
    char *dev = NULL;
    /* the lists, the stage's ids, then the stage (256-byte aligned, as cudaMalloc's own) */
    const uint64_t ids_bytes = (uint64_t)(2 * m + most) * sizeof(int32_t);
    const uint64_t stage_off = (ids_bytes + 255) / 256 * 256;
    if (m > 0) {
        s = gy_cuda_set_device(gy_arena_device(gy_kv_arena(mv->items[0].dst)));
        /* device memory the move allocates: the allocation site of fault injection */
        if (s == GY_OK && gy_fault_hit(GY_FAULT_ALLOC))
            s = GY_FAIL(GY_ERR_CUDA, "injected fault: the device stage of an overlapping KV move "
                        "(%lld bytes)", (long long)stage_bytes);
        if (s == GY_OK) s = gy_cuda_malloc((void **)&dev, stage_off + (uint64_t)stage_bytes);
        if (s == GY_OK) s = gy_cuda_memcpy_htod(dev, lists, (uint64_t)m * sizeof(int32_t));
        if (s == GY_OK)
            s = gy_cuda_memcpy_htod(dev + m * sizeof(int32_t), lists + total, (uint64_t)m * sizeof(int32_t));
        if (s == GY_OK)
            s = gy_cuda_memcpy_htod(dev + 2 * m * sizeof(int32_t), iota, (uint64_t)most * sizeof(int32_t));
    }
    const int32_t *dst_ids = (const int32_t *)dev, *src_ids = dst_ids + m, *stage_ids = src_ids + m;
    for (int64_t l = mv->first_layer; l < mv->end_layer && m > 0 && s == GY_OK; l++)
        for (int pass = 0; pass < 2 && s == GY_OK; pass++) /* every read, then every write */
            for (int64_t g = 0; g < n_groups && s == GY_OK; g++) {
                const int64_t count = groups[g + 1] - groups[g];
                if (count == 0) continue;
                const gy_kv_move_item *it = &mv->items[group_item[g]];
                const gy_kv_config *c = gy_kv_config_of(it->src);
                gy_kv_layout part;
                s = gy_kv_layout_init(&part, GY_KV_LAYOUT_HEAD, c->block_size, it->n_heads,
                                      c->head_dim, c->elem_size, count);
                if (s != GY_OK) break;
                char *staged = dev + stage_off + stage_at[g];
                if (pass == 0)
                    s = gy_cuda_kv_copy_heads(
                        staged, &part, stage_ids, 0,
                        (const void *)gy_kv_layer_address(it->src, gy_kv_move_layer(it->src, l)),
                        gy_kv_layout_of(it->src), src_ids + groups[g], it->src_head, it->n_heads,
                        count, NULL);
                else
                    s = gy_cuda_kv_copy_heads(
                        (void *)gy_kv_layer_address(it->dst, gy_kv_move_layer(it->dst, l)),
                        gy_kv_layout_of(it->dst), dst_ids + groups[g], it->dst_head, staged, &part,
                        stage_ids, 0, it->n_heads, count, NULL);
            }
    /* Also where an error a copy hit while running surfaces. */
    if (s == GY_OK && m > 0) s = gy_cuda_stream_synchronize(NULL);
    gy_cuda_free(dev);
    free(groups);
    if (s == GY_OK) {
        st->bytes -= in_place;
        st->bytes_in_place = in_place;
        st->bytes_late = st->bytes;
        st->stage_bytes = (uint64_t)stage_bytes;
    }
    return s;
}

const gy_kv_move_backend gy_kv_move_device_backend = {
    .name = "cuda",
    .copy = gy_kv_move_device_copy,
    .copy_overlapping = gy_kv_move_device_copy_overlapping,
};

gy_status gy_kv_move_device_register(void) {
    return gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_DEVICE, &gy_kv_move_device_backend);
}

#else

gy_status gy_kv_move_device_register(void) { return GY_OK; }

#endif
