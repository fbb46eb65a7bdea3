/* stage.h (private to the engine): what an instance runs, as data.
 *
 * An instance's plan is an ordered list of stages. A stage runs layers [first, end) in one or
 * several TP groups; a step runs the stages in order and hands the hidden states of its tokens
 * from one stage to the next through a host buffer (x [n_tokens, hidden]). The first stage
 * embeds the tokens; the last non-empty one computes the logits.
 *
 *   plain TP                one stage [0, L), one group: the whole batch, no hand-off
 *   pipeline (PP[3,1])      stages [0, 3) and [3, 4), one group each, on different workers
 *   layer-staggered scale-up (Gyges 4.3)
 *                           [0, b) in the old groups, each on the rows of the requests it
 *                           holds (its "home"), then [b, L) in the new group on every row
 *   layer-staggered scale-down
 *                           [0, b) in the old group, then [b, L) in the new groups
 *
 * A stage with one group runs every request; a stage with several homes each request in one of
 * them (gy_stage_home) and runs each group on its own requests' rows, numbered in the group.
 * Every rank of a stage keeps its own KV cache, scheduler adapter (the request's sequence in that
 * cache), block tables and workspace. A stage is `owned` when its caches are the engine's to grow
 * and shrink; a transformation's old caches are borrowed (their pages are being moved).
 *
 * Threads: the ranks of one stage run at once (their TP collectives need it), one per engine
 * thread: thread t runs the stage's rank t, counted group after group (gy_stage_rank_at). A
 * worker appears at most once in a stage, so a worker's thread pool never serves two ranks at
 * the same time. */
#ifndef GY_ENGINE_STAGE_H
#define GY_ENGINE_STAGE_H

#include <stdint.h>

#include "../comm/comm.h"
#include "../sched/batch.h"
#include "../sched/idmap.h"
#include "../sched/kv_adapter.h"
#include "engine.h"
#include "forward.h"

#define GY_STAGE_MAX_RANKS GY_MODEL_MAX_TP /* ranks of one stage, over all its groups */

/* One rank of one group of one stage. */
typedef struct gy_stage_rank {
    gy_engine_rank r;               /* the worker's model, KV cache and thread pool (borrowed) */
    gy_comm_rank comm_rank;         /* its rank in the group's communicator */
    gy_sched_kv_adapter *adapter;   /* request id -> sequence in r.kv */
    gy_sched_kv_ops inner;          /* the adapter's ops */
    gy_forward_ws ws;
    int32_t *bt_indptr, *bt_indices; /* the block tables of its group's entries this step */
    int64_t cap_entries, cap_blocks;
    gy_forward_batch batch;         /* the step's batch as this rank sees it */
    int stream_borrowed;            /* cuda: the communicator runs on this rank's model stream */
    struct gy_kv_dirty *dirty;      /* borrowed, or NULL: the KV slots each step writes are
                                     * marked here (a pipeline re-split's patching, kv_dirty.h) */
    gy_forward_remote *parts;       /* [batch.n_remote] this step's remote attention */
    int32_t *zeros;                 /* [cap_zeros] zeros: the parts' token_seq */
    int64_t cap_parts, cap_zeros;
} gy_stage_rank;

typedef struct gy_stage_group {
    int32_t size;
    gy_comm *comm;                  /* NULL for one rank */
    gy_stage_rank ranks[GY_MODEL_MAX_TP];
    int64_t n_requests;             /* homed here (several groups only) */
    /* The step's rows of this group, when the stage has several groups: its entries, their
     * tokens, and its sampling rows with their place among the step's logits. */
    int64_t n_entries, n_tokens, n_logits;
    int64_t cap_entries, cap_tokens, cap_logits;
    int64_t *entry_index;           /* [n_entries] index into the step's batch */
    int32_t *rows;                  /* [n_tokens] token rows in the step's batch */
    int32_t *tokens, *token_seq, *token_pos; /* [n_tokens], sequences numbered in the group */
    int32_t *logit_rows;            /* [n_logits] the group's logit rows, in its own rows */
    int64_t *logit_index;           /* [n_logits] their place among the step's logits */
    float *logits;                  /* [n_logits, vocab] */
} gy_stage_group;

