/* engine.c: the serving loop of one instance (one or several TP ranks). */
#include "engine.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../comm/comm.h"
#include "../sched/idmap.h"
#include "../sched/kv_adapter.h"

#define GY_ENGINE_MAX_RANKS GY_MODEL_MAX_TP

typedef struct gy_engine_request {
    int64_t id;
    int32_t *tokens;      /* (n_tokens) prompt then generated tokens: what a recompute reads */
    int64_t n_tokens;
    int64_t capacity;
    int64_t prompt_len;
    gy_engine_params params;
    int32_t *stop_tokens; /* owned copy of params.stop_tokens */
} gy_engine_request;

/* What one rank needs beyond gy_engine_rank: its KV adapter, workspace, block tables and, for
 * ranks above 0, the thread that runs its forward passes. */
typedef struct gy_engine_rank_state {
    gy_engine_rank r;
    gy_sched_kv_adapter *adapter;
    gy_sched_kv_ops inner;       /* the adapter's ops */
    gy_forward_ws ws;
    gy_comm_rank comm_rank;
    int32_t *bt_indptr, *bt_indices;
    int64_t cap_entries, cap_blocks;
    gy_forward_batch batch;      /* the step's batch as this rank sees it */
    gy_status status;            /* of its last forward */
    char error[512];
    pthread_t thread;
    int has_thread;
} gy_engine_rank_state;

struct gy_engine {
    const gy_model *model;       /* rank 0's: the shapes every rank shares */
    int32_t n_ranks;
    gy_engine_rank_state ranks[GY_ENGINE_MAX_RANKS];
    gy_comm *comm;
    gy_sched *sched;
    gy_idmap requests;           /* id -> gy_engine_request * */
    /* The rank threads wait for a new generation, run, and count themselves done. */
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    uint64_t generation;
    int32_t n_done;
    int stopping;
    /* Per-step scratch shared by the ranks, grown on demand. */
    int64_t cap_tokens, cap_entries;
    int32_t *tokens, *token_seq, *token_pos, *logit_rows, *sampled;
    int64_t *sample_index, *sampled_ids, *finished;
    gy_sampler_params *sample_params;
    uint8_t *stop;
    float *logits;
};

/* ---- KV on demand, on every rank ---- */

static int64_t gy_engine_growable_pages(const gy_kv_cache *kv) {
    gy_arena_stats st;
    gy_arena_stats_get(gy_kv_arena(kv), &st);
    const int64_t n_layers = gy_kv_config_of(kv)->n_layers;
    const int64_t free_pages = (int64_t)((st.max_pages - st.bytes_in_use / st.page_size)) / n_layers;
    gy_kv_stats ks;
    gy_kv_stats_get(kv, &ks);
    const int64_t room = gy_kv_config_of(kv)->slots_per_layer - ks.pages_per_layer;
    return free_pages < room ? free_pages : room;
}

/* Blocks rank i could still hand out: free ones plus what its budget could map. */
static int64_t gy_engine_rank_free(const gy_engine_rank_state *rs) {
    return rs->inner.free_blocks(rs->inner.ctx) +
           gy_kv_blocks_if_grown(rs->r.kv, gy_engine_growable_pages(rs->r.kv));
}

static int64_t gy_engine_free_blocks(void *ctx) {
    gy_engine *e = ctx;
    int64_t least = gy_engine_rank_free(&e->ranks[0]);
    for (int32_t i = 1; i < e->n_ranks; i++) {
        const int64_t f = gy_engine_rank_free(&e->ranks[i]);
        if (f < least) least = f;
    }
    return least;
}

static int64_t gy_engine_blocks_needed(void *ctx, int64_t req, int64_t n_tokens) {
    gy_engine *e = ctx;
    return e->ranks[0].inner.blocks_needed(e->ranks[0].inner.ctx, req, n_tokens);
}

/* Maps pages on one rank until it has `want` free blocks. */
static gy_status gy_engine_rank_make_room(gy_engine_rank_state *rs, int64_t want) {
    const int64_t short_by = want - rs->inner.free_blocks(rs->inner.ctx);
    if (short_by <= 0) return GY_OK;
    const int64_t max_pages = gy_engine_growable_pages(rs->r.kv);
    int64_t pages = 1;
    while (pages <= max_pages && gy_kv_blocks_if_grown(rs->r.kv, pages) < short_by) pages++;
    if (pages > max_pages)
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY, "KV budget exhausted: %lld more blocks needed",
                       (long long)short_by);
    return gy_kv_grow(rs->r.kv, pages);
}

