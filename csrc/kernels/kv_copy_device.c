/* kv_copy_device.c: the device half of kv/kv_copy.h's gy_kv_copy_heads, on the CUDA kernels
 * (kv_copy_heads.cu): kv/ declares it, the kernels implement it, so kv/ includes nothing of
 * kernels/. Without CUDA it answers GY_ERR_UNAVAILABLE. */
#include "../kv/kv_copy.h"

#ifdef GY_WITH_CUDA

#include "kv_ops.h"

/* The device copy: the block lists go up once, then one launch per layer on the legacy default
 * stream (the workers' streams are non-blocking and idle between steps, when transformations
 * run), and the host waits before the lists are freed. */
gy_status gy_kv_copy_heads_device(gy_kv_cache *dst, const int32_t *dst_blocks, int64_t dst_head0,
                                  int64_t dst_layer0, const gy_kv_cache *src,
                                  const int32_t *src_blocks, int64_t src_head0, int64_t src_layer0,
                                  int64_t n_heads, int64_t n_blocks, int64_t n_layers) {
    GY_TRY(gy_cuda_set_device(gy_arena_device(gy_kv_arena(dst))));
    int32_t *lists = NULL; /* (2, n_blocks): destination blocks, then source blocks */
    const uint64_t list_bytes = (uint64_t)n_blocks * sizeof(int32_t);
    GY_TRY(gy_cuda_malloc((void **)&lists, 2 * list_bytes));
    gy_status s = gy_cuda_memcpy_htod(lists, dst_blocks, list_bytes);
    if (s == GY_OK) s = gy_cuda_memcpy_htod(lists + n_blocks, src_blocks, list_bytes);
    for (int64_t l = 0; l < n_layers && s == GY_OK; l++)
        s = gy_cuda_kv_copy_heads((void *)gy_kv_layer_address(dst, dst_layer0 + l),
                                  gy_kv_layout_of(dst), lists, dst_head0,
                                  (const void *)gy_kv_layer_address(src, src_layer0 + l),
                                  gy_kv_layout_of(src), lists + n_blocks, src_head0, n_heads,
                                  n_blocks, NULL);
    /* Also where an error a copy hit while running surfaces. */
    if (s == GY_OK) s = gy_cuda_stream_synchronize(NULL);
    gy_cuda_free(lists);
    return s;
}

#else

gy_status gy_kv_copy_heads_device(gy_kv_cache *dst, const int32_t *dst_blocks, int64_t dst_head0,
                                  int64_t dst_layer0, const gy_kv_cache *src,
                                  const int32_t *src_blocks, int64_t src_head0, int64_t src_layer0,
                                  int64_t n_heads, int64_t n_blocks, int64_t n_layers) {
    (void)dst, (void)dst_blocks, (void)dst_head0, (void)dst_layer0, (void)src, (void)src_blocks;
    (void)src_head0, (void)src_layer0, (void)n_heads, (void)n_blocks, (void)n_layers;
    return GY_FAIL(GY_ERR_UNAVAILABLE, "copy_heads on a cuda arena: gyges was not built with CUDA");
}

#endif
