/* batch.c: the continuous-batching policy described in batch.h. Requests live in a pool of slots
 * found by id through an id map; the waiting queue is two linked lists (preempted, then never-run
 * sorted by key), the running set an array in admission order. */
#include "batch.h"
#include "../core/alloc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "idmap.h"

typedef struct gy_sched_req {
    int64_t id;
    int64_t prompt_len;    /* P */
    int64_t max_new;
    int64_t n_generated;   /* G */
    int64_t n_computed;    /* C */
    int64_t prefill_end;   /* E, while running */
    int64_t n_preemptions;
    int64_t admission;     /* admission number while running; larger = more recent */
    int64_t add_order;     /* tie-breaker of the waiting order */
    double arrival, first_scheduled, first_token, finished_at;
    int32_t priority;
    gy_sched_state state;
    gy_sched_finish finish;
    int64_t prev, next;    /* links in its queue (slots; -1 at the ends) */
    int64_t entry;         /* its entry in the step under way, or -1 */
} gy_sched_req;

typedef struct gy_sched_queue {
    int64_t head, tail; /* slots; -1 when empty */
} gy_sched_queue;

struct gy_sched {
    gy_sched_config config;
    gy_sched_kv_ops ops;

    gy_sched_req *reqs;   /* (capacity) the pool */
    int64_t capacity;
    int64_t *free_slots;  /* (capacity) stack of unused slots */
    int64_t n_free_slots;
    gy_idmap by_id;       /* id -> slot */

    gy_sched_queue preempted_q; /* most recently preempted first */
    gy_sched_queue waiting_q;   /* never run, sorted by (priority, arrival, add_order) */
    /* Arrays of running_cap, at least max_running: admission stops at max_running, but an
     * adoption (a merge of instances) may bring more running requests, and the room grows. */
    int64_t running_cap;
    int64_t *running;           /* (running_cap) slots, admission order */
    int64_t n_running;

    gy_sched_entry *entries;    /* (running_cap) the step under way */
    int64_t *entry_slot;        /* (running_cap) slot of each entry */
    int64_t n_entries;
    int64_t *preempted;         /* (running_cap) ids preempted by the last schedule */
    int64_t n_preempted;
    int64_t *parked;            /* (running_cap) ids parked by the last schedule */
    int64_t n_parked;
    int64_t *finished;          /* (running_cap) ids finished by the last commit */
    int64_t n_finished_step;

    int64_t counts[GY_SCHED_STATE_COUNT];
    int64_t next_admission, next_add_order;
    int64_t n_steps, n_preemptions;
    double now;                 /* the latest time seen */
    int32_t in_flight;
    int32_t held;               /* gy_sched_hold: no admissions */
    int32_t prefill_only;       /* gy_sched_prefill_only: decodes are parked */

    /* The undo record of the step under way (a schedule that fails half-way, gy_sched_cancel):
     * a copy of each request before schedule changed it (a request may be copied more than
     * once; restoring in reverse order ends with its first copy) and what else it changed. */
    int recording;              /* schedule is running: copy before changing */
    int undoable;               /* the record describes the step under way */
    gy_sched_req *saved;        /* (n_saved) */
    int64_t *saved_slot;        /* (n_saved) */
    int64_t n_saved, saved_cap; /* room reserved before the step: it never runs out */
    int64_t *saved_running;     /* (running_cap) */
    int64_t saved_n_running;
    gy_sched_queue saved_preempted_q, saved_waiting_q;
    int64_t saved_counts[GY_SCHED_STATE_COUNT];
    int64_t saved_next_admission, saved_n_preemptions;
    double saved_now;
};

const char *gy_sched_state_name(gy_sched_state state) {
    switch (state) {
    case GY_SCHED_STATE_WAITING: return "waiting";
    case GY_SCHED_STATE_PREEMPTED: return "preempted";
    case GY_SCHED_STATE_RUNNING: return "running";
    case GY_SCHED_STATE_FINISHED: return "finished";
    default: return "unknown";
    }
}

const char *gy_sched_finish_name(gy_sched_finish finish) {
    switch (finish) {
    case GY_SCHED_FINISH_NONE: return "none";
    case GY_SCHED_FINISH_STOP: return "stop";
    case GY_SCHED_FINISH_LENGTH: return "length";
    case GY_SCHED_FINISH_ABORT: return "abort";
    case GY_SCHED_FINISH_ERROR: return "error";
    default: return "unknown";
    }
}

/* The arrays of the running set with room for `cap` requests (cap > running_cap). On failure
 * the room is as it was (an array already grown is only larger than needed). */