static gy_status gy_engine_reserve(void *ctx, int64_t req, int64_t n_tokens) {
    gy_engine *e = ctx;
    /* Check every rank before reserving on any, so that a refusal changes nothing. */
    const int64_t need = gy_engine_blocks_needed(e, req, n_tokens);
    if (need > gy_engine_free_blocks(e))
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY, "KV budget exhausted: %lld more blocks needed",
                       (long long)need);
    for (int32_t i = 0; i < e->n_ranks; i++) {
        gy_engine_rank_state *rs = &e->ranks[i];
        GY_TRY(gy_engine_rank_make_room(rs, need));
        GY_TRY(rs->inner.reserve(rs->inner.ctx, req, n_tokens));
    }
    return GY_OK;
}

static void gy_engine_release_kv(void *ctx, int64_t req) {
    gy_engine *e = ctx;
    for (int32_t i = 0; i < e->n_ranks; i++) e->ranks[i].inner.release(e->ranks[i].inner.ctx, req);
}

int64_t gy_engine_capacity_blocks(const gy_engine *e) {
    int64_t least = INT64_MAX;
    for (int32_t i = 0; i < e->n_ranks; i++) {
        gy_kv_stats ks;
        gy_kv_stats_get(e->ranks[i].r.kv, &ks);
        const int64_t n = ks.n_blocks + gy_kv_blocks_if_grown(e->ranks[i].r.kv,
                                                             gy_engine_growable_pages(e->ranks[i].r.kv));
        if (n < least) least = n;
    }
    return least;
}

/* ---- rank threads ---- */

static void gy_engine_rank_forward(gy_engine *e, int32_t i) {
    gy_engine_rank_state *rs = &e->ranks[i];
    const gy_tp_group tp = {.rank = i, .size = e->n_ranks,
                            .all_reduce = e->n_ranks > 1 ? gy_comm_rank_all_reduce : NULL,
                            .ctx = &rs->comm_rank};
    rs->status = gy_forward(i == 0 ? e->logits : NULL, rs->r.model, &tp, rs->r.kv, &rs->batch,
                            &rs->ws, rs->r.pool);
    if (rs->status != GY_OK) snprintf(rs->error, sizeof rs->error, "%s", gy_error_message());
}

typedef struct gy_engine_thread_arg {
    gy_engine *e;
    int32_t rank;
} gy_engine_thread_arg;

static void *gy_engine_rank_main(void *p) {
    gy_engine_thread_arg arg = *(gy_engine_thread_arg *)p;
    free(p);
    gy_engine *e = arg.e;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&e->lock);
        while (e->generation == seen && !e->stopping) pthread_cond_wait(&e->wake, &e->lock);
        if (e->stopping) {
            pthread_mutex_unlock(&e->lock);
            return NULL;
        }
        seen = e->generation;
        pthread_mutex_unlock(&e->lock);
        gy_engine_rank_forward(e, arg.rank);
        pthread_mutex_lock(&e->lock);
        e->n_done++;
        pthread_cond_signal(&e->done);
        pthread_mutex_unlock(&e->lock);
    }
}

/* Runs the forward pass on every rank (rank 0 on this thread); the first failure wins. */
static gy_status gy_engine_forward_all(gy_engine *e) {
    if (e->n_ranks > 1) {
        pthread_mutex_lock(&e->lock);
        e->n_done = 0;
        e->generation++;
        pthread_cond_broadcast(&e->wake);
        pthread_mutex_unlock(&e->lock);
    }
    gy_engine_rank_forward(e, 0);
    if (e->n_ranks > 1) {
        pthread_mutex_lock(&e->lock);
        while (e->n_done < e->n_ranks - 1) pthread_cond_wait(&e->done, &e->lock);
        pthread_mutex_unlock(&e->lock);
    }
    for (int32_t i = 0; i < e->n_ranks; i++)
        if (e->ranks[i].status != GY_OK)
            return GY_FAIL(e->ranks[i].status, "rank %d: %s", (int)i, e->ranks[i].error);
    return GY_OK;
}

/* ---- life cycle ---- */

