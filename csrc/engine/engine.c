/* engine.c: the serving loop of one instance (one or several TP ranks). */
#include "engine.h"
#include "../core/alloc.h"

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
    char *error;          /* why the engine failed it (finish reason "error"), or NULL */
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
    int stream_borrowed;         /* the communicator's rank runs on this rank's model stream */
} gy_engine_rank_state;

/* A layer-staggered transformation (Gyges 4.3): layers [0, boundary) still run in the old
 * groups, each on the rows of the requests it held before, with the old models and KV caches;
 * their hidden states are gathered and layers [boundary, L) run in this engine's group. */
typedef struct gy_engine_old_rank {
    gy_engine_rank r;            /* the worker's old model and old (owner) KV cache */
    gy_sched_kv_adapter *adapter;
    gy_sched_kv_ops inner;
    gy_forward_ws ws;
    int32_t group, group_rank;
    gy_comm_rank comm_rank;
    int32_t *bt_indptr, *bt_indices;
    int64_t cap_entries, cap_blocks;
    gy_forward_batch batch;
} gy_engine_old_rank;

typedef struct gy_engine_old_group_state {
    gy_engine_old_group g;
    int64_t n_requests;          /* homed here, for placing new requests */
    /* The step's rows of this group: entries, tokens, positions (in the group's own numbering). */
    int64_t cap_tokens, cap_entries;
    int64_t n_entries, n_tokens;
    int64_t *entry_index;        /* (n_entries) index into the step's batch */
    int32_t *rows;               /* (n_tokens) token rows in the step's batch */
    int32_t *tokens, *token_seq, *token_pos;
    int64_t n_logits;            /* groups_last: the group's sampling rows... */
    int32_t *logit_rows;         /* (n_entries) ...in its own rows */
    int64_t *logit_index;        /* (n_entries) ...and their place among the step's logits */
    float *logits;               /* (n_entries, vocab) */
    int64_t cap_logits;
} gy_engine_old_group_state;

typedef struct gy_engine_transition {
    int active;
    int groups_last;             /* scale-down: the groups run layers [boundary, L) instead */
    int64_t boundary;
    int32_t n_groups;
    gy_engine_old_group_state groups[GY_ENGINE_MAX_RANKS];
    gy_engine_old_rank old[GY_ENGINE_MAX_RANKS]; /* indexed by engine rank */
    gy_idmap home;               /* request id -> old group */
    float *x_full;               /* (tokens, hidden) gathered at the boundary */
    int64_t cap_x;
} gy_engine_transition;

struct gy_engine {
    /* Every public call holds it, so callers on several threads take turns (engine.h). */
    pthread_mutex_t api;
    const gy_model *model;       /* rank 0's: the shapes every rank shares */
    int32_t n_ranks;
    int64_t max_running;         /* bounds what one step can change (its undo record) */
    gy_engine_rank_state ranks[GY_ENGINE_MAX_RANKS];
    gy_engine_transition tr;
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
    uint8_t *stop;               /* (entries) gy_sched_end of each entry */
    uint8_t *failed;             /* (entries) the sampling rows whose logits were refused */
    float *logits;
};

static void gy_engine_transition_free(gy_engine *e);

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

static int64_t gy_engine_old_free(const gy_engine_old_rank *o) {
    return o->inner.free_blocks(o->inner.ctx) +
           gy_kv_blocks_if_grown(o->r.kv, gy_engine_growable_pages(o->r.kv));
}

static int64_t gy_engine_free_blocks(void *ctx) {
    gy_engine *e = ctx;
    int64_t least = gy_engine_rank_free(&e->ranks[0]);
    for (int32_t i = 1; i < e->n_ranks; i++) {
        const int64_t f = gy_engine_rank_free(&e->ranks[i]);
        if (f < least) least = f;
    }
    /* While transforming, a request also needs room in the old caches of its group. */
    for (int32_t i = 0; e->tr.active && i < e->n_ranks; i++) {
        const int64_t f = gy_engine_old_free(&e->tr.old[i]);
        if (f < least) least = f;
    }
    return least;
}

/* The old group of a request during a transformation; new requests go to the group with the
 * fewest requests. */
static int32_t gy_engine_home(gy_engine *e, int64_t req) {
    int64_t g;
    if (gy_idmap_get(&e->tr.home, req, &g)) return (int32_t)g;
    int32_t best = 0;
    for (int32_t i = 1; i < e->tr.n_groups; i++)
        if (e->tr.groups[i].n_requests < e->tr.groups[best].n_requests) best = i;
    if (gy_idmap_put(&e->tr.home, req, best) != GY_OK) return -1;
    e->tr.groups[best].n_requests++;
    return best;
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

/* Every adapter of the engine: its ranks', then (while transforming) the old ranks'. */
static int32_t gy_engine_adapters(gy_engine *e, gy_sched_kv_adapter **out) {
    int32_t n = 0;
    for (int32_t i = 0; i < e->n_ranks; i++) out[n++] = e->ranks[i].adapter;
    for (int32_t i = 0; e->tr.active && i < e->n_ranks; i++) out[n++] = e->tr.old[i].adapter;
    return n;
}

static gy_status gy_engine_reserve_all(gy_engine *e, int64_t req, int64_t n_tokens, int64_t need) {
    for (int32_t i = 0; i < e->n_ranks; i++) {
        gy_engine_rank_state *rs = &e->ranks[i];
        GY_TRY(gy_engine_rank_make_room(rs, need));
        GY_TRY(rs->inner.reserve(rs->inner.ctx, req, n_tokens));
    }
    if (e->tr.active) {
        const int32_t g = gy_engine_home(e, req);
        if (g < 0) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
        const gy_engine_old_group *grp = &e->tr.groups[g].g;
        for (int32_t k = 0; k < grp->size; k++) {
            gy_engine_old_rank *o = &e->tr.old[grp->ranks[k]];
            gy_engine_rank_state view = {.r = o->r, .inner = o->inner};
            GY_TRY(gy_engine_rank_make_room(&view, need));
            GY_TRY(o->inner.reserve(o->inner.ctx, req, n_tokens));
        }
    }
    return GY_OK;
}

static gy_status gy_engine_reserve(void *ctx, int64_t req, int64_t n_tokens) {
    gy_engine *e = ctx;
    /* Check every rank before reserving on any, so that a refusal changes nothing. */
    const int64_t need = gy_engine_blocks_needed(e, req, n_tokens);
    if (need > gy_engine_free_blocks(e))
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY, "KV budget exhausted: %lld more blocks needed",
                       (long long)need);
    /* All ranks or none: a failure on one rank takes back what the others reserved (the step's
     * mark is on, gy_engine_step). Pages mapped meanwhile stay, free. */
    gy_sched_kv_adapter *adapters[2 * GY_ENGINE_MAX_RANKS];
    gy_sched_kv_point points[2 * GY_ENGINE_MAX_RANKS];
    const int32_t n = gy_engine_adapters(e, adapters);
    for (int32_t i = 0; i < n; i++) points[i] = gy_sched_kv_adapter_point(adapters[i]);
    const gy_status s = gy_engine_reserve_all(e, req, n_tokens, need);
    if (s != GY_OK)
        for (int32_t i = 0; i < n; i++) gy_sched_kv_adapter_undo_to(adapters[i], points[i]);
    return s;
}

