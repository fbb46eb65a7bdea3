/* paged.c: validation of a paged token batch against a KV layout. */
#include "paged.h"

#include <stddef.h>

gy_status gy_cpu_paged_batch_check(const gy_cpu_paged_batch *batch, const gy_kv_layout *layout,
                                   const char *what, int64_t *max_len) {
    if (max_len) *max_len = 0;
    if (batch == NULL || layout == NULL) return GY_FAIL(GY_ERR_INVALID, "%s: NULL batch or layout", what);
    if (layout->block_size <= 0 || layout->n_heads <= 0 || layout->head_dim <= 0 ||
        layout->n_blocks < 0)
        return GY_FAIL(GY_ERR_INVALID, "%s: the KV layout is not initialised", what);
    if (batch->n_tokens < 0 || batch->n_seqs < 0)
        return GY_FAIL(GY_ERR_INVALID, "%s: negative n_tokens=%lld or n_seqs=%lld", what,
                       (long long)batch->n_tokens, (long long)batch->n_seqs);
    if (batch->n_tokens == 0) return GY_OK;
    if (batch->token_seq == NULL || batch->token_pos == NULL || batch->bt_indptr == NULL)
        return GY_FAIL(GY_ERR_INVALID, "%s: NULL token or block-table array", what);
    if (batch->bt_indptr[0] < 0)
        return GY_FAIL(GY_ERR_INVALID, "%s: bt_indptr[0]=%d is negative", what, (int)batch->bt_indptr[0]);
    for (int64_t s = 0; s < batch->n_seqs; s++)
        if (batch->bt_indptr[s + 1] < batch->bt_indptr[s])
            return GY_FAIL(GY_ERR_INVALID, "%s: bt_indptr decreases at sequence %lld (%d -> %d)", what,
                           (long long)s, (int)batch->bt_indptr[s], (int)batch->bt_indptr[s + 1]);
    const int64_t n_listed = batch->bt_indptr[batch->n_seqs];
    if (n_listed > 0 && batch->bt_indices == NULL)
        return GY_FAIL(GY_ERR_INVALID, "%s: NULL bt_indices", what);
    for (int64_t i = batch->bt_indptr[0]; i < n_listed; i++)
        if (batch->bt_indices[i] < 0 || batch->bt_indices[i] >= layout->n_blocks)
            return GY_FAIL(GY_ERR_INVALID, "%s: bt_indices[%lld]=%d is outside the layer's %lld blocks",
                           what, (long long)i, (int)batch->bt_indices[i], (long long)layout->n_blocks);
    int64_t longest = 0;
    for (int64_t t = 0; t < batch->n_tokens; t++) {
        const int64_t s = batch->token_seq[t], p = batch->token_pos[t];
        if (s < 0 || s >= batch->n_seqs)
            return GY_FAIL(GY_ERR_INVALID, "%s: token %lld belongs to sequence %lld, outside [0, %lld)",
                           what, (long long)t, (long long)s, (long long)batch->n_seqs);
        const int64_t owned = batch->bt_indptr[s + 1] - batch->bt_indptr[s];
        if (p < 0 || p / layout->block_size >= owned)
            return GY_FAIL(GY_ERR_INVALID,
                           "%s: token %lld is at position %lld but sequence %lld owns %lld blocks of "
                           "%lld tokens", what, (long long)t, (long long)p, (long long)s,
                           (long long)owned, (long long)layout->block_size);
        if (p + 1 > longest) longest = p + 1;
    }
    if (max_len) *max_len = longest;
    return GY_OK;
}
