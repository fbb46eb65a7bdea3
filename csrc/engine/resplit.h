/* resplit.h: the live re-split of a pipeline engine's stages (PipeLive; gyges/pipelive.py drives
 * it, and KunServe's buddy groups use the copies between stages, gyges/kunserve.py): one job of
 * the engine, apart from its requests and step (engine.h). The stages it names are the plan's
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
/* For every request holding KV on rank `rank` of both stages, copies its tokens in model layers
 * [first_layer, end_layer) from src_stage's cache to dst_stage's (gy_kv_copy_tokens): all its
 * blocks, or with `dirty` (a taken bitmap of dirty_slots over the source's slots) only those
 * slots. *copied gets the token slots copied. Both caches must hold the layers. */
gy_status gy_engine_copy_layers(gy_engine *e, int32_t src_stage, int32_t dst_stage, int32_t rank,
                                int64_t first_layer, int64_t end_layer, const uint64_t *dirty,
                                int64_t dirty_slots, int64_t *copied);
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
