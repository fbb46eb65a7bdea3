/* peer.h: a pipeline whose layers are split between two processes (a gyges.Cluster's KunServe
 * buddy group whose members sit on different hosts): one job of the engine, apart from its
 * requests and step (engine.h).
 *
 * The LEADER is an engine whose plan ends before the model's last layer (config.end_layer). It
 * keeps the requests and schedules them; after its stages have run a step, its outlet carries
 * the step (which tokens of which requests, their hidden states) to the FOLLOWER, an engine whose
 * plan starts past layer 0 (config.first_layer) in the other process, which runs its layers on
 * them (gy_engine_follow) and returns the logits; the leader samples. Tokens are bit-identical to
 * one engine over the whole model: each side runs its layers exactly as a local stage does.
 *
 * The follower's KV mirrors the leader's: it reserves for each entry what the leader reserved
 * (same block size, same token counts), and frees what the leader released. Releases made by the
 * leader's previous commit or between steps (finished, aborted) travel as `released_before`, applied
 * for good; those made by this step's schedule (preemptions) as `released_now`, applied under the
 * follower's undo record like the step's reserves. Steps are numbered. A leader step that fails
 * once its outlet was called (the follower may or may not have run it: a lost reply) calls the
 * outlet once more with a cancel of that number: a follower that ran it takes it back (its
 * reserves and releases), so both sides are as before it and the same step can run again; one
 * that did not keeps its last step, which the leader committed. The next step commits the
 * follower's record. The leader therefore sees the follower's room as peer_capacity minus what
 * the leader itself holds. */
#ifndef GY_ENGINE_PEER_H
#define GY_ENGINE_PEER_H

#include <stdint.h>

#include "engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One step as the follower needs it. */
typedef struct gy_peer_step {
    int64_t number;              /* the leader's count of steps sent */
    int32_t cancel;              /* 1: take step `number` back if it ran (nothing else is set) */
    int64_t n_entries;
    const int64_t *ids;          /* [n_entries] request ids */
    const int64_t *pos;          /* [n_entries] the entry's first position */
    const int64_t *n_tokens;     /* [n_entries] its tokens this step */
    int64_t n_rows;              /* sum of n_tokens */
    const int32_t *tokens;       /* [n_rows] */
    int64_t n_logits;
    const int32_t *logit_rows;   /* [n_logits] rows whose logits the leader samples or scores */
    const float *x;              /* [n_rows, hidden] the leader's last stage's output */
    int64_t n_released_before, n_released_now;
    const int64_t *released;     /* [n_released_before + n_released_now] request ids */
} gy_peer_step;

/* Runs `step` on the follower and writes logits [step->n_logits, vocab] (a cancel or a step of
 * no rows writes none). */
typedef gy_status (*gy_peer_outlet)(void *ctx, const gy_peer_step *step, float *logits);

/* Makes e (a plan ending before the model's last layer) the leader of a follower that can hold
 * `peer_capacity` KV blocks. The outlet is called from the stepping thread with the engine's
 * lock held; fn == NULL detaches it (steps are refused until one is set again). */
gy_status gy_engine_set_outlet(gy_engine *e, gy_peer_outlet fn, void *ctx, int64_t peer_capacity);
/* Leader: tells the follower of the releases it has not heard of yet (a step of no entries),
 * so that an idle pair holds no KV. Between steps. */
gy_status gy_engine_peer_flush(gy_engine *e);
/* The follower's side of one leader step (see above): a cancel takes it back, a step of no
 * entries and no releases commits the last. */
gy_status gy_engine_follow(gy_engine *e, const gy_peer_step *step, float *logits);
/* Follower: request `id` holds sequence `seqs[k]` in rank k of its plan (a buddy group's
 * formation hands over the KV it holds; -1: none). */
gy_status gy_engine_follow_adopt(gy_engine *e, int64_t id, const int64_t *seqs);
/* Follower: request `id`'s sequence on each rank (-1 where none), its ranks counted stage after
 * stage; returns how many ranks. */
int32_t gy_engine_follow_seqs(gy_engine *e, int64_t id, int64_t *seqs);
/* Follower: forgets request `id` without freeing its sequences (a restore takes them). */
void gy_engine_follow_forget(gy_engine *e, int64_t id);

#ifdef __cplusplus
}
#endif
#endif
