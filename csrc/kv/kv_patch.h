/* kv_patch.h: PipeLive's KV patching (section 6.2): while the KV of some layers is copied to a
 * worker that will own them, the steps that keep running write new tokens into the source; a
 * dirty bitmap over the source cache's token slots records which, and the sender drains it and
 * copies just those slots, until what is left is small enough to send in a short pause.
 *
 * A slot is block * block_size + token-in-block of the source cache. Marking (the serving step,
 * after it wrote the KV) and taking (the sender, before it reads the KV) may run on different
 * threads: a take swaps each word with zero atomically, so a slot marked during a take is either
 * in what it returned or still set, never lost; marking is a release and taking an acquire, so
 * a taken slot's KV bytes are the ones written before its mark.
 *
 * gy_kv_copy_tokens is the copy itself, of whole blocks (the bulk pass) or of the slots a take
 * returned (a patch), for a range of model layers held by both caches. */
#ifndef GY_KV_PATCH_H
#define GY_KV_PATCH_H

#include <stdint.h>

#include "kv_cache.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_kv_dirty gy_kv_dirty;

/* A bitmap of n_slots slots, all clean. */
gy_status gy_kv_dirty_init(gy_kv_dirty **out, int64_t n_slots);
void gy_kv_dirty_free(gy_kv_dirty *d);
int64_t gy_kv_dirty_slots(const gy_kv_dirty *d);
/* Words of 64 slots a take fills. */
int64_t gy_kv_dirty_words(const gy_kv_dirty *d);

/* Marks the slots of tokens [pos, pos + n) of live sequence `seq` of `kv` (its block table), and
 * adds n to the tokens marked so far (T_sched). Refused, marking nothing, when a slot is past
 * the bitmap or the tokens past the sequence's room. */
gy_status gy_kv_dirty_mark(gy_kv_dirty *d, const gy_kv_cache *kv, int64_t seq, int64_t pos,
                           int64_t n);
/* Marks one slot (tests, and callers that know their slots). */
gy_status gy_kv_dirty_mark_slot(gy_kv_dirty *d, int64_t slot);
/* Drains: out[w] receives word w and the word becomes 0, atomically, for every word
 * (out: gy_kv_dirty_words entries). Returns the slots taken. */
int64_t gy_kv_dirty_take(gy_kv_dirty *d, uint64_t *out);
/* Slots set now (the lag a commit waits on), and tokens marked since init. */
int64_t gy_kv_dirty_count(const gy_kv_dirty *d);
int64_t gy_kv_dirty_marked(const gy_kv_dirty *d);

/* For i < n_blocks, token slots of block src_blocks[i] of `src` go to the same token slots of
 * block dst_blocks[i] of `dst`, every KV head, K and V, in model layers [first_layer,
 * end_layer), which both caches must hold (their own first_layer says where each keeps them).
 * With `dirty` (a bitmap of dirty_slots slots over src's, as gy_kv_dirty_take fills it, covering
 * every source block listed) only the slots set there; with NULL, every slot of the blocks. The caches must have the same block size, heads,
 * head size and value size, and both live on the host or both on one CUDA device. On a device,
 * each block holding a slot to copy goes whole (one kernel per layer: kv_copy.h). *copied (may
 * be NULL) gets the token slots asked for (per layer once). */
gy_status gy_kv_copy_tokens(gy_kv_cache *dst, const int32_t *dst_blocks, const gy_kv_cache *src,
                            const int32_t *src_blocks, int64_t n_blocks, int64_t first_layer,
                            int64_t end_layer, const uint64_t *dirty, int64_t dirty_slots,
                            int64_t *copied);

#ifdef __cplusplus
}
#endif
#endif