gy_status gy_engine_init(gy_engine **out, const gy_engine_rank *ranks, int32_t n_ranks,
                         gy_comm *comm, const gy_engine_config *config) {
    if (out == NULL || ranks == NULL || config == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_engine_init: NULL argument");
    *out = NULL;
    if (n_ranks < 1 || n_ranks > GY_ENGINE_MAX_RANKS || (n_ranks > 1 && comm == NULL) ||
        (comm != NULL && gy_comm_size(comm) != n_ranks))
        return GY_FAIL(GY_ERR_INVALID, "an engine of %d ranks needs a communicator of that size",
                       (int)n_ranks);
    for (int32_t i = 0; i < n_ranks; i++)
        if (ranks[i].model == NULL || ranks[i].kv == NULL)
            return GY_FAIL(GY_ERR_INVALID, "rank %d has no model or KV cache", (int)i);
    gy_engine *e = calloc(1, sizeof *e);
    if (e == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    e->model = ranks[0].model;
    e->n_ranks = n_ranks;
    e->comm = comm;
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->wake, NULL);
    pthread_cond_init(&e->done, NULL);
    gy_status s = GY_OK;
    for (int32_t i = 0; i < n_ranks && s == GY_OK; i++) {
        gy_engine_rank_state *rs = &e->ranks[i];
        rs->r = ranks[i];
        rs->comm_rank = (gy_comm_rank){.comm = comm, .rank = i};
        s = gy_sched_kv_adapter_init(&rs->adapter, ranks[i].kv);
        if (s == GY_OK) rs->inner = gy_sched_kv_adapter_ops(rs->adapter);
    }
    const gy_sched_kv_ops ops = {.ctx = e, .free_blocks = gy_engine_free_blocks,
                                 .blocks_needed = gy_engine_blocks_needed,
                                 .reserve = gy_engine_reserve, .release = gy_engine_release_kv};
    if (s == GY_OK) {
        const gy_sched_config sc = {
            .total_blocks = gy_engine_capacity_blocks(e),
            .block_size = gy_kv_config_of(ranks[0].kv)->block_size,
            .max_batch_tokens = config->max_batch_tokens,
            .max_running = config->max_running,
            .max_prefill_chunk = config->max_prefill_chunk,
            .watermark_blocks = config->watermark_blocks,
        };
        if (sc.total_blocks <= 0)
            s = GY_FAIL(GY_ERR_OUT_OF_MEMORY,
                        "no memory is left for the KV cache after the weights; raise the budget");
        else
            s = gy_sched_init(&e->sched, &sc, &ops);
    }
    for (int32_t i = 1; i < n_ranks && s == GY_OK; i++) {
        gy_engine_thread_arg *arg = malloc(sizeof *arg);
        if (arg == NULL) {
            s = GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
            break;
        }
        *arg = (gy_engine_thread_arg){.e = e, .rank = i};
        if (pthread_create(&e->ranks[i].thread, NULL, gy_engine_rank_main, arg) != 0) {
            free(arg);
            s = GY_FAIL(GY_ERR_SYSTEM, "could not start the thread of rank %d", (int)i);
            break;
        }
        e->ranks[i].has_thread = 1;
    }
    if (s != GY_OK) {
        gy_engine_free(e);
        return s;
    }
    *out = e;
    return GY_OK;
}

static void gy_engine_request_free(gy_engine_request *r) {
    if (r == NULL) return;
    free(r->tokens);
    free(r->stop_tokens);
    free(r);
}

static gy_engine_request *gy_engine_find(const gy_engine *e, int64_t id) {
    int64_t value;
    return gy_idmap_get(&e->requests, id, &value) ? (gy_engine_request *)(intptr_t)value : NULL;
}

void gy_engine_free(gy_engine *e) {
    if (e == NULL) return;
    pthread_mutex_lock(&e->lock);
    e->stopping = 1;
    pthread_cond_broadcast(&e->wake);
    pthread_mutex_unlock(&e->lock);
    for (int32_t i = 0; i < e->n_ranks; i++)
        if (e->ranks[i].has_thread) pthread_join(e->ranks[i].thread, NULL);
    for (int64_t i = 0; i < e->requests.capacity; i++)
        if (e->requests.used[i]) gy_engine_request_free((gy_engine_request *)(intptr_t)e->requests.values[i]);
    gy_idmap_free(&e->requests);
    gy_sched_free(e->sched);
    for (int32_t i = 0; i < e->n_ranks; i++) {
        gy_engine_rank_state *rs = &e->ranks[i];
        gy_sched_kv_adapter_free(rs->adapter);
        gy_forward_ws_free(&rs->ws);
        free(rs->bt_indptr);
        free(rs->bt_indices);
    }
    void *scratch[] = {e->tokens, e->token_seq, e->token_pos, e->logit_rows, e->sampled,
                       e->sample_index, e->sampled_ids, e->finished, e->sample_params, e->stop,
                       e->logits};
    for (size_t i = 0; i < sizeof scratch / sizeof scratch[0]; i++) free(scratch[i]);
    pthread_mutex_destroy(&e->lock);
    pthread_cond_destroy(&e->wake);
    pthread_cond_destroy(&e->done);
    free(e);
}

/* ---- requests ---- */

/* Checks a request and records it in e->requests (not in the scheduler). */
static gy_status gy_engine_add_request(gy_engine *e, int64_t id, const int32_t *prompt,
                                       int64_t prompt_len, const gy_engine_params *p) {
    if (e == NULL || prompt == NULL || p == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    if (prompt_len <= 0) return GY_FAIL(GY_ERR_INVALID, "the prompt is empty");
    for (int64_t i = 0; i < prompt_len; i++)
        if (prompt[i] < 0 || prompt[i] >= e->model->vocab)
            return GY_FAIL(GY_ERR_INVALID, "prompt token %lld is %d, outside the vocabulary [0, %lld)",
                           (long long)i, (int)prompt[i], (long long)e->model->vocab);
    if (prompt_len + p->max_new_tokens > e->model->max_pos)
        return GY_FAIL(GY_ERR_INVALID,
                       "prompt (%lld) + max_tokens (%lld) is longer than the model's %lld positions",
                       (long long)prompt_len, (long long)p->max_new_tokens, (long long)e->model->max_pos);
    GY_TRY(gy_sampler_check(&p->sampler, e->model->vocab));
    if (gy_engine_find(e, id) != NULL)
        return GY_FAIL(GY_ERR_STATE, "request id %lld is already in use", (long long)id);
    gy_engine_request *r = calloc(1, sizeof *r);
    if (r == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    r->id = id;
    r->prompt_len = prompt_len;
    r->params = *p;
    r->capacity = prompt_len + (p->max_new_tokens > 0 ? p->max_new_tokens : 0);
    r->tokens = malloc((size_t)r->capacity * sizeof(int32_t));
    r->stop_tokens = p->n_stop_tokens > 0 ? malloc((size_t)p->n_stop_tokens * sizeof(int32_t)) : NULL;
    if (r->tokens == NULL || (p->n_stop_tokens > 0 && r->stop_tokens == NULL)) {
        gy_engine_request_free(r);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a prompt of %lld tokens", (long long)prompt_len);
    }
    memcpy(r->tokens, prompt, (size_t)prompt_len * sizeof(int32_t));
    r->n_tokens = prompt_len;
    if (p->n_stop_tokens > 0) memcpy(r->stop_tokens, p->stop_tokens, (size_t)p->n_stop_tokens * sizeof(int32_t));
    r->params.stop_tokens = r->stop_tokens;
    gy_status s = gy_idmap_put(&e->requests, id, (int64_t)(intptr_t)r);
    if (s != GY_OK) gy_engine_request_free(r);
    return s;
}

gy_status gy_engine_add(gy_engine *e, int64_t id, const int32_t *prompt, int64_t prompt_len,
                        const gy_engine_params *p, double arrival) {
    GY_TRY(gy_engine_add_request(e, id, prompt, prompt_len, p));
    const gy_sched_request sr = {.id = id, .prompt_len = prompt_len,
                                 .max_new_tokens = p->max_new_tokens, .arrival = arrival};
    gy_status s = gy_sched_add(e->sched, &sr);
    if (s != GY_OK) {
        gy_engine_request *r = gy_engine_find(e, id);
        gy_idmap_remove(&e->requests, id);
        gy_engine_request_free(r);
    }
    return s;
}

gy_status gy_engine_abort(gy_engine *e, int64_t id) {
    if (gy_engine_find(e, id) == NULL) return GY_FAIL(GY_ERR_STATE, "no request %lld", (long long)id);
    return gy_sched_abort(e->sched, id);
}

gy_status gy_engine_release(gy_engine *e, int64_t id) {
    gy_engine_request *r = gy_engine_find(e, id);
    if (r == NULL) return GY_FAIL(GY_ERR_STATE, "no request %lld", (long long)id);
    GY_TRY(gy_sched_forget(e->sched, id));
    gy_idmap_remove(&e->requests, id);
    gy_engine_request_free(r);
    return GY_OK;
}

gy_sched *gy_engine_sched(const gy_engine *e) { return e->sched; }
int32_t gy_engine_n_ranks(const gy_engine *e) { return e->n_ranks; }

/* ---- moving requests between instances ---- */

int64_t gy_engine_request_ids(const gy_engine *e, int64_t *ids, int64_t capacity) {
    int64_t n = 0;
    for (int64_t i = 0; i < e->requests.capacity; i++) {
        if (!e->requests.used[i]) continue;
        const gy_engine_request *r = (const gy_engine_request *)(intptr_t)e->requests.values[i];
        gy_sched_info info;
        if (gy_sched_info_get(e->sched, r->id, &info) != GY_OK || info.state == GY_SCHED_STATE_FINISHED)
            continue;
        if (n < capacity) ids[n] = r->id;
        n++;
    }
    /* The map's order is arbitrary; ids grow with submission, so sorting restores it. */
    for (int64_t i = 1; i < (n < capacity ? n : capacity); i++)
        for (int64_t j = i; j > 0 && ids[j - 1] > ids[j]; j--) {
            const int64_t t = ids[j];
            ids[j] = ids[j - 1];
            ids[j - 1] = t;
        }
    return n;
}

gy_status gy_engine_request_get(const gy_engine *e, int64_t id, gy_engine_request_view *out) {
    const gy_engine_request *r = gy_engine_find(e, id);
    if (r == NULL) return GY_FAIL(GY_ERR_STATE, "no request %lld", (long long)id);
    GY_TRY(gy_sched_info_get(e->sched, id, &out->info));
    out->tokens = r->tokens;
    out->n_tokens = r->n_tokens;
    out->prompt_len = r->prompt_len;
    out->params = r->params;
    for (int32_t i = 0; i < GY_MODEL_MAX_TP; i++)
        out->seqs[i] = i < e->n_ranks ? gy_sched_kv_adapter_seq(e->ranks[i].adapter, id) : -1;
    return GY_OK;
}

gy_status gy_engine_adopt(gy_engine *e, int64_t id, const int32_t *tokens, int64_t n_tokens,
                          int64_t prompt_len, const gy_engine_params *params,
                          const gy_sched_info *info, const int64_t *seqs) {
    if (e == NULL || tokens == NULL || params == NULL || info == NULL || seqs == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_engine_adopt: NULL argument");
    if (n_tokens < prompt_len || n_tokens - prompt_len != info->n_generated)
        return GY_FAIL(GY_ERR_INVALID, "request %lld: %lld tokens for a prompt of %lld and %lld generated",
                       (long long)id, (long long)n_tokens, (long long)prompt_len,
                       (long long)info->n_generated);
    GY_TRY(gy_engine_add_request(e, id, tokens, prompt_len, params));
    gy_engine_request *r = gy_engine_find(e, id);
    memcpy(r->tokens + prompt_len, tokens + prompt_len, (size_t)(n_tokens - prompt_len) * sizeof(int32_t));
    r->n_tokens = n_tokens;
    gy_status s = GY_OK;
    int32_t adopted = 0;
    for (; adopted < e->n_ranks && s == GY_OK; adopted++)
        if (seqs[adopted] >= 0) s = gy_sched_kv_adapter_adopt(e->ranks[adopted].adapter, id, seqs[adopted]);
    const gy_sched_request sr = {.id = id, .prompt_len = prompt_len,
                                 .max_new_tokens = params->max_new_tokens, .arrival = info->arrival};
    if (s == GY_OK) s = gy_sched_adopt(e->sched, &sr, info);
    if (s != GY_OK) {
        char message[512];
        snprintf(message, sizeof message, "%s", gy_error_message());
        for (int32_t i = 0; i < adopted; i++) gy_sched_kv_adapter_forget(e->ranks[i].adapter, id);
        gy_idmap_remove(&e->requests, id);
        gy_engine_request_free(r);
        return GY_FAIL(s, "%s", message);
    }
    return GY_OK;
}

/* ---- one step ---- */

static gy_status gy_engine_scratch(gy_engine *e, int64_t n_tokens, int64_t n_entries) {
    if (n_tokens > e->cap_tokens) {
        free(e->tokens); free(e->token_seq); free(e->token_pos);
        e->tokens = malloc((size_t)n_tokens * sizeof(int32_t));
        e->token_seq = malloc((size_t)n_tokens * sizeof(int32_t));
        e->token_pos = malloc((size_t)n_tokens * sizeof(int32_t));
        e->cap_tokens = n_tokens;
        if (!e->tokens || !e->token_seq || !e->token_pos) goto oom;
    }
    if (n_entries > e->cap_entries) {
        free(e->logit_rows); free(e->sampled); free(e->sample_index); free(e->sampled_ids);
        free(e->finished); free(e->sample_params); free(e->stop); free(e->logits);
        e->logit_rows = malloc((size_t)n_entries * sizeof(int32_t));
        e->sampled = malloc((size_t)n_entries * sizeof(int32_t));
        e->sample_index = malloc((size_t)n_entries * sizeof(int64_t));
        e->sampled_ids = malloc((size_t)n_entries * sizeof(int64_t));
        e->finished = malloc((size_t)n_entries * sizeof(int64_t));
        e->sample_params = malloc((size_t)n_entries * sizeof(gy_sampler_params));
        e->stop = malloc((size_t)n_entries);
        e->logits = malloc((size_t)(n_entries * e->model->vocab) * sizeof(float));
        e->cap_entries = n_entries;
        if (!e->logit_rows || !e->sampled || !e->sample_index || !e->sampled_ids || !e->finished ||
            !e->sample_params || !e->stop || !e->logits)
            goto oom;
    }
    return GY_OK;
oom:
    e->cap_tokens = e->cap_entries = 0;
    return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a step's batch");
}

/* One rank's block tables for the batch, in entry order. */
static gy_status gy_engine_rank_tables(gy_engine_rank_state *rs, const gy_sched_batch *b) {
    int64_t n_blocks = 0;
    for (int64_t i = 0; i < b->n_entries; i++) {
        const int64_t seq = gy_sched_kv_adapter_seq(rs->adapter, b->entries[i].id);
        if (seq < 0) return GY_FAIL(GY_ERR_STATE, "request %lld is scheduled without KV", (long long)b->entries[i].id);
        n_blocks += gy_kv_seq_n_blocks(rs->r.kv, seq);
    }
    if (b->n_entries + 1 > rs->cap_entries) {
        free(rs->bt_indptr);
        rs->bt_indptr = malloc((size_t)(b->n_entries + 1) * sizeof(int32_t));
        rs->cap_entries = rs->bt_indptr ? b->n_entries + 1 : 0;
    }
    if (n_blocks > rs->cap_blocks || rs->bt_indices == NULL) {
        free(rs->bt_indices);
        rs->bt_indices = malloc((size_t)(n_blocks > 0 ? n_blocks : 1) * sizeof(int32_t));
        rs->cap_blocks = rs->bt_indices ? n_blocks : 0;
    }
    if (rs->bt_indptr == NULL || rs->bt_indices == NULL)
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for block tables");
    int64_t blocks = 0;
    rs->bt_indptr[0] = 0;
    for (int64_t i = 0; i < b->n_entries; i++) {
        const int64_t seq = gy_sched_kv_adapter_seq(rs->adapter, b->entries[i].id);
        const int64_t nb = gy_kv_seq_n_blocks(rs->r.kv, seq);
        memcpy(rs->bt_indices + blocks, gy_kv_seq_blocks(rs->r.kv, seq), (size_t)nb * sizeof(int32_t));
        blocks += nb;
        rs->bt_indptr[i + 1] = (int32_t)blocks;
    }
    return GY_OK;
}

/* Gathers the tokens and positions, and every rank's block tables and batch. */
static gy_status gy_engine_build(gy_engine *e, const gy_sched_batch *b, int64_t *n_logits) {
    GY_TRY(gy_engine_scratch(e, b->n_tokens, b->n_entries));
    int64_t t = 0, rows = 0;
    for (int64_t i = 0; i < b->n_entries; i++) {
        const gy_sched_entry *en = &b->entries[i];
        const gy_engine_request *r = gy_engine_find(e, en->id);
        if (r == NULL || en->pos + en->n_tokens > r->n_tokens)
            return GY_FAIL(GY_ERR_STATE, "request %lld: scheduled tokens it does not have", (long long)en->id);
        for (int64_t j = 0; j < en->n_tokens; j++, t++) {
            e->tokens[t] = r->tokens[en->pos + j];
            e->token_seq[t] = (int32_t)i;
            e->token_pos[t] = (int32_t)(en->pos + j);
        }
        if (en->samples) {
            e->logit_rows[rows] = (int32_t)(t - 1);
            e->sample_params[rows] = r->params.sampler;
            e->sample_index[rows] = en->sample_index;
            e->sampled_ids[rows] = en->id;
            rows++;
        }
    }
    for (int32_t i = 0; i < e->n_ranks; i++) {
        gy_engine_rank_state *rs = &e->ranks[i];
        GY_TRY(gy_engine_rank_tables(rs, b));
        rs->batch = (gy_forward_batch){
            .tokens = e->tokens,
            .paged = {.n_tokens = b->n_tokens, .token_seq = e->token_seq, .token_pos = e->token_pos,
                      .n_seqs = b->n_entries, .bt_indptr = rs->bt_indptr, .bt_indices = rs->bt_indices},
            .n_logits = i == 0 ? rows : 0,
            .logit_rows = e->logit_rows,
        };
    }
    *n_logits = rows;
    return GY_OK;
}

static int gy_engine_is_stop(const gy_engine_request *r, int32_t token) {
    for (int64_t i = 0; i < r->params.n_stop_tokens; i++)
        if (r->stop_tokens[i] == token) return 1;
    return 0;
}

gy_status gy_engine_step(gy_engine *e, double now, gy_engine_step_out *out) {
    if (e == NULL || out == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    memset(out, 0, sizeof *out);
    gy_sched_batch b;
    GY_TRY(gy_sched_schedule(e->sched, now, &b));
    int64_t n_logits = 0;
    gy_status s = b.n_entries > 0 ? gy_engine_build(e, &b, &n_logits) : GY_OK;
    if (s == GY_OK && b.n_entries > 0) {
        s = gy_engine_forward_all(e);
        if (s == GY_OK && n_logits > 0)
            s = gy_sampler_sample_batch(e->sampled, e->logits, n_logits, e->model->vocab,
                                        e->sample_params, e->sample_index);
    }
    if (s != GY_OK) {
        /* The step did not happen: an empty commit keeps the scheduler consistent. */
        gy_sched_done none;
        gy_sched_commit(e->sched, now, NULL, 0, &none);
        return s;
    }
    /* Append the sampled tokens and decide which requests stop. */
    int64_t row = 0;
    for (int64_t i = 0; i < b.n_entries; i++) {
        e->stop[i] = 0;
        if (!b.entries[i].samples) continue;
        gy_engine_request *r = gy_engine_find(e, b.entries[i].id);
        const int32_t token = e->sampled[row++];
        /* A recomputed request already has this token: sampling is keyed by (seed, index), so
         * it drew the same one again; keep the list as it is. */
        const int64_t index = r->prompt_len + b.entries[i].sample_index;
        if (index == r->n_tokens && r->n_tokens < r->capacity) r->tokens[r->n_tokens++] = token;
        e->stop[i] = (uint8_t)gy_engine_is_stop(r, token);
    }
    gy_sched_done done;
    GY_TRY(gy_sched_commit(e->sched, now, e->stop, b.n_entries, &done));
    memcpy(e->finished, done.finished, (size_t)done.n_finished * sizeof(int64_t));
    if (done.n_finished > 0) {
        /* Give the free tails back; a live NumPy view of a raw-layout layer may refuse, which
         * only delays the shrink to a later step. */
        for (int32_t i = 0; i < e->n_ranks; i++) {
            const int64_t spare = gy_kv_shrinkable_pages(e->ranks[i].r.kv);
            if (spare > 0 && gy_kv_shrink(e->ranks[i].r.kv, spare) != GY_OK) gy_error_clear();
        }
    }
    out->n_tokens = n_logits;
    out->token_ids = e->sampled_ids;
    out->tokens = e->sampled;
    out->n_finished = done.n_finished;
    out->finished = e->finished;
    out->n_batch_tokens = b.n_tokens;
    out->n_preempted = b.n_preempted;
    return GY_OK;
}
