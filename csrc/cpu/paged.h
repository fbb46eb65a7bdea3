/* paged.h: which tokens of which sequences a paged-KV kernel works on, in CSR form.
 *
 * Token t (a query token for attention, a new K/V row for gy_cpu_kv_write) belongs to sequence
 * token_seq[t] and sits at position token_pos[t] of it. Sequence s owns the blocks
 * bt_indices[bt_indptr[s] .. bt_indptr[s + 1]) in logical order: position p of s lives in block
 * bt_indices[bt_indptr[s] + p / block_size], slot p % block_size. */
#ifndef GY_CPU_PAGED_H
#define GY_CPU_PAGED_H

#include <stdint.h>

#include "../core/status.h"
#include "../kv/kv_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_cpu_paged_batch {
    int64_t n_tokens;
    const int32_t *token_seq;  /* [n_tokens] in [0, n_seqs) */
    const int32_t *token_pos;  /* [n_tokens] >= 0, covered by the sequence's blocks */
    int64_t n_seqs;
    const int32_t *bt_indptr;  /* [n_seqs + 1] non-decreasing, bt_indptr[0] >= 0 */
    const int32_t *bt_indices; /* [bt_indptr[n_seqs]] block ids in [0, layout->n_blocks) */
} gy_cpu_paged_batch;

/* GY_ERR_INVALID, naming `what` and the first offending entry, unless every token's sequence,
 * position and every listed block fit `layout`. Also returns the largest position + 1 of any
 * token (0 when there are none) in *max_len when max_len is not NULL. */
gy_status gy_cpu_paged_batch_check(const gy_cpu_paged_batch *batch, const gy_kv_layout *layout,
                                   const char *what, int64_t *max_len);

/* The block holding position pos of token t's sequence (after a successful check). */
static inline int64_t gy_cpu_paged_block(const gy_cpu_paged_batch *batch, int64_t seq, int64_t pos,
                                         int64_t block_size) {
    return batch->bt_indices[batch->bt_indptr[seq] + pos / block_size];
}

#ifdef __cplusplus
}
#endif
#endif
