/* peer.c: a pipeline split between two processes, both sides (peer.h). */
#include <stdio.h>
#include <string.h>

#include "../core/grow.h"
#include "engine_impl.h"

/* ---- the leader ---- */

gy_status gy_engine_set_outlet(gy_engine *e, gy_peer_outlet fn, void *ctx, int64_t peer_capacity) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    pthread_mutex_lock(&e->api);
    gy_status s = GY_OK;
    if (fn != NULL && (e->first_layer > 0 || e->end_layer >= e->model->n_layers))
        s = GY_FAIL(GY_ERR_INVALID, "an outlet leads a plan that ends before the model's last "
                    "layer; this one covers [%lld, %lld) of %lld", (long long)e->first_layer,
                    (long long)e->end_layer, (long long)e->model->n_layers);
    else if (fn != NULL && peer_capacity < 1)
        s = GY_FAIL(GY_ERR_INVALID, "peer_capacity must be at least one block, got %lld",
                    (long long)peer_capacity);
    else {
        e->outlet = fn;
        e->outlet_ctx = ctx;
        e->peer_capacity = peer_capacity;
        e->n_released = e->n_released_committed = 0; /* a new follower has heard of nothing */
        e->released_lost = 0;
        e->outlet_called = 0;
        gy_sched_set_total_blocks(e->sched, gy_engine_capacity_blocks_locked(e));
    }
    pthread_mutex_unlock(&e->api);
    return s;
}

void gy_engine_peer_released(gy_engine *e, int64_t req) {
    if (gy_grow((void **)&e->released, &e->cap_released, e->n_released + 1, sizeof(int64_t),
                "released requests") != GY_OK) {
        gy_error_clear();
        e->released_lost = 1;
        return;
    }
    e->released[e->n_released++] = req;
}

int64_t gy_engine_peer_free_blocks(const gy_engine *e) {
    if (e->outlet == NULL) return INT64_MAX;
    /* The follower holds what the leader's main stage holds, block for block. */
    const gy_stage_rank *rk = &e->stages[e->main].groups[0].ranks[0];
    const int64_t used = gy_stage_rank_capacity_blocks(rk) - gy_stage_rank_free_blocks(rk);
    return e->peer_capacity > used ? e->peer_capacity - used : 0;
}

gy_status gy_engine_peer_run(gy_engine *e, const gy_sched_batch *b) {
    if (e->released_lost)
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory noting the follower's releases");
    GY_TRY(gy_grow((void **)&e->peer_columns, &e->cap_peer_columns, 3 * b->n_entries,
                   sizeof(int64_t), "the step's entries"));
    int64_t *ids = e->peer_columns, *pos = ids + b->n_entries,
            *n_tokens = pos + b->n_entries;
    for (int64_t i = 0; i < b->n_entries; i++) {
        ids[i] = b->entries[i].id;
        pos[i] = b->entries[i].pos;
        n_tokens[i] = b->entries[i].n_tokens;
    }
    const gy_peer_step step = {
        .number = ++e->peer_number, .n_entries = b->n_entries, .ids = ids, .pos = pos, .n_tokens = n_tokens,
        .n_rows = b->n_tokens, .tokens = e->tokens, .n_logits = e->rows.n_logits,
        .logit_rows = e->logit_rows, .x = e->x,
        .n_released_before = e->n_released_committed,
        .n_released_now = e->n_released - e->n_released_committed, .released = e->released};
    e->outlet_called = 1;
    GY_TRY(e->outlet(e->outlet_ctx, &step, e->logits));
    e->n_released = e->n_released_committed = 0; /* the follower has them all now */
    return GY_OK;
}

gy_status gy_engine_peer_flush(gy_engine *e) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    pthread_mutex_lock(&e->api);
    gy_status s = GY_OK;
    if (e->outlet != NULL && e->n_released > 0) {
        const gy_peer_step step = {.number = ++e->peer_number, .n_released_before = e->n_released,
                                   .released = e->released};
        s = e->outlet(e->outlet_ctx, &step, NULL);
        if (s == GY_OK) e->n_released = e->n_released_committed = 0;
    }
    pthread_mutex_unlock(&e->api);
    return s;
}

void gy_engine_peer_cancel(gy_engine *e) {
    if (e->outlet == NULL) return;
    if (e->outlet_called) {
        const gy_peer_step cancel = {.number = e->peer_number, .cancel = 1};
        if (e->outlet(e->outlet_ctx, &cancel, NULL) != GY_OK)
            gy_error_clear(); /* (a follower not told keeps the step: see gy_engine_peer_cancel) */
    }
    e->outlet_called = 0;
    e->n_released = e->n_released_committed; /* the schedule's releases were taken back */
}

void gy_engine_peer_begin(gy_engine *e) {
    e->outlet_called = 0;
    e->n_released_committed = e->n_released;
}

/* ---- the follower ---- */

