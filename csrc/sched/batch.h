/* batch.h: continuous batching for one serving instance (vLLM-style, chunked prefill, preemption
 * by recompute). It decides which tokens of which requests run in each step; it knows nothing
 * about models or memory and sees KV capacity only through a gy_sched_kv_ops table, so the same
 * code drives the CPU engine and the discrete-event simulator.
 *
 * Protocol: gy_sched_add requests at any time; then repeat
 *     gy_sched_schedule(s, now, &batch)   -> which tokens run this step
 *     (the engine runs the batch, samples one token for each entry with `samples` set)
 *     gy_sched_commit(s, now, stop, n)    -> the step is done; stop[i] says the engine ended entry
 *                                           i's request (GY_SCHED_END_STOP: EOS, stop string) or
 *                                           that it failed (GY_SCHED_END_FAIL: its logits were
 *                                           not numbers)
 * Every schedule is followed by exactly one commit, even for an empty batch, or by one
 * gy_sched_cancel when the step could not run: everything is then as before the schedule.
 *
 * Failure. A schedule whose KV backend fails (a reserve failing other than with
 * GY_ERR_OUT_OF_MEMORY) returns that failure with the scheduler exactly as before the call: it
 * keeps an undo record of what it changed. What the ops themselves changed before the failure is
 * the caller's to take back (the engine marks its KV caches, kv_adapter.h).
 *
 * A request with prompt length P has, between steps: G tokens generated (committed), T = P + G
 * known tokens, C tokens whose KV is computed, and, while running, a prefill end E (the T it had
 * when it was admitted: P the first time, P + G after a preemption). It is in prefill while
 * C < E and in decode once C >= E (then T == C + 1: the last sampled token is not computed yet).
 *
 * THE POLICY of gy_sched_schedule(now). `budget` starts at max_batch_tokens; `running` is kept in
 * admission order (the order of the admission counter).
 *   1. Decode. For each running request in decode, oldest admission first, while budget > 0:
 *      it wants 1 token at position C (room for C + 1 tokens). While blocks_needed(C + 1) >
 *      free_blocks, preempt the most recently admitted running request (the victim); stop when the
 *      victim was this request itself. If room was found: reserve, emit {pos C, 1 token,
 *      samples}, budget -= 1.
 *   2. Prefill continuation. For each running request still in prefill, oldest admission first,
 *      while budget > 0: chunk n = min(E - C, budget, max_prefill_chunk or no cap); make room for
 *      C + n tokens exactly as in 1 (the victim may be a request already given an entry this step:
 *      its entry is removed and its tokens return to the budget); emit {pos C, n tokens, samples
 *      when C + n == E}, budget -= n.
 *   3. Admission, only when nothing was preempted in this step and admission is not held
 *      (gy_sched_hold). Walk the waiting queue in order,
 *      skipping requests whose arrival time is after `now`; stop at the first visible request
 *      that cannot be admitted (head-of-line blocking: strict order, no overtaking), or when
 *      budget == 0 or max_running requests run. A request is admitted (C = 0, E = T, new admission
 *      number) when, for n = min(T, budget, max_prefill_chunk or no cap),
 *      blocks_needed(n) + watermark <= free_blocks (watermark = watermark_blocks while any
 *      request runs, else 0); it is reserved and emits {pos 0, n tokens, samples when n == T}.
 *      No preemption happens for admission.
 * Prefill only (gy_sched_prefill_only, Seesaw's prefill phase): before pass 1, every running
 * request in decode is parked, oldest admission first: its KV released, C = 0, appended to the
 * preempted queue (no preemption counted; the caller keeps its KV elsewhere, in host memory, or
 * it is recomputed); and admission skips, without blocking, every queued request that has
 * generated a token (it would only decode). Nothing else changes: prompts are admitted and
 * prefilled, and sample their first token.
 * Preempting a request releases all its KV, sets C = 0, counts a preemption and puts it at the
 * FRONT of the waiting queue (so several preempted in one step end up oldest first). It keeps its
 * generated tokens and is later recomputed as a prefill of all T = P + G tokens, which samples its
 * next token; nothing is ever dropped.
 * The waiting queue is [preempted requests, most recently pushed first] followed by
 * [never-run requests sorted by (priority, arrival, add order)]; a lower priority value runs
 * first. Priority only orders the waiting queue: the victim is always the most recently admitted.
 * Batch entries come out as: decodes, then prefill continuations, then admissions.
 *
 * gy_sched_commit(now, stop): for each entry whose request still runs (not aborted meanwhile):
 * stop[i] == FAIL finishes it (reason ERROR, nothing of the step counted); otherwise C += n, and
 * if it samples, G += 1 and the request finishes when stop[i] == STOP (reason STOP) or G reaches
 * max_new_tokens (reason LENGTH); a finished request releases its KV.
 *
 * Liveness: the oldest running request is preempted only after every newer one, and it alone fits
 * the whole cache (gy_sched_add refuses a request when ceil((P + max_new_tokens) / block_size) >
 * total_blocks), so some request always makes progress.
 *
 * Determinism: the batches depend only on the sequence of calls and their arguments (including
 * the ops' answers), never on addresses or hash order. */
