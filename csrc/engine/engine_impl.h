/* engine_impl.h (private to csrc/engine/): the engine's own struct and the helpers the files of
 * its jobs share. engine.c keeps the requests and the step; transition.c, resplit.c, remote.c and
 * handover.c each do one of the other jobs on the same struct. Callers outside the engine see
 * gy_engine as an opaque handle through engine.h and those files' headers (ggml's *-impl.h habit),
 * so the struct can change without touching them.
 *
 * Every function declared here expects its caller to hold e->api (each public call takes it
 * once, engine.h), so they call one another freely without locking twice. */
#ifndef GY_ENGINE_ENGINE_IMPL_H
#define GY_ENGINE_ENGINE_IMPL_H

#include <pthread.h>
#include <stdint.h>

#include "../sched/batch.h"
#include "../sched/idmap.h"
#include "../sched/kv_adapter.h"
#include "engine.h"
#include "peer.h"
#include "rank_threads.h"
#include "stage.h"

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

/* Where engine rank i sits in the transformation's stage: group and rank in the group. */
typedef struct gy_engine_slot {
    int32_t group, rank;
} gy_engine_slot;

struct gy_engine {
    /* Every public call holds it, so callers on several threads take turns (engine.h). */
    pthread_mutex_t api;
    const gy_model *model;       /* the first rank's: the shapes every rank shares */
    /* The plan, in the order a step runs it. `main` is the stage of the engine's own group (what
     * requests move in and out of); `transition` the stage a layer-staggered transformation
     * added (-1 when none runs), whose ranks are indexed by engine rank through `slots`. */
    gy_stage stages[GY_ENGINE_MAX_STAGES];
    int32_t n_stages;
    int32_t main;
    int32_t transition;
    int groups_last;             /* the transformation's groups run the upper layers */
    gy_engine_slot slots[GY_MODEL_MAX_TP];
    gy_rank_threads crew;
    gy_sched *sched;
    gy_idmap requests;           /* id -> gy_engine_request * */
    /* This step: the rows every stage reads, which stage computes the logits, and how each
     * thread's ranks fared (the first failure wins). */
    gy_step_rows rows;
    int32_t last_stage;
    int32_t n_live_stages;       /* non-empty stages: more than one hands over between them */
    int step_failed;             /* set atomically by a failing thread */
    gy_status status[GY_RANK_THREADS_MAX];
    char error[GY_RANK_THREADS_MAX][512];
    /* Per-step scratch, grown on demand. The logit rows are the sampling rows and, for requests
     * with prompt_logprobs, the prompt positions their chunks compute, in token order. */
    int64_t cap_tokens, cap_entries, cap_logits;
    int32_t *tokens, *token_seq, *token_pos, *sampled;
    int64_t *sample_index, *sampled_ids, *finished;
    int64_t *sample_at;          /* (entries) each sampling row's row of `logits` */
    gy_sampler_params *sample_params;
    uint8_t *stop;               /* (entries) gy_sched_end of each entry */
    uint8_t *failed;             /* (entries) the sampling rows whose logits were refused */
    float *sample_logits;        /* (entries, vocab) the sampling rows, penalised (logits.h) */
    gy_logprobs *sample_lp;      /* (entries) */
    int32_t *logit_rows;         /* (logits) token rows of the batch */
    float *logits;               /* (logits, vocab) raw */
    int64_t *prompt_at, *prompt_ids; /* (logits) the prompt rows: row of `logits`, request id */
    int32_t *prompt_pos;         /* (logits) the position scored */
    gy_logprobs *prompt_lp;      /* (logits) */
    int32_t *counts;             /* (vocab) zero between uses: gy_logits_process's scratch */
    float *x;                    /* (tokens, hidden) the hidden states between stages */
    /* Remote attention so far (gy_engine_set_remote): calls (a part's layer) and token-layers. */
    int64_t remote_calls, remote_token_layers;
    /* The layers the plan covers (a side of a pipeline split between processes, peer.h). */
    int64_t first_layer, end_layer;
    /* Leader: the outlet, the follower's capacity, the releases it has not heard of (the first
     * n_released_committed of them are final), and whether this step's outlet ran. */
    gy_peer_outlet outlet;
    void *outlet_ctx;
    int64_t peer_capacity;
    int64_t *released, n_released, cap_released, n_released_committed;
    int outlet_called;           /* this step's outlet was called (it may have run) */
    int64_t peer_number;         /* steps sent to the follower */
    int released_lost;           /* a release could not be noted (out of host memory) */
    int64_t *peer_columns;       /* [3, entries] the step's ids, positions and token counts */
    int64_t cap_peer_columns;
    /* Follower: the undo record of the last followed step (its number), open until the next
     * call. */
    int follow_marked;
    int64_t follow_number;
    int64_t follow_pages[GY_ENGINE_MAX_STAGES * GY_STAGE_MAX_RANKS];
    gy_sched_entry *follow_entries;
    int64_t cap_follow_entries;
};