/* The rows of `in` as this engine's step: entries, tokens, positions and logit rows. */
static gy_status gy_engine_follow_rows(gy_engine *e, const gy_peer_step *in, gy_sched_batch *b) {
    GY_TRY(gy_grow((void **)&e->follow_entries, &e->cap_follow_entries, in->n_entries + 1,
                   sizeof(gy_sched_entry), "the follower's entries"));
    int64_t rows = 0;
    for (int64_t i = 0; i < in->n_entries; i++) {
        if (in->pos[i] < 0 || in->n_tokens[i] < 1)
            return GY_FAIL(GY_ERR_INVALID, "entry %lld: position %lld, %lld tokens", (long long)i,
                           (long long)in->pos[i], (long long)in->n_tokens[i]);
        e->follow_entries[i] = (gy_sched_entry){.id = in->ids[i], .pos = in->pos[i],
                                                .n_tokens = in->n_tokens[i]};
        rows += in->n_tokens[i];
    }
    if (rows != in->n_rows)
        return GY_FAIL(GY_ERR_INVALID, "the entries hold %lld tokens, the step %lld rows",
                       (long long)rows, (long long)in->n_rows);
    GY_TRY(gy_engine_scratch(e, in->n_rows, in->n_entries, in->n_logits));
    int64_t t = 0;
    for (int64_t i = 0; i < in->n_entries; i++)
        for (int64_t j = 0; j < in->n_tokens[i]; j++, t++) {
            e->token_seq[t] = (int32_t)i;
            e->token_pos[t] = (int32_t)(in->pos[i] + j);
        }
    memcpy(e->tokens, in->tokens, (size_t)in->n_rows * sizeof(int32_t));
    memcpy(e->x, in->x, (size_t)(in->n_rows * e->model->hidden) * sizeof(float));
    memcpy(e->logit_rows, in->logit_rows, (size_t)in->n_logits * sizeof(int32_t));
    *b = (gy_sched_batch){.n_entries = in->n_entries, .entries = e->follow_entries,
                          .n_tokens = in->n_rows};
    return GY_OK;
}

static gy_status gy_engine_follow_locked(gy_engine *e, const gy_peer_step *in, float *logits) {
    if (e->first_layer == 0)
        return GY_FAIL(GY_ERR_STATE, "only a plan from past layer 0 follows another engine");
    if (in->cancel) { /* the leader's step `number` did not happen */
        if (e->follow_marked && e->follow_number == in->number)
            gy_engine_undo(e, e->follow_pages);
        else if (e->follow_marked) /* (it never came: the one marked stands) */
            gy_engine_unmark(e);
        e->follow_marked = 0;
        return GY_OK;
    }
    if (e->follow_marked) gy_engine_unmark(e); /* the leader's last step stands */
    e->follow_marked = 0;
    for (int64_t i = 0; i < in->n_released_before; i++) gy_engine_release_kv(e, in->released[i]);
    if (in->n_released_before > 0) gy_engine_shrink(e); /* as the leader gave its pages back */
    if (in->n_entries == 0 && in->n_released_now == 0) return GY_OK;
    GY_TRY(gy_engine_mark(e, e->follow_pages));
    e->follow_marked = 1;
    e->follow_number = in->number;
    gy_status s = GY_OK;
    for (int64_t i = 0; i < in->n_released_now; i++)
        gy_engine_release_kv(e, in->released[in->n_released_before + i]);
    gy_sched_batch b;
    s = gy_engine_follow_rows(e, in, &b);
    for (int64_t i = 0; i < b.n_entries && s == GY_OK; i++)
        s = gy_engine_reserve(e, in->ids[i], in->pos[i] + in->n_tokens[i]);
    if (s == GY_OK && b.n_entries > 0) {
        e->rows = (gy_step_rows){.batch = &b, .tokens = e->tokens, .token_seq = e->token_seq,
                                 .token_pos = e->token_pos, .n_logits = in->n_logits,
                                 .logit_rows = e->logit_rows, .x = e->x, .logits = e->logits};
        s = gy_engine_build_stages(e);
        if (s == GY_OK) s = gy_engine_forward_all(e);
        if (s == GY_OK)
            memcpy(logits, e->logits, (size_t)(in->n_logits * e->model->vocab) * sizeof(float));
    }
    if (s != GY_OK) { /* as before the call: the leader's step fails and is tried again */
        char message[512];
        snprintf(message, sizeof message, "%s", gy_error_message());
        gy_engine_undo(e, e->follow_pages);
        e->follow_marked = 0;
        return GY_FAIL(s, "%s", message);
    }
    return GY_OK;
}

gy_status gy_engine_follow(gy_engine *e, const gy_peer_step *step, float *logits) {
    if (e == NULL || step == NULL || (step->n_logits > 0 && logits == NULL))
        return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_follow_locked(e, step, logits);
    pthread_mutex_unlock(&e->api);
    return s;
}

gy_status gy_engine_follow_adopt(gy_engine *e, int64_t id, const int64_t *seqs) {
    if (e == NULL || seqs == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    pthread_mutex_lock(&e->api);
    gy_sched_kv_adapter *adapters[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n = gy_engine_adapters(e, adapters);
    gy_status s = GY_OK;
    for (int32_t k = 0; k < n && s == GY_OK; k++)
        if (gy_sched_kv_adapter_seq(adapters[k], id) >= 0)
            s = GY_FAIL(GY_ERR_INVALID, "request %lld already holds KV here", (long long)id);
    int32_t done = 0;
    for (; done < n && s == GY_OK; done++)
        if (seqs[done] >= 0) s = gy_sched_kv_adapter_adopt(adapters[done], id, seqs[done]);
    if (s != GY_OK)
        for (int32_t k = 0; k < done; k++) gy_sched_kv_adapter_forget(adapters[k], id);
    pthread_mutex_unlock(&e->api);
    return s;
}

int32_t gy_engine_follow_seqs(gy_engine *e, int64_t id, int64_t *seqs) {
    pthread_mutex_lock(&e->api);
    gy_sched_kv_adapter *adapters[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n = gy_engine_adapters(e, adapters);
    for (int32_t k = 0; k < n; k++) seqs[k] = gy_sched_kv_adapter_seq(adapters[k], id);
    pthread_mutex_unlock(&e->api);
    return n;
}

void gy_engine_follow_forget(gy_engine *e, int64_t id) {
    pthread_mutex_lock(&e->api);
    gy_sched_kv_adapter *adapters[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n = gy_engine_adapters(e, adapters);
    for (int32_t k = 0; k < n; k++) gy_sched_kv_adapter_forget(adapters[k], id);
    pthread_mutex_unlock(&e->api);
}