#ifndef GY_SCHED_BATCH_H
#define GY_SCHED_BATCH_H

#include <stdint.h>

#include "../core/status.h"
#include "kv_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gy_sched_state {
    GY_SCHED_STATE_WAITING = 0,   /* queued, never run */
    GY_SCHED_STATE_PREEMPTED = 1, /* queued again after a preemption; will be recomputed */
    GY_SCHED_STATE_RUNNING = 2,
    GY_SCHED_STATE_FINISHED = 3,
    GY_SCHED_STATE_COUNT
} gy_sched_state;

typedef enum gy_sched_finish {
    GY_SCHED_FINISH_NONE = 0,   /* not finished */
    GY_SCHED_FINISH_STOP = 1,   /* the engine said so at commit (EOS, stop string) */
    GY_SCHED_FINISH_LENGTH = 2, /* max_new_tokens generated */
    GY_SCHED_FINISH_ABORT = 3,  /* gy_sched_abort */
    GY_SCHED_FINISH_ERROR = 4,  /* the engine failed it at commit (GY_SCHED_END_FAIL) */
} gy_sched_finish;

/* How the engine ends an entry's request at commit (the `stop` flags). */
typedef enum gy_sched_end {
    GY_SCHED_END_NONE = 0,
    GY_SCHED_END_STOP = 1, /* it sampled a stop token */
    GY_SCHED_END_FAIL = 2, /* the step failed for this request alone */
} gy_sched_end;

typedef struct gy_sched_config {
    int64_t total_blocks;      /* KV blocks of the instance (for the submit-time check) */
    int64_t block_size;        /* tokens per block */
    int64_t max_batch_tokens;  /* tokens per step, >= 1 */
    int64_t max_running;       /* running requests admission stops at, >= 1 (an adoption may
                                  bring more: gy_sched_adopt) */
    int64_t max_prefill_chunk; /* tokens of one request's prefill per step; 0 = no cap */
    int64_t watermark_blocks;  /* blocks admission leaves free; 0 = none; < total_blocks */
} gy_sched_config;

/* What the caller submits. */
typedef struct gy_sched_request {
    int64_t id;             /* the caller's; unique among the requests the scheduler remembers */
    int64_t prompt_len;     /* >= 1 */
    int64_t max_new_tokens; /* >= 1 */
    double arrival;         /* invisible to gy_sched_schedule while now < arrival */
    int32_t priority;       /* lower runs first; 0 for FCFS */
} gy_sched_request;

/* One request's share of a step: tokens [pos, pos + n_tokens) of its known tokens. */
typedef struct gy_sched_entry {
    int64_t id;
    int64_t pos;          /* first position; 0 for an admission */
    int64_t n_tokens;
    int64_t sample_index; /* G: the index among generated tokens of the token sampled here */
    uint8_t samples;      /* 1: the chunk reaches the last known token, so sample one token */
    uint8_t is_prefill;   /* 0 for decode entries */
} gy_sched_entry;

/* Owned by the scheduler; valid until the next gy_sched_schedule. */
typedef struct gy_sched_batch {
    int64_t n_entries;
    const gy_sched_entry *entries; /* (n_entries): decodes, continuations, admissions */
    int64_t n_tokens;              /* sum of n_tokens, <= max_batch_tokens */
    int64_t n_decode;              /* entries with is_prefill == 0 */
    int64_t n_preempted;
    const int64_t *preempted;      /* (n_preempted) ids preempted this step, in preemption order */
    int64_t n_parked;
    const int64_t *parked;         /* (n_parked) ids parked this step (prefill only), in order */
} gy_sched_batch;

/* Owned by the scheduler; valid until the next gy_sched_commit. */
typedef struct gy_sched_done {
    int64_t n_finished;
    const int64_t *finished; /* (n_finished) ids finished by this commit, in entry order */
} gy_sched_done;

typedef struct gy_sched_info {
    gy_sched_state state;
    gy_sched_finish finish;
    int64_t prompt_len;
    int64_t max_new_tokens;
    int32_t priority;
    int64_t n_generated;     /* G */
    int64_t n_computed;      /* C */
    int64_t prefill_end;     /* E while running, else 0 */
    int64_t n_preemptions;
    double arrival;
    double first_scheduled;  /* `now` of its first admission; NaN before */
    double first_token;      /* `now` of the commit of its first token; NaN before */
    double finished_at;      /* `now` of the commit (or the last known time for an abort); NaN */
} gy_sched_info;

