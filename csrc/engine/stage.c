/* stage.c: the stages of an instance's plan (stage.h): their ranks, the rows each group runs,
 * and one rank's share of a step. */
#include "stage.h"
#include "../core/alloc.h"
#include "../core/grow.h"

#include <stdlib.h>
#include <string.h>

gy_status gy_stage_init(gy_stage *st, int64_t first, int64_t end, const gy_stage_group_spec *groups,
                        int32_t n_groups, int owned) {
    memset(st, 0, sizeof *st);
    if (groups == NULL || n_groups < 1 || n_groups > GY_STAGE_MAX_RANKS)
        return GY_FAIL(GY_ERR_INVALID, "a stage has 1 to %d groups, got %d", GY_STAGE_MAX_RANKS,
                       (int)n_groups);
    if (first < 0 || end < first)
        return GY_FAIL(GY_ERR_INVALID, "a stage's layers [%lld, %lld) are not a range",
                       (long long)first, (long long)end);
    int32_t n_ranks = 0;
    for (int32_t g = 0; g < n_groups; g++) {
        const gy_stage_group_spec *spec = &groups[g];
        if (spec->size < 1 || spec->size > GY_MODEL_MAX_TP || spec->ranks == NULL ||
            (spec->size > 1 && (spec->comm == NULL || gy_comm_size(spec->comm) != spec->size)))
            return GY_FAIL(GY_ERR_INVALID,
                           "group %d of layers [%lld, %lld) needs 1 to %d ranks and, for more "
                           "than one, a communicator of that size",
                           (int)g, (long long)first, (long long)end, GY_MODEL_MAX_TP);
        for (int32_t k = 0; k < spec->size; k++) {
            if (spec->ranks[k].model == NULL || spec->ranks[k].kv == NULL)
                return GY_FAIL(GY_ERR_INVALID, "group %d rank %d has no model or KV cache",
                               (int)g, (int)k);
            if (spec->ranks[k].model->backend != groups[0].ranks[0].model->backend)
                return GY_FAIL(GY_ERR_INVALID, "group %d rank %d runs on another backend than "
                               "group 0 rank 0", (int)g, (int)k);
        }
        n_ranks += spec->size;
    }
    if (n_ranks > GY_STAGE_MAX_RANKS)
        return GY_FAIL(GY_ERR_INVALID, "a stage of %d ranks (at most %d)", (int)n_ranks,
                       GY_STAGE_MAX_RANKS);
    st->first = first;
    st->end = end;
    st->owned = owned;
    st->n_groups = n_groups;
    st->n_ranks = n_ranks;
    gy_status s = GY_OK;
    for (int32_t g = 0; g < n_groups && s == GY_OK; g++) {
        gy_stage_group *grp = &st->groups[g];
        grp->size = groups[g].size;
        grp->comm = groups[g].comm;
        for (int32_t k = 0; k < grp->size && s == GY_OK; k++) {
            gy_stage_rank *rk = &grp->ranks[k];
            rk->r = groups[g].ranks[k];
            rk->comm_rank = (gy_comm_rank){.comm = grp->comm, .rank = k};
            s = gy_sched_kv_adapter_init(&rk->adapter, rk->r.kv);
            if (s == GY_OK) rk->inner = gy_sched_kv_adapter_ops(rk->adapter);
        }
    }
    if (s != GY_OK) gy_stage_free(st);
    return s;
}

void gy_stage_free(gy_stage *st) {
    for (int32_t g = 0; g < st->n_groups; g++) {
        gy_stage_group *grp = &st->groups[g];
        for (int32_t k = 0; k < grp->size; k++) {
            gy_stage_rank *rk = &grp->ranks[k];
            gy_sched_kv_adapter_free(rk->adapter); /* frees the sequences it still holds */
            gy_forward_ws_free(&rk->ws);
            free(rk->bt_indptr);
            free(rk->bt_indices);
            free(rk->parts);
            free(rk->zeros);
        }
        void *rows[] = {grp->entry_index, grp->rows, grp->tokens, grp->token_seq, grp->token_pos,
                        grp->logit_rows, grp->logit_index, grp->logits};
        for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) free(rows[i]);
    }
    gy_idmap_free(&st->home);
    gy_idmap_free(&st->remote_of);
    free(st->remote);
    memset(st, 0, sizeof *st);
}