/* Room for every rank of every stage of a plan, stage after stage. */
#define GY_ENGINE_MAX_ADAPTERS (GY_ENGINE_MAX_STAGES * GY_STAGE_MAX_RANKS)

/* ---- engine.c ---- */

/* The stage of the engine's own group (what requests move in and out of). */
gy_stage *gy_engine_main(gy_engine *e);
/* The request's record, or NULL when the engine has none. */
gy_engine_request *gy_engine_find(const gy_engine *e, int64_t id);
void gy_engine_request_free(gy_engine_request *r);
/* Every adapter of the plan, stage after stage, into out[GY_ENGINE_MAX_ADAPTERS]; returns how
 * many. */
int32_t gy_engine_adapters(gy_engine *e, gy_sched_kv_adapter **out);
/* What a plan must be before any of it is built (gy_engine_init_plan; a re-plan checks the same):
 * its stages cover layers [first, end) (end 0: to the model's last). */
gy_status gy_engine_check_plan(const gy_engine_stage *stages, int32_t n_stages, int64_t first,
                               int64_t end);
/* Forgets the KV sequences of every rank of the stage without freeing them. */
void gy_engine_detach_stage(gy_stage *st);
/* gy_engine_request_get and gy_engine_adopt with the lock held (gy_engine_take holds two). */
gy_status gy_engine_request_get_locked(const gy_engine *e, int64_t id, gy_engine_request_view *out);
gy_status gy_engine_adopt_locked(gy_engine *e, int64_t id, const int32_t *tokens, int64_t n_tokens,
                                 int64_t prompt_len, const gy_engine_params *params,
                                 const gy_sched_info *info, const int64_t *seqs);

/* The step's machinery, shared with peer.c: the undo record of a step over every cache
 * (pages[GY_ENGINE_MAX_ADAPTERS] receives each owned cache's size), the per-step scratch, the
 * stages' forward passes on every thread, and the scheduler's KV ops. */
gy_status gy_engine_mark(gy_engine *e, int64_t *pages);
void gy_engine_unmark(gy_engine *e);
void gy_engine_undo(gy_engine *e, const int64_t *pages);
/* Gives the free tails of the owned caches back (after requests finished). */
void gy_engine_shrink(gy_engine *e);
/* Blocks every request could get (with a follower: no more than it holds). */
int64_t gy_engine_capacity_blocks_locked(const gy_engine *e);
gy_status gy_engine_scratch(gy_engine *e, int64_t n_tokens, int64_t n_entries, int64_t n_logits);
gy_status gy_engine_forward_all(gy_engine *e);
gy_status gy_engine_reserve(void *ctx, int64_t req, int64_t n_tokens);
void gy_engine_release_kv(void *ctx, int64_t req);
/* Which stage computes the logits this step (-1: none, the follower does) and how many stages
 * run; called once the rows are in e->rows. */
gy_status gy_engine_build_stages(gy_engine *e);

/* ---- peer.c ---- */

/* Leader: request `req` let go of its KV (the follower frees its own at the next step). Out of
 * host memory to note it, the leader's steps fail until the follower is detached. */
void gy_engine_peer_released(gy_engine *e, int64_t req);
/* Leader: sends the built step to the follower and takes its logits into e->logits. */
gy_status gy_engine_peer_run(gy_engine *e, const gy_sched_batch *b);
/* Leader: the step failed; the follower takes back its part if it ran, and this step's
 * releases are forgotten (the scheduler took them back). */
void gy_engine_peer_cancel(gy_engine *e);
/* Leader: a step begins; every release noted so far is final (an earlier step's commit, an
 * abort between steps). */
void gy_engine_peer_begin(gy_engine *e);
/* Blocks the follower could still give (INT64_MAX without one). */
int64_t gy_engine_peer_free_blocks(const gy_engine *e);

/* ---- resplit.c ---- */

/* Marks the slots the step wrote on every rank whose KV is being patched elsewhere
 * (gy_engine_set_dirty); called after the forward pass. */
gy_status gy_engine_mark_dirty(gy_engine *e, const gy_sched_batch *b);

/* ---- remote.c ---- */

/* A request leaving the engine attends nowhere else any more: its remote ranges go. */
void gy_engine_forget_remote(gy_engine *e, int64_t id);
/* Adds the step's remote attention to the engine's counts (gy_engine_remote_stats). */
void gy_engine_count_remote(gy_engine *e);

#endif
