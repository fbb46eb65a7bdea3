/* transition.c: the layer-staggered transformation (Gyges 4.3) of a running engine. While one
 * runs, the engine's plan has a second stage over the same workers: the old groups (their old
 * models and KV caches, borrowed) below the boundary on a scale-up, the new groups above it on a
 * scale-down; the caller moves the boundary down while it moves each layer's KV (transition.h).
 * Apart from the step, which runs whatever stages the plan has (engine.c), the transformation
 * is all here: adding the stage, homing requests in its groups, moving the boundary, ending it. */
#include "transition.h"

#include <string.h>

#include "engine_impl.h"

/* The boundary is where the lower of the two stages ends. */
int64_t gy_engine_transition_boundary(const gy_engine *e) {
    pthread_mutex_lock((pthread_mutex_t *)&e->api);
    const int64_t b = e->transition >= 0 ? e->stages[0].end : -1;
    pthread_mutex_unlock((pthread_mutex_t *)&e->api);
    return b;
}

static gy_status gy_engine_transition_begin_locked(gy_engine *e, const gy_engine_rank *old_ranks,
                                                   const gy_engine_old_group *groups,
                                                   int32_t n_groups, int groups_last) {
    if (e == NULL || old_ranks == NULL || groups == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_engine_transition_begin: NULL argument");
    if (e->transition >= 0) return GY_FAIL(GY_ERR_BUSY, "a transformation is already under way");
    if (e->n_stages != 1)
        return GY_FAIL(GY_ERR_UNAVAILABLE,
                       "layer-staggered transformations start from a plan of one stage, this "
                       "engine has %d", (int)e->n_stages);
    gy_stage *main = gy_engine_main(e);
    const int32_t n_ranks = main->n_ranks;
    if (n_groups < 1 || n_groups > n_ranks)
        return GY_FAIL(GY_ERR_INVALID, "%d old groups for %d ranks", (int)n_groups, (int)n_ranks);
    int seen[GY_MODEL_MAX_TP] = {0};
    for (int32_t g = 0; g < n_groups; g++) {
        if (groups[g].size < 1 || (groups[g].size > 1 && groups[g].comm == NULL))
            return GY_FAIL(GY_ERR_INVALID, "old group %d needs a size and a communicator", (int)g);
        for (int32_t k = 0; k < groups[g].size; k++) {
            const int32_t r = groups[g].ranks[k];
            if (r < 0 || r >= n_ranks || seen[r]++)
                return GY_FAIL(GY_ERR_INVALID, "old groups must cover every rank once (rank %d)", (int)r);
        }
    }
    for (int32_t i = 0; i < n_ranks; i++)
        if (!seen[i] || old_ranks[i].model == NULL || old_ranks[i].kv == NULL)
            return GY_FAIL(GY_ERR_INVALID, "rank %d has no old group, model or KV cache", (int)i);
    /* The boundary's hidden states go through the engine's host buffer as every pipeline's do
     * (stage.c: each backend's x_out, then x_in, in the activations' own bytes), with a map of
     * each group's rows; on CUDA those are device copies on each rank's stream. A rank's two
     * models are on one backend and device, as a worker is. */
    for (int32_t i = 0; i < n_ranks; i++) {
        const gy_model *now = main->groups[0].ranks[i].r.model, *other = old_ranks[i].model;
        if (now->backend != other->backend || now->device != other->device)
            return GY_FAIL(GY_ERR_INVALID,
                           "rank %d: its models of the two geometries run on different backends "
                           "or devices (%d on %d, %d on %d)", (int)i, (int)now->backend,
                           (int)now->device, (int)other->backend, (int)other->device);
    }
    gy_engine_rank members[GY_MODEL_MAX_TP][GY_MODEL_MAX_TP];
    gy_stage_group_spec specs[GY_MODEL_MAX_TP];
    for (int32_t g = 0; g < n_groups; g++) {
        for (int32_t k = 0; k < groups[g].size; k++) {
            members[g][k] = old_ranks[groups[g].ranks[k]];
            e->slots[groups[g].ranks[k]] = (gy_engine_slot){.group = g, .rank = k};
        }
        specs[g] = (gy_stage_group_spec){.size = groups[g].size, .ranks = members[g],
                                         .comm = groups[g].comm};
    }
    /* Starts with the boundary at L: the transformation's groups run every layer (scale-up:
     * below the boundary) or none yet (scale-down: above it). */
    const int64_t L = e->model->n_layers;
    gy_stage added;
    GY_TRY(gy_stage_init(&added, groups_last ? L : 0, L, specs, n_groups, 0));
    if (groups_last) {
        e->stages[1] = added;
        e->transition = 1;
    } else {
        e->stages[1] = e->stages[0];
        e->stages[1].first = L;
        e->stages[0] = added;
        e->main = 1;
        e->transition = 0;
    }
    e->n_stages = 2;
    e->groups_last = groups_last != 0;
    return GY_OK;
}

static gy_status gy_engine_transition_adopt_locked(gy_engine *e, int64_t id, int32_t group, const int64_t *old_seqs) {
    if (e->transition < 0) return GY_FAIL(GY_ERR_STATE, "no transformation is under way");
    gy_stage *tr = &e->stages[e->transition];
    if (group < 0 || group >= tr->n_groups)
        return GY_FAIL(GY_ERR_INVALID, "old group %d does not exist", (int)group);
    if (gy_engine_find(e, id) == NULL) return GY_FAIL(GY_ERR_STATE, "no request %lld", (long long)id);
    const gy_stage_group *grp = &tr->groups[group];
    gy_status s = GY_OK;
    int32_t adopted = 0; /* ranks [0, adopted) took their sequence */
    for (; adopted < grp->size && s == GY_OK; adopted++)
        if (old_seqs[adopted] >= 0)
            s = gy_sched_kv_adapter_adopt(grp->ranks[adopted].adapter, id, old_seqs[adopted]);
    if (s != GY_OK) adopted--; /* the rank that failed took nothing */
    if (s == GY_OK) s = gy_stage_set_home(tr, id, group);
    if (s != GY_OK) /* all or nothing: a half-adopted request would be found in the wrong group */
        for (int32_t k = 0; k < adopted; k++)
            if (old_seqs[k] >= 0) gy_sched_kv_adapter_forget(grp->ranks[k].adapter, id);
    return s;
}

static gy_status gy_engine_transition_set_boundary_locked(gy_engine *e, int64_t boundary) {
    if (e->transition < 0) return GY_FAIL(GY_ERR_STATE, "no transformation is under way");
    const int64_t now = e->stages[0].end;
    if (boundary < 0 || boundary > now)
        return GY_FAIL(GY_ERR_INVALID, "the boundary only moves down, from %lld (got %lld)",
                       (long long)now, (long long)boundary);
    e->stages[0].end = boundary;
    e->stages[1].first = boundary;
    return GY_OK;
}

static gy_status gy_engine_transition_seq_locked(const gy_engine *e, int64_t id, int32_t rank,
                                                 int32_t *group, int64_t *seq) {
    if (e->transition < 0) return GY_FAIL(GY_ERR_STATE, "no transformation is under way");
    const gy_stage *tr = &e->stages[e->transition];
    if (rank < 0 || rank >= tr->n_ranks) return GY_FAIL(GY_ERR_INVALID, "rank %d out of range", (int)rank);
    const gy_engine_slot slot = e->slots[rank];
    *seq = gy_sched_kv_adapter_seq(tr->groups[slot.group].ranks[slot.rank].adapter, id);
    int64_t g;
    if (tr->n_groups == 1) *group = *seq >= 0 ? 0 : -1;
    else *group = gy_idmap_get(&tr->home, id, &g) ? (int32_t)g : -1;
    return GY_OK;
}

static void gy_engine_transition_detach_locked(gy_engine *e) {
    if (e->transition >= 0) gy_engine_detach_stage(&e->stages[e->transition]);
}

/* Frees the transition stage; the other one runs every layer again as the only stage. */
static void gy_engine_drop_transition_stage(gy_engine *e) {
    gy_stage_free(&e->stages[e->transition]);
    if (e->transition == 0) e->stages[0] = e->stages[1];
    memset(&e->stages[1], 0, sizeof e->stages[1]);
    e->stages[0].first = 0;
    e->stages[0].end = e->model->n_layers;
    e->n_stages = 1;
    e->main = 0;
    e->transition = -1;
}

/* Drops the transition's stage wherever the boundary is, keeping its sequences (a rollback moved
 * the layers back and frees them itself); the main stage runs every layer again. */
static void gy_engine_transition_abort_locked(gy_engine *e) {
    if (e->transition < 0) return;
    gy_engine_detach_stage(&e->stages[e->transition]);
    gy_engine_drop_transition_stage(e);
}

static gy_status gy_engine_transition_end_locked(gy_engine *e) {
    if (e->transition < 0) return GY_FAIL(GY_ERR_STATE, "no transformation is under way");
    if (e->stages[0].end != 0)
        return GY_FAIL(GY_ERR_STATE, "layers [0, %lld) have not moved yet", (long long)e->stages[0].end);
    gy_engine_drop_transition_stage(e); /* the adapters free the old sequences */
    return GY_OK;
}

/* ---- the public calls: each holds the engine's lock (engine.h) ---- */

gy_status gy_engine_transition_begin(gy_engine *e, const gy_engine_rank *old_ranks,
                                     const gy_engine_old_group *groups, int32_t n_groups,
                                     int groups_last) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_transition_begin_locked(e, old_ranks, groups, n_groups, groups_last);
    pthread_mutex_unlock(&e->api);
    return s;
}