gy_stage_rank *gy_stage_rank_at(gy_stage *st, int32_t k, int32_t *group) {
    for (int32_t g = 0; g < st->n_groups; g++) {
        if (k < st->groups[g].size) {
            if (group != NULL) *group = g;
            return &st->groups[g].ranks[k];
        }
        k -= st->groups[g].size;
    }
    return NULL;
}

int32_t gy_stage_home(gy_stage *st, int64_t req) {
    if (st->n_groups == 1) return 0;
    int64_t g;
    if (gy_idmap_get(&st->home, req, &g)) return (int32_t)g;
    int32_t best = 0;
    for (int32_t i = 1; i < st->n_groups; i++)
        if (st->groups[i].n_requests < st->groups[best].n_requests) best = i;
    return gy_stage_set_home(st, req, best) == GY_OK ? best : -1;
}

gy_status gy_stage_set_home(gy_stage *st, int64_t req, int32_t group) {
    if (st->n_groups == 1) return GY_OK;
    GY_TRY(gy_idmap_put(&st->home, req, group));
    st->groups[group].n_requests++;
    return GY_OK;
}

void gy_stage_unhome(gy_stage *st, int64_t req) {
    int64_t g;
    if (st->n_groups == 1 || !gy_idmap_get(&st->home, req, &g)) return;
    gy_idmap_remove(&st->home, req);
    st->groups[g].n_requests--;
}

/* ---- remote attention ---- */

const gy_stage_remote *gy_stage_remote_of(const gy_stage *st, int64_t req) {
    int64_t i;
    return gy_idmap_get(&st->remote_of, req, &i) ? &st->remote[i] : NULL;
}

gy_status gy_stage_set_remote(gy_stage *st, int64_t req, const gy_stage *src, int64_t first_layer,
                              int64_t end_layer) {
    int64_t i;
    const int known = gy_idmap_get(&st->remote_of, req, &i);
    if (first_layer >= end_layer) { /* forget: the last record takes its place */
        if (!known) return GY_OK;
        gy_idmap_remove(&st->remote_of, req);
        if (i != --st->n_remote) {
            st->remote[i] = st->remote[st->n_remote];
            GY_TRY(gy_idmap_put(&st->remote_of, st->remote[i].req, i)); /* overwrites: no alloc */
        }
        return GY_OK;
    }
    if (src == NULL || src == st || st->n_groups != 1 || src->n_groups != 1 ||
        src->groups[0].size != st->groups[0].size)
        return GY_FAIL(GY_ERR_INVALID, "remote attention is between two other stages of one group "
                       "of the same size");
    if (!known) {
        GY_TRY(gy_grow((void **)&st->remote, &st->cap_remote, st->n_remote + 1,
                       sizeof *st->remote, "remote attention records"));
        GY_TRY(gy_idmap_put(&st->remote_of, req, st->n_remote));
        i = st->n_remote++;
    }
    st->remote[i] = (gy_stage_remote){.req = req, .src = src, .first_layer = first_layer,
                                      .end_layer = end_layer};
    return GY_OK;
}

/* Rank rk's remote parts for the entries of a one-group stage: the requests with a record whose
 * layers meet the stage's. */
