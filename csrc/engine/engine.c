/* engine.c: the serving loop of one instance: its requests and its step. What the instance runs
 * is its plan, a list of stages (stage.h); the ranks of each stage run on a crew of threads
 * (rank_threads.h). The engine's other jobs work on the same struct (engine_impl.h), each in its
 * own file: the layer-staggered transformation (transition.c), PipeLive's re-split
 * (resplit.c), KunServe's remote attention (remote.c) and handing requests over to other
 * engines (handover.c). */
#include "engine_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../comm/comm.h"
#include "../core/alloc.h"

gy_stage *gy_engine_main(gy_engine *e) { return &e->stages[e->main]; }

/* ---- KV on demand, on every rank of the plan ---- */

/* The ranks that hold request `req`'s KV in stage `st`: the whole stage with one group, the
 * request's home group with several. */
static gy_stage_group *gy_engine_group_of(gy_stage *st, int64_t req) {
    const int32_t g = gy_stage_home(st, req);
    return g < 0 ? NULL : &st->groups[g];
}

static int64_t gy_engine_free_blocks(void *ctx) {
    gy_engine *e = ctx;
    /* Conservative: every rank, as if each request could land on any of them. */
    int64_t least = INT64_MAX;
    for (int32_t s = 0; s < e->n_stages; s++)
        for (int32_t k = 0; k < e->stages[s].n_ranks; k++) {
            const int64_t f = gy_stage_rank_free_blocks(gy_stage_rank_at(&e->stages[s], k, NULL));
            if (f < least) least = f;
        }
    const int64_t peer = gy_engine_peer_free_blocks(e);
    return peer < least ? peer : least;
}

static int64_t gy_engine_blocks_needed(void *ctx, int64_t req, int64_t n_tokens) {
    gy_engine *e = ctx;
    const gy_stage_rank *rk = &gy_engine_main(e)->groups[0].ranks[0];
    return rk->inner.blocks_needed(rk->inner.ctx, req, n_tokens);
}

/* Every adapter of the plan, stage after stage. */
int32_t gy_engine_adapters(gy_engine *e, gy_sched_kv_adapter **out) {
    int32_t n = 0;
    for (int32_t s = 0; s < e->n_stages; s++)
        for (int32_t k = 0; k < e->stages[s].n_ranks; k++)
            out[n++] = gy_stage_rank_at(&e->stages[s], k, NULL)->adapter;
    return n;
}