static void gy_engine_release_kv(void *ctx, int64_t req) {
    gy_engine *e = ctx;
    for (int32_t i = 0; i < e->n_ranks; i++) e->ranks[i].inner.release(e->ranks[i].inner.ctx, req);
    int64_t g;
    if (e->tr.active && gy_idmap_get(&e->tr.home, req, &g)) {
        const gy_engine_old_group *grp = &e->tr.groups[g].g;
        for (int32_t k = 0; k < grp->size; k++) {
            gy_engine_old_rank *o = &e->tr.old[grp->ranks[k]];
            o->inner.release(o->inner.ctx, req);
        }
        gy_idmap_remove(&e->tr.home, req);
        e->tr.groups[g].n_requests--;
    }
}

static int64_t gy_engine_capacity_blocks_locked(const gy_engine *e) {
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

/* Layers [0, boundary) in the rank's old group, on that group's rows; every rank then meets at
 * the barrier, and the old groups' rank 0 have put their rows of hidden state into x_full. */
static gy_status gy_engine_old_layers(gy_engine *e, int32_t i) {
    gy_engine_old_rank *o = &e->tr.old[i];
    const gy_engine_old_group_state *gs = &e->tr.groups[o->group];
    if (gs->n_tokens == 0) return GY_OK;
    const gy_tp_group tp = {.rank = o->group_rank, .size = gs->g.size,
                            .all_reduce = gs->g.size > 1 ? gy_comm_rank_all_reduce : NULL,
                            .ctx = &o->comm_rank};
    GY_TRY(gy_forward_begin(o->r.model, &tp, o->r.kv, &o->batch, &o->ws, 1));
    GY_TRY(gy_forward_layers(o->r.model, &tp, o->r.kv, &o->batch, &o->ws, o->r.pool, 0, e->tr.boundary));
    if (o->group_rank == 0) {
        const int64_t hid = e->model->hidden;
        for (int64_t t = 0; t < gs->n_tokens; t++)
            memcpy(e->tr.x_full + (int64_t)gs->rows[t] * hid, o->ws.x + t * hid, (size_t)hid * sizeof(float));
    }
    return GY_OK;
}

/* Scale-down: layers [0, boundary) in this engine's group on every row, then each rank's new
 * group runs [boundary, L) on its own rows and its rank 0 computes their logits. */
static gy_status gy_engine_rank_pass_groups_last(gy_engine *e, int32_t i, const gy_tp_group *tp) {
    gy_engine_rank_state *rs = &e->ranks[i];
    const int64_t b = e->tr.boundary, hid = e->model->hidden;
    if (b > 0) {
        GY_TRY(gy_forward_begin(rs->r.model, tp, rs->r.kv, &rs->batch, &rs->ws, 1));
        GY_TRY(gy_forward_layers(rs->r.model, tp, rs->r.kv, &rs->batch, &rs->ws, rs->r.pool, 0, b));
    }
    gy_engine_old_rank *o = &e->tr.old[i];
    gy_engine_old_group_state *gs = &e->tr.groups[o->group];
    if (gs->n_tokens == 0) return GY_OK;
    const gy_tp_group gtp = {.rank = o->group_rank, .size = gs->g.size,
                             .all_reduce = gs->g.size > 1 ? gy_comm_rank_all_reduce : NULL,
                             .ctx = &o->comm_rank};
    GY_TRY(gy_forward_begin(o->r.model, &gtp, o->r.kv, &o->batch, &o->ws, b == 0));
    if (b > 0)
        for (int64_t t = 0; t < gs->n_tokens; t++)
            memcpy(o->ws.x + t * hid, rs->ws.x + (int64_t)gs->rows[t] * hid, (size_t)hid * sizeof(float));
    GY_TRY(gy_forward_layers(o->r.model, &gtp, o->r.kv, &o->batch, &o->ws, o->r.pool, b,
                             e->model->n_layers));
    if (o->group_rank != 0 || gs->n_logits == 0) return GY_OK;
    GY_TRY(gy_forward_end(gs->logits, o->r.model, &o->batch, &o->ws, o->r.pool));
    const int64_t V = e->model->vocab;
    for (int64_t k = 0; k < gs->n_logits; k++)
        memcpy(e->logits + gs->logit_index[k] * V, gs->logits + k * V, (size_t)V * sizeof(float));
    return GY_OK;
}

static gy_status gy_engine_rank_pass(gy_engine *e, int32_t i) {
    gy_engine_rank_state *rs = &e->ranks[i];
    const gy_tp_group tp = {.rank = i, .size = e->n_ranks,
                            .all_reduce = e->n_ranks > 1 ? gy_comm_rank_all_reduce : NULL,
                            .ctx = &rs->comm_rank,
                            .device_buffers = rs->r.model->backend == GY_MODEL_BACKEND_CUDA};
    if (e->tr.active && e->tr.groups_last && e->tr.boundary < e->model->n_layers)
        return gy_engine_rank_pass_groups_last(e, i, &tp);
    if (!e->tr.active || e->tr.groups_last || e->tr.boundary == 0)
        return gy_forward(i == 0 ? e->logits : NULL, rs->r.model, &tp, rs->r.kv, &rs->batch,
                          &rs->ws, rs->r.pool);
    /* Every rank reaches the barrier, even after a failure, so that none waits forever. */
    gy_status s = gy_engine_old_layers(e, i);
    if (e->n_ranks > 1) gy_comm_barrier(e->comm, i);
    GY_TRY(s);
    const int64_t L = e->model->n_layers;
    GY_TRY(gy_forward_begin(rs->r.model, &tp, rs->r.kv, &rs->batch, &rs->ws, 0));
    memcpy(rs->ws.x, e->tr.x_full, (size_t)(rs->batch.paged.n_tokens * e->model->hidden) * sizeof(float));
    GY_TRY(gy_forward_layers(rs->r.model, &tp, rs->r.kv, &rs->batch, &rs->ws, rs->r.pool,
                             e->tr.boundary, L));
    return i == 0 ? gy_forward_end(e->logits, rs->r.model, &rs->batch, &rs->ws, rs->r.pool) : GY_OK;
}

/* Every communicator a step's forward passes use: the group's, and the old groups' while a
 * layer-staggered transformation runs. */
static int32_t gy_engine_comms(gy_engine *e, gy_comm **out) {
    int32_t n = 0;
    if (e->comm != NULL) out[n++] = e->comm;
    for (int32_t g = 0; e->tr.active && g < e->tr.n_groups; g++)
        if (e->tr.groups[g].g.comm != NULL) out[n++] = e->tr.groups[g].g.comm;
    return n;
}

static void gy_engine_rank_forward(gy_engine *e, int32_t i) {
    gy_engine_rank_state *rs = &e->ranks[i];
    rs->status = gy_engine_rank_pass(e, i);
    if (rs->status == GY_OK) return;
    snprintf(rs->error, sizeof rs->error, "%s", gy_error_message());
    /* Peers waiting for this rank in a collective would wait forever: fail them too. */
    gy_comm *comms[GY_ENGINE_MAX_RANKS + 1];
    const int32_t n = gy_engine_comms(e, comms);
    for (int32_t c = 0; c < n; c++) gy_comm_abort(comms[c], i, rs->error);
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
    /* Every rank is out of its collectives now: an aborted communicator can be used again. */
    gy_comm *comms[GY_ENGINE_MAX_RANKS + 1];
    const int32_t n = gy_engine_comms(e, comms);
    for (int32_t c = 0; c < n; c++) gy_comm_reset(comms[c]);
    /* The first failure, not a peer's report of the abort it caused. */
    int32_t first = -1;
    for (int32_t i = 0; i < e->n_ranks; i++)
        if (e->ranks[i].status != GY_OK &&
            (first < 0 || (strstr(e->ranks[first].error, "was aborted") != NULL &&
                           strstr(e->ranks[i].error, "was aborted") == NULL)))
            first = i;
    if (first >= 0)
        return GY_FAIL(e->ranks[first].status, "rank %d: %s", (int)first, e->ranks[first].error);
    return GY_OK;
}

/* ---- life cycle ---- */

/* The communicator must move the buffers the ranks' forward passes all-reduce: host memory for
 * cpu ranks (shm), device memory of each rank's own GPU for cuda ranks (d2d or nccl). */
static gy_status gy_engine_check_comm(const gy_engine_rank *ranks, int32_t n_ranks,
                                      const gy_comm *comm) {
    const gy_comm_backend_kind kind = gy_comm_backend(comm);
    const char *name = gy_comm_backend_name(kind);
    if (ranks[0].model->backend == GY_MODEL_BACKEND_CPU) {
        if (kind != GY_COMM_BACKEND_SHM)
            return GY_FAIL(GY_ERR_INVALID,
                           "the ranks run on the CPU, whose all-reduce adds host buffers, but the "
                           "communicator is %s (device buffers); CPU ranks need shm",
                           name);
        return GY_OK;
    }
    if (kind == GY_COMM_BACKEND_SHM)
        return GY_FAIL(GY_ERR_INVALID,
                       "tensor parallelism on CUDA needs a device communicator (d2d for virtual "
                       "workers sharing one GPU, nccl for one GPU each) that all-reduces device "
                       "buffers on each worker's stream; shm adds host buffers");
    for (int32_t i = 0; i < n_ranks; i++) {
        const gy_model *m = ranks[i].model;
        if (m->stream == NULL)
            return GY_FAIL(GY_ERR_STATE, "rank %d's model is not attached to a CUDA stream", (int)i);
        if (gy_comm_device(comm, i) != m->device)
            return GY_FAIL(GY_ERR_INVALID,
                           "rank %d's model is on CUDA device %d but the %s communicator's rank %d "
                           "is on device %d",
                           (int)i, (int)m->device, name, (int)i, (int)gy_comm_device(comm, i));
    }
    return GY_OK;
}

/* CUDA ranks: each rank's collectives go on its model's stream, so the all-reduce is ordered
 * between the kernels before and after it with no host wait. Done from the constructing thread
 * before any collective (switching orders the new stream after the old one's work). */
static gy_status gy_engine_borrow_streams(gy_engine *e) {
    if (e->n_ranks == 1 || e->model->backend != GY_MODEL_BACKEND_CUDA) return GY_OK;
    for (int32_t i = 0; i < e->n_ranks; i++) {
        GY_TRY(gy_comm_set_stream(e->comm, i, e->ranks[i].r.model->stream));
        e->ranks[i].stream_borrowed = 1;
    }
    return GY_OK;
}

/* Gives each rank of the communicator its own stream back while the model's still exists (the
 * models outlive the engine; the communicator outlives both). A later engine that took the rank
 * over meanwhile keeps it. */
static void gy_engine_return_streams(gy_engine *e) {
    for (int32_t i = 0; i < e->n_ranks; i++) {
        if (!e->ranks[i].stream_borrowed) continue;
        if (gy_comm_stream(e->comm, i) == (void *)e->ranks[i].r.model->stream &&
            gy_comm_set_stream(e->comm, i, gy_comm_own_stream(e->comm, i)) != GY_OK)
            gy_error_clear();
        e->ranks[i].stream_borrowed = 0;
    }
}

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
    for (int32_t i = 1; i < n_ranks; i++)
        if (ranks[i].model->backend != ranks[0].model->backend)
            return GY_FAIL(GY_ERR_INVALID, "rank %d runs on another backend than rank 0", (int)i);
    if (n_ranks > 1) GY_TRY(gy_engine_check_comm(ranks, n_ranks, comm));
    gy_engine *e = gy_calloc(1, sizeof *e);
    if (e == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    e->model = ranks[0].model;
    e->n_ranks = n_ranks;
    e->max_running = config->max_running;
    e->comm = comm;
    pthread_mutex_init(&e->api, NULL);
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
            .total_blocks = gy_engine_capacity_blocks_locked(e),
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
    if (s == GY_OK) s = gy_engine_borrow_streams(e);
    for (int32_t i = 1; i < n_ranks && s == GY_OK; i++) {
        gy_engine_thread_arg *arg = gy_malloc(sizeof *arg);
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
        char message[512];
        snprintf(message, sizeof message, "%s", gy_error_message());
        gy_engine_free(e);
        return GY_FAIL(s, "%s", message);
    }
    *out = e;
    return GY_OK;
}

static void gy_engine_request_free(gy_engine_request *r) {
    if (r == NULL) return;
    free(r->tokens);
    free(r->stop_tokens);
    free(r->error);
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
    gy_engine_return_streams(e);
    for (int64_t i = 0; i < e->requests.capacity; i++)
        if (e->requests.used[i]) gy_engine_request_free((gy_engine_request *)(intptr_t)e->requests.values[i]);
    gy_idmap_free(&e->requests);
    gy_sched_free(e->sched);
    if (e->tr.active) gy_engine_transition_free(e);
    for (int32_t i = 0; i < e->n_ranks; i++) {
        gy_engine_rank_state *rs = &e->ranks[i];
        gy_sched_kv_adapter_free(rs->adapter);
        gy_forward_ws_free(&rs->ws);
        free(rs->bt_indptr);
        free(rs->bt_indices);
    }
    void *scratch[] = {e->tokens, e->token_seq, e->token_pos, e->logit_rows, e->sampled,
                       e->sample_index, e->sampled_ids, e->finished, e->sample_params, e->stop,
                       e->failed, e->logits};
    for (size_t i = 0; i < sizeof scratch / sizeof scratch[0]; i++) free(scratch[i]);
    pthread_mutex_destroy(&e->api);
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
    gy_engine_request *r = gy_calloc(1, sizeof *r);
    if (r == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    r->id = id;
    r->prompt_len = prompt_len;
    r->params = *p;
    r->capacity = prompt_len + (p->max_new_tokens > 0 ? p->max_new_tokens : 0);
    r->tokens = gy_malloc((size_t)r->capacity * sizeof(int32_t));
    r->stop_tokens = p->n_stop_tokens > 0 ? gy_malloc((size_t)p->n_stop_tokens * sizeof(int32_t)) : NULL;
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

static gy_status gy_engine_add_locked(gy_engine *e, int64_t id, const int32_t *prompt, int64_t prompt_len,
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

static gy_status gy_engine_abort_locked(gy_engine *e, int64_t id) {
    if (gy_engine_find(e, id) == NULL) return GY_FAIL(GY_ERR_STATE, "no request %lld", (long long)id);
    return gy_sched_abort(e->sched, id);
}

static gy_status gy_engine_release_locked(gy_engine *e, int64_t id) {
    gy_engine_request *r = gy_engine_find(e, id);
    if (r == NULL) return GY_FAIL(GY_ERR_STATE, "no request %lld", (long long)id);
    GY_TRY(gy_sched_forget(e->sched, id));
    gy_idmap_remove(&e->requests, id);
    gy_engine_request_free(r);
    return GY_OK;
}

gy_status gy_engine_info(gy_engine *e, int64_t id, gy_sched_info *out, char *error, size_t error_size) {
    if (e == NULL || out == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_sched_info_get(e->sched, id, out);
    const gy_engine_request *r = gy_engine_find(e, id);
    if (error != NULL && error_size > 0)
        snprintf(error, error_size, "%s", s == GY_OK && r != NULL && r->error ? r->error : "");
    pthread_mutex_unlock(&e->api);
    return s;
}

void gy_engine_stats(gy_engine *e, gy_sched_stats *out) {
    pthread_mutex_lock(&e->api);
    gy_sched_stats_get(e->sched, out);
    pthread_mutex_unlock(&e->api);
}

/* ---- layer-staggered transformation ---- */

static void gy_engine_transition_free(gy_engine *e) {
    for (int32_t i = 0; i < e->n_ranks; i++) {
        gy_engine_old_rank *o = &e->tr.old[i];
        gy_sched_kv_adapter_free(o->adapter);
        gy_forward_ws_free(&o->ws);
        free(o->bt_indptr);
        free(o->bt_indices);
    }
    for (int32_t g = 0; g < e->tr.n_groups; g++) {
        gy_engine_old_group_state *gs = &e->tr.groups[g];
        free(gs->entry_index); free(gs->rows); free(gs->tokens); free(gs->token_seq); free(gs->token_pos);
        free(gs->logit_rows); free(gs->logit_index); free(gs->logits);
    }
    gy_idmap_free(&e->tr.home);
    free(e->tr.x_full);
    memset(&e->tr, 0, sizeof e->tr);
}

static gy_status gy_engine_transition_begin_locked(gy_engine *e, const gy_engine_rank *old_ranks,
                                     const gy_engine_old_group *groups, int32_t n_groups,
                                     int groups_last) {
    if (e == NULL || old_ranks == NULL || groups == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_engine_transition_begin: NULL argument");
    if (e->tr.active) return GY_FAIL(GY_ERR_BUSY, "a transformation is already under way");
    if (n_groups < 1 || n_groups > e->n_ranks)
        return GY_FAIL(GY_ERR_INVALID, "%d old groups for %d ranks", (int)n_groups, (int)e->n_ranks);
    int seen[GY_ENGINE_MAX_RANKS] = {0};
    for (int32_t g = 0; g < n_groups; g++) {
        if (groups[g].size < 1 || (groups[g].size > 1 && groups[g].comm == NULL))
            return GY_FAIL(GY_ERR_INVALID, "old group %d needs a size and a communicator", (int)g);
        for (int32_t k = 0; k < groups[g].size; k++) {
            const int32_t r = groups[g].ranks[k];
            if (r < 0 || r >= e->n_ranks || seen[r]++)
                return GY_FAIL(GY_ERR_INVALID, "old groups must cover every rank once (rank %d)", (int)r);
        }
    }
    for (int32_t i = 0; i < e->n_ranks; i++)
        if (!seen[i] || old_ranks[i].model == NULL || old_ranks[i].kv == NULL)
            return GY_FAIL(GY_ERR_INVALID, "rank %d has no old group, model or KV cache", (int)i);
    /* The boundary's hidden states are gathered in host memory between the two passes. */
    for (int32_t i = 0; i < e->n_ranks; i++)
        if (e->ranks[i].r.model->backend != GY_MODEL_BACKEND_CPU ||
            old_ranks[i].model->backend != GY_MODEL_BACKEND_CPU)
            return GY_FAIL(GY_ERR_UNAVAILABLE,
                           "layer-staggered transformations run on the CPU backend only");
    memset(&e->tr, 0, sizeof e->tr);
    e->tr.n_groups = n_groups;
    for (int32_t g = 0; g < n_groups; g++) {
        e->tr.groups[g].g = groups[g];
        for (int32_t k = 0; k < groups[g].size; k++) {
            gy_engine_old_rank *o = &e->tr.old[groups[g].ranks[k]];
            o->group = g;
            o->group_rank = k;
            o->comm_rank = (gy_comm_rank){.comm = groups[g].comm, .rank = k};
        }
    }
    gy_status s = GY_OK;
    for (int32_t i = 0; i < e->n_ranks && s == GY_OK; i++) {
        gy_engine_old_rank *o = &e->tr.old[i];
        o->r = old_ranks[i];
        s = gy_sched_kv_adapter_init(&o->adapter, o->r.kv);
        if (s == GY_OK) o->inner = gy_sched_kv_adapter_ops(o->adapter);
    }
    if (s != GY_OK) {
        gy_engine_transition_free(e);
        return s;
    }
    e->tr.boundary = e->model->n_layers;
    e->tr.groups_last = groups_last != 0;
    e->tr.active = 1;
    return GY_OK;
}

static gy_status gy_engine_transition_adopt_locked(gy_engine *e, int64_t id, int32_t group, const int64_t *old_seqs) {
    if (!e->tr.active) return GY_FAIL(GY_ERR_STATE, "no transformation is under way");
    if (group < 0 || group >= e->tr.n_groups)
        return GY_FAIL(GY_ERR_INVALID, "old group %d does not exist", (int)group);
    if (gy_engine_find(e, id) == NULL) return GY_FAIL(GY_ERR_STATE, "no request %lld", (long long)id);
    const gy_engine_old_group *grp = &e->tr.groups[group].g;
    for (int32_t k = 0; k < grp->size; k++)
        if (old_seqs[k] >= 0)
            GY_TRY(gy_sched_kv_adapter_adopt(e->tr.old[grp->ranks[k]].adapter, id, old_seqs[k]));
    GY_TRY(gy_idmap_put(&e->tr.home, id, group));
    e->tr.groups[group].n_requests++;
    return GY_OK;
}

static gy_status gy_engine_transition_set_boundary_locked(gy_engine *e, int64_t boundary) {
    if (!e->tr.active) return GY_FAIL(GY_ERR_STATE, "no transformation is under way");
    if (boundary < 0 || boundary > e->tr.boundary)
        return GY_FAIL(GY_ERR_INVALID, "the boundary only moves down, from %lld (got %lld)",
                       (long long)e->tr.boundary, (long long)boundary);
    e->tr.boundary = boundary;
    return GY_OK;
}

static gy_status gy_engine_transition_seq_locked(const gy_engine *e, int64_t id, int32_t rank, int32_t *group,
                                   int64_t *seq) {
    if (!e->tr.active) return GY_FAIL(GY_ERR_STATE, "no transformation is under way");
    if (rank < 0 || rank >= e->n_ranks) return GY_FAIL(GY_ERR_INVALID, "rank %d out of range", (int)rank);
    int64_t g;
    *group = gy_idmap_get(&e->tr.home, id, &g) ? (int32_t)g : -1;
    *seq = gy_sched_kv_adapter_seq(e->tr.old[rank].adapter, id);
    return GY_OK;
}

static void gy_engine_transition_detach_locked(gy_engine *e) {
    for (int32_t i = 0; e->tr.active && i < e->n_ranks; i++)
        gy_sched_kv_adapter_detach_all(e->tr.old[i].adapter);
}

static gy_status gy_engine_transition_end_locked(gy_engine *e) {
    if (!e->tr.active) return GY_FAIL(GY_ERR_STATE, "no transformation is under way");
    if (e->tr.boundary != 0)
        return GY_FAIL(GY_ERR_STATE, "layers [0, %lld) have not moved yet", (long long)e->tr.boundary);
    gy_engine_transition_free(e); /* the adapters free the old sequences */
    return GY_OK;
}

int64_t gy_engine_transition_boundary(const gy_engine *e) {
    pthread_mutex_lock((pthread_mutex_t *)&e->api);
    const int64_t b = e->tr.active ? e->tr.boundary : -1;
    pthread_mutex_unlock((pthread_mutex_t *)&e->api);
    return b;
}
int32_t gy_engine_n_ranks(const gy_engine *e) { return e->n_ranks; }

static void gy_engine_detach_kv_locked(gy_engine *e) {
    for (int32_t i = 0; i < e->n_ranks; i++) gy_sched_kv_adapter_detach_all(e->ranks[i].adapter);
}

/* ---- moving requests between instances ---- */

static int64_t gy_engine_request_ids_locked(const gy_engine *e, int64_t *ids, int64_t capacity) {
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

static gy_status gy_engine_request_get_locked(const gy_engine *e, int64_t id, gy_engine_request_view *out) {
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

static gy_status gy_engine_adopt_locked(gy_engine *e, int64_t id, const int32_t *tokens, int64_t n_tokens,
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
        e->tokens = gy_malloc((size_t)n_tokens * sizeof(int32_t));
        e->token_seq = gy_malloc((size_t)n_tokens * sizeof(int32_t));
        e->token_pos = gy_malloc((size_t)n_tokens * sizeof(int32_t));
        e->cap_tokens = n_tokens;
        if (!e->tokens || !e->token_seq || !e->token_pos) goto oom;
    }
    if (n_entries > e->cap_entries) {
        free(e->logit_rows); free(e->sampled); free(e->sample_index); free(e->sampled_ids);
        free(e->finished); free(e->sample_params); free(e->stop); free(e->failed); free(e->logits);
        e->logit_rows = gy_malloc((size_t)n_entries * sizeof(int32_t));
        e->sampled = gy_malloc((size_t)n_entries * sizeof(int32_t));
        e->sample_index = gy_malloc((size_t)n_entries * sizeof(int64_t));
        e->sampled_ids = gy_malloc((size_t)n_entries * sizeof(int64_t));
        e->finished = gy_malloc((size_t)n_entries * sizeof(int64_t));
        e->sample_params = gy_malloc((size_t)n_entries * sizeof(gy_sampler_params));
        e->stop = gy_malloc((size_t)n_entries);
        e->failed = gy_malloc((size_t)n_entries);
        e->logits = gy_malloc((size_t)(n_entries * e->model->vocab) * sizeof(float));
        e->cap_entries = n_entries;
        if (!e->logit_rows || !e->sampled || !e->sample_index || !e->sampled_ids || !e->finished ||
            !e->sample_params || !e->stop || !e->failed || !e->logits)
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
        rs->bt_indptr = gy_malloc((size_t)(b->n_entries + 1) * sizeof(int32_t));
        rs->cap_entries = rs->bt_indptr ? b->n_entries + 1 : 0;
    }
    if (n_blocks > rs->cap_blocks || rs->bt_indices == NULL) {
        free(rs->bt_indices);
        rs->bt_indices = gy_malloc((size_t)(n_blocks > 0 ? n_blocks : 1) * sizeof(int32_t));
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

/* The rows of each old group and its ranks' old block tables (during a transformation). */
static gy_status gy_engine_build_old(gy_engine *e, const gy_sched_batch *b, int64_t n_tokens) {
    const int64_t hid = e->model->hidden;
    if (n_tokens > e->tr.cap_x) {
        free(e->tr.x_full);
        e->tr.x_full = gy_malloc((size_t)(n_tokens * hid) * sizeof(float));
        e->tr.cap_x = e->tr.x_full ? n_tokens : 0;
        if (e->tr.x_full == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    }
    for (int32_t g = 0; g < e->tr.n_groups; g++) {
        gy_engine_old_group_state *gs = &e->tr.groups[g];
        if (b->n_entries > gs->cap_entries) {
            free(gs->entry_index);
            gs->entry_index = gy_malloc((size_t)b->n_entries * sizeof(int64_t));
            gs->cap_entries = gs->entry_index ? b->n_entries : 0;
        }
        if (n_tokens > gs->cap_tokens) {
            free(gs->rows); free(gs->tokens); free(gs->token_seq); free(gs->token_pos);
            gs->rows = gy_malloc((size_t)n_tokens * sizeof(int32_t));
            gs->tokens = gy_malloc((size_t)n_tokens * sizeof(int32_t));
            gs->token_seq = gy_malloc((size_t)n_tokens * sizeof(int32_t));
            gs->token_pos = gy_malloc((size_t)n_tokens * sizeof(int32_t));
            gs->cap_tokens = (gs->rows && gs->tokens && gs->token_seq && gs->token_pos) ? n_tokens : 0;
        }
        if (b->n_entries > gs->cap_logits) {
            free(gs->logit_rows); free(gs->logit_index); free(gs->logits);
            gs->logit_rows = gy_malloc((size_t)b->n_entries * sizeof(int32_t));
            gs->logit_index = gy_malloc((size_t)b->n_entries * sizeof(int64_t));
            gs->logits = gy_malloc((size_t)(b->n_entries * e->model->vocab) * sizeof(float));
            gs->cap_logits = (gs->logit_rows && gs->logit_index && gs->logits) ? b->n_entries : 0;
        }
        if (gs->cap_entries < b->n_entries || gs->cap_tokens < n_tokens || gs->cap_logits < b->n_entries)
            return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a group's rows");
        gs->n_entries = gs->n_tokens = gs->n_logits = 0;
    }
    int64_t row = 0, sample = 0;
    for (int64_t i = 0; i < b->n_entries; i++) {
        const gy_sched_entry *en = &b->entries[i];
        const int32_t g = gy_engine_home(e, en->id);
        if (g < 0) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
        gy_engine_old_group_state *gs = &e->tr.groups[g];
        const int32_t local = (int32_t)gs->n_entries;
        gs->entry_index[gs->n_entries++] = i;
        for (int64_t j = 0; j < en->n_tokens; j++, row++) {
            gs->rows[gs->n_tokens] = (int32_t)row;
            gs->tokens[gs->n_tokens] = e->tokens[row];
            gs->token_seq[gs->n_tokens] = local;
            gs->token_pos[gs->n_tokens] = e->token_pos[row];
            gs->n_tokens++;
        }
        if (en->samples) {
            gs->logit_rows[gs->n_logits] = (int32_t)(gs->n_tokens - 1);
            gs->logit_index[gs->n_logits] = sample++;
            gs->n_logits++;
        }
    }
    for (int32_t i = 0; i < e->n_ranks; i++) {
        gy_engine_old_rank *o = &e->tr.old[i];
        gy_engine_old_group_state *gs = &e->tr.groups[o->group];
        int64_t n_blocks = 0;
        for (int64_t k = 0; k < gs->n_entries; k++) {
            const int64_t seq = gy_sched_kv_adapter_seq(o->adapter, b->entries[gs->entry_index[k]].id);
            if (seq < 0) return GY_FAIL(GY_ERR_STATE, "request %lld has no KV in its old group",
                                        (long long)b->entries[gs->entry_index[k]].id);
            n_blocks += gy_kv_seq_n_blocks(o->r.kv, seq);
        }
        if (gs->n_entries + 1 > o->cap_entries) {
            free(o->bt_indptr);
            o->bt_indptr = gy_malloc((size_t)(gs->n_entries + 1) * sizeof(int32_t));
            o->cap_entries = o->bt_indptr ? gs->n_entries + 1 : 0;
        }
        if (n_blocks > o->cap_blocks || o->bt_indices == NULL) {
            free(o->bt_indices);
            o->bt_indices = gy_malloc((size_t)(n_blocks > 0 ? n_blocks : 1) * sizeof(int32_t));
            o->cap_blocks = o->bt_indices ? n_blocks : 0;
        }
        if (o->bt_indptr == NULL || o->bt_indices == NULL)
            return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for block tables");
        int64_t blocks = 0;
        o->bt_indptr[0] = 0;
        for (int64_t k = 0; k < gs->n_entries; k++) {
            const int64_t seq = gy_sched_kv_adapter_seq(o->adapter, b->entries[gs->entry_index[k]].id);
            const int64_t nb = gy_kv_seq_n_blocks(o->r.kv, seq);
            memcpy(o->bt_indices + blocks, gy_kv_seq_blocks(o->r.kv, seq), (size_t)nb * sizeof(int32_t));
            blocks += nb;
            o->bt_indptr[k + 1] = (int32_t)blocks;
        }
        o->batch = (gy_forward_batch){
            .tokens = gs->tokens,
            .paged = {.n_tokens = gs->n_tokens, .token_seq = gs->token_seq, .token_pos = gs->token_pos,
                      .n_seqs = gs->n_entries, .bt_indptr = o->bt_indptr, .bt_indices = o->bt_indices},
            .n_logits = e->tr.groups_last && o->group_rank == 0 ? gs->n_logits : 0,
            .logit_rows = gs->logit_rows,
        };
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
    if (e->tr.active && (e->tr.groups_last ? e->tr.boundary < e->model->n_layers : e->tr.boundary > 0))
        GY_TRY(gy_engine_build_old(e, b, t));
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

/* ---- the step's undo (a step that fails takes everything back) ---- */

/* Marks every KV adapter and remembers each cache's pages, so that a failed step can take back
 * what its scheduler reserved and released, and unmap what it grew. */
static gy_status gy_engine_mark(gy_engine *e, int64_t *pages) {
    gy_sched_kv_adapter *adapters[2 * GY_ENGINE_MAX_RANKS];
    const int32_t n = gy_engine_adapters(e, adapters);
    for (int32_t i = 0; i < n; i++) {
        /* A step touches at most max_running requests, each reserved and released once. */
        const gy_status st = gy_sched_kv_adapter_mark(adapters[i], 2 * e->max_running + 4);
        if (st != GY_OK) {
            for (int32_t j = 0; j < i; j++) gy_sched_kv_adapter_unmark(adapters[j]);
            return st;
        }
    }
    for (int32_t i = 0; i < e->n_ranks; i++) {
        gy_kv_stats ks;
        gy_kv_stats_get(e->ranks[i].r.kv, &ks);
        pages[i] = ks.pages_per_layer;
    }
    return GY_OK;
}

static void gy_engine_unmark(gy_engine *e) {
    gy_sched_kv_adapter *adapters[2 * GY_ENGINE_MAX_RANKS];
    const int32_t n = gy_engine_adapters(e, adapters);
    for (int32_t i = 0; i < n; i++) gy_sched_kv_adapter_unmark(adapters[i]);
}

/* Back to the mark; pages grown since go back too where nothing holds them (a live view of a
 * raw layer, or a transformation's shared pages, keep them: free blocks, no request changed). */
static void gy_engine_undo(gy_engine *e, const int64_t *pages) {
    gy_sched_kv_adapter *adapters[2 * GY_ENGINE_MAX_RANKS];
    const int32_t n = gy_engine_adapters(e, adapters);
    for (int32_t i = n - 1; i >= 0; i--) gy_sched_kv_adapter_undo(adapters[i]);
    for (int32_t i = 0; i < e->n_ranks; i++) {
        gy_kv_stats ks;
        gy_kv_stats_get(e->ranks[i].r.kv, &ks);
        if (ks.pages_per_layer > pages[i] && gy_kv_shrink(e->ranks[i].r.kv, ks.pages_per_layer - pages[i]) != GY_OK)
            gy_error_clear();
    }
}

/* ---- sampling ---- */

/* Samples every row; a row the sampler refuses (its logits are NaN or +inf: the weights or the
 * activations overflowed) fails its request alone: ends[row] = GY_SCHED_END_FAIL and the reason
 * is kept on the request. */
static gy_status gy_engine_sample(gy_engine *e, int64_t n_logits, uint8_t *failed) {
    memset(failed, 0, (size_t)n_logits);
    const int64_t V = e->model->vocab;
    if (gy_sampler_sample_batch(e->sampled, e->logits, n_logits, V, e->sample_params,
                                e->sample_index) == GY_OK)
        return GY_OK;
    for (int64_t row = 0; row < n_logits; row++) {
        if (gy_sampler_sample(&e->sampled[row], e->logits + row * V, V, &e->sample_params[row],
                              e->sample_index[row]) == GY_OK)
            continue;
        gy_engine_request *r = gy_engine_find(e, e->sampled_ids[row]);
        char *why = gy_malloc(strlen(gy_error_message()) + 1);
        if (why == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
        strcpy(why, gy_error_message());
        free(r->error);
        r->error = why;
        failed[row] = 1;
    }
    return GY_OK;
}

/* ---- one step ---- */

/* Everything but the commit; any failure leaves the step for the caller to cancel. */
static gy_status gy_engine_run(gy_engine *e, const gy_sched_batch *b, int64_t *n_logits) {
    if (b->n_entries == 0) return GY_OK;
    GY_TRY(gy_engine_build(e, b, n_logits));
    GY_TRY(gy_engine_forward_all(e));
    return *n_logits > 0 ? gy_engine_sample(e, *n_logits, e->failed) : GY_OK;
}

static gy_status gy_engine_step_locked(gy_engine *e, double now, gy_engine_step_out *out) {
    memset(out, 0, sizeof *out);
    int64_t pages[GY_ENGINE_MAX_RANKS];
    GY_TRY(gy_engine_mark(e, pages));
    gy_sched_batch b;
    gy_status s = gy_sched_schedule(e->sched, now, &b);
    if (s != GY_OK) { /* the scheduler took its own changes back */
        char message[512];
        snprintf(message, sizeof message, "%s", gy_error_message());
        gy_engine_undo(e, pages);
        return GY_FAIL(s, "%s", message);
    }
    int64_t n_logits = 0;
    s = gy_engine_run(e, &b, &n_logits);
    if (s != GY_OK) {
        /* The step did not happen: the scheduler and the caches go back to before it, so the
         * next step tries the same again. */
        char message[512];
        snprintf(message, sizeof message, "%s", gy_error_message());
        gy_sched_cancel(e->sched);
        gy_engine_undo(e, pages);
        return GY_FAIL(s, "%s", message);
    }
    gy_engine_unmark(e);
    /* Append the sampled tokens and decide which requests stop or fail. */
    int64_t row = 0;
    for (int64_t i = 0; i < b.n_entries; i++) {
        e->stop[i] = GY_SCHED_END_NONE;
        if (!b.entries[i].samples) continue;
        gy_engine_request *r = gy_engine_find(e, b.entries[i].id);
        const int failed = e->failed[row];
        const int32_t token = e->sampled[row++];
        if (failed) {
            e->stop[i] = GY_SCHED_END_FAIL;
            continue;
        }
        /* A recomputed request already has this token: sampling is keyed by (seed, index), so
         * it drew the same one again; keep the list as it is. */
        const int64_t index = r->prompt_len + b.entries[i].sample_index;
        if (index == r->n_tokens && r->n_tokens < r->capacity) r->tokens[r->n_tokens++] = token;
        if (gy_engine_is_stop(r, token)) e->stop[i] = GY_SCHED_END_STOP;
    }
    gy_sched_done done;
    GY_TRY(gy_sched_commit(e->sched, now, e->stop, b.n_entries, &done));
    /* Only the tokens of requests that did not fail are reported. */
    int64_t n_out = 0;
    for (int64_t k = 0; k < n_logits; k++)
        if (!e->failed[k]) {
            e->sampled_ids[n_out] = e->sampled_ids[k];
            e->sampled[n_out++] = e->sampled[k];
        }
    memcpy(e->finished, done.finished, (size_t)done.n_finished * sizeof(int64_t));
    if (done.n_finished > 0) {
        /* Give the free tails back; a live NumPy view of a raw-layout layer may refuse, which
         * only delays the shrink to a later step. */
        for (int32_t i = 0; i < e->n_ranks; i++) {
            const int64_t spare = gy_kv_shrinkable_pages(e->ranks[i].r.kv);
            if (spare > 0 && gy_kv_shrink(e->ranks[i].r.kv, spare) != GY_OK) gy_error_clear();
        }
    }
    out->n_tokens = n_out;
    out->token_ids = e->sampled_ids;
    out->tokens = e->sampled;
    out->n_finished = done.n_finished;
    out->finished = e->finished;
    out->n_batch_tokens = b.n_tokens;
    out->n_preempted = b.n_preempted;
    return GY_OK;
}

gy_status gy_engine_step(gy_engine *e, double now, gy_engine_step_out *out) {
    if (e == NULL || out == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_step_locked(e, now, out);
    pthread_mutex_unlock(&e->api);
    return s;
}

/* ---- the public calls: each holds the engine's lock (engine.h) ---- */

gy_status gy_engine_add(gy_engine *e, int64_t id, const int32_t *prompt, int64_t prompt_len,
                        const gy_engine_params *p, double arrival) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_add_locked(e, id, prompt, prompt_len, p, arrival);
    pthread_mutex_unlock(&e->api);
    return s;
}

gy_status gy_engine_abort(gy_engine *e, int64_t id) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_abort_locked(e, id);
    pthread_mutex_unlock(&e->api);
    return s;
}

gy_status gy_engine_release(gy_engine *e, int64_t id) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_release_locked(e, id);
    pthread_mutex_unlock(&e->api);
    return s;
}

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

gy_status gy_engine_transition_end(gy_engine *e) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_transition_end_locked(e);
    pthread_mutex_unlock(&e->api);
    return s;
}

void gy_engine_detach_kv(gy_engine *e) {
    if (e == NULL) return;
    pthread_mutex_lock(&e->api);
    gy_engine_detach_kv_locked(e);
    pthread_mutex_unlock(&e->api);
}

int64_t gy_engine_request_ids(const gy_engine *e, int64_t *ids, int64_t capacity) {
    pthread_mutex_lock(&((gy_engine *)e)->api);
    const int64_t n = gy_engine_request_ids_locked(e, ids, capacity);
    pthread_mutex_unlock(&((gy_engine *)e)->api);
    return n;
}

gy_status gy_engine_request_get(const gy_engine *e, int64_t id, gy_engine_request_view *out) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&((gy_engine *)e)->api);
    const gy_status s = gy_engine_request_get_locked(e, id, out);
    pthread_mutex_unlock(&((gy_engine *)e)->api);
    return s;
}

gy_status gy_engine_adopt(gy_engine *e, int64_t id, const int32_t *tokens, int64_t n_tokens,
                          int64_t prompt_len, const gy_engine_params *params,
                          const gy_sched_info *info, const int64_t *seqs) {
    if (e == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL engine");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_adopt_locked(e, id, tokens, n_tokens, prompt_len, params, info, seqs);
    pthread_mutex_unlock(&e->api);
    return s;
}

int64_t gy_engine_capacity_blocks(const gy_engine *e) {
    pthread_mutex_lock(&((gy_engine *)e)->api);
    const int64_t n = gy_engine_capacity_blocks_locked(e);
    pthread_mutex_unlock(&((gy_engine *)e)->api);
    return n;
}