static gy_status gy_stage_rank_parts(gy_stage *st, int32_t k, gy_stage_rank *rk,
                                     const gy_sched_batch *b) {
    rk->batch.n_remote = 0;
    if (st->n_remote == 0) return GY_OK;
    GY_TRY(gy_grow((void **)&rk->parts, &rk->cap_parts, b->n_entries, sizeof *rk->parts,
                   "remote attention parts"));
    const int64_t old_cap = rk->cap_zeros;
    GY_TRY(gy_grow((void **)&rk->zeros, &rk->cap_zeros, b->n_tokens, sizeof(int32_t), "zeros"));
    if (rk->cap_zeros > old_cap) memset(rk->zeros, 0, (size_t)rk->cap_zeros * sizeof(int32_t));
    int64_t row = 0, n = 0;
    for (int64_t i = 0; i < b->n_entries; row += b->entries[i++].n_tokens) {
        const gy_stage_remote *r = gy_stage_remote_of(st, b->entries[i].id);
        if (r == NULL) continue;
        const int64_t first = r->first_layer > st->first ? r->first_layer : st->first;
        const int64_t end = r->end_layer < st->end ? r->end_layer : st->end;
        if (first >= end) continue;
        const gy_stage_rank *at = &r->src->groups[0].ranks[k];
        const int64_t seq = gy_sched_kv_adapter_seq(at->adapter, r->req);
        if (seq < 0)
            return GY_FAIL(GY_ERR_STATE, "request %lld attends remotely but holds no KV there",
                           (long long)r->req);
        rk->parts[n++] = (gy_forward_remote){
            .kv = at->r.kv, .pool = at->r.pool, .first_layer = first, .end_layer = end,
            .row0 = row, .n_rows = b->entries[i].n_tokens,
            .indptr = {0, (int32_t)gy_kv_seq_n_blocks(at->r.kv, seq)},
            .blocks = gy_kv_seq_blocks(at->r.kv, seq)};
    }
    rk->batch.n_remote = n;
    rk->batch.remote = rk->parts;
    rk->batch.zeros = rk->zeros;
    return GY_OK;
}

/* ---- KV on demand ---- */

/* Pages each layer of the cache could still map: the arena's free budget split over the layers,
 * capped by the cache's page cap (its reserved slots, or a pipeline re-split's block budget). */
static int64_t gy_stage_growable_pages(const gy_kv_cache *kv) {
    gy_arena_stats st;
    gy_arena_stats_get(gy_kv_arena(kv), &st);
    const int64_t free_pages = (int64_t)((st.max_pages - st.bytes_in_use / st.page_size)) /
                               gy_kv_n_runs(kv); /* pages are mapped per run of layers */
    const int64_t room = gy_kv_page_room(kv);
    return free_pages < room ? free_pages : room;
}

int64_t gy_stage_rank_free_blocks(const gy_stage_rank *rk) {
    return rk->inner.free_blocks(rk->inner.ctx) +
           gy_kv_blocks_if_grown(rk->r.kv, gy_stage_growable_pages(rk->r.kv));
}

int64_t gy_stage_rank_capacity_blocks(const gy_stage_rank *rk) {
    gy_kv_stats ks;
    gy_kv_stats_get(rk->r.kv, &ks);
    return ks.n_blocks + gy_kv_blocks_if_grown(rk->r.kv, gy_stage_growable_pages(rk->r.kv));
}

gy_status gy_stage_rank_make_room(gy_stage_rank *rk, int64_t want) {
    const int64_t short_by = want - rk->inner.free_blocks(rk->inner.ctx);
    if (short_by <= 0) return GY_OK;
    const int64_t max_pages = gy_stage_growable_pages(rk->r.kv);
    int64_t pages = 1;
    while (pages <= max_pages && gy_kv_blocks_if_grown(rk->r.kv, pages) < short_by) pages++;
    if (pages > max_pages)
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY, "KV budget exhausted: %lld more blocks needed",
                       (long long)short_by);
    return gy_kv_grow(rk->r.kv, pages);
}

/* ---- a step ---- */

/* Grows *p to hold n elements of `size` bytes (contents not kept); 0 or -1. */
static int gy_stage_reserve(void **p, int64_t n, size_t size) {
    free(*p);
    *p = gy_malloc((size_t)(n > 0 ? n : 1) * size);
    return *p != NULL ? 0 : -1;
}

