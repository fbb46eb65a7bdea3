/* kv_layout.c: strides of the three Gyges KV layouts. */
#include "kv_layout.h"

gy_status gy_kv_layout_init(gy_kv_layout *out, gy_kv_layout_kind kind, int64_t block_size,
                            int64_t n_heads, int64_t head_dim, int64_t elem_size, int64_t n_blocks) {
    if (block_size <= 0 || n_heads <= 0 || head_dim <= 0 || elem_size <= 0 || n_blocks < 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "KV layout sizes must be positive: block_size=%lld n_heads=%lld "
                       "head_dim=%lld elem_size=%lld n_blocks=%lld",
                       (long long)block_size, (long long)n_heads, (long long)head_dim,
                       (long long)elem_size, (long long)n_blocks);
    const int64_t d = head_dim, h = n_heads, b = block_size;
    gy_kv_layout layout = {0};
    layout.kind = (int32_t)kind;
    layout.block_size = b;
    layout.n_heads = h;
    layout.head_dim = d;
    layout.n_blocks = n_blocks;
    layout.elem_size = elem_size;
    layout.block_elems = 2 * b * h * d;
    switch (kind) {
    case GY_KV_LAYOUT_RAW: /* [K/V, Block, Token, Head, d] */
        layout.stride_head = d;
        layout.stride_token = h * d;
        layout.stride_block = b * h * d;
        layout.stride_kv = n_blocks * b * h * d;
        break;
    case GY_KV_LAYOUT_PAGE: /* [Block, K/V, Token, Head, d] */
        layout.stride_head = d;
        layout.stride_token = h * d;
        layout.stride_kv = b * h * d;
        layout.stride_block = 2 * b * h * d;
        break;
    case GY_KV_LAYOUT_HEAD: /* [Block, Head, K/V, Token, d] */
        layout.stride_token = d;
        layout.stride_kv = b * d;
        layout.stride_head = 2 * b * d;
        layout.stride_block = h * 2 * b * d;
        break;
    default:
        return GY_FAIL(GY_ERR_INVALID, "unknown KV layout %d (expected 0=raw, 1=page, 2=head)",
                       (int)kind);
    }
    *out = layout;
    return GY_OK;
}

void gy_kv_layout_stride_order(gy_kv_layout_kind kind, int32_t order[GY_KV_DIM_COUNT]) {
    static const int32_t orders[GY_KV_LAYOUT_COUNT][GY_KV_DIM_COUNT] = {
        [GY_KV_LAYOUT_RAW] = {GY_KV_DIM_KV, GY_KV_DIM_BLOCK, GY_KV_DIM_TOKEN, GY_KV_DIM_HEAD},
        [GY_KV_LAYOUT_PAGE] = {GY_KV_DIM_BLOCK, GY_KV_DIM_KV, GY_KV_DIM_TOKEN, GY_KV_DIM_HEAD},
        [GY_KV_LAYOUT_HEAD] = {GY_KV_DIM_BLOCK, GY_KV_DIM_HEAD, GY_KV_DIM_KV, GY_KV_DIM_TOKEN},
    };
    const int k = (kind >= 0 && kind < GY_KV_LAYOUT_COUNT) ? (int)kind : 0;
    for (int i = 0; i < GY_KV_DIM_COUNT; i++) order[i] = orders[k][i];
}

const char *gy_kv_layout_name(gy_kv_layout_kind kind) {
    switch (kind) {
    case GY_KV_LAYOUT_RAW: return "raw";
    case GY_KV_LAYOUT_PAGE: return "page";
    case GY_KV_LAYOUT_HEAD: return "head";
    default: return "unknown";
    }
}
