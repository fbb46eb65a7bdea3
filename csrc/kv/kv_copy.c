/* kv_copy.c: head ranges of block lists between two KV caches, on the host or on the device (see
 * kv_copy.h). Every address goes through gy_kv_layout_offset. */
#include "kv_copy.h"
#include "../core/fault.h"

#include <string.h>

static gy_status gy_kv_copy_check_blocks(const gy_kv_cache *kv, const int32_t *blocks,
                                         int64_t n_blocks, const char *which) {
    gy_kv_stats st;
    gy_kv_stats_get(kv, &st);
    for (int64_t i = 0; i < n_blocks; i++)
        if (blocks[i] < 0 || blocks[i] >= st.n_blocks)
            return GY_FAIL(GY_ERR_INVALID,
                           "copy_heads: %s block %d (entry %lld) is not one of the cache's %lld "
                           "mapped blocks",
                           which, (int)blocks[i], (long long)i, (long long)st.n_blocks);
    return GY_OK;
}

gy_status gy_kv_copy_check_arenas(const gy_kv_cache *dst, const gy_kv_cache *src, const char *what) {
    const gy_arena *da = gy_kv_arena(dst), *sa = gy_kv_arena(src);
    const int d_cuda = gy_arena_backend(da) == GY_ARENA_BACKEND_CUDA;
    const int s_cuda = gy_arena_backend(sa) == GY_ARENA_BACKEND_CUDA;
    if (d_cuda != s_cuda)
        return GY_FAIL(GY_ERR_UNAVAILABLE,
                       "%s: KV copies between a host arena and a device arena are not "
                       "implemented", what);
    if (d_cuda && gy_arena_device(da) != gy_arena_device(sa))
        return GY_FAIL(GY_ERR_UNAVAILABLE,
                       "%s: KV copies between CUDA devices %d and %d are not implemented "
                       "(only between virtual workers sharing one GPU)",
                       what, (int)gy_arena_device(sa), (int)gy_arena_device(da));
    return GY_OK;
}

static gy_status gy_kv_copy_check(const gy_kv_cache *dst, const int32_t *dst_blocks,
                                  int64_t dst_head0, const gy_kv_cache *src,
                                  const int32_t *src_blocks, int64_t src_head0, int64_t n_heads,
                                  int64_t n_blocks, int64_t first_layer, int64_t n_layers) {
    if (dst == NULL || src == NULL || (n_blocks > 0 && (dst_blocks == NULL || src_blocks == NULL)))
        return GY_FAIL(GY_ERR_INVALID, "copy_heads: NULL cache or block list");
    if (n_heads < 0 || n_blocks < 0 || n_layers < 0)
        return GY_FAIL(GY_ERR_INVALID, "copy_heads: negative count (%lld heads, %lld blocks, %lld layers)",
                       (long long)n_heads, (long long)n_blocks, (long long)n_layers);
    const gy_kv_config *dc = gy_kv_config_of(dst), *sc = gy_kv_config_of(src);
    if (dc->block_size != sc->block_size || dc->head_dim != sc->head_dim ||
        dc->elem_size != sc->elem_size)
        return GY_FAIL(GY_ERR_INVALID,
                       "copy_heads: the caches differ in block_size (%lld vs %lld), head_dim "
                       "(%lld vs %lld) or value size (%lld vs %lld bytes)",
                       (long long)dc->block_size, (long long)sc->block_size,
                       (long long)dc->head_dim, (long long)sc->head_dim,
                       (long long)dc->elem_size, (long long)sc->elem_size);
    if (first_layer < 0 || first_layer + n_layers > dc->n_layers ||
        first_layer + n_layers > sc->n_layers)
        return GY_FAIL(GY_ERR_INVALID, "copy_heads: layers [%lld, %lld) are not in both caches",
                       (long long)first_layer, (long long)(first_layer + n_layers));
    if (src_head0 < 0 || src_head0 + n_heads > sc->n_heads || dst_head0 < 0 ||
        dst_head0 + n_heads > dc->n_heads)
        return GY_FAIL(GY_ERR_INVALID,
                       "copy_heads: heads [%lld, %lld) of %lld -> [%lld, %lld) of %lld are out of "
                       "range",
                       (long long)src_head0, (long long)(src_head0 + n_heads),
                       (long long)sc->n_heads, (long long)dst_head0,
                       (long long)(dst_head0 + n_heads), (long long)dc->n_heads);
    GY_TRY(gy_kv_copy_check_arenas(dst, src, "copy_heads"));
    GY_TRY(gy_kv_copy_check_blocks(dst, dst_blocks, n_blocks, "destination"));
    return gy_kv_copy_check_blocks(src, src_blocks, n_blocks, "source");
}

/* The host copy: one memmove per (block, K/V, token, head) row of head_dim values. */
static void gy_kv_copy_host(gy_kv_cache *dst, const int32_t *dst_blocks, int64_t dst_head0,
                            const gy_kv_cache *src, const int32_t *src_blocks, int64_t src_head0,
                            int64_t n_heads, int64_t n_blocks, int64_t layer) {
    const gy_kv_layout *dl = gy_kv_layout_of(dst), *sl = gy_kv_layout_of(src);
    char *dbase = gy_kv_layer_ptr(dst, layer);
    const char *sbase = gy_kv_layer_ptr(src, layer);
    const int64_t es = dl->elem_size, row = dl->head_dim * es;
    for (int64_t i = 0; i < n_blocks; i++)
        for (int64_t kv = 0; kv < 2; kv++)
            for (int64_t t = 0; t < dl->block_size; t++)
                for (int64_t h = 0; h < n_heads; h++)
                    memmove(dbase + gy_kv_layout_offset(dl, kv, dst_blocks[i], t, dst_head0 + h) * es,
                            sbase + gy_kv_layout_offset(sl, kv, src_blocks[i], t, src_head0 + h) * es,
                            (size_t)row);
}


gy_status gy_kv_copy_heads(gy_kv_cache *dst, const int32_t *dst_blocks, int64_t dst_head0,
                           const gy_kv_cache *src, const int32_t *src_blocks, int64_t src_head0,
                           int64_t n_heads, int64_t n_blocks, int64_t first_layer,
                           int64_t n_layers) {
    GY_TRY(gy_kv_copy_check(dst, dst_blocks, dst_head0, src, src_blocks, src_head0, n_heads,
                            n_blocks, first_layer, n_layers));
    if (n_heads == 0 || n_blocks == 0 || n_layers == 0) return GY_OK;
    if (gy_fault_hit(GY_FAULT_COPY))
        return GY_FAIL(GY_ERR_SYSTEM, "injected fault: copying %lld blocks' heads failed",
                       (long long)n_blocks);
    if (gy_arena_backend(gy_kv_arena(dst)) == GY_ARENA_BACKEND_CUDA)
        return gy_kv_copy_heads_device(dst, dst_blocks, dst_head0, first_layer, src, src_blocks,
                                       src_head0, first_layer, n_heads, n_blocks, n_layers);
    for (int64_t l = first_layer; l < first_layer + n_layers; l++)
        gy_kv_copy_host(dst, dst_blocks, dst_head0, src, src_blocks, src_head0, n_heads, n_blocks, l);
    return GY_OK;
}
