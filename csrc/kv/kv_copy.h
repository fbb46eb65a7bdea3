/* kv_copy.h: copies ranges of KV heads of lists of blocks from one paged KV cache to another (or
 * within one), wherever the caches live: the data movement of a TP transformation (Gyges 4.1.2)
 * on any backend. A host cache is copied with memmove on the host; a CUDA cache with one
 * gy_cuda_kv_copy_heads launch per layer (csrc/kernels/kv_copy_heads.cu) on the device, the block
 * lists uploaded once, so no byte of KV passes through the host.
 *
 * For i < n_blocks and every layer in [first_layer, first_layer + n_layers), heads
 * [src_head0, src_head0 + n_heads) of block src_blocks[i] of `src` (K and V, every token of the
 * block) go to heads [dst_head0, ...) of block dst_blocks[i] of `dst`, as the two caches' layouts
 * say (gy_kv_layout_offset): the layouts may differ in kind and heads per block, not in
 * block_size, head_dim or value size. The regions read and written must not overlap (the same
 * cache is allowed, e.g. a phase that receives into blocks an earlier one sent away).
 *
 * Both caches must be on one backend (and, for cuda, one device: virtual workers sharing a GPU);
 * block ids must be mapped blocks of their cache. Refused with nothing copied otherwise. Returns
 * when the copies have landed (cuda: after waiting for the device). */
#ifndef GY_KV_COPY_H
#define GY_KV_COPY_H

#include <stdint.h>

#include "kv_cache.h"

#ifdef __cplusplus
extern "C" {
#endif

gy_status gy_kv_copy_heads(gy_kv_cache *dst, const int32_t *dst_blocks, int64_t dst_head0,
                           const gy_kv_cache *src, const int32_t *src_blocks, int64_t src_head0,
                           int64_t n_heads, int64_t n_blocks, int64_t first_layer,
                           int64_t n_layers);

/* Whether two caches can be copied between: both on the host, or both on one CUDA device
 * (virtual workers sharing a GPU). `what` names the caller in the message. */
gy_status gy_kv_copy_check_arenas(const gy_kv_cache *dst, const gy_kv_cache *src, const char *what);

/* The device half, after the callers' checks: heads of block lists in layers [dst_layer0,
 * dst_layer0 + n_layers) of dst from [src_layer0, ...) of src (cache-local layer indices, which
 * differ where the caches hold different layer ranges: a pipeline re-split's copies).
 * Implemented by the CUDA kernels (csrc/kernels/kv_copy_device.c), so that kv/ does not depend
 * on them; GY_ERR_UNAVAILABLE in a build without CUDA. */
gy_status gy_kv_copy_heads_device(gy_kv_cache *dst, const int32_t *dst_blocks, int64_t dst_head0,
                                  int64_t dst_layer0, const gy_kv_cache *src,
                                  const int32_t *src_blocks, int64_t src_head0, int64_t src_layer0,
                                  int64_t n_heads, int64_t n_blocks, int64_t n_layers);

#ifdef __cplusplus
}
#endif
#endif