/* A group's rows: the entries homed in it, renumbered. */
static gy_status gy_stage_group_rows(gy_stage *st, const gy_step_rows *rows, int64_t vocab) {
    const gy_sched_batch *b = rows->batch;
    for (int32_t g = 0; g < st->n_groups; g++) {
        gy_stage_group *grp = &st->groups[g];
        if (b->n_entries > grp->cap_entries) {
            grp->cap_entries = 0;
            if (gy_stage_reserve((void **)&grp->entry_index, b->n_entries, sizeof(int64_t)))
                return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a group's rows");
            grp->cap_entries = b->n_entries;
        }
        if (rows->n_logits > grp->cap_logits) {
            grp->cap_logits = 0;
            if (gy_stage_reserve((void **)&grp->logit_rows, rows->n_logits, sizeof(int32_t)) ||
                gy_stage_reserve((void **)&grp->logit_index, rows->n_logits, sizeof(int64_t)) ||
                gy_stage_reserve((void **)&grp->logits, rows->n_logits * vocab, sizeof(float)))
                return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a group's rows");
            grp->cap_logits = rows->n_logits;
        }
        if (b->n_tokens > grp->cap_tokens) {
            grp->cap_tokens = 0;
            if (gy_stage_reserve((void **)&grp->rows, b->n_tokens, sizeof(int32_t)) ||
                gy_stage_reserve((void **)&grp->tokens, b->n_tokens, sizeof(int32_t)) ||
                gy_stage_reserve((void **)&grp->token_seq, b->n_tokens, sizeof(int32_t)) ||
                gy_stage_reserve((void **)&grp->token_pos, b->n_tokens, sizeof(int32_t)))
                return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a group's rows");
            grp->cap_tokens = b->n_tokens;
        }
        grp->n_entries = grp->n_tokens = grp->n_logits = 0;
    }
    /* The step's logit rows are in token order, so each entry's are the next ones below its
     * end: they become rows of the entry's group, keeping their place among the step's logits. */
    int64_t row = 0, logit = 0;
    for (int64_t i = 0; i < b->n_entries; i++) {
        const gy_sched_entry *en = &b->entries[i];
        const int32_t g = gy_stage_home(st, en->id);
        if (g < 0) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
        gy_stage_group *grp = &st->groups[g];
        const int32_t local = (int32_t)grp->n_entries;
        const int64_t first_row = row, first_local = grp->n_tokens;
        grp->entry_index[grp->n_entries++] = i;
        for (int64_t j = 0; j < en->n_tokens; j++, row++) {
            grp->rows[grp->n_tokens] = (int32_t)row;
            grp->tokens[grp->n_tokens] = rows->tokens[row];
            grp->token_seq[grp->n_tokens] = local;
            grp->token_pos[grp->n_tokens] = rows->token_pos[row];
            grp->n_tokens++;
        }
        for (; logit < rows->n_logits && rows->logit_rows[logit] < row; logit++) {
            grp->logit_rows[grp->n_logits] = (int32_t)(first_local + rows->logit_rows[logit] - first_row);
            grp->logit_index[grp->n_logits] = logit;
            grp->n_logits++;
        }
    }
    return GY_OK;
}

/* The rank's block tables for the entries `entry_index` (NULL: all of them) of the batch. */
static gy_status gy_stage_rank_tables(gy_stage_rank *rk, const gy_sched_batch *b,
                                      const int64_t *entry_index, int64_t n_entries) {
    int64_t n_blocks = 0;
    for (int64_t k = 0; k < n_entries; k++) {
        const int64_t id = b->entries[entry_index ? entry_index[k] : k].id;
        const int64_t seq = gy_sched_kv_adapter_seq(rk->adapter, id);
        if (seq < 0) return GY_FAIL(GY_ERR_STATE, "request %lld is scheduled without KV", (long long)id);
        n_blocks += gy_kv_seq_n_blocks(rk->r.kv, seq);
    }
    GY_TRY(gy_grow((void **)&rk->bt_indptr, &rk->cap_entries, n_entries + 1, sizeof(int32_t),
                   "block tables"));
    GY_TRY(gy_grow((void **)&rk->bt_indices, &rk->cap_blocks, n_blocks > 0 ? n_blocks : 1,
                   sizeof(int32_t), "block tables"));
    int64_t blocks = 0;
    rk->bt_indptr[0] = 0;
    for (int64_t k = 0; k < n_entries; k++) {
        const int64_t seq = gy_sched_kv_adapter_seq(rk->adapter, b->entries[entry_index ? entry_index[k] : k].id);
        const int64_t nb = gy_kv_seq_n_blocks(rk->r.kv, seq);
        memcpy(rk->bt_indices + blocks, gy_kv_seq_blocks(rk->r.kv, seq), (size_t)nb * sizeof(int32_t));
        blocks += nb;
        rk->bt_indptr[k + 1] = (int32_t)blocks;
    }
    return GY_OK;
}

