/* engine.h: the serving loop of one instance. The instance runs a plan: stages of layers, each
 * run by a group of workers with tensor parallelism (one stage of one rank for a plain engine;
 * stage.h). One step = schedule (sched/batch.h) -> gather the batch's tokens and every rank's
 * block tables -> run the stages in order, the ranks of a stage at once, each on its own thread,
 * joined by their communicator's all-reduce (forward.h) -> sample -> commit.
 *
 * Every rank has its own KV cache holding its KV heads; the scheduler sees the smallest of their
 * capacities, and a request's blocks are reserved on all ranks together. The block ids may differ
 * between ranks (after a transformation they do), so each rank gets its own block tables.
 *
 * The KV cache grows on demand: when the scheduler wants blocks that are not there, the engine
 * maps more pages while the arena's budget allows, and after requests finish it gives the free
 * pages at the end of the cache back, so an idle engine holds its weights and nothing else.
 * The scheduler therefore sees every block the budget could hold as available.
 *
 * Threads. Every call below holds the engine's own lock, so callers on several threads take
 * turns: a step runs whole, and an add or abort from another thread waits for it.
 *
 * Failure. A step either happens or not. If the schedule, the batch, a rank's forward pass
 * (peers waiting for that rank in a collective are released: gy_comm_abort) or the sampling
 * fails, the step is taken back: the scheduler's state, every request's progress and every
 * rank's block tables are as before it (gy_sched_cancel, gy_kv_mark), the KV pages it mapped are
 * unmapped again, and the same step can be tried again. A request whose logits are not numbers
 * (NaN or +inf: an overflow in the weights or activations) fails alone: it finishes with reason
 * "error" and the sampler's message (gy_engine_info), and the step goes on for the others.
 *
 * This header is the core: life cycle, requests, the step, and a request's state for whoever
 * moves it. The engine's other jobs have headers of their own: transition.h (the layer-staggered
 * transformation), resplit.h (PipeLive's live re-split of a pipeline), remote.h (KunServe's
 * remote attention) and handover.h (holding admission, taking a request from another engine,
 * detaching KV). */
#ifndef GY_ENGINE_ENGINE_H
#define GY_ENGINE_ENGINE_H

#include <stdint.h>
#include <stddef.h>

#include "../sched/batch.h"
#include "../sched/logits.h"
#include "../sched/sampler.h"
#include "forward.h"

struct gy_comm;

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_engine_config {
    int64_t max_batch_tokens;
    int64_t max_running;
    int64_t max_prefill_chunk; /* 0 = no cap */
    int64_t watermark_blocks;
    /* The layers the plan covers, [first_layer, end_layer); 0, 0: the whole model. A part of it
     * is one side of a pipeline split between processes (peer.h). */
    int64_t first_layer, end_layer;
} gy_engine_config;

typedef struct gy_engine_params {
    gy_sampler_params sampler;   /* its penalties applied by the engine (sched/logits.h) */
    int64_t max_new_tokens;
    const int32_t *stop_tokens; /* ends the request when sampled (EOS included unless ignore_eos) */
    int64_t n_stop_tokens;
    /* Zeroed, these ask for nothing (every sampled token is scored anyway). */
    int64_t min_tokens;          /* [0, max_new_tokens]: stop tokens get -inf until this many */
    int32_t logprobs_top;        /* [0, 20]: the top k beside each sampled token */
    int32_t prompt_logprobs;     /* 1: score every prompt token (vLLM's prompt_logprobs set) */
    int32_t prompt_logprobs_top; /* [0, 20]: the top k beside each scored prompt token */
} gy_engine_params;

/* What one step produced: a token for each sampling entry, and the requests that finished.
 * Every sampled token comes with its log-probability and rank in the raw logits (logits.h),
 * with the top params.logprobs_top. A request with prompt_logprobs gets a scored row
 * for each prompt position its chunk computed, position p scoring prompt token p (p >= 1)
 * given tokens [0, p); a recomputed prefill reports them again, identical. */
typedef struct gy_engine_step_out {
    int64_t n_tokens;
    const int64_t *token_ids;  /* (n_tokens) request ids */
    const int32_t *tokens;     /* (n_tokens) the sampled tokens, in entry order */
    const gy_logprobs *logprobs; /* (n_tokens) */
    int64_t n_prompt;
    const int64_t *prompt_ids; /* (n_prompt) request ids */
    const int32_t *prompt_pos; /* (n_prompt) the position p of the prompt token scored */
    const gy_logprobs *prompt_logprobs; /* (n_prompt) */
    int64_t n_finished;
    const int64_t *finished;   /* (n_finished) ids; their info is final */
    int64_t n_batch_tokens;    /* tokens run through the model */
    int64_t n_preempted;
} gy_engine_step_out;

typedef struct gy_engine gy_engine;

/* One rank: the worker's model (weights in its arena), KV cache and thread pool (may be NULL),
 * all borrowed and outliving the engine. */
typedef struct gy_engine_rank {
    const gy_model *model;
    gy_kv_cache *kv;
    gy_threadpool *pool;
} gy_engine_rank;

#define GY_ENGINE_MAX_STAGES 8

/* One stage of a plan: layers [first_layer, end_layer) run by a TP group of `size` ranks (their
 * models, caches and pools borrowed), joined by `comm` (NULL for one rank). */
