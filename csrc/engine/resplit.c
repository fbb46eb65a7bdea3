/* resplit.c: PipeLive's live re-split of a pipeline (gyges/reconfig/resplit.py drives it). A
 * re-split moves the boundaries between stages while requests keep running: the KV of the layers
 * that change stage is copied from one stage's caches to the other's while steps go on (the steps
 * mark the slots they write, so later copies carry only those), then the plan switches to the
 * new layer ranges between two steps. The engine's part of that is here: the dirty marks, which
 * sequence holds a request's KV on a stage (the copies between stages are KV moves of those
 * pairs, kv/kv_move.h), and the switch itself. KunServe's buddy-group exchange
 * (gyges/reconfig/buddy.py) moves KV between stages with the same marks and moves. */
#include "resplit.h"

#include "../kv/kv_dirty.h"
#include "engine_impl.h"

/* Rank `rank` of stage `stage`, which must have one group (a re-split's stages have). */
static gy_status gy_engine_stage_rank(gy_engine *e, int32_t stage, int32_t rank, gy_stage_rank **out) {
    if (stage < 0 || stage >= e->n_stages || e->stages[stage].n_groups != 1 || rank < 0 ||
        rank >= e->stages[stage].groups[0].size)
        return GY_FAIL(GY_ERR_INVALID, "stage %d rank %d is not a rank of a one-group stage of this "
                       "plan (%d stages)", (int)stage, (int)rank, (int)e->n_stages);
    *out = &e->stages[stage].groups[0].ranks[rank];
    return GY_OK;
}

static gy_status gy_engine_set_dirty_locked(gy_engine *e, int32_t stage, int32_t rank, gy_kv_dirty *d) {
    gy_stage_rank *rk = NULL;
    GY_TRY(gy_engine_stage_rank(e, stage, rank, &rk));
    rk->dirty = d;
    return GY_OK;
}

/* The slots the step wrote, on every rank whose KV is being patched elsewhere (after the
 * forward pass wrote them, so a sender that takes a mark reads the new bytes). */
gy_status gy_engine_mark_dirty(gy_engine *e, const gy_sched_batch *b) {
    for (int32_t s = 0; s < e->n_stages; s++)
        for (int32_t k = 0; k < e->stages[s].n_ranks; k++) {
            gy_stage_rank *rk = gy_stage_rank_at(&e->stages[s], k, NULL);
            if (rk->dirty == NULL) continue;
            for (int64_t i = 0; i < b->n_entries; i++) {
                const gy_sched_entry *en = &b->entries[i];
                const int64_t seq = gy_sched_kv_adapter_seq(rk->adapter, en->id);
                if (seq >= 0) GY_TRY(gy_kv_dirty_mark(rk->dirty, rk->r.kv, seq, en->pos, en->n_tokens));
            }
        }
    return GY_OK;
}

static gy_status gy_engine_stage_pairs_locked(gy_engine *e, int32_t src_stage, int32_t dst_stage,
                                              int32_t rank, int64_t *pairs, int64_t cap,
                                              int64_t *n_out) {
    gy_stage_rank *src = NULL, *dst = NULL;
    GY_TRY(gy_engine_stage_rank(e, src_stage, rank, &src));
    GY_TRY(gy_engine_stage_rank(e, dst_stage, rank, &dst));
    int64_t n = 0;
    for (int64_t i = 0; i < e->requests.capacity; i++) {
        if (!e->requests.used[i]) continue;
        const gy_engine_request *r = (const gy_engine_request *)(intptr_t)e->requests.values[i];
        const int64_t ss = gy_sched_kv_adapter_seq(src->adapter, r->id);
        const int64_t ds = gy_sched_kv_adapter_seq(dst->adapter, r->id);
        if (ss < 0 || ds < 0) continue;
        if (n < cap) {
            pairs[2 * n] = ss;
            pairs[2 * n + 1] = ds;
        }
        n++;
    }
    *n_out = n;
    return GY_OK;
}

