/* transition.h: the layer-staggered transformation of a running engine (Gyges 4.3): one job of
 * the engine, apart from its requests and step (engine.h), driven by
 * gyges/reconfig/staggered.py. An engine of a one-stage plan runs it, on either backend;
 * requests do not move in or out of an engine (gy_engine_take) while it runs.
 *
 * A scale-up, step by step: gy_engine_transition_begin with the old groups (groups_last = 0),
 * gy_engine_transition_adopt for every request the old groups hold, then, a few layers at a
 * time, move those layers' KV into the new caches and gy_engine_transition_set_boundary below
 * them, stepping in between; at boundary 0, gy_engine_transition_end. A scale-down starts with
 * the new groups (groups_last = 1) and keeps their sequences (gy_engine_transition_detach). */
#ifndef GY_ENGINE_TRANSITION_H
#define GY_ENGINE_TRANSITION_H

#include <stdint.h>

#include "engine.h"

struct gy_comm;

#ifdef __cplusplus
extern "C" {
#endif

/* While one runs, layers [0, boundary) still run in the old groups (each on the rows of the
 * requests it holds), with the workers' old models and KV caches; layers [boundary, L) run in
 * this engine's group. The caller moves the boundary down a few layers at a time (reversed: the
 * last layer first), moving each layer's KV from the old caches to the new ones in between. */
typedef struct gy_engine_old_group {
    int32_t size;
    int32_t ranks[GY_MODEL_MAX_TP]; /* engine ranks, in the order of their rank in the old group */
    struct gy_comm *comm;           /* of that size; NULL for one rank */
} gy_engine_old_group;

/* old_ranks[i]: engine rank i's model and KV cache in its group (borrowed). Starts with
 * boundary L. groups_last = 0 (scale-up): the groups are the old configuration and run layers
 * [0, boundary). groups_last = 1 (scale-down): the groups are the new configuration and run
 * [boundary, L) on their own rows, their rank 0 computing those rows' logits. */
gy_status gy_engine_transition_begin(gy_engine *e, const gy_engine_rank *old_ranks,
                                     const gy_engine_old_group *groups, int32_t n_groups,
                                     int groups_last);
/* Forgets the groups' KV sequences without freeing them (a scale-down keeps them). */
void gy_engine_transition_detach(gy_engine *e);
/* Records where an adopted request's KV lives in its old group: old_seqs[k] on the group's
 * rank k. */
gy_status gy_engine_transition_adopt(gy_engine *e, int64_t id, int32_t group, const int64_t *old_seqs);
gy_status gy_engine_transition_set_boundary(gy_engine *e, int64_t boundary);
/* The request's group and its old KV sequence on engine rank `rank` (-1 when none). */
gy_status gy_engine_transition_seq(const gy_engine *e, int64_t id, int32_t rank, int32_t *group,
                                   int64_t *seq);
/* Ends it (the boundary must be 0): the old sequences are freed. */
gy_status gy_engine_transition_end(gy_engine *e);
/* Drops the transition's stage wherever the boundary is, freeing none of its sequences (a
 * rollback moves the layers back and frees them itself); nothing when none runs. */
void gy_engine_transition_abort(gy_engine *e);
int64_t gy_engine_transition_boundary(const gy_engine *e); /* -1 when none runs */

#ifdef __cplusplus
}
#endif
#endif