gy_status gy_stage_build(gy_stage *st, const gy_step_rows *rows, int last, int64_t vocab) {
    const gy_sched_batch *b = rows->batch;
    if (st->n_groups > 1) GY_TRY(gy_stage_group_rows(st, rows, vocab));
    for (int32_t g = 0; g < st->n_groups; g++) {
        gy_stage_group *grp = &st->groups[g];
        const int whole = st->n_groups == 1;
        for (int32_t k = 0; k < grp->size; k++) {
            gy_stage_rank *rk = &grp->ranks[k];
            GY_TRY(gy_stage_rank_tables(rk, b, whole ? NULL : grp->entry_index,
                                        whole ? b->n_entries : grp->n_entries));
            const int64_t n_logits = whole ? rows->n_logits : grp->n_logits;
            rk->batch = (gy_forward_batch){
                .tokens = whole ? rows->tokens : grp->tokens,
                .paged = {.n_tokens = whole ? b->n_tokens : grp->n_tokens,
                          .token_seq = whole ? rows->token_seq : grp->token_seq,
                          .token_pos = whole ? rows->token_pos : grp->token_pos,
                          .n_seqs = whole ? b->n_entries : grp->n_entries,
                          .bt_indptr = rk->bt_indptr, .bt_indices = rk->bt_indices},
                .n_logits = last && k == 0 ? n_logits : 0,
                .logit_rows = whole ? rows->logit_rows : grp->logit_rows,
            };
            if (whole) GY_TRY(gy_stage_rank_parts(st, k, rk, b));
        }
    }
    return GY_OK;
}

gy_status gy_stage_run_rank(gy_stage *st, int32_t k, const gy_step_rows *rows, int last,
                            int64_t hidden, int64_t vocab) {
    int32_t g = 0;
    gy_stage_rank *rk = gy_stage_rank_at(st, k, &g);
    const gy_stage_group *grp = &st->groups[g];
    const int whole = st->n_groups == 1;
    const int64_t n_tokens = rk->batch.paged.n_tokens;
    if (n_tokens == 0) return GY_OK; /* a group with no requests this step */
    const gy_model *model = rk->r.model;
    const gy_tp_group tp = {.rank = rk->comm_rank.rank, .size = grp->size,
                            .all_reduce = grp->size > 1 ? gy_comm_rank_all_reduce : NULL,
                            .ctx = &rk->comm_rank,
                            .device_buffers = model->backend == GY_MODEL_BACKEND_CUDA};
    const size_t row_bytes = (size_t)hidden * sizeof(float); /* rows->x: fp32-sized rows */
    const int32_t *map = whole ? NULL : grp->rows; /* this group's rows of the step */
    GY_TRY(gy_forward_begin(model, &tp, rk->r.kv, &rk->batch, &rk->ws, st->first == 0));
    if (st->first > 0) /* the previous stage's hidden states of this group's rows */
        GY_TRY(gy_forward_x_in(model, &rk->ws, rows->x, row_bytes, map, n_tokens));
    GY_TRY(gy_forward_layers(model, &tp, rk->r.kv, &rk->batch, &rk->ws, rk->r.pool, st->first,
                             st->end));
    if (rk->comm_rank.rank != 0) return GY_OK; /* the group's rank 0 speaks for it */
    if (!last) return gy_forward_x_out(model, &rk->ws, rows->x, row_bytes, map, n_tokens);
    if (rk->batch.n_logits == 0) return GY_OK;
    if (whole) return gy_forward_end(rows->logits, model, &rk->batch, &rk->ws, rk->r.pool);
    GY_TRY(gy_forward_end(grp->logits, model, &rk->batch, &rk->ws, rk->r.pool));
    for (int64_t i = 0; i < grp->n_logits; i++)
        memcpy(rows->logits + grp->logit_index[i] * vocab, grp->logits + i * vocab,
               (size_t)vocab * sizeof(float));
    return GY_OK;
}
