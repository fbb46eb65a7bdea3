/* attention.h: causal paged attention over a layer's fp32 KV cache, prefill and decode alike.
 *
 * Query token t (paged.h: sequence s = token_seq[t], position p = token_pos[t]) attends over
 * positions 0..p of s, whose K/V are read through gy_kv_layout_offset(layout, kv, block, slot,
 * head) from layer_base. Grouped-query attention: query head h reads KV head
 * h / (n_q_heads / layout->n_heads). The K/V of positions 0..p must already be in the cache (write
 * a prefill chunk's K/V with gy_cpu_kv_write before attending).
 *
 * The arithmetic for one (token, query head), in this order:
 *   s_j   = gy_dot_ref(k_j, q) * scale          j = 0..p, scale = 1 / sqrtf(head_dim)
 *   m     = max_j s_j
 *   e_j   = gy_exp_ref(s_j - m)
 *   sum   = 16-lane sum of e_j (lane j % 16, zero padded, halving tree as in dot.h)
 *   acc_d = fma chain over j = 0..p increasing: acc_d = fma(e_j, v_j[d], acc_d), from +0
 *   out_d = acc_d / sum
 * Nothing depends on the block size, the layout, the block ids, the other tokens of the batch or
 * how a prompt is cut into chunks: a token's output is bit-identical in prefill and in decode,
 * alone or batched, with any of the three layouts; also on the AVX-512 and portable paths. */
#ifndef GY_CPU_ATTENTION_H
#define GY_CPU_ATTENTION_H

#include <stdint.h>

#include "paged.h"
#include "threadpool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out [n_tokens, n_q_heads, head_dim] = attention of q [n_tokens, n_q_heads, head_dim] over the
 * cache at layer_base (gy_kv_layout_layer_elems(layout) floats, elem_size 4). n_q_heads must be a
 * multiple of layout->n_heads. Work is split over (token, head) pairs. out must not overlap q. */
gy_status gy_cpu_attention(float *out, const float *q, const float *layer_base,
                           const gy_kv_layout *layout, const gy_cpu_paged_batch *batch,
                           int64_t n_q_heads, gy_threadpool *pool);

#ifdef __cplusplus
}
#endif
#endif
