/* resplit.h: the live re-split of a pipeline engine's stages (PipeLive; gyges/reconfig/resplit.py
 * drives it, and KunServe's buddy groups move KV between stages too, gyges/reconfig/buddy.py):
 * one job of the engine, apart from its requests and step (engine.h). The stages it names are the plan's
 * (gy_engine_init_plan), counted from 0 in the order a step runs them. */
#ifndef GY_ENGINE_RESPLIT_H
#define GY_ENGINE_RESPLIT_H

#include <stdint.h>

#include "engine.h"

struct gy_kv_dirty;

#ifdef __cplusplus
extern "C" {
#endif

/* From the next step on, every step marks the KV slots it wrote on rank `rank` of stage `stage`
 * in `d` (borrowed; NULL stops). Only for stages of one group. */
gy_status gy_engine_set_dirty(gy_engine *e, int32_t stage, int32_t rank, struct gy_kv_dirty *d);
/* The requests holding KV on rank `rank` of both stages, as pairs of sequences: pairs[2i] on
 * src_stage, pairs[2i + 1] on dst_stage, for the first `cap`; *n gets how many there are (call
 * again with room for them when it is more). The copies between stages are KV moves of these
 * pairs (kv/kv_move.h), the caches the ranks' own. */
gy_status gy_engine_stage_pairs(gy_engine *e, int32_t src_stage, int32_t dst_stage, int32_t rank,
                                int64_t *pairs, int64_t cap, int64_t *n);
/* The KV sequence of request `id` on rank `rank` of stage `stage` (-1 when it holds none). */
int64_t gy_engine_stage_seq(gy_engine *e, int32_t stage, int32_t rank, int64_t id);
/* Switches the plan between two steps: the same stages, ranks and KV caches (every request keeps
 * its sequences), new layer ranges and models, checked as gy_engine_init_plan checks a plan.
 * Refused, changing nothing, during a layer-staggered transformation or when a rank's cache is
 * not the one it has. */
gy_status gy_engine_replan(gy_engine *e, const gy_engine_stage *stages, int32_t n_stages);

#ifdef __cplusplus
}
#endif
#endif
