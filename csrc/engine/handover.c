/* handover.c: an engine handing its requests and their KV over to other engines, for the
 * mechanisms that regroup workers (the transformations, Flying Serving's mode switches, KunServe's
 * buddy groups, recovery). Three calls: holding admission, so that a worker's engine starts
 * nothing new while its work moves elsewhere; taking one request, whole, from one engine into
 * another under both engines' locks (the letting go is here, the adoption is engine.c's, shared
 * with gy_engine_adopt); and detaching an engine's KV sequences, so that freeing the engine
 * leaves them in their caches for whoever holds them next. */
#include "handover.h"

#include <stdint.h>

#include "engine_impl.h"

static void gy_engine_detach_kv_locked(gy_engine *e) {
    for (int32_t s = 0; s < e->n_stages; s++)
        if (e->stages[s].owned) gy_engine_detach_stage(&e->stages[s]);
}

/* src lets go of a request dst has adopted: its KV sequences are forgotten on every rank (so the
 * abort releases nothing), then its record goes. */
static void gy_engine_let_go_locked(gy_engine *src, int64_t id) {
    gy_sched_kv_adapter *adapters[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n = gy_engine_adapters(src, adapters);
    for (int32_t i = 0; i < n; i++) gy_sched_kv_adapter_forget(adapters[i], id);
    for (int32_t s = 0; s < src->n_stages; s++) gy_stage_unhome(&src->stages[s], id);
    gy_engine_forget_remote(src, id);
    if (gy_sched_release(src->sched, id) != GY_OK) gy_error_clear(); /* checked by the caller */
    gy_engine_request *r = gy_engine_find(src, id);
    gy_idmap_remove(&src->requests, id);
    gy_engine_request_free(r);
}

/* ---- the public calls: each holds the engine's lock (engine.h) ---- */

void gy_engine_hold(gy_engine *e, int held) {
    pthread_mutex_lock(&e->api);
    gy_sched_hold(e->sched, held);
    pthread_mutex_unlock(&e->api);
}

gy_status gy_engine_take(gy_engine *dst, gy_engine *src, int64_t id, const int64_t *seqs) {
    return gy_engine_take_as(dst, src, id, seqs, NULL);
}

gy_status gy_engine_take_as(gy_engine *dst, gy_engine *src, int64_t id, const int64_t *seqs,
                            const gy_sched_info *as) {
    if (dst == NULL || src == NULL || seqs == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_engine_take: NULL argument");
    if (dst == src) return GY_FAIL(GY_ERR_INVALID, "gy_engine_take: an engine cannot take from itself");
    /* Two locks, always in the same order, so two takes in opposite directions cannot deadlock. */
    pthread_mutex_t *first = (uintptr_t)dst < (uintptr_t)src ? &dst->api : &src->api;
    pthread_mutex_t *second = first == &dst->api ? &src->api : &dst->api;
    pthread_mutex_lock(first);
    pthread_mutex_lock(second);
    gy_status s = GY_OK;
    gy_engine_request_view v;
    if (src->transition >= 0 || dst->transition >= 0)
        s = GY_FAIL(GY_ERR_BUSY, "requests do not move in or out during a layer-staggered "
                                 "transformation");
    if (s == GY_OK) s = gy_engine_request_get_locked(src, id, &v);
    if (s == GY_OK && v.info.state == GY_SCHED_STATE_FINISHED)
        s = GY_FAIL(GY_ERR_STATE, "request %lld has finished; there is nothing to move", (long long)id);
    if (s == GY_OK && as != NULL) { /* the record it had before an earlier move (a rollback) */
        v.info.state = as->state;
        v.info.n_computed = as->n_computed;
        v.info.prefill_end = as->prefill_end;
        v.info.n_preemptions = as->n_preemptions;
        v.info.first_scheduled = as->first_scheduled;
        v.info.first_token = as->first_token;
    }
    if (s == GY_OK)
        s = gy_engine_adopt_locked(dst, id, v.tokens, v.n_tokens, v.prompt_len, &v.params, &v.info,
                                   seqs);
    if (s == GY_OK) gy_engine_let_go_locked(src, id);
    pthread_mutex_unlock(second);
    pthread_mutex_unlock(first);
    return s;
}

void gy_engine_detach_kv(gy_engine *e) {
    if (e == NULL) return;
    pthread_mutex_lock(&e->api);
    gy_engine_detach_kv_locked(e);
    pthread_mutex_unlock(&e->api);
}
