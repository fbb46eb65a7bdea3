/* remote.c: KunServe's remote attention in a pipeline engine. While a buddy group exchanges KV,
 * a request whose KV for some layers still lives on another stage's ranks has those layers'
 * attention run there (forward.h), so it keeps decoding without waiting for the move. The
 * stages carry the per-request ranges (gy_stage_set_remote) and the step runs them; the engine's
 * part is here: checking and setting a range, forgetting a request's ranges when it leaves, and
 * counting the calls for the stats. */
#include "remote.h"

#include "engine_impl.h"

static gy_status gy_engine_set_remote_locked(gy_engine *e, int64_t id, int32_t stage,
                                             int32_t src_stage, int64_t first_layer,
                                             int64_t end_layer) {
    if (stage < 0 || stage >= e->n_stages || src_stage < 0 || src_stage >= e->n_stages ||
        e->transition >= 0)
        return GY_FAIL(GY_ERR_INVALID, "stages %d and %d are not stages of this plan (%d stages%s)",
                       (int)stage, (int)src_stage, (int)e->n_stages,
                       e->transition >= 0 ? ", a layer-staggered transformation running" : "");
    if (first_layer < end_layer && gy_engine_find(e, id) == NULL)
        return GY_FAIL(GY_ERR_STATE, "no request %lld", (long long)id);
    if (first_layer < end_layer) {
        /* the source must hold those layers' KV: its caches are checked at every step too */
        const gy_stage *src = &e->stages[src_stage];
        for (int32_t k = 0; k < src->n_ranks; k++) {
            const gy_kv_config *c = gy_kv_config_of(gy_stage_rank_at((gy_stage *)src, k, NULL)->r.kv);
            if (first_layer < c->first_layer || end_layer > c->first_layer + c->n_layers)
                return GY_FAIL(GY_ERR_INVALID, "stage %d rank %d's cache holds layers [%lld, %lld), "
                               "not [%lld, %lld)", (int)src_stage, (int)k, (long long)c->first_layer,
                               (long long)(c->first_layer + c->n_layers), (long long)first_layer,
                               (long long)end_layer);
        }
    }
    return gy_stage_set_remote(&e->stages[stage], id, &e->stages[src_stage], first_layer, end_layer);
}

/* A request leaving the engine attends nowhere else any more. */
void gy_engine_forget_remote(gy_engine *e, int64_t id) {
    for (int32_t s = 0; s < e->n_stages; s++)
        (void)gy_stage_set_remote(&e->stages[s], id, NULL, 0, 0); /* a removal cannot fail */
}

/* Counts the step's remote attention: a call per part and layer (its rows go there and back). */
void gy_engine_count_remote(gy_engine *e) {
    for (int32_t s = 0; s < e->n_stages; s++) {
        if (e->stages[s].n_remote == 0 || e->stages[s].first == e->stages[s].end) continue;
        for (int32_t k = 0; k < e->stages[s].n_ranks; k++) {
            const gy_forward_batch *fb = &gy_stage_rank_at(&e->stages[s], k, NULL)->batch;
            for (int64_t i = 0; i < fb->n_remote; i++) {
                const int64_t layers = fb->remote[i].end_layer - fb->remote[i].first_layer;
                e->remote_calls += layers;
                e->remote_token_layers += layers * fb->remote[i].n_rows;
            }
        }
    }
}

/* ---- the public calls: each holds the engine's lock (engine.h) ---- */

gy_status gy_engine_set_remote(gy_engine *e, int64_t id, int32_t stage, int32_t src_stage,
                               int64_t first_layer, int64_t end_layer) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_set_remote_locked(e, id, stage, src_stage, first_layer, end_layer);
    pthread_mutex_unlock(&e->api);
    return s;
}

void gy_engine_remote_stats(gy_engine *e, int64_t *calls, int64_t *token_layers) {
    *calls = *token_layers = 0;
    if (e == NULL) return;
    pthread_mutex_lock(&e->api);
    *calls = e->remote_calls;
    *token_layers = e->remote_token_layers;
    pthread_mutex_unlock(&e->api);
}