/* A request whose attention in some layers of this stage runs where its KV still is: on the
 * ranks of stage `src` (KunServe's remote attention during a buddy group's exchange; forward.h).
 * Rank k of this stage reads the request's sequence on rank k of src. */
typedef struct gy_stage_remote {
    int64_t req;
    const struct gy_stage *src;
    int64_t first_layer, end_layer; /* model layers */
} gy_stage_remote;

typedef struct gy_stage {
    int64_t first, end;             /* layers [first, end) */
    int owned;
    int32_t n_groups;
    int32_t n_ranks;                /* over all groups */
    gy_stage_group groups[GY_STAGE_MAX_RANKS];
    gy_idmap home;                  /* request id -> group (several groups only) */
    gy_idmap remote_of;             /* request id -> index in remote (one-group stages only) */
    gy_stage_remote *remote;        /* [n_remote], in no particular order */
    int64_t n_remote, cap_remote;
} gy_stage;

/* A group as the caller describes it: `size` ranks (borrowed) and their communicator. */
typedef struct gy_stage_group_spec {
    int32_t size;
    const gy_engine_rank *ranks;    /* [size] */
    gy_comm *comm;                  /* of that size; NULL for one rank */
} gy_stage_group_spec;

/* The step as every stage sees it, in the engine's numbering. */
typedef struct gy_step_rows {
    const gy_sched_batch *batch;
    const int32_t *tokens, *token_seq, *token_pos; /* [batch->n_tokens] */
    int64_t n_logits;
    const int32_t *logit_rows;      /* [n_logits] token rows, ascending (gy_stage_build) */
    float *x;                       /* [n_tokens, hidden] host: hidden states between stages */
    float *logits;                  /* [n_logits, vocab] */
} gy_step_rows;

/* Checks the groups (sizes, communicators, models and caches present, every rank on one
 * backend) and makes each rank's adapter. On failure the stage is empty again. */
gy_status gy_stage_init(gy_stage *st, int64_t first, int64_t end, const gy_stage_group_spec *groups,
                        int32_t n_groups, int owned);
void gy_stage_free(gy_stage *st);

/* Rank k of the stage, counted group after group; *group receives its group. */
gy_stage_rank *gy_stage_rank_at(gy_stage *st, int32_t k, int32_t *group);

/* The group of request `req`: 0 with one group; else where it was homed, or the group with the
 * fewest requests (recorded). -1 when out of host memory. */
int32_t gy_stage_home(gy_stage *st, int64_t req);
/* Records that `req` lives in `group` (a request moved in with its KV). */
gy_status gy_stage_set_home(gy_stage *st, int64_t req, int32_t group);
/* Forgets where `req` lived. */
void gy_stage_unhome(gy_stage *st, int64_t req);

/* Request `req`'s attention in model layers [first_layer, end_layer) runs on stage src's ranks
 * (an empty range forgets it). The stage and src have one group each, of the same size. */
gy_status gy_stage_set_remote(gy_stage *st, int64_t req, const gy_stage *src, int64_t first_layer,
                              int64_t end_layer);
/* Its record, or NULL. */
const gy_stage_remote *gy_stage_remote_of(const gy_stage *st, int64_t req);

/* ---- KV on demand ---- */

/* Blocks the rank could still hand out: free ones plus what its budget could map. */
int64_t gy_stage_rank_free_blocks(const gy_stage_rank *rk);
/* Blocks the rank's cache could hold in all: mapped plus what its budget could map. */
int64_t gy_stage_rank_capacity_blocks(const gy_stage_rank *rk);
/* Maps pages until the rank has `want` free blocks. */
gy_status gy_stage_rank_make_room(gy_stage_rank *rk, int64_t want);

/* ---- a step ---- */

/* Each group's rows (several groups) and each rank's block tables and batch for `rows`. Only
 * ranks of the last non-empty stage ask for logits (`last`). */
gy_status gy_stage_build(gy_stage *st, const gy_step_rows *rows, int last, int64_t vocab);
/* Runs rank k of the stage on the step: embeds (first stage) or takes its rows of rows->x,
 * runs the layers, and leaves its group's rows in rows->x (the group's rank 0), or their
 * logits in rows->logits (the last stage). */
gy_status gy_stage_run_rank(gy_stage *st, int32_t k, const gy_step_rows *rows, int last,
                            int64_t hidden, int64_t vocab);

#endif
