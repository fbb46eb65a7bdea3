/* kv_write.c: scatter of new K/V rows into the paged cache. */
#include "kv_write.h"

#include <string.h>

gy_status gy_cpu_kv_write(float *layer_base, const gy_kv_layout *layout, const float *k,
                          const float *v, const gy_cpu_paged_batch *batch) {
    GY_TRY(gy_cpu_paged_batch_check(batch, layout, "gy_cpu_kv_write", NULL));
    if (layout->elem_size != 4)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_kv_write: the CPU cache holds fp32 (elem_size 4), "
                       "the layout says %lld", (long long)layout->elem_size);
    if (batch->n_tokens == 0) return GY_OK;
    if (layer_base == NULL || k == NULL || v == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_kv_write: NULL buffer");
    const int64_t H = layout->n_heads, d = layout->head_dim;
    for (int64_t t = 0; t < batch->n_tokens; t++) {
        const int64_t pos = batch->token_pos[t];
        const int64_t block = gy_cpu_paged_block(batch, batch->token_seq[t], pos, layout->block_size);
        const int64_t slot = pos % layout->block_size;
        for (int64_t h = 0; h < H; h++) {
            memcpy(layer_base + gy_kv_layout_offset(layout, 0, block, slot, h), k + (t * H + h) * d,
                   (size_t)d * sizeof(float));
            memcpy(layer_base + gy_kv_layout_offset(layout, 1, block, slot, h), v + (t * H + h) * d,
                   (size_t)d * sizeof(float));
        }
    }
    return GY_OK;
}