static gy_status gy_sched_grow_running(gy_sched *s, int64_t cap) {
    const size_t m = (size_t)cap;
#define GY_SCHED_GROW(field)                                                                     \
    do {                                                                                         \
        void *grown = gy_realloc(s->field, m * sizeof *s->field);                                \
        if (grown == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for %lld running "  \
                                          "requests", (long long)cap);                           \
        s->field = grown;                                                                        \
    } while (0)
    GY_SCHED_GROW(running);
    GY_SCHED_GROW(entries);
    GY_SCHED_GROW(entry_slot);
    GY_SCHED_GROW(preempted);
    GY_SCHED_GROW(parked);
    GY_SCHED_GROW(finished);
    GY_SCHED_GROW(saved_running);
#undef GY_SCHED_GROW
    s->running_cap = cap;
    return GY_OK;
}

gy_status gy_sched_init(gy_sched **out, const gy_sched_config *c, const gy_sched_kv_ops *ops) {
    if (out == NULL || c == NULL || ops == NULL)
        return GY_FAIL(GY_ERR_INVALID, "gy_sched_init: NULL argument");
    *out = NULL;
    if (ops->free_blocks == NULL || ops->blocks_needed == NULL || ops->reserve == NULL ||
        ops->release == NULL)
        return GY_FAIL(GY_ERR_INVALID, "scheduler KV ops table has a NULL entry");
    if (c->total_blocks <= 0 || c->block_size <= 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "scheduler needs total_blocks > 0 and block_size > 0 (got %lld, %lld)",
                       (long long)c->total_blocks, (long long)c->block_size);
    if (c->max_batch_tokens <= 0 || c->max_running <= 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "scheduler needs max_batch_tokens >= 1 and max_running >= 1 (got %lld, %lld)",
                       (long long)c->max_batch_tokens, (long long)c->max_running);
    if (c->max_running > (INT64_C(1) << 32))
        return GY_FAIL(GY_ERR_INVALID, "max_running %lld is absurdly large",
                       (long long)c->max_running);
    if (c->max_prefill_chunk < 0)
        return GY_FAIL(GY_ERR_INVALID, "max_prefill_chunk must be >= 0 (0 = no cap), got %lld",
                       (long long)c->max_prefill_chunk);
    if (c->watermark_blocks < 0 || c->watermark_blocks >= c->total_blocks)
        return GY_FAIL(GY_ERR_INVALID, "watermark_blocks must be in [0, total_blocks=%lld), got %lld",
                       (long long)c->total_blocks, (long long)c->watermark_blocks);
    gy_sched *s = gy_calloc(1, sizeof *s);
    if (s == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    s->config = *c;
    s->ops = *ops;
    s->preempted_q.head = s->preempted_q.tail = -1;
    s->waiting_q.head = s->waiting_q.tail = -1;
    s->now = -INFINITY;
    if (gy_sched_grow_running(s, c->max_running) != GY_OK) {
        gy_sched_free(s);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for max_running=%lld",
                       (long long)c->max_running);
    }
    *out = s;
    return GY_OK;
}

void gy_sched_free(gy_sched *s) {
    if (s == NULL) return;
    for (int64_t i = 0; i < s->n_running; i++) s->ops.release(s->ops.ctx, s->reqs[s->running[i]].id);
    gy_idmap_free(&s->by_id);
    free(s->reqs);
    free(s->free_slots);
    free(s->running);
    free(s->entries);
    free(s->entry_slot);
    free(s->preempted);
    free(s->parked);
    free(s->finished);
    free(s->saved);
    free(s->saved_slot);
    free(s->saved_running);
    free(s);
}

const gy_sched_config *gy_sched_config_of(const gy_sched *s) { return &s->config; }

int64_t gy_sched_running_capacity(const gy_sched *s) { return s->running_cap; }

/* ---- the undo record ---- */

/* Copies request `slot` before schedule changes it. The room was reserved when the step began
 * (gy_sched_record_begin), so this cannot fail. */
static void gy_sched_save(gy_sched *s, int64_t slot) {
    if (!s->recording || slot < 0 || s->n_saved >= s->saved_cap) return;
    s->saved[s->n_saved] = s->reqs[slot];
    s->saved_slot[s->n_saved++] = slot;
}

/* A schedule copies at most 11 requests per request it touches (a preemption: the victim, its
 * state and the queue it joins; an admission: the queue it leaves, its state, its entry), and
 * it touches at most the running set's room (running_cap: max_running, or more after adoptions
 * past it), twice that when it parks them (prefill only: the parked, then as many admitted). */
static gy_status gy_sched_record_begin(gy_sched *s) {
    const int64_t need = 24 * s->running_cap + 16;
    if (s->saved_cap < need) {
        gy_sched_req *saved = gy_realloc(s->saved, (size_t)need * sizeof *saved);
        if (saved == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a step's undo record");
        s->saved = saved;
        int64_t *slots = gy_realloc(s->saved_slot, (size_t)need * sizeof *slots);
        if (slots == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a step's undo record");
        s->saved_slot = slots;
        s->saved_cap = need;
    }
    s->n_saved = 0;
    memcpy(s->saved_running, s->running, (size_t)s->n_running * sizeof *s->running);
    s->saved_n_running = s->n_running;
    s->saved_preempted_q = s->preempted_q;
    s->saved_waiting_q = s->waiting_q;
    memcpy(s->saved_counts, s->counts, sizeof s->counts);
    s->saved_next_admission = s->next_admission;
    s->saved_n_preemptions = s->n_preemptions;
    s->saved_now = s->now;
    s->recording = 1;
    s->undoable = 1;
    return GY_OK;
}

/* Everything back as it was before the schedule that began the record. */
static void gy_sched_record_undo(gy_sched *s) {
    for (int64_t i = s->n_saved - 1; i >= 0; i--) s->reqs[s->saved_slot[i]] = s->saved[i];
    memcpy(s->running, s->saved_running, (size_t)s->saved_n_running * sizeof *s->running);
    s->n_running = s->saved_n_running;
    s->preempted_q = s->saved_preempted_q;
    s->waiting_q = s->saved_waiting_q;
    memcpy(s->counts, s->saved_counts, sizeof s->counts);
    s->next_admission = s->saved_next_admission;
    s->n_preemptions = s->saved_n_preemptions;
    s->now = s->saved_now;
    s->n_entries = s->n_preempted = s->n_parked = 0;
    s->recording = s->undoable = 0;
    s->n_saved = 0;
}

static gy_status gy_sched_lookup(const gy_sched *s, int64_t id, int64_t *slot) {
    if (!gy_idmap_get(&s->by_id, id, slot))
        return GY_FAIL(GY_ERR_INVALID, "no request with id %lld", (long long)id);
    return GY_OK;
}

static void gy_sched_set_state(gy_sched *s, gy_sched_req *r, gy_sched_state state) {
    gy_sched_save(s, r - s->reqs);
    s->counts[r->state]--;
    s->counts[state]++;
    r->state = state;
}

/* ---- the queues ---- */

static void gy_sched_queue_unlink(gy_sched *s, gy_sched_queue *q, int64_t slot) {
    gy_sched_req *r = &s->reqs[slot];
    gy_sched_save(s, slot);
    gy_sched_save(s, r->prev);
    gy_sched_save(s, r->next);
    if (r->prev >= 0) s->reqs[r->prev].next = r->next; else q->head = r->next;
    if (r->next >= 0) s->reqs[r->next].prev = r->prev; else q->tail = r->prev;
    r->prev = r->next = -1;
}

/* Links `slot` after `after` (-1: at the head). */
static void gy_sched_queue_link(gy_sched *s, gy_sched_queue *q, int64_t after, int64_t slot) {
    gy_sched_req *r = &s->reqs[slot];
    gy_sched_save(s, slot);
    gy_sched_save(s, after);
    gy_sched_save(s, after >= 0 ? s->reqs[after].next : q->head);
    r->prev = after;
    r->next = after >= 0 ? s->reqs[after].next : q->head;
    if (r->next >= 0) s->reqs[r->next].prev = slot; else q->tail = slot;
    if (after >= 0) s->reqs[after].next = slot; else q->head = slot;
}

static int gy_sched_key_le(const gy_sched_req *a, const gy_sched_req *b) {
    if (a->priority != b->priority) return a->priority < b->priority;
    if (a->arrival != b->arrival) return a->arrival < b->arrival;
    return a->add_order <= b->add_order;
}

static gy_sched_queue *gy_sched_queue_of(gy_sched *s, const gy_sched_req *r) {
    return r->state == GY_SCHED_STATE_PREEMPTED ? &s->preempted_q : &s->waiting_q;
}

/* ---- the pool ---- */

static gy_status gy_sched_new_slot(gy_sched *s, int64_t *slot) {
    if (s->n_free_slots == 0) {
        const int64_t capacity = s->capacity ? 2 * s->capacity : 64;
        gy_sched_req *reqs = gy_realloc(s->reqs, (size_t)capacity * sizeof *reqs);
        if (reqs == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for requests");
        s->reqs = reqs;
        int64_t *free_slots = gy_realloc(s->free_slots, (size_t)capacity * sizeof *free_slots);
        if (free_slots == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for requests");
        s->free_slots = free_slots;
        for (int64_t i = capacity - 1; i >= s->capacity; i--) s->free_slots[s->n_free_slots++] = i;
        s->capacity = capacity;
    }
    *slot = s->free_slots[--s->n_free_slots];
    return GY_OK;
}

gy_status gy_sched_add(gy_sched *s, const gy_sched_request *q) {
    if (s == NULL || q == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_add: NULL argument");
    const int64_t limit = INT64_C(1) << 40; /* keeps every sum of lengths far from overflow */
    if (q->prompt_len < 1 || q->prompt_len > limit)
        return GY_FAIL(GY_ERR_INVALID, "request %lld: prompt length must be in [1, 2^40], got %lld",
                       (long long)q->id, (long long)q->prompt_len);
    if (q->max_new_tokens < 1 || q->max_new_tokens > limit)
        return GY_FAIL(GY_ERR_INVALID,
                       "request %lld: max_new_tokens must be in [1, 2^40], got %lld",
                       (long long)q->id, (long long)q->max_new_tokens);
    if (!isfinite(q->arrival))
        return GY_FAIL(GY_ERR_INVALID, "request %lld: arrival time must be finite",
                       (long long)q->id);
    const int64_t total = q->prompt_len + q->max_new_tokens;
    const int64_t blocks = total / s->config.block_size + (total % s->config.block_size != 0);
    if (blocks > s->config.total_blocks)
        return GY_FAIL(GY_ERR_INVALID,
                       "request %lld can never fit: prompt %lld + max_new_tokens %lld = %lld tokens "
                       "need %lld blocks of %lld tokens, but the KV cache has %lld blocks",
                       (long long)q->id, (long long)q->prompt_len, (long long)q->max_new_tokens,
                       (long long)total, (long long)blocks, (long long)s->config.block_size,
                       (long long)s->config.total_blocks);
    int64_t slot;
    if (gy_idmap_get(&s->by_id, q->id, &slot))
        return GY_FAIL(GY_ERR_INVALID, "request id %lld is already in use (%s)", (long long)q->id,
                       gy_sched_state_name(s->reqs[slot].state));
    GY_TRY(gy_sched_new_slot(s, &slot));
    gy_status st = gy_idmap_put(&s->by_id, q->id, slot);
    if (st != GY_OK) {
        s->free_slots[s->n_free_slots++] = slot;
        return st;
    }
    s->undoable = 0; /* a step under way can no longer be cancelled */
    gy_sched_req *r = &s->reqs[slot];
    memset(r, 0, sizeof *r);
    r->id = q->id;
    r->prompt_len = q->prompt_len;
    r->max_new = q->max_new_tokens;
    r->arrival = q->arrival;
    r->priority = q->priority;
    r->add_order = s->next_add_order++;
    r->first_scheduled = r->first_token = r->finished_at = NAN;
    r->state = GY_SCHED_STATE_WAITING;
    r->finish = GY_SCHED_FINISH_NONE;
    r->entry = -1;
    s->counts[GY_SCHED_STATE_WAITING]++;
    /* Sorted insert from the tail: arrivals usually come in order, so this is O(1). */
    int64_t after = s->waiting_q.tail;
    while (after >= 0 && !gy_sched_key_le(&s->reqs[after], r)) after = s->reqs[after].prev;
    gy_sched_queue_link(s, &s->waiting_q, after, slot);
    return GY_OK;
}

gy_status gy_sched_adopt(gy_sched *s, const gy_sched_request *q, const gy_sched_info *info) {
    if (s == NULL || q == NULL || info == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_adopt: NULL argument");
    if (s->in_flight) return GY_FAIL(GY_ERR_STATE, "cannot adopt a request while a step is in flight");
    const gy_sched_state state = info->state;
    if (state == GY_SCHED_STATE_FINISHED || (int)state < 0 || state >= GY_SCHED_STATE_COUNT)
        return GY_FAIL(GY_ERR_INVALID, "request %lld: only unfinished requests can be adopted", (long long)q->id);
    if (info->n_generated < 0 || info->n_generated >= q->max_new_tokens ||
        info->n_computed < 0 || info->n_computed > q->prompt_len + info->n_generated ||
        (state == GY_SCHED_STATE_WAITING && (info->n_generated != 0 || info->n_computed != 0)) ||
        (state == GY_SCHED_STATE_RUNNING && (info->prefill_end < 1 ||
                                             info->prefill_end > q->prompt_len + info->n_generated)))
        return GY_FAIL(GY_ERR_INVALID, "request %lld: inconsistent progress (G=%lld, C=%lld, E=%lld)",
                       (long long)q->id, (long long)info->n_generated, (long long)info->n_computed,
                       (long long)info->prefill_end);
    /* Beyond max_running the running set grows: a merged instance runs on what its parts ran
     * (and admits nothing new until fewer than max_running run). */
    if (state == GY_SCHED_STATE_RUNNING && s->n_running >= s->running_cap)
        GY_TRY(gy_sched_grow_running(s, 2 * s->running_cap));
    if (state == GY_SCHED_STATE_WAITING) return gy_sched_add(s, q);
    GY_TRY(gy_sched_add(s, q));
    int64_t slot;
    GY_TRY(gy_sched_lookup(s, q->id, &slot));
    gy_sched_req *r = &s->reqs[slot];
    gy_sched_queue_unlink(s, &s->waiting_q, slot);
    s->counts[GY_SCHED_STATE_WAITING]--;
    r->n_generated = info->n_generated;
    r->n_preemptions = info->n_preemptions;
    r->first_scheduled = info->first_scheduled;
    r->first_token = info->first_token;
    if (state == GY_SCHED_STATE_RUNNING) {
        r->n_computed = info->n_computed;
        r->prefill_end = info->prefill_end;
        r->admission = s->next_admission++;
        r->state = GY_SCHED_STATE_RUNNING;
        s->running[s->n_running++] = slot;
    } else {
        /* Queued after a preemption: it will be recomputed from scratch, behind the others. */
        r->n_computed = 0;
        r->state = GY_SCHED_STATE_PREEMPTED;
        gy_sched_queue_link(s, &s->preempted_q, s->preempted_q.tail, slot);
    }
    s->counts[r->state]++;
    return GY_OK;
}

/* ---- one step ---- */

static void gy_sched_remove_running(gy_sched *s, int64_t slot) {
    for (int64_t i = 0; i < s->n_running; i++) {
        if (s->running[i] != slot) continue;
        memmove(&s->running[i], &s->running[i + 1],
                (size_t)(s->n_running - i - 1) * sizeof *s->running);
        s->n_running--;
        return;
    }
}

static void gy_sched_remove_entry(gy_sched *s, int64_t e) {
    memmove(&s->entries[e], &s->entries[e + 1], (size_t)(s->n_entries - e - 1) * sizeof *s->entries);
    memmove(&s->entry_slot[e], &s->entry_slot[e + 1],
            (size_t)(s->n_entries - e - 1) * sizeof *s->entry_slot);
    s->n_entries--;
    for (int64_t i = e; i < s->n_entries; i++) s->reqs[s->entry_slot[i]].entry = i;
}

/* Preempts the most recently admitted running request; returns its slot. */
static int64_t gy_sched_preempt_newest(gy_sched *s, int64_t *budget) {
    const int64_t slot = s->running[s->n_running - 1]; /* running is in admission order */
    gy_sched_req *v = &s->reqs[slot];
    gy_sched_save(s, slot);
    if (v->entry >= 0) {
        *budget += s->entries[v->entry].n_tokens;
        gy_sched_remove_entry(s, v->entry);
        v->entry = -1;
    }
    s->ops.release(s->ops.ctx, v->id);
    s->n_running--;
    v->n_computed = 0;
    v->prefill_end = 0;
    v->n_preemptions++;
    s->n_preemptions++;
    gy_sched_set_state(s, v, GY_SCHED_STATE_PREEMPTED);
    gy_sched_queue_link(s, &s->preempted_q, -1, slot);
    s->preempted[s->n_preempted++] = v->id;
    return slot;
}

/* Prefill only: parks every running request in decode, oldest admission first (THE POLICY). */
static void gy_sched_park_decodes(gy_sched *s) {
    for (int64_t i = 0; i < s->n_running;) {
        const int64_t slot = s->running[i];
        gy_sched_req *r = &s->reqs[slot];
        if (r->n_computed < r->prefill_end) {
            i++;
            continue;
        }
        gy_sched_save(s, slot);
        s->ops.release(s->ops.ctx, r->id);
        gy_sched_remove_running(s, slot);
        r->n_computed = 0;
        r->prefill_end = 0;
        gy_sched_set_state(s, r, GY_SCHED_STATE_PREEMPTED);
        gy_sched_queue_link(s, &s->preempted_q, s->preempted_q.tail, slot);
        s->parked[s->n_parked++] = r->id;
    }
}

/* 1 and reserved when the request fits n_tokens in total (after `margin` free blocks), 0 when
 * not, -1 when the backend failed (*failure set, its message kept). */
static int gy_sched_try_reserve(gy_sched *s, const gy_sched_req *r, int64_t n_tokens,
                                int64_t margin, gy_status *failure) {
    const int64_t need = s->ops.blocks_needed(s->ops.ctx, r->id, n_tokens);
    if (need + margin > s->ops.free_blocks(s->ops.ctx)) return 0;
    const gy_status st = s->ops.reserve(s->ops.ctx, r->id, n_tokens);
    if (st == GY_OK) return 1;
    if (st == GY_ERR_OUT_OF_MEMORY) return 0;
    *failure = st;
    return -1;
}

static void gy_sched_emit(gy_sched *s, int64_t slot, int64_t n, int64_t *budget) {
    gy_sched_req *r = &s->reqs[slot];
    gy_sched_save(s, slot);
    const int64_t e = s->n_entries++;
    const int prefill = r->n_computed < r->prefill_end;
    s->entries[e] = (gy_sched_entry){
        .id = r->id,
        .pos = r->n_computed,
        .n_tokens = n,
        .sample_index = r->n_generated,
        .samples = (uint8_t)(!prefill || r->n_computed + n == r->prefill_end),
        .is_prefill = (uint8_t)prefill,
    };
    s->entry_slot[e] = slot;
    r->entry = e;
    *budget -= n;
}

static int64_t gy_sched_chunk(const gy_sched *s, int64_t remaining, int64_t budget) {
    int64_t n = remaining < budget ? remaining : budget;
    if (s->config.max_prefill_chunk > 0 && n > s->config.max_prefill_chunk)
        n = s->config.max_prefill_chunk;
    return n;
}

/* Passes 1 and 2: running requests in the given phase, oldest first. */
static gy_status gy_sched_run_pass(gy_sched *s, int decode, int64_t *budget) {
    /* Iterate by admission number: preemptions shrink `running` from the end only, so indices
     * below the current one never move. */
    for (int64_t i = 0; i < s->n_running && *budget > 0; i++) {
        const int64_t slot = s->running[i];
        gy_sched_req *r = &s->reqs[slot];
        const int in_decode = r->n_computed >= r->prefill_end;
        if (in_decode != decode) continue;
        const int64_t n = decode ? 1 : gy_sched_chunk(s, r->prefill_end - r->n_computed, *budget);
        for (;;) {
            gy_status failure = GY_OK;
            const int fit = gy_sched_try_reserve(s, r, r->n_computed + n, 0, &failure);
            if (fit < 0) return failure;
            if (fit) {
                gy_sched_emit(s, slot, n, budget);
                break;
            }
            if (gy_sched_preempt_newest(s, budget) == slot) break;
        }
    }
    return GY_OK;
}

static gy_status gy_sched_admit(gy_sched *s, double now, int64_t *budget) {
    gy_sched_queue *queues[2] = {&s->preempted_q, &s->waiting_q};
    for (int q = 0; q < 2; q++) {
        int64_t slot = queues[q]->head;
        while (slot >= 0) {
            if (*budget <= 0 || s->n_running >= s->config.max_running) return GY_OK;
            gy_sched_req *r = &s->reqs[slot];
            const int64_t next = r->next;
            if (r->arrival > now || (s->prefill_only && r->n_generated > 0)) {
                slot = next;
                continue;
            }
            const int64_t total = r->prompt_len + r->n_generated;
            const int64_t n = gy_sched_chunk(s, total, *budget);
            /* the watermark protects running requests; with none, a lone request always fits */
            const int64_t margin = s->n_running > 0 ? s->config.watermark_blocks : 0;
            gy_status failure = GY_OK;
            const int fit = gy_sched_try_reserve(s, r, n, margin, &failure);
            if (fit < 0) return failure;
            if (!fit) return GY_OK; /* head-of-line blocking */
            gy_sched_save(s, slot);
            gy_sched_queue_unlink(s, queues[q], slot);
            gy_sched_set_state(s, r, GY_SCHED_STATE_RUNNING);
            r->n_computed = 0;
            r->prefill_end = total;
            r->admission = s->next_admission++;
            if (isnan(r->first_scheduled)) r->first_scheduled = now;
            s->running[s->n_running++] = slot;
            gy_sched_emit(s, slot, n, budget);
            slot = next;
        }
    }
    return GY_OK;
}

static gy_status gy_sched_check_time(gy_sched *s, double now) {
    if (!isfinite(now))
        return GY_FAIL(GY_ERR_INVALID, "the scheduler's time must be finite");
    if (now < s->now)
        return GY_FAIL(GY_ERR_INVALID, "time went backwards: %.17g after %.17g", now, s->now);
    return GY_OK;
}

gy_status gy_sched_schedule(gy_sched *s, double now, gy_sched_batch *out) {
    if (s == NULL || out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_schedule: NULL argument");
    memset(out, 0, sizeof *out);
    if (s->in_flight)
        return GY_FAIL(GY_ERR_STATE, "a step is under way: commit it before scheduling the next");
    GY_TRY(gy_sched_check_time(s, now));
    GY_TRY(gy_sched_record_begin(s));
    s->now = now;
    s->n_entries = 0;
    s->n_preempted = s->n_parked = 0;
    if (s->prefill_only) gy_sched_park_decodes(s);
    int64_t budget = s->config.max_batch_tokens;
    gy_status st = gy_sched_run_pass(s, 1, &budget);
    if (st == GY_OK) st = gy_sched_run_pass(s, 0, &budget);
    if (st == GY_OK && s->n_preempted == 0 && !s->held) st = gy_sched_admit(s, now, &budget);
    s->recording = 0;
    if (st != GY_OK) {
        gy_sched_record_undo(s); /* the ops' own changes are the caller's to undo */
        return st;
    }
    s->in_flight = 1;
    s->n_steps++;
    out->n_entries = s->n_entries;
    out->entries = s->entries;
    out->n_preempted = s->n_preempted;
    out->preempted = s->preempted;
    out->n_parked = s->n_parked;
    out->parked = s->parked;
    for (int64_t i = 0; i < s->n_entries; i++) {
        out->n_tokens += s->entries[i].n_tokens;
        out->n_decode += !s->entries[i].is_prefill;
    }
    return GY_OK;
}

static void gy_sched_finish_request(gy_sched *s, int64_t slot, gy_sched_finish why, double now) {
    gy_sched_req *r = &s->reqs[slot];
    if (r->state == GY_SCHED_STATE_RUNNING) {
        s->ops.release(s->ops.ctx, r->id);
        gy_sched_remove_running(s, slot);
    } else if (r->state == GY_SCHED_STATE_WAITING || r->state == GY_SCHED_STATE_PREEMPTED) {
        gy_sched_queue_unlink(s, gy_sched_queue_of(s, r), slot);
    }
    gy_sched_set_state(s, r, GY_SCHED_STATE_FINISHED);
    r->finish = why;
    r->finished_at = now;
    r->entry = -1;
    r->prefill_end = 0;
}

gy_status gy_sched_commit(gy_sched *s, double now, const uint8_t *stop, int64_t n,
                          gy_sched_done *done) {
    if (s == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_commit: NULL scheduler");
    if (done != NULL) memset(done, 0, sizeof *done);
    if (!s->in_flight) return GY_FAIL(GY_ERR_STATE, "no step is under way: schedule one first");
    if (n != s->n_entries)
        return GY_FAIL(GY_ERR_INVALID, "commit got %lld stop flags for a batch of %lld entries",
                       (long long)n, (long long)s->n_entries);
    GY_TRY(gy_sched_check_time(s, now));
    for (int64_t i = 0; stop != NULL && i < n; i++)
        if (stop[i] > GY_SCHED_END_FAIL)
            return GY_FAIL(GY_ERR_INVALID, "entry %lld: unknown end %d", (long long)i, (int)stop[i]);
    s->undoable = 0;
    s->now = now;
    s->n_finished_step = 0;
    for (int64_t i = 0; i < s->n_entries; i++) {
        const int64_t slot = s->entry_slot[i];
        gy_sched_req *r = &s->reqs[slot];
        /* aborted (and maybe forgotten and reused) meanwhile: the slot no longer points here */
        if (r->entry != i || r->state != GY_SCHED_STATE_RUNNING) continue;
        const gy_sched_entry *e = &s->entries[i];
        r->entry = -1;
        if (stop != NULL && stop[i] == GY_SCHED_END_FAIL) { /* nothing of this step counts */
            gy_sched_finish_request(s, slot, GY_SCHED_FINISH_ERROR, now);
            s->finished[s->n_finished_step++] = r->id;
            continue;
        }
        r->n_computed += e->n_tokens;
        if (!e->samples) continue;
        r->n_generated++;
        if (r->n_generated == 1) r->first_token = now;
        const int stopped = stop != NULL && stop[i] == GY_SCHED_END_STOP;
        if (stopped || r->n_generated >= r->max_new) {
            gy_sched_finish_request(s, slot, stopped ? GY_SCHED_FINISH_STOP : GY_SCHED_FINISH_LENGTH,
                                    now);
            s->finished[s->n_finished_step++] = r->id;
        }
    }
    s->in_flight = 0;
    if (done != NULL) {
        done->n_finished = s->n_finished_step;
        done->finished = s->finished;
    }
    return GY_OK;
}

gy_status gy_sched_abort(gy_sched *s, int64_t id) {
    if (s == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_abort: NULL scheduler");
    int64_t slot;
    GY_TRY(gy_sched_lookup(s, id, &slot));
    if (s->reqs[slot].state == GY_SCHED_STATE_FINISHED)
        return GY_FAIL(GY_ERR_STATE, "request %lld has already finished (%s)", (long long)id,
                       gy_sched_finish_name(s->reqs[slot].finish));
    s->undoable = 0;
    gy_sched_finish_request(s, slot, GY_SCHED_FINISH_ABORT, s->now);
    return GY_OK;
}

gy_status gy_sched_release(gy_sched *s, int64_t id) {
    if (s == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_release: NULL scheduler");
    int64_t slot;
    GY_TRY(gy_sched_lookup(s, id, &slot));
    gy_sched_req *r = &s->reqs[slot];
    if (r->state == GY_SCHED_STATE_FINISHED)
        return GY_FAIL(GY_ERR_STATE, "request %lld has already finished (%s); there is nothing to "
                                     "let go", (long long)id, gy_sched_finish_name(r->finish));
    s->undoable = 0;
    if (r->state == GY_SCHED_STATE_RUNNING) gy_sched_remove_running(s, slot);
    else gy_sched_queue_unlink(s, gy_sched_queue_of(s, r), slot);
    s->counts[r->state]--;
    r->state = GY_SCHED_STATE_FINISHED; /* a free slot's state, as forget leaves it */
    r->entry = -1;
    gy_idmap_remove(&s->by_id, id);
    s->free_slots[s->n_free_slots++] = slot;
    return GY_OK;
}

gy_status gy_sched_cancel(gy_sched *s) {
    if (s == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_cancel: NULL scheduler");
    if (!s->in_flight) return GY_FAIL(GY_ERR_STATE, "no step is under way to cancel");
    if (!s->undoable)
        return GY_FAIL(GY_ERR_STATE, "the step under way cannot be cancelled: requests were "
                                     "added, adopted or aborted since it was scheduled");
    gy_sched_record_undo(s);
    s->n_steps--;
    s->in_flight = 0;
    return GY_OK;
}

gy_status gy_sched_forget(gy_sched *s, int64_t id) {
    if (s == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_forget: NULL scheduler");
    int64_t slot;
    GY_TRY(gy_sched_lookup(s, id, &slot));
    if (s->reqs[slot].state != GY_SCHED_STATE_FINISHED)
        return GY_FAIL(GY_ERR_STATE, "request %lld is %s; only finished requests can be forgotten",
                       (long long)id, gy_sched_state_name(s->reqs[slot].state));
    gy_idmap_remove(&s->by_id, id);
    s->counts[GY_SCHED_STATE_FINISHED]--;
    s->free_slots[s->n_free_slots++] = slot;
    return GY_OK;
}

const gy_sched_entry *gy_sched_step_entries(const gy_sched *s, int64_t *n) {
    *n = s->in_flight ? s->n_entries : 0;
    return s->in_flight ? s->entries : NULL;
}

gy_status gy_sched_info_get(const gy_sched *s, int64_t id, gy_sched_info *out) {
    if (s == NULL || out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_sched_info_get: NULL argument");
    int64_t slot;
    GY_TRY(gy_sched_lookup(s, id, &slot));
    const gy_sched_req *r = &s->reqs[slot];
    *out = (gy_sched_info){
        .state = r->state,
        .finish = r->finish,
        .prompt_len = r->prompt_len,
        .max_new_tokens = r->max_new,
        .priority = r->priority,
        .n_generated = r->n_generated,
        .n_computed = r->n_computed,
        .prefill_end = r->prefill_end,
        .n_preemptions = r->n_preemptions,
        .arrival = r->arrival,
        .first_scheduled = r->first_scheduled,
        .first_token = r->first_token,
        .finished_at = r->finished_at,
    };
    return GY_OK;
}

void gy_sched_stats_get(const gy_sched *s, gy_sched_stats *out) {
    *out = (gy_sched_stats){
        .n_waiting = s->counts[GY_SCHED_STATE_WAITING],
        .n_preempted = s->counts[GY_SCHED_STATE_PREEMPTED],
        .n_running = s->counts[GY_SCHED_STATE_RUNNING],
        .n_finished = s->counts[GY_SCHED_STATE_FINISHED],
        .n_steps = s->n_steps,
        .n_preemptions = s->n_preemptions,
        .free_blocks = s->ops.free_blocks(s->ops.ctx),
        .in_flight = s->in_flight,
    };
}

void gy_sched_hold(gy_sched *s, int held) { s->held = held != 0; }

void gy_sched_prefill_only(gy_sched *s, int on) { s->prefill_only = on != 0; }

void gy_sched_set_total_blocks(gy_sched *s, int64_t total_blocks) {
    if (total_blocks > s->config.watermark_blocks) s->config.total_blocks = total_blocks;
}
