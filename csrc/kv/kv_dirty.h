/* kv_dirty.h: the dirty bitmap of PipeLive's KV patching (section 6.2): while the KV of some
 * layers is copied to a worker that will own them, the steps that keep running write new tokens
 * into the source; a dirty bitmap over the source cache's token slots records which, and the
 * sender drains it and copies just those slots, until what is left is small enough to send in a
 * short pause.
 *
 * A slot is block * block_size + token-in-block of the source cache. Marking (the serving step,
 * after it wrote the KV) and taking (the sender, before it reads the KV) may run on different
 * threads: a take swaps each word with zero atomically, so a slot marked during a take is either
 * in what it returned or still set, never lost; marking is a release and taking an acquire, so
 * a taken slot's KV bytes are the ones written before its mark.
 *
 * The copies themselves, of whole blocks (the bulk pass) or of the slots a take returned (a
 * patch), are KV moves with the taken words as their bitmap (kv_move.h). */
#ifndef GY_KV_DIRTY_H
#define GY_KV_DIRTY_H

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

#ifdef __cplusplus
}
#endif
#endif