typedef struct gy_sched_stats {
    int64_t n_waiting;        /* state WAITING */
    int64_t n_preempted;      /* state PREEMPTED (queued) */
    int64_t n_running;
    int64_t n_finished;       /* finished and not yet forgotten */
    int64_t n_steps;          /* schedule calls */
    int64_t n_preemptions;    /* preemptions ever */
    int64_t free_blocks;      /* from the ops */
    int32_t in_flight;        /* 1 between schedule and commit */
} gy_sched_stats;

typedef struct gy_sched gy_sched;

/* `ops` is copied; its ctx must outlive the scheduler. */
gy_status gy_sched_init(gy_sched **out, const gy_sched_config *config, const gy_sched_kv_ops *ops);
/* Releases the KV of every running request through the ops, then frees the scheduler. */
void gy_sched_free(gy_sched *s);

/* Queues a request; refuses (GY_ERR_INVALID, naming the cause) a prompt_len or max_new_tokens
 * below 1, a non-finite arrival, an id in use, or a request that could never fit:
 * ceil((prompt_len + max_new_tokens) / block_size) > total_blocks. */
gy_status gy_sched_add(gy_sched *s, const gy_sched_request *request);
/* One step of the policy above. `now` is finite and never below an earlier call's. */
gy_status gy_sched_schedule(gy_sched *s, double now, gy_sched_batch *out);
/* Ends the step; `stop` is (n) gy_sched_end values aligned with the batch's entries
 * (n == batch.n_entries; NULL when none ended). `done` (may be NULL) lists the requests it
 * finished. */
gy_status gy_sched_commit(gy_sched *s, double now, const uint8_t *stop, int64_t n,
                          gy_sched_done *done);
/* Takes back the step under way, which did not run: every request's state, progress, place in
 * its queue, and the statistics are as before its schedule (the ops' changes are the caller's to
 * undo). Refused (GY_ERR_STATE) when requests were added, adopted or aborted since. */
gy_status gy_sched_cancel(gy_sched *s);
/* Finishes a queued or running request (reason ABORT) and releases its KV; an entry of it in the
 * step under way is then ignored by commit. */
gy_status gy_sched_abort(gy_sched *s, int64_t id);
/* Takes over a request from another scheduler with its progress (a live transformation moves
 * requests between instances without recomputing them). `info` is what gy_sched_info_get said
 * in the old scheduler: RUNNING requests arrive running, with n_computed tokens of KV that the
 * caller has already placed behind this scheduler's KV ops; WAITING and PREEMPTED ones arrive
 * queued. A running one beyond max_running is taken too (the running set grows): a merge of
 * instances keeps every request running, and admission waits until fewer than max_running run.
 * Refused (nothing changed) when the state is inconsistent. */
gy_status gy_sched_adopt(gy_sched *s, const gy_sched_request *request, const gy_sched_info *info);
/* Lets go of a queued or running request that another scheduler has adopted: it leaves its
 * queue or the running set and its record goes, with no finish reason and nothing counted (it
 * did not end, it moved). Its KV belongs to the adopter now, so the ops' release is not called.
 * An entry of it in the step under way is then ignored by commit, as after an abort. */
gy_status gy_sched_release(gy_sched *s, int64_t id);
/* Drops a finished request's record so its memory and id can be reused. */
gy_status gy_sched_forget(gy_sched *s, int64_t id);

/* The entries of the step under way (n = 0 and NULL when none), as schedule returned them. */
const gy_sched_entry *gy_sched_step_entries(const gy_sched *s, int64_t *n);
gy_status gy_sched_info_get(const gy_sched *s, int64_t id, gy_sched_info *out);
void gy_sched_stats_get(const gy_sched *s, gy_sched_stats *out);
/* held != 0 skips step 3 (admission) until released: running requests go on, queued and
 * preempted ones wait (a Flying Serving member draining before it binds into a TP group). */
void gy_sched_hold(gy_sched *s, int held);
/* on != 0: prefill only (THE POLICY above) from the next schedule on; 0: decodes again, the
 * parked requests first (they head the preempted queue's parked part, oldest first). */
void gy_sched_prefill_only(gy_sched *s, int on);
/* The blocks the submit-time check compares a request with (the instance's KV changed size:
 * a follower in another process holds fewer, engine/peer.h). */
void gy_sched_set_total_blocks(gy_sched *s, int64_t total_blocks);
const gy_sched_config *gy_sched_config_of(const gy_sched *s);
/* The running requests one step may touch: max_running, or more after adoptions beyond it. */
int64_t gy_sched_running_capacity(const gy_sched *s);
const char *gy_sched_state_name(gy_sched_state state);
const char *gy_sched_finish_name(gy_sched_finish finish);

#ifdef __cplusplus
}
#endif
#endif
