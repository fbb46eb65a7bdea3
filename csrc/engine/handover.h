/* handover.h: an engine handing its requests and their KV over to other engines (the
 * transformations, Flying Serving's mode switches, KunServe's buddy groups, recovery): one job of
 * the engine, apart from its requests and step (engine.h). */
#ifndef GY_ENGINE_HANDOVER_H
#define GY_ENGINE_HANDOVER_H

#include <stdint.h>

#include "engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* held != 0: the engine admits nothing new (queued requests wait) until released (batch.h). */
void gy_engine_hold(gy_engine *e, int held);

/* Moves request `id` from `src` to `dst` with everything it has, in C: its tokens, parameters,
 * progress and timings (sampling is keyed by (seed, token index), so it goes on where it was),
 * and its KV: seqs[r] is the sequence already holding it in rank r of dst's one-stage plan, or
 * of a pipeline's ranks counted stage after stage (-1 for none: a queued request, or one to
 * recompute). src lets go of the request and of its KV
 * sequences without freeing them (they are dst's now, or their caches' owner's); its stats
 * count it as aborted. Refused with both engines unchanged when src has no such unfinished
 * request or dst cannot take it (an id in use, a full running set, a sequence that does not
 * exist). Either engine may be in use on other threads: both locks are taken, in a fixed order. */
gy_status gy_engine_take(gy_engine *dst, gy_engine *src, int64_t id, const int64_t *seqs);
/* gy_engine_take with the scheduler record `as` gives instead of the source's progress (its
 * state, tokens computed, prefill end, preemptions and first timings; NULL: the source's): a
 * rollback moves a request back as it was before a move that made it recompute. */
gy_status gy_engine_take_as(gy_engine *dst, gy_engine *src, int64_t id, const int64_t *seqs,
                            const gy_sched_info *as);
/* Forgets which KV sequences the requests hold without freeing them, so that freeing the engine
 * leaves them in the caches (a layer-staggered transformation keeps reading them). */
void gy_engine_detach_kv(gy_engine *e);

#ifdef __cplusplus
}
#endif
#endif
