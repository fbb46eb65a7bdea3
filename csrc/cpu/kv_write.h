/* kv_write.h: storing the new tokens' K and V into a layer's paged cache (fp32), through the
 * layout's offsets (kv_layout.h), one token row at a time. */
#ifndef GY_CPU_KV_WRITE_H
#define GY_CPU_KV_WRITE_H

#include <stdint.h>

#include "paged.h"

#ifdef __cplusplus
extern "C" {
#endif

/* For every token t and KV head h: K[t, h, :] and V[t, h, :] go to the slot of token t's position
 * (paged.h). k, v [n_tokens, layout->n_heads, layout->head_dim]; layer_base holds
 * gy_kv_layout_layer_elems(layout) floats; layout->elem_size must be 4. Tokens are written in
 * order, so a later token wins a slot named twice. */
gy_status gy_cpu_kv_write(float *layer_base, const gy_kv_layout *layout, const float *k,
                          const float *v, const gy_cpu_paged_batch *batch);

#ifdef __cplusplus
}
#endif
#endif