static gy_status gy_engine_replan_locked(gy_engine *e, const gy_engine_stage *stages, int32_t n_stages) {
    if (e->transition >= 0)
        return GY_FAIL(GY_ERR_BUSY, "a layer-staggered transformation is running; re-plan after it");
    for (int32_t s = 0; s < e->n_stages; s++)
        if (e->stages[s].n_remote > 0)
            return GY_FAIL(GY_ERR_BUSY, "stage %d has requests attending remotely; re-plan after "
                           "their KV has moved", (int)s);
    if (n_stages != e->n_stages)
        return GY_FAIL(GY_ERR_INVALID, "a re-plan keeps the %d stages, got %d", (int)e->n_stages,
                       (int)n_stages);
    GY_TRY(gy_engine_check_plan(stages, n_stages, e->first_layer, e->end_layer));
    for (int32_t s = 0; s < n_stages; s++) {
        const gy_stage *st = &e->stages[s];
        if (st->n_groups != 1 || stages[s].size != st->groups[0].size)
            return GY_FAIL(GY_ERR_INVALID, "stage %d has %d ranks in one group, the re-plan %d",
                           (int)s, (int)st->groups[0].size, (int)stages[s].size);
        for (int32_t k = 0; k < stages[s].size; k++)
            if (stages[s].ranks[k].kv != st->groups[0].ranks[k].r.kv)
                return GY_FAIL(GY_ERR_INVALID, "stage %d rank %d: a re-plan keeps the rank's KV "
                               "cache (its requests' sequences live there)", (int)s, (int)k);
    }
    for (int32_t s = 0; s < n_stages; s++) {
        gy_stage *st = &e->stages[s];
        st->first = stages[s].first_layer;
        st->end = stages[s].end_layer;
        for (int32_t k = 0; k < stages[s].size; k++) {
            gy_stage_rank *rk = &st->groups[0].ranks[k];
            /* A CUDA workspace runs on its model's stream, which goes when the old model does:
             * free it now, while that stream exists; the next step makes one for the new model. */
            if (rk->r.model != stages[s].ranks[k].model) gy_forward_ws_free(&rk->ws);
            rk->r.model = stages[s].ranks[k].model;
        }
    }
    e->model = stages[0].ranks[0].model;
    return GY_OK;
}

/* ---- the public calls: each holds the engine's lock (engine.h) ---- */

gy_status gy_engine_set_dirty(gy_engine *e, int32_t stage, int32_t rank, gy_kv_dirty *d) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_set_dirty_locked(e, stage, rank, d);
    pthread_mutex_unlock(&e->api);
    return s;
}

gy_status gy_engine_stage_pairs(gy_engine *e, int32_t src_stage, int32_t dst_stage, int32_t rank,
                                int64_t *pairs, int64_t cap, int64_t *n) {
    if (e == NULL || n == NULL || (cap > 0 && pairs == NULL))
        return GY_FAIL(GY_ERR_INVALID, "gy_engine_stage_pairs: NULL argument");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_stage_pairs_locked(e, src_stage, dst_stage, rank, pairs, cap, n);
    pthread_mutex_unlock(&e->api);
    return s;
}

int64_t gy_engine_stage_seq(gy_engine *e, int32_t stage, int32_t rank, int64_t id) {
    if (e == NULL) return -1;
    pthread_mutex_lock(&e->api);
    gy_stage_rank *rk = NULL;
    int64_t seq = -1;
    if (stage >= 0 && stage < e->n_stages && rank >= 0 && rank < e->stages[stage].n_ranks) {
        rk = gy_stage_rank_at(&e->stages[stage], rank, NULL);
        seq = gy_sched_kv_adapter_seq(rk->adapter, id);
    }
    pthread_mutex_unlock(&e->api);
    return seq;
}

gy_status gy_engine_replan(gy_engine *e, const gy_engine_stage *stages, int32_t n_stages) {
    if (e == NULL || stages == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_engine_replan: NULL argument");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_replan_locked(e, stages, n_stages);
    pthread_mutex_unlock(&e->api);
    return s;
}
