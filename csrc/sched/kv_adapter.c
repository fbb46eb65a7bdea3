/* kv_adapter.c: request id -> KV sequence in an id map; every call forwards to the cache. */
#include "kv_adapter.h"
#include "../core/alloc.h"

#include <string.h>

#include <stdlib.h>

#include "idmap.h"
#include "../core/grow.h"

/* While marked: a request's sequence before a change (-1: it held none). */
typedef struct gy_sched_kva_undo {
    int64_t req, seq;
} gy_sched_kva_undo;

struct gy_sched_kv_adapter {
    gy_kv_cache *kv;
    gy_idmap seqs; /* request id -> sequence */
    int marked;
    gy_sched_kva_undo *undo; /* (n_undo) */
    int64_t n_undo, undo_cap;
};

/* Writes down request `req`'s sequence before it changes; within the room the mark reserved it
 * cannot fail. */
static gy_status gy_sched_kva_record(gy_sched_kv_adapter *a, int64_t req) {
    if (!a->marked) return GY_OK;
    GY_TRY(gy_grow((void **)&a->undo, &a->undo_cap, a->n_undo + 1, sizeof *a->undo,
                   "a KV undo record"));
    a->undo[a->n_undo++] = (gy_sched_kva_undo){req, gy_sched_kv_adapter_seq(a, req)};
    return GY_OK;
}

gy_status gy_sched_kv_adapter_init(gy_sched_kv_adapter **out, gy_kv_cache *kv) {
    if (out == NULL || kv == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_kv_adapter_init: NULL argument");
    *out = gy_calloc(1, sizeof **out);
    if (*out == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    (*out)->kv = kv;
    return GY_OK;
}

void gy_sched_kv_adapter_free(gy_sched_kv_adapter *a) {
    if (a == NULL) return;
    for (int64_t i = 0; i < a->seqs.capacity; i++)
        if (a->seqs.used[i]) gy_kv_seq_free(a->kv, a->seqs.values[i]);
    gy_idmap_free(&a->seqs);
    free(a->undo);
    free(a);
}

int64_t gy_sched_kv_adapter_seq(const gy_sched_kv_adapter *a, int64_t req) {
    int64_t seq = -1;
    gy_idmap_get(&a->seqs, req, &seq);
    return seq;
}

static int64_t gy_sched_kva_free(void *ctx) {
    gy_kv_stats st;
    gy_kv_stats_get(((gy_sched_kv_adapter *)ctx)->kv, &st);
    return st.free_blocks;
}

static int64_t gy_sched_kva_needed(void *ctx, int64_t req, int64_t n_tokens) {
    gy_sched_kv_adapter *a = ctx;
    const int64_t seq = gy_sched_kv_adapter_seq(a, req);
    if (seq >= 0) return gy_kv_blocks_needed(a->kv, seq, n_tokens);
    const int64_t bs = gy_kv_config_of(a->kv)->block_size;
    return n_tokens > 0 ? (n_tokens + bs - 1) / bs : 0;
}

static gy_status gy_sched_kva_reserve(void *ctx, int64_t req, int64_t n_tokens) {
    gy_sched_kv_adapter *a = ctx;
    int64_t seq = gy_sched_kv_adapter_seq(a, req);
    if (seq >= 0) return gy_kv_seq_reserve(a->kv, seq, n_tokens);
    GY_TRY(gy_sched_kva_record(a, req));
    GY_TRY(gy_kv_seq_new(a->kv, &seq));
    gy_status st = gy_kv_seq_reserve(a->kv, seq, n_tokens);
    if (st == GY_OK) st = gy_idmap_put(&a->seqs, req, seq);
    if (st != GY_OK) gy_kv_seq_free(a->kv, seq); /* all-or-nothing; keeps the first message */
    return st;
}

static void gy_sched_kva_release(void *ctx, int64_t req) {
    gy_sched_kv_adapter *a = ctx;
    const int64_t seq = gy_sched_kv_adapter_seq(a, req);
    if (seq < 0) return;
    /* Both records fit the room a mark reserved; unmarked, neither call can fail. */
    if (gy_sched_kva_record(a, req) != GY_OK || gy_kv_seq_free(a->kv, seq) != GY_OK) return;
    gy_idmap_remove(&a->seqs, req);
}

gy_sched_kv_ops gy_sched_kv_adapter_ops(gy_sched_kv_adapter *a) {
    gy_sched_kv_ops ops = {
        .ctx = a,
        .free_blocks = gy_sched_kva_free,
        .blocks_needed = gy_sched_kva_needed,
        .reserve = gy_sched_kva_reserve,
        .release = gy_sched_kva_release,
    };
    return ops;
}

gy_status gy_sched_kv_adapter_adopt(gy_sched_kv_adapter *a, int64_t req, int64_t seq) {
    if (a == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL adapter");
    int64_t existing;
    if (gy_idmap_get(&a->seqs, req, &existing))
        return GY_FAIL(GY_ERR_STATE, "request %lld already holds KV sequence %lld", (long long)req,
                       (long long)existing);
    if (gy_kv_seq_n_blocks(a->kv, seq) < 0)
        return GY_FAIL(GY_ERR_STATE, "KV sequence %lld does not exist", (long long)seq);
    return gy_idmap_put(&a->seqs, req, seq);
}

gy_status gy_sched_kv_adapter_mark(gy_sched_kv_adapter *a, int64_t changes) {
    if (a == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL adapter");
    GY_TRY(gy_grow((void **)&a->undo, &a->undo_cap, changes > 0 ? changes : 1, sizeof *a->undo,
                   "a KV undo record"));
    GY_TRY(gy_kv_mark(a->kv, 4 * changes)); /* new, reserve, free, and a free undoing a new */
    a->marked = 1;
    a->n_undo = 0;
    return GY_OK;
}

gy_sched_kv_point gy_sched_kv_adapter_point(const gy_sched_kv_adapter *a) {
    return (gy_sched_kv_point){a->marked ? a->n_undo : 0, gy_kv_undo_point(a->kv)};
}

/* A removed entry goes back into a map that holds no more entries than it did then, so the
 * put never grows the map: undo allocates nothing. */
void gy_sched_kv_adapter_undo_to(gy_sched_kv_adapter *a, gy_sched_kv_point point) {
    if (a == NULL || !a->marked) return;
    for (int64_t i = a->n_undo - 1; i >= point.map; i--) {
        const gy_sched_kva_undo *u = &a->undo[i];
        if (u->seq >= 0) gy_idmap_put(&a->seqs, u->req, u->seq);
        else gy_idmap_remove(&a->seqs, u->req);
    }
    if (point.map < a->n_undo) a->n_undo = point.map;
    gy_kv_undo_to(a->kv, point.kv);
}

void gy_sched_kv_adapter_undo(gy_sched_kv_adapter *a) {
    if (a == NULL || !a->marked) return;
    gy_sched_kv_adapter_undo_to(a, (gy_sched_kv_point){0, 0});
    gy_sched_kv_adapter_unmark(a);
}

void gy_sched_kv_adapter_unmark(gy_sched_kv_adapter *a) {
    if (a == NULL) return;
    a->marked = 0;
    a->n_undo = 0;
    gy_kv_unmark(a->kv);
}

void gy_sched_kv_adapter_forget(gy_sched_kv_adapter *a, int64_t req) {
    if (a != NULL) gy_idmap_remove(&a->seqs, req);
}

void gy_sched_kv_adapter_detach_all(gy_sched_kv_adapter *a) {
    if (a == NULL) return;
    gy_idmap_free(&a->seqs);
    memset(&a->seqs, 0, sizeof a->seqs);
}