gy_status gy_engine_transition_adopt(gy_engine *e, int64_t id, int32_t group, const int64_t *old_seqs) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_transition_adopt_locked(e, id, group, old_seqs);
    pthread_mutex_unlock(&e->api);
    return s;
}

gy_status gy_engine_transition_set_boundary(gy_engine *e, int64_t boundary) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_transition_set_boundary_locked(e, boundary);
    pthread_mutex_unlock(&e->api);
    return s;
}

gy_status gy_engine_transition_seq(const gy_engine *e, int64_t id, int32_t rank, int32_t *group,
                                   int64_t *seq) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&((gy_engine *)e)->api);
    const gy_status s = gy_engine_transition_seq_locked(e, id, rank, group, seq);
    pthread_mutex_unlock(&((gy_engine *)e)->api);
    return s;
}

void gy_engine_transition_detach(gy_engine *e) {
    if (e == NULL) return;
    pthread_mutex_lock(&e->api);
    gy_engine_transition_detach_locked(e);
    pthread_mutex_unlock(&e->api);
}

void gy_engine_transition_abort(gy_engine *e) {
    if (e == NULL) return;
    pthread_mutex_lock(&e->api);
    gy_engine_transition_abort_locked(e);
    pthread_mutex_unlock(&e->api);
}

gy_status gy_engine_transition_end(gy_engine *e) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_transition_end_locked(e);
    pthread_mutex_unlock(&e->api);
    return s;
}