typedef struct gy_engine_stage {
    int64_t first_layer, end_layer;
    int32_t size;
    const gy_engine_rank *ranks;   /* [size] */
    struct gy_comm *comm;
} gy_engine_stage;

/* An instance running a plan of `n_stages` stages (at most 8) in order, covering the model's
 * layers [0, L) each at least one, the hidden states of every token handed from one stage to the
 * next (PP[3,1]: layers [0, 3) on one worker, [3, 4) on another). Every model has the same shape
 * and every cache the same block size; a request holds KV blocks on every rank of every stage,
 * and the scheduler sees the least any rank could hold. Tokens are bit-identical to a plan of
 * one stage: each stage runs its layers exactly as the one-stage pass does. Several stages run
 * on the CPU backend only (GY_ERR_UNAVAILABLE otherwise, naming what is missing). Requests move
 * in and out of a pipeline with a sequence per stage (gy_engine_take); gy_engine_request_get
 * reports the main stage's, and layer-staggered transformations are for one-stage plans. */
gy_status gy_engine_init_plan(gy_engine **out, const gy_engine_stage *stages, int32_t n_stages,
                              const gy_engine_config *config);

/* A plan of one stage: ranks [n_ranks]; comm joins them (NULL when n_ranks == 1) and is borrowed. Every rank runs on
 * one backend, and the communicator must fit it: shm for cpu ranks; d2d or nccl for cuda ranks,
 * its rank i on rank i's device (GY_ERR_INVALID naming the mismatch otherwise). With cuda ranks
 * the engine points the communicator's rank i at model i's stream (gy_comm_set_stream), so the
 * all-reduce runs in order on the worker's stream, and gives it its own stream back when freed:
 * free the engine before the models, and use a communicator in one engine at a time. */
gy_status gy_engine_init(gy_engine **out, const gy_engine_rank *ranks, int32_t n_ranks,
                         struct gy_comm *comm, const gy_engine_config *config);
void gy_engine_free(gy_engine *e);

/* Copies the prompt; refuses tokens outside the vocabulary, bad sampling params, and requests
 * that could never fit in the KV the budget allows (naming the reason). */
gy_status gy_engine_add(gy_engine *e, int64_t id, const int32_t *prompt, int64_t prompt_len,
                        const gy_engine_params *params, double arrival);
gy_status gy_engine_abort(gy_engine *e, int64_t id);
/* Forgets a finished request (its tokens and scheduler record). */
gy_status gy_engine_release(gy_engine *e, int64_t id);

/* One step at time `now`; out's arrays are valid until the next step. A step with nothing to
 * run returns n_batch_tokens == 0. */
gy_status gy_engine_step(gy_engine *e, double now, gy_engine_step_out *out);

/* ---- a request's whole state, out and in (moving requests between instances; gy_engine_take,
 * handover.h, moves one in a single call) ---- */

/* What a transformation needs to know of a request. */
typedef struct gy_engine_request_view {
    const int32_t *tokens;    /* (n_tokens) prompt then generated; valid until the next step */
    int64_t n_tokens;
    int64_t prompt_len;
    gy_engine_params params;  /* its stop_tokens stay owned by the engine */
    gy_sched_info info;
    int64_t seqs[GY_MODEL_MAX_TP]; /* per rank: its KV sequence in that rank's cache, or -1 */
} gy_engine_request_view;

/* The ids of the unfinished requests, in the order they were added; returns how many (at most
 * capacity are written). */
int64_t gy_engine_request_ids(const gy_engine *e, int64_t *ids, int64_t capacity);
gy_status gy_engine_request_get(const gy_engine *e, int64_t id, gy_engine_request_view *out);
/* Takes over a request with its progress: `seqs[rank]` are sequences already holding its KV in
 * each rank's cache (all -1 when it holds none: a queued request, or a running one, which is
 * then queued to be recomputed and counted as preempted). */
gy_status gy_engine_adopt(gy_engine *e, int64_t id, const int32_t *tokens, int64_t n_tokens,
                          int64_t prompt_len, const gy_engine_params *params,
                          const gy_sched_info *info, const int64_t *seqs);

/* A request's scheduler record and, when it finished with reason "error", why (copied into
 * `error`, "" otherwise; may be NULL). */
gy_status gy_engine_info(gy_engine *e, int64_t id, gy_sched_info *out, char *error, size_t error_size);
void gy_engine_stats(gy_engine *e, gy_sched_stats *out);
int32_t gy_engine_n_ranks(const gy_engine *e);
/* The model's hidden size and vocabulary. */
int64_t gy_engine_hidden(const gy_engine *e);
int64_t gy_engine_vocab(const gy_engine *e);
/* Points request `id` at KV sequences again, seqs[r] on rank r of the ranks an adopt gives
 * sequences to (-1: none): a rollback gives back what detach_kv or a take let go of. On
 * failure the request holds no KV sequence. */
gy_status gy_engine_attach_kv(gy_engine *e, int64_t id, const int64_t *seqs);
/* Blocks the whole budget could hold (what the submit-time check uses). */
int64_t gy_engine_capacity_blocks(const gy_engine *e);

#ifdef __cplusplus
}
#endif
#endif
