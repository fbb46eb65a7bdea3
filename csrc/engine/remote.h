/* remote.h: KunServe's remote attention in a pipeline engine (gyges/kunserve.py drives it): one
 * job of the engine, apart from its requests and step (engine.h). */
#ifndef GY_ENGINE_REMOTE_H
#define GY_ENGINE_REMOTE_H

#include <stdint.h>

#include "engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* KunServe's remote attention (forward.h): from the next step on, request `id`'s attention in
 * model layers [first_layer, end_layer) of stage `stage` runs on the ranks of stage `src_stage`
 * (rank k on rank k), over its sequence there, whose cache must hold those layers; an empty range
 * ends it. Both stages have one group, of the same size (on CUDA, on one device or two:
 * forward.h). A buddy group's exchange sets it for the requests whose KV has not moved yet and
 * narrows it as layers arrive. Forgotten when the request leaves the engine; re-plans are
 * refused while any is set. */
gy_status gy_engine_set_remote(gy_engine *e, int64_t id, int32_t stage, int32_t src_stage,
                               int64_t first_layer, int64_t end_layer);
/* Remote attention so far: calls (one per request, stage rank and layer in a step) and
 * token-layers (the rows those calls carried). */
void gy_engine_remote_stats(gy_engine *e, int64_t *calls, int64_t *token_layers);

#ifdef __cplusplus
}
#endif
#endif