static gy_status gy_engine_reserve_all(gy_engine *e, int64_t req, int64_t n_tokens, int64_t need) {
    for (int32_t s = 0; s < e->n_stages; s++) {
        gy_stage_group *grp = gy_engine_group_of(&e->stages[s], req);
        if (grp == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
        for (int32_t k = 0; k < grp->size; k++) {
            gy_stage_rank *rk = &grp->ranks[k];
            GY_TRY(gy_stage_rank_make_room(rk, need));
            GY_TRY(rk->inner.reserve(rk->inner.ctx, req, n_tokens));
        }
    }
    return GY_OK;
}

gy_status gy_engine_reserve(void *ctx, int64_t req, int64_t n_tokens) {
    gy_engine *e = ctx;
    /* Check every rank before reserving on any, so that a refusal changes nothing. */
    const int64_t need = gy_engine_blocks_needed(e, req, n_tokens);
    if (need > gy_engine_free_blocks(e))
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY, "KV budget exhausted: %lld more blocks needed",
                       (long long)need);
    /* All ranks or none: a failure on one rank takes back what the others reserved (the step's
     * mark is on, gy_engine_step). Pages mapped meanwhile stay, free. */
    gy_sched_kv_adapter *adapters[GY_ENGINE_MAX_ADAPTERS];
    gy_sched_kv_point points[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n = gy_engine_adapters(e, adapters);
    for (int32_t i = 0; i < n; i++) points[i] = gy_sched_kv_adapter_point(adapters[i]);
    const gy_status s = gy_engine_reserve_all(e, req, n_tokens, need);
    if (s != GY_OK)
        for (int32_t i = 0; i < n; i++) gy_sched_kv_adapter_undo_to(adapters[i], points[i]);
    return s;
}

void gy_engine_release_kv(void *ctx, int64_t req) {
    gy_engine *e = ctx;
    if (e->outlet != NULL) gy_engine_peer_released(e, req);
    for (int32_t s = 0; s < e->n_stages; s++) {
        gy_stage *st = &e->stages[s];
        int64_t g = 0;
        if (st->n_groups > 1 && !gy_idmap_get(&st->home, req, &g)) continue; /* never placed */
        for (int32_t k = 0; k < st->groups[g].size; k++)
            st->groups[g].ranks[k].inner.release(st->groups[g].ranks[k].inner.ctx, req);
        gy_stage_unhome(st, req);
    }
}

/* The stage's requests keep their KV where it is, with its new owner (a transformation's old
 * groups, another engine): the adapters forget their sequences without freeing them. */
void gy_engine_detach_stage(gy_stage *st) {
    for (int32_t k = 0; k < st->n_ranks; k++)
        gy_sched_kv_adapter_detach_all(gy_stage_rank_at(st, k, NULL)->adapter);
}

/* Blocks every request could get: the least any owned one-group stage could hold. */
int64_t gy_engine_capacity_blocks_locked(const gy_engine *e) {
    int64_t least = INT64_MAX;
    for (int32_t s = 0; s < e->n_stages; s++) {
        const gy_stage *st = &e->stages[s];
        if (!st->owned || st->n_groups != 1) continue;
        for (int32_t k = 0; k < st->groups[0].size; k++) {
            const int64_t n = gy_stage_rank_capacity_blocks(&st->groups[0].ranks[k]);
            if (n < least) least = n;
        }
    }
    return e->outlet != NULL && e->peer_capacity < least ? e->peer_capacity : least;
}

/* ---- the ranks' forward passes ---- */

/* Every communicator of the plan (a communicator may appear twice: aborting it twice is
 * harmless, and so is resetting it). */
static int32_t gy_engine_comms(gy_engine *e, gy_comm **out) {
    int32_t n = 0;
    for (int32_t s = 0; s < e->n_stages; s++)
        for (int32_t g = 0; g < e->stages[s].n_groups; g++)
            if (e->stages[s].groups[g].comm != NULL) out[n++] = e->stages[s].groups[g].comm;
    return n;
}

/* Thread t's share of a step: rank t of every non-empty stage, in order, meeting the other
 * threads between stages. After a failure the thread does no more work, but still meets the
 * others, and its communicators are aborted so that no peer waits for it in a collective. */
static void gy_engine_thread_step(void *ctx, int32_t t) {
    gy_engine *e = ctx;
    e->status[t] = GY_OK;
    e->error[t][0] = '\0';
    for (int32_t s = 0; s < e->n_stages; s++) {
        gy_stage *st = &e->stages[s];
        if (st->first == st->end) continue;
        if (t < st->n_ranks && !__atomic_load_n(&e->step_failed, __ATOMIC_ACQUIRE)) {
            const gy_status status = gy_stage_run_rank(st, t, &e->rows, s == e->last_stage,
                                                       e->model->hidden, e->model->vocab);
            if (status != GY_OK) {
                e->status[t] = status;
                snprintf(e->error[t], sizeof e->error[t], "%s", gy_error_message());
                __atomic_store_n(&e->step_failed, 1, __ATOMIC_RELEASE);
                gy_comm *comms[GY_ENGINE_MAX_ADAPTERS];
                const int32_t n = gy_engine_comms(e, comms);
                for (int32_t c = 0; c < n; c++) gy_comm_abort(comms[c], t, e->error[t]);
            }
        }
        if (e->n_live_stages > 1) gy_rank_threads_barrier(&e->crew);
    }
}

/* Runs the step's stages on every thread (thread 0 is this one); the first failure wins. */
gy_status gy_engine_forward_all(gy_engine *e) {
    e->step_failed = 0;
    gy_rank_threads_run(&e->crew);
    /* Every rank is out of its collectives now: an aborted communicator can be used again. */
    gy_comm *comms[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n = gy_engine_comms(e, comms);
    for (int32_t c = 0; c < n; c++) gy_comm_reset(comms[c]);
    /* The first failure, not a peer's report of the abort it caused. */
    int32_t first = -1;
    for (int32_t t = 0; t < e->crew.n; t++)
        if (e->status[t] != GY_OK &&
            (first < 0 || (strstr(e->error[first], "was aborted") != NULL &&
                           strstr(e->error[t], "was aborted") == NULL)))
            first = t;
    if (first >= 0)
        return GY_FAIL(e->status[first], "rank %d: %s", (int)first, e->error[first]);
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
    if (e->model->backend != GY_MODEL_BACKEND_CUDA) return GY_OK;
    for (int32_t s = 0; s < e->n_stages; s++)
        for (int32_t g = 0; g < e->stages[s].n_groups; g++) {
            gy_stage_group *grp = &e->stages[s].groups[g];
            for (int32_t k = 0; grp->size > 1 && k < grp->size; k++) {
                GY_TRY(gy_comm_set_stream(grp->comm, k, grp->ranks[k].r.model->stream));
                grp->ranks[k].stream_borrowed = 1;
            }
        }
    return GY_OK;
}

/* Gives each rank of a communicator its own stream back while the model's still exists (the
 * models outlive the engine; the communicator outlives both). A later engine that took the rank
 * over meanwhile keeps it. */
static void gy_engine_return_streams(gy_engine *e) {
    for (int32_t s = 0; s < e->n_stages; s++)
        for (int32_t g = 0; g < e->stages[s].n_groups; g++) {
            gy_stage_group *grp = &e->stages[s].groups[g];
            for (int32_t k = 0; k < grp->size; k++) {
                gy_stage_rank *rk = &grp->ranks[k];
                if (!rk->stream_borrowed) continue;
                if (gy_comm_stream(grp->comm, k) == (void *)rk->r.model->stream &&
                    gy_comm_set_stream(grp->comm, k, gy_comm_own_stream(grp->comm, k)) != GY_OK)
                    gy_error_clear();
                rk->stream_borrowed = 0;
            }
        }
}

/* What a plan must be before any of it is built: stages covering [0, L) in order, each a TP
 * group of ranks with models of one shape and caches of one block size, each group's
 * communicator fitting its ranks. */
gy_status gy_engine_check_plan(const gy_engine_stage *stages, int32_t n_stages, int64_t first,
                               int64_t end) {
    if (n_stages < 1 || n_stages > GY_ENGINE_MAX_STAGES)
        return GY_FAIL(GY_ERR_INVALID, "a plan has 1 to %d stages, got %d", GY_ENGINE_MAX_STAGES,
                       (int)n_stages);
    for (int32_t s = 0; s < n_stages; s++)
        if (stages[s].size < 1 || stages[s].size > GY_MODEL_MAX_TP || stages[s].ranks == NULL ||
            (stages[s].size > 1 && stages[s].comm == NULL) ||
            (stages[s].comm != NULL && gy_comm_size(stages[s].comm) != stages[s].size))
            return GY_FAIL(GY_ERR_INVALID,
                           "stage %d: an engine of %d ranks needs a communicator of that size",
                           (int)s, (int)stages[s].size);
    for (int32_t s = 0; s < n_stages; s++)
        for (int32_t k = 0; k < stages[s].size; k++)
            if (stages[s].ranks[k].model == NULL || stages[s].ranks[k].kv == NULL)
                return GY_FAIL(GY_ERR_INVALID, "stage %d rank %d has no model or KV cache",
                               (int)s, (int)k);
    const gy_model *m0 = stages[0].ranks[0].model;
    const int64_t block_size = gy_kv_config_of(stages[0].ranks[0].kv)->block_size;
    if (end == 0) end = m0->n_layers;
    if (first < 0 || end > m0->n_layers || first >= end)
        return GY_FAIL(GY_ERR_INVALID, "a plan covers layers [%lld, %lld) of the model's %lld",
                       (long long)first, (long long)end, (long long)m0->n_layers);
    int64_t next = first;
    for (int32_t s = 0; s < n_stages; s++) {
        const gy_engine_stage *st = &stages[s];
        if (st->first_layer != next || st->end_layer <= st->first_layer ||
            st->end_layer > m0->n_layers)
            return GY_FAIL(GY_ERR_INVALID,
                           "stage %d runs layers [%lld, %lld); the stages must cover layers "
                           "[%lld, %lld) in order, each at least one",
                           (int)s, (long long)st->first_layer, (long long)st->end_layer,
                           (long long)first, (long long)end);
        next = st->end_layer;
        for (int32_t k = 0; k < st->size; k++) {
            const gy_model *m = st->ranks[k].model;
            if (m->backend != m0->backend)
                return GY_FAIL(GY_ERR_INVALID, "stage %d rank %d runs on another backend than "
                               "stage 0 rank 0", (int)s, (int)k);
            if (m->n_layers != m0->n_layers || m->hidden != m0->hidden || m->vocab != m0->vocab)
                return GY_FAIL(GY_ERR_INVALID, "stage %d rank %d's model has another shape than "
                               "stage 0 rank 0's", (int)s, (int)k);
            if (m->layer_begin > st->first_layer || m->layer_end < st->end_layer ||
                (s == 0 && first == 0 && !m->has_embed) ||
                (s == n_stages - 1 && end == m0->n_layers && !m->has_head))
                return GY_FAIL(GY_ERR_INVALID, "stage %d rank %d's model holds layers [%lld, %lld)%s%s, "
                               "not all the stage [%lld, %lld) needs", (int)s, (int)k,
                               (long long)m->layer_begin, (long long)m->layer_end,
                               m->has_embed ? ", the embedding" : "", m->has_head ? ", the head" : "",
                               (long long)st->first_layer, (long long)st->end_layer);
            const gy_kv_config *kc = gy_kv_config_of(st->ranks[k].kv);
            if (kc->first_layer > st->first_layer || kc->first_layer + kc->n_layers < st->end_layer)
                return GY_FAIL(GY_ERR_INVALID, "stage %d rank %d's KV cache holds layers [%lld, "
                               "%lld), not the stage's [%lld, %lld)", (int)s, (int)k,
                               (long long)kc->first_layer, (long long)(kc->first_layer + kc->n_layers),
                               (long long)st->first_layer, (long long)st->end_layer);
            if (kc->block_size != block_size)
                return GY_FAIL(GY_ERR_INVALID, "stage %d rank %d's KV blocks hold %lld tokens, "
                               "stage 0's %lld", (int)s, (int)k,
                               (long long)gy_kv_config_of(st->ranks[k].kv)->block_size,
                               (long long)block_size);
        }
        if (st->size > 1) GY_TRY(gy_engine_check_comm(st->ranks, st->size, st->comm));
    }
    if (next != end)
        return GY_FAIL(GY_ERR_INVALID, "the stages end at layer %lld, not %lld", (long long)next,
                       (long long)end);
    return GY_OK;
}

gy_status gy_engine_init_plan(gy_engine **out, const gy_engine_stage *stages, int32_t n_stages,
                              const gy_engine_config *config) {
    if (out == NULL || stages == NULL || config == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_engine_init_plan: NULL argument");
    *out = NULL;
    GY_TRY(gy_engine_check_plan(stages, n_stages, config->first_layer, config->end_layer));
    gy_engine *e = gy_calloc(1, sizeof *e);
    if (e == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    e->model = stages[0].ranks[0].model;
    e->first_layer = config->first_layer;
    e->end_layer = config->end_layer > 0 ? config->end_layer : e->model->n_layers;
    e->transition = -1;
    pthread_mutex_init(&e->api, NULL);
    gy_status s = GY_OK;
    int32_t n_threads = 1;
    for (int32_t i = 0; i < n_stages && s == GY_OK; i++) {
        const gy_stage_group_spec group = {.size = stages[i].size, .ranks = stages[i].ranks,
                                           .comm = stages[i].comm};
        s = gy_stage_init(&e->stages[i], stages[i].first_layer, stages[i].end_layer, &group, 1, 1);
        if (s == GY_OK) e->n_stages = i + 1;
        if (stages[i].size > n_threads) n_threads = stages[i].size;
    }
    const gy_sched_kv_ops ops = {.ctx = e, .free_blocks = gy_engine_free_blocks,
                                 .blocks_needed = gy_engine_blocks_needed,
                                 .reserve = gy_engine_reserve, .release = gy_engine_release_kv};
    if (s == GY_OK) {
        const gy_sched_config sc = {
            .total_blocks = gy_engine_capacity_blocks_locked(e),
            .block_size = gy_kv_config_of(stages[0].ranks[0].kv)->block_size,
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
    if (s == GY_OK) s = gy_rank_threads_start(&e->crew, n_threads, gy_engine_thread_step, e);
    if (s != GY_OK) {
        char message[512];
        snprintf(message, sizeof message, "%s", gy_error_message());
        gy_engine_free(e);
        return GY_FAIL(s, "%s", message);
    }
    *out = e;
    return GY_OK;
}

gy_status gy_engine_init(gy_engine **out, const gy_engine_rank *ranks, int32_t n_ranks,
                         gy_comm *comm, const gy_engine_config *config) {
    if (out == NULL || ranks == NULL || config == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_engine_init: NULL argument");
    *out = NULL;
    if (n_ranks < 1 || n_ranks > GY_MODEL_MAX_TP || (n_ranks > 1 && comm == NULL) ||
        (comm != NULL && gy_comm_size(comm) != n_ranks))
        return GY_FAIL(GY_ERR_INVALID, "an engine of %d ranks needs a communicator of that size",
                       (int)n_ranks);
    for (int32_t i = 0; i < n_ranks; i++)
        if (ranks[i].model == NULL || ranks[i].kv == NULL)
            return GY_FAIL(GY_ERR_INVALID, "rank %d has no model or KV cache", (int)i);
    const gy_engine_stage stage = {.first_layer = 0, .end_layer = ranks[0].model->n_layers,
                                   .size = n_ranks, .ranks = ranks, .comm = comm};
    return gy_engine_init_plan(out, &stage, 1, config);
}

void gy_engine_request_free(gy_engine_request *r) {
    if (r == NULL) return;
    free(r->tokens);
    free(r->stop_tokens);
    free(r->error);
    free(r);
}

gy_engine_request *gy_engine_find(const gy_engine *e, int64_t id) {
    int64_t value;
    return gy_idmap_get(&e->requests, id, &value) ? (gy_engine_request *)(intptr_t)value : NULL;
}

void gy_engine_free(gy_engine *e) {
    if (e == NULL) return;
    gy_rank_threads_stop(&e->crew);
    gy_engine_return_streams(e);
    for (int64_t i = 0; i < e->requests.capacity; i++)
        if (e->requests.used[i]) gy_engine_request_free((gy_engine_request *)(intptr_t)e->requests.values[i]);
    gy_idmap_free(&e->requests);
    gy_sched_free(e->sched);
    for (int32_t s = 0; s < e->n_stages; s++) gy_stage_free(&e->stages[s]);
    void *scratch[] = {e->tokens, e->token_seq, e->token_pos, e->logit_rows, e->sampled,
                       e->sample_index, e->sampled_ids, e->finished, e->sample_params, e->stop,
                       e->failed, e->logits, e->x, e->sample_at, e->sample_logits, e->sample_lp,
                       e->prompt_at, e->prompt_ids, e->prompt_pos, e->prompt_lp, e->counts,
                       e->released, e->follow_entries, e->peer_columns};
    for (size_t i = 0; i < sizeof scratch / sizeof scratch[0]; i++) free(scratch[i]);
    pthread_mutex_destroy(&e->api);
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
    if (p->min_tokens < 0 || p->min_tokens > (p->max_new_tokens > 0 ? p->max_new_tokens : 0))
        return GY_FAIL(GY_ERR_INVALID, "min_tokens must be in [0, max_tokens=%lld], got %lld",
                       (long long)p->max_new_tokens, (long long)p->min_tokens);
    if (p->logprobs_top < 0 || p->logprobs_top > GY_LOGPROBS_MAX)
        return GY_FAIL(GY_ERR_INVALID, "logprobs must be in [0, %d], got %d", GY_LOGPROBS_MAX,
                       (int)p->logprobs_top);
    if (p->prompt_logprobs_top < 0 || p->prompt_logprobs_top > GY_LOGPROBS_MAX)
        return GY_FAIL(GY_ERR_INVALID, "prompt_logprobs must be in [0, %d], got %d",
                       GY_LOGPROBS_MAX, (int)p->prompt_logprobs_top);
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
    gy_engine_forget_remote(e, id);
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

int32_t gy_engine_n_ranks(const gy_engine *e) { return e->stages[e->main].n_ranks; }
int64_t gy_engine_hidden(const gy_engine *e) { return e->model->hidden; }
int64_t gy_engine_vocab(const gy_engine *e) { return e->model->vocab; }

/* ---- a request's whole state, out and in (gy_engine_take moves one: handover.c) ---- */

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

gy_status gy_engine_request_get_locked(const gy_engine *e, int64_t id, gy_engine_request_view *out) {
    const gy_engine_request *r = gy_engine_find(e, id);
    if (r == NULL) return GY_FAIL(GY_ERR_STATE, "no request %lld", (long long)id);
    GY_TRY(gy_sched_info_get(e->sched, id, &out->info));
    out->tokens = r->tokens;
    out->n_tokens = r->n_tokens;
    out->prompt_len = r->prompt_len;
    out->params = r->params;
    const gy_stage_group *grp = &e->stages[e->main].groups[0];
    for (int32_t i = 0; i < GY_MODEL_MAX_TP; i++)
        out->seqs[i] = i < grp->size ? gy_sched_kv_adapter_seq(grp->ranks[i].adapter, id) : -1;
    return GY_OK;
}

/* The ranks a request moving in brings sequences for: the main stage's (a one-stage plan, or a
 * layer-staggered transformation's main stage), or every stage's in order (a pipeline). */
static int32_t gy_engine_adoption_ranks(gy_engine *e, gy_sched_kv_adapter **out) {
    if (e->n_stages > 1 && e->transition < 0) return gy_engine_adapters(e, out);
    gy_stage_group *grp = &e->stages[e->main].groups[0];
    for (int32_t k = 0; k < grp->size; k++) out[k] = grp->ranks[k].adapter;
    return grp->size;
}

gy_status gy_engine_adopt_locked(gy_engine *e, int64_t id, const int32_t *tokens, int64_t n_tokens,
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
    /* seqs: one per rank of the main stage, or of every stage of a pipeline (stage after stage) */
    gy_sched_kv_adapter *adapters[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n_ranks = gy_engine_adoption_ranks(e, adapters);
    gy_status s = GY_OK;
    int32_t adopted = 0;
    for (; adopted < n_ranks && s == GY_OK; adopted++)
        if (seqs[adopted] >= 0) s = gy_sched_kv_adapter_adopt(adapters[adopted], id, seqs[adopted]);
    const gy_sched_request sr = {.id = id, .prompt_len = prompt_len,
                                 .max_new_tokens = params->max_new_tokens, .arrival = info->arrival};
    /* A running request that arrives with no KV at all goes on by recomputing its prompt and
     * generated tokens, as after a preemption (Flying Serving's soft preemption). */
    gy_sched_info in = *info;
    int with_kv = 0;
    for (int32_t k = 0; k < n_ranks; k++) with_kv |= seqs[k] >= 0;
    if (in.state == GY_SCHED_STATE_RUNNING && !with_kv) {
        in.state = GY_SCHED_STATE_PREEMPTED;
        in.n_computed = in.prefill_end = 0;
        in.n_preemptions++;
    }
    if (s == GY_OK) s = gy_sched_adopt(e->sched, &sr, &in);
    if (s != GY_OK) {
        char message[512];
        snprintf(message, sizeof message, "%s", gy_error_message());
        for (int32_t i = 0; i < adopted; i++) gy_sched_kv_adapter_forget(adapters[i], id);
        gy_idmap_remove(&e->requests, id);
        gy_engine_request_free(r);
        return GY_FAIL(s, "%s", message);
    }
    return GY_OK;
}

/* Points request `id` at KV sequences again (seqs: one per rank it adopts on, -1 for none): what
 * a rollback gives back after detach_kv or a take let them go. On failure it holds none. */
static gy_status gy_engine_attach_kv_locked(gy_engine *e, int64_t id, const int64_t *seqs) {
    if (gy_engine_find(e, id) == NULL) return GY_FAIL(GY_ERR_STATE, "no request %lld", (long long)id);
    gy_sched_kv_adapter *adapters[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n = gy_engine_adoption_ranks(e, adapters);
    for (int32_t k = 0; k < n; k++) gy_sched_kv_adapter_forget(adapters[k], id);
    for (int32_t k = 0; k < n; k++) {
        if (seqs[k] < 0) continue;
        const gy_status s = gy_sched_kv_adapter_adopt(adapters[k], id, seqs[k]);
        if (s != GY_OK) {
            for (int32_t i = 0; i < k; i++) gy_sched_kv_adapter_forget(adapters[i], id);
            return s;
        }
    }
    return GY_OK;
}

/* ---- one step ---- */

gy_status gy_engine_scratch(gy_engine *e, int64_t n_tokens, int64_t n_entries, int64_t n_logits) {
    const int64_t V = e->model->vocab;
    /* Hidden states are handed over between stages, and to or from another process. */
    const int hands_over = e->n_stages > 1 || e->first_layer > 0 || e->end_layer < e->model->n_layers;
    if (n_tokens > e->cap_tokens) {
        free(e->tokens); free(e->token_seq); free(e->token_pos); free(e->x);
        e->tokens = gy_malloc((size_t)n_tokens * sizeof(int32_t));
        e->token_seq = gy_malloc((size_t)n_tokens * sizeof(int32_t));
        e->token_pos = gy_malloc((size_t)n_tokens * sizeof(int32_t));
        e->x = hands_over ? gy_malloc((size_t)(n_tokens * e->model->hidden) * sizeof(float)) : NULL;
        e->cap_tokens = n_tokens;
        if (!e->tokens || !e->token_seq || !e->token_pos || (hands_over && !e->x)) goto oom;
    }
    if (hands_over && e->x == NULL) {
        e->x = gy_malloc((size_t)(e->cap_tokens * e->model->hidden) * sizeof(float));
        if (e->x == NULL) goto oom;
    }
    if (e->counts == NULL && (e->counts = gy_calloc((size_t)V, sizeof(int32_t))) == NULL) goto oom;
    if (n_entries > e->cap_entries) {
        free(e->sampled); free(e->sample_index); free(e->sampled_ids); free(e->finished);
        free(e->sample_params); free(e->stop); free(e->failed); free(e->sample_at);
        free(e->sample_logits); free(e->sample_lp);
        e->sampled = gy_malloc((size_t)n_entries * sizeof(int32_t));
        e->sample_index = gy_malloc((size_t)n_entries * sizeof(int64_t));
        e->sampled_ids = gy_malloc((size_t)n_entries * sizeof(int64_t));
        e->finished = gy_malloc((size_t)n_entries * sizeof(int64_t));
        e->sample_params = gy_malloc((size_t)n_entries * sizeof(gy_sampler_params));
        e->stop = gy_malloc((size_t)n_entries);
        e->failed = gy_malloc((size_t)n_entries);
        e->sample_at = gy_malloc((size_t)n_entries * sizeof(int64_t));
        e->sample_logits = gy_malloc((size_t)(n_entries * V) * sizeof(float));
        e->sample_lp = gy_malloc((size_t)n_entries * sizeof(gy_logprobs));
        e->cap_entries = n_entries;
        if (!e->sampled || !e->sample_index || !e->sampled_ids || !e->finished ||
            !e->sample_params || !e->stop || !e->failed || !e->sample_at || !e->sample_logits ||
            !e->sample_lp)
            goto oom;
    }
    if (n_logits > e->cap_logits) {
        free(e->logit_rows); free(e->logits); free(e->prompt_at); free(e->prompt_ids);
        free(e->prompt_pos); free(e->prompt_lp);
        e->logit_rows = gy_malloc((size_t)n_logits * sizeof(int32_t));
        e->logits = gy_malloc((size_t)(n_logits * V) * sizeof(float));
        e->prompt_at = gy_malloc((size_t)n_logits * sizeof(int64_t));
        e->prompt_ids = gy_malloc((size_t)n_logits * sizeof(int64_t));
        e->prompt_pos = gy_malloc((size_t)n_logits * sizeof(int32_t));
        e->prompt_lp = gy_malloc((size_t)n_logits * sizeof(gy_logprobs));
        e->cap_logits = n_logits;
        if (!e->logit_rows || !e->logits || !e->prompt_at || !e->prompt_ids || !e->prompt_pos ||
            !e->prompt_lp)
            goto oom;
    }
    return GY_OK;
oom:
    e->cap_tokens = e->cap_entries = e->cap_logits = 0;
    return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a step's batch");
}

/* The prompt positions [lo, hi) of entry `en` that score a prompt token (prompt_logprobs): the
 * row at position q scores token q + 1, so positions [0, prompt_len - 1). */
static void gy_engine_prompt_span(const gy_engine_request *r, const gy_sched_entry *en,
                                  int64_t *lo, int64_t *hi) {
    *lo = en->pos;
    *hi = en->pos + en->n_tokens;
    if (!r->params.prompt_logprobs || *hi > r->prompt_len - 1) *hi = r->prompt_len - 1;
    if (!r->params.prompt_logprobs || *lo > *hi) *lo = *hi;
}

/* Gathers the tokens and positions, and every stage's rows, block tables and batches. */
static gy_status gy_engine_build(gy_engine *e, const gy_sched_batch *b, int64_t *n_samples,
                                 int64_t *n_prompt) {
    int64_t n_logits = 0;
    for (int64_t i = 0; i < b->n_entries; i++) {
        const gy_sched_entry *en = &b->entries[i];
        const gy_engine_request *r = gy_engine_find(e, en->id);
        if (r == NULL || en->pos + en->n_tokens > r->n_tokens)
            return GY_FAIL(GY_ERR_STATE, "request %lld: scheduled tokens it does not have", (long long)en->id);
        int64_t lo, hi;
        gy_engine_prompt_span(r, en, &lo, &hi);
        n_logits += (hi - lo) + (en->samples ? 1 : 0);
    }
    GY_TRY(gy_engine_scratch(e, b->n_tokens, b->n_entries, n_logits));
    /* Logit rows in token order (stage.c's groups rely on it): an entry's prompt rows, then its
     * sampling row, the entry's last token. */
    int64_t t = 0, rows = 0, samples = 0, prompts = 0;
    for (int64_t i = 0; i < b->n_entries; i++) {
        const gy_sched_entry *en = &b->entries[i];
        const gy_engine_request *r = gy_engine_find(e, en->id);
        int64_t lo, hi;
        gy_engine_prompt_span(r, en, &lo, &hi);
        for (int64_t j = 0; j < en->n_tokens; j++, t++) {
            e->tokens[t] = r->tokens[en->pos + j];
            e->token_seq[t] = (int32_t)i;
            e->token_pos[t] = (int32_t)(en->pos + j);
            if (en->pos + j >= lo && en->pos + j < hi) {
                e->prompt_at[prompts] = rows;
                e->prompt_ids[prompts] = en->id;
                e->prompt_pos[prompts++] = (int32_t)(en->pos + j + 1);
                e->logit_rows[rows++] = (int32_t)t;
            }
        }
        if (en->samples) {
            e->sample_at[samples] = rows;
            e->logit_rows[rows++] = (int32_t)(t - 1);
            e->sample_params[samples] = r->params.sampler;
            e->sample_index[samples] = en->sample_index;
            e->sampled_ids[samples] = en->id;
            samples++;
        }
    }
    e->rows = (gy_step_rows){.batch = b, .tokens = e->tokens, .token_seq = e->token_seq,
                             .token_pos = e->token_pos, .n_logits = rows,
                             .logit_rows = e->logit_rows, .x = e->x, .logits = e->logits};
    *n_samples = samples;
    *n_prompt = prompts;
    return gy_engine_build_stages(e);
}

gy_status gy_engine_build_stages(gy_engine *e) {
    e->n_live_stages = 0;
    e->last_stage = -1;
    for (int32_t s = 0; s < e->n_stages; s++)
        if (e->stages[s].first < e->stages[s].end) {
            e->n_live_stages++;
            e->last_stage = s;
        }
    if (e->end_layer < e->model->n_layers) e->last_stage = -1; /* the follower's stages end it */
    for (int32_t s = 0; s < e->n_stages; s++)
        if (e->stages[s].first < e->stages[s].end)
            GY_TRY(gy_stage_build(&e->stages[s], &e->rows, s == e->last_stage, e->model->vocab));
    return GY_OK;
}

static int gy_engine_is_stop(const gy_engine_request *r, int32_t token) {
    for (int64_t i = 0; i < r->params.n_stop_tokens; i++)
        if (r->stop_tokens[i] == token) return 1;
    return 0;
}

/* ---- the step's undo (a step that fails takes everything back) ---- */

/* Marks every KV adapter and remembers the pages of each owned cache, so that a failed step can
 * take back what its scheduler reserved and released, and unmap what it grew. */
gy_status gy_engine_mark(gy_engine *e, int64_t *pages) {
    gy_sched_kv_adapter *adapters[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n = gy_engine_adapters(e, adapters);
    for (int32_t i = 0; i < n; i++) {
        /* A step touches at most the running set's requests (max_running, or more after a
         * merge adopted more), each reserved and released once. */
        const gy_status st = gy_sched_kv_adapter_mark(
            adapters[i], 2 * gy_sched_running_capacity(e->sched) + 4);
        if (st != GY_OK) {
            for (int32_t j = 0; j < i; j++) gy_sched_kv_adapter_unmark(adapters[j]);
            return st;
        }
    }
    for (int32_t i = 0; i < n; i++) pages[i] = -1;
    int32_t i = 0;
    for (int32_t s = 0; s < e->n_stages; s++)
        for (int32_t k = 0; k < e->stages[s].n_ranks; k++, i++) {
            if (!e->stages[s].owned) continue;
            gy_kv_stats ks;
            gy_kv_stats_get(gy_stage_rank_at(&e->stages[s], k, NULL)->r.kv, &ks);
            pages[i] = ks.pages_per_layer;
        }
    return GY_OK;
}

void gy_engine_unmark(gy_engine *e) {
    gy_sched_kv_adapter *adapters[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n = gy_engine_adapters(e, adapters);
    for (int32_t i = 0; i < n; i++) gy_sched_kv_adapter_unmark(adapters[i]);
}

/* Back to the mark; pages grown since go back too where nothing holds them (a live view of a
 * raw layer, or a transformation's shared pages, keep them: free blocks, no request changed). */
void gy_engine_undo(gy_engine *e, const int64_t *pages) {
    gy_sched_kv_adapter *adapters[GY_ENGINE_MAX_ADAPTERS];
    const int32_t n = gy_engine_adapters(e, adapters);
    for (int32_t i = n - 1; i >= 0; i--) gy_sched_kv_adapter_undo(adapters[i]);
    int32_t i = 0;
    for (int32_t s = 0; s < e->n_stages; s++)
        for (int32_t k = 0; k < e->stages[s].n_ranks; k++, i++) {
            if (pages[i] < 0) continue;
            gy_kv_cache *kv = gy_stage_rank_at(&e->stages[s], k, NULL)->r.kv;
            gy_kv_stats ks;
            gy_kv_stats_get(kv, &ks);
            if (ks.pages_per_layer > pages[i] && gy_kv_shrink(kv, ks.pages_per_layer - pages[i]) != GY_OK)
                gy_error_clear();
        }
}

/* Gives the free tails of the owned caches back; a live NumPy view of a raw-layout layer may
 * refuse, which only delays the shrink to a later step. */
void gy_engine_shrink(gy_engine *e) {
    for (int32_t s = 0; s < e->n_stages; s++) {
        if (!e->stages[s].owned) continue;
        for (int32_t k = 0; k < e->stages[s].n_ranks; k++) {
            gy_kv_cache *kv = gy_stage_rank_at(&e->stages[s], k, NULL)->r.kv;
            const int64_t spare = gy_kv_shrinkable_pages(kv);
            if (spare > 0 && gy_kv_shrink(kv, spare) != GY_OK) gy_error_clear();
        }
    }
}

/* Records why request `id`'s row was refused (its finish reason becomes "error"). */
static gy_status gy_engine_fail_request(gy_engine *e, int64_t id) {
    gy_engine_request *r = gy_engine_find(e, id);
    char *why = gy_malloc(strlen(gy_error_message()) + 1);
    if (why == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    strcpy(why, gy_error_message());
    free(r->error);
    r->error = why;
    return GY_OK;
}

/* Each sampling row: penalised into sample_logits (logits.h), sampled, and its token scored in
 * the raw row; then every prompt row is scored. */
static gy_status gy_engine_sample(gy_engine *e, int64_t n_samples, int64_t n_prompt, uint8_t *failed) {
    memset(failed, 0, (size_t)n_samples);
    const int64_t V = e->model->vocab;
    for (int64_t row = 0; row < n_samples; row++) {
        const gy_engine_request *r = gy_engine_find(e, e->sampled_ids[row]);
        float *x = e->sample_logits + row * V;
        memcpy(x, e->logits + e->sample_at[row] * V, (size_t)V * sizeof(float));
        /* the tokens before the one sampled here (a recomputed request may hold more) */
        int64_t n = r->prompt_len + e->sample_index[row];
        if (n > r->n_tokens) n = r->n_tokens;
        if (gy_logits_active(&r->params.sampler, n - r->prompt_len, r->params.min_tokens))
            GY_TRY(gy_logits_process(x, V, r->tokens, n, r->prompt_len, &r->params.sampler,
                                     r->params.min_tokens, r->stop_tokens,
                                     r->params.n_stop_tokens, e->counts));
    }
    if (gy_sampler_sample_batch(e->sampled, e->sample_logits, n_samples, V, e->sample_params,
                                e->sample_index) != GY_OK) {
        for (int64_t row = 0; row < n_samples; row++) {
            if (gy_sampler_sample(&e->sampled[row], e->sample_logits + row * V, V,
                                  &e->sample_params[row], e->sample_index[row]) == GY_OK)
                continue;
            GY_TRY(gy_engine_fail_request(e, e->sampled_ids[row]));
            failed[row] = 1;
        }
    }
    for (int64_t row = 0; row < n_samples; row++) {
        if (failed[row]) continue;
        const gy_engine_request *r = gy_engine_find(e, e->sampled_ids[row]);
        GY_TRY(gy_logits_logprobs(&e->sample_lp[row], e->logits + e->sample_at[row] * V, V,
                                  e->sampled[row], r->params.logprobs_top));
    }
    for (int64_t q = 0; q < n_prompt; q++) {
        const gy_engine_request *r = gy_engine_find(e, e->prompt_ids[q]);
        GY_TRY(gy_logits_logprobs(&e->prompt_lp[q], e->logits + e->prompt_at[q] * V, V,
                                  r->tokens[e->prompt_pos[q]], r->params.prompt_logprobs_top));
    }
    return GY_OK;
}

/* ---- one step ---- */

/* Everything but the commit; any failure leaves the step for the caller to cancel. */
static gy_status gy_engine_run(gy_engine *e, const gy_sched_batch *b, int64_t *n_samples,
                               int64_t *n_prompt) {
    if (b->n_entries == 0) return GY_OK;
    GY_TRY(gy_engine_build(e, b, n_samples, n_prompt));
    GY_TRY(gy_engine_forward_all(e));
    if (e->outlet != NULL) GY_TRY(gy_engine_peer_run(e, b));
    GY_TRY(gy_engine_mark_dirty(e, b));
    gy_engine_count_remote(e); /* (a later failure of the sampler still ran the attention) */
    return *n_samples + *n_prompt > 0 ? gy_engine_sample(e, *n_samples, *n_prompt, e->failed)
                                      : GY_OK;
}

static gy_status gy_engine_step_locked(gy_engine *e, double now, gy_engine_step_out *out) {
    memset(out, 0, sizeof *out);
    if (e->first_layer > 0)
        return GY_FAIL(GY_ERR_STATE, "a plan from layer %lld on follows another engine's steps "
                       "(gy_engine_follow)", (long long)e->first_layer);
    if (e->end_layer < e->model->n_layers && e->outlet == NULL)
        return GY_FAIL(GY_ERR_STATE, "a plan ending at layer %lld of %lld steps once its "
                       "follower is attached (gy_engine_set_outlet)", (long long)e->end_layer,
                       (long long)e->model->n_layers);
    int64_t pages[GY_ENGINE_MAX_ADAPTERS];
    gy_engine_peer_begin(e);   /* what was released before this step is final */
    GY_TRY(gy_engine_mark(e, pages));
    gy_sched_batch b;
    gy_status s = gy_sched_schedule(e->sched, now, &b);
    if (s != GY_OK) { /* the scheduler took its own changes back */
        char message[512];
        snprintf(message, sizeof message, "%s", gy_error_message());
        gy_engine_undo(e, pages);
        gy_engine_peer_cancel(e);
        return GY_FAIL(s, "%s", message);
    }
    int64_t n_logits = 0, n_prompt = 0;
    s = gy_engine_run(e, &b, &n_logits, &n_prompt);
    if (s != GY_OK) {
        /* The step did not happen: the scheduler and the caches go back to before it, so the
         * next step tries the same again. */
        char message[512];
        snprintf(message, sizeof message, "%s", gy_error_message());
        gy_sched_cancel(e->sched);
        gy_engine_undo(e, pages);
        gy_engine_peer_cancel(e);
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
            e->sample_lp[n_out] = e->sample_lp[k];
            e->sampled[n_out++] = e->sampled[k];
        }
    /* (e->finished is NULL until some request has been added: no memcpy of nothing into it) */
    if (done.n_finished > 0) {
        memcpy(e->finished, done.finished, (size_t)done.n_finished * sizeof(int64_t));
        gy_engine_shrink(e);
    }
    out->n_tokens = n_out;
    out->token_ids = e->sampled_ids;
    out->tokens = e->sampled;
    out->logprobs = e->sample_lp;
    out->n_prompt = n_prompt;
    out->prompt_ids = e->prompt_ids;
    out->prompt_pos = e->prompt_pos;
    out->prompt_logprobs = e->prompt_lp;
    out->n_finished = done.n_finished;
    out->finished = e->finished;
    out->n_batch_tokens = b.n_tokens;
    out->n_preempted = b.n_preempted;
    return GY_OK;
}

/* ---- the public calls: each holds the engine's lock (engine.h) ---- */

gy_status gy_engine_step(gy_engine *e, double now, gy_engine_step_out *out) {
    if (e == NULL || out == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL argument");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_step_locked(e, now, out);
    pthread_mutex_unlock(&e->api);
    return s;
}

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

gy_status gy_engine_attach_kv(gy_engine *e, int64_t id, const int64_t *seqs) {
    if (e == NULL || seqs == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_engine_attach_kv: NULL argument");
    pthread_mutex_lock(&e->api);
    const gy_status s = gy_engine_attach_kv_locked(e, id, seqs);
    pthread_mutex_unlock(&e->api);
    return s;
}
