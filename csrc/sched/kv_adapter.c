/* kv_adapter.c: request id -> KV sequence in an id map; every call forwards to the cache. */
#include "kv_adapter.h"

#include <string.h>

#include <stdlib.h>

#include "idmap.h"

struct gy_sched_kv_adapter {
    gy_kv_cache *kv;
    gy_idmap seqs; /* request id -> sequence */
};

gy_status gy_sched_kv_adapter_init(gy_sched_kv_adapter **out, gy_kv_cache *kv) {
    if (out == NULL || kv == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_kv_adapter_init: NULL argument");
    *out = calloc(1, sizeof **out);
    if (*out == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    (*out)->kv = kv;
    return GY_OK;
}

void gy_sched_kv_adapter_free(gy_sched_kv_adapter *a) {
    if (a == NULL) return;
    for (int64_t i = 0; i < a->seqs.capacity; i++)
        if (a->seqs.used[i]) gy_kv_seq_free(a->kv, a->seqs.values[i]);
    gy_idmap_free(&a->seqs);
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
    gy_kv_seq_free(a->kv, seq);
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

void gy_sched_kv_adapter_forget(gy_sched_kv_adapter *a, int64_t req) {
    if (a != NULL) gy_idmap_remove(&a->seqs, req);
}

void gy_sched_kv_adapter_detach_all(gy_sched_kv_adapter *a) {
    if (a == NULL) return;
    gy_idmap_free(&a->seqs);
    memset(&a->seqs, 0, sizeof a->seqs);
}
