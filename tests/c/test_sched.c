/* test_sched.c: the batch scheduler over the block counter: admission, chunking, the budget,
 * preemption and recompute in scenarios checked by hand step by step, submit-time refusals, the
 * call protocol, a failing KV backend, and a long random run checked against invariants. The id
 * map under them is checked against a plain array, the real-KV adapter against the counter. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/fault.h"
#include "gytest.h"
#include "sched/batch.h"
#include "sched/block_counter.h"
#include "sched/idmap.h"
#include "sched/kv_adapter.h"

typedef struct {
    gy_sched_block_counter *bc;
    gy_sched *s;
} fixture;

static fixture make(int64_t total_blocks, int64_t block_size, int64_t budget, int64_t max_running,
                    int64_t chunk) {
    fixture f = {0};
    CHECK_OK(gy_sched_block_counter_init(&f.bc, total_blocks, block_size));
    gy_sched_kv_ops ops = gy_sched_block_counter_ops(f.bc);
    gy_sched_config c = {.total_blocks = total_blocks, .block_size = block_size,
                         .max_batch_tokens = budget, .max_running = max_running,
                         .max_prefill_chunk = chunk};
    CHECK_OK(gy_sched_init(&f.s, &c, &ops));
    return f;
}

static void done(fixture *f) {
    gy_sched_free(f->s);
    CHECK(gy_sched_block_counter_n_holders(f->bc) == 0); /* freeing released every block */
    gy_sched_block_counter_free(f->bc);
}

static void add(fixture *f, int64_t id, int64_t prompt, int64_t max_new) {
    gy_sched_request r = {.id = id, .prompt_len = prompt, .max_new_tokens = max_new};
    CHECK_OK(gy_sched_add(f->s, &r));
}

/* CHECKs that entry i is {id, pos, n, samples, sample_index}. */
#define CHECK_ENTRY(b, i, id_, pos_, n_, samples_, index_)                                         \
    do {                                                                                           \
        CHECK((b).n_entries > (i));                                                                \
        if ((b).n_entries > (i)) {                                                                 \
            const gy_sched_entry *e_ = &(b).entries[i];                                            \
            CHECK(e_->id == (id_) && e_->pos == (pos_) && e_->n_tokens == (n_));                   \
            CHECK(e_->samples == (samples_) && e_->sample_index == (index_));                      \
        }                                                                                          \
    } while (0)

static gy_sched_batch step(fixture *f, double now) {
    gy_sched_batch b;
    CHECK_OK(gy_sched_schedule(f->s, now, &b));
    return b;
}

static gy_sched_done commit_none(fixture *f, const gy_sched_batch *b, double now) {
    gy_sched_done d;
    CHECK_OK(gy_sched_commit(f->s, now, NULL, b->n_entries, &d));
    return d;
}

static gy_sched_info info(fixture *f, int64_t id) {
    gy_sched_info i;
    CHECK_OK(gy_sched_info_get(f->s, id, &i));
    return i;
}

GYTEST(sched_admission_and_chunking) {
    /* 100 blocks of 4, 8 tokens a step, no chunk cap */
    fixture f = make(100, 4, 8, 4, 0);
    add(&f, 10, 10, 3);
    add(&f, 11, 5, 2);
    gy_sched_batch b = step(&f, 0);
    CHECK(b.n_entries == 1 && b.n_tokens == 8 && b.n_decode == 0);
    CHECK_ENTRY(b, 0, 10, 0, 8, 0, 0); /* budget exhausted: 11 waits */
    CHECK(info(&f, 11).state == GY_SCHED_STATE_WAITING);
    CHECK(gy_sched_block_counter_held(f.bc, 10) == 2);
    commit_none(&f, &b, 1);
    b = step(&f, 1);
    CHECK(b.n_entries == 2 && b.n_tokens == 7);
    CHECK_ENTRY(b, 0, 10, 8, 2, 1, 0); /* continuation ends the prompt */
    CHECK_ENTRY(b, 1, 11, 0, 5, 1, 0); /* admitted with the rest of the budget */
    gy_sched_done d = commit_none(&f, &b, 2);
    CHECK(d.n_finished == 0);
    CHECK(info(&f, 10).first_token == 2 && info(&f, 10).first_scheduled == 0);
    b = step(&f, 2);
    CHECK(b.n_entries == 2 && b.n_decode == 2);
    CHECK_ENTRY(b, 0, 10, 10, 1, 1, 1);
    CHECK_ENTRY(b, 1, 11, 5, 1, 1, 1);
    d = commit_none(&f, &b, 3);
    CHECK(d.n_finished == 1 && d.finished[0] == 11); /* max_new_tokens 2 reached */
    CHECK(info(&f, 11).finish == GY_SCHED_FINISH_LENGTH && info(&f, 11).n_generated == 2);
    CHECK(gy_sched_block_counter_held(f.bc, 11) == 0);
    b = step(&f, 3);
    CHECK(b.n_entries == 1);
    CHECK_ENTRY(b, 0, 10, 11, 1, 1, 2);
    d = commit_none(&f, &b, 4);
    CHECK(d.n_finished == 1 && d.finished[0] == 10);
    gy_sched_stats st;
    gy_sched_stats_get(f.s, &st);
    CHECK(st.n_running == 0 && st.n_waiting == 0 && st.n_finished == 2 && st.free_blocks == 100);
    b = step(&f, 5); /* nothing to do: an empty batch, still committed */
    CHECK(b.n_entries == 0);
    commit_none(&f, &b, 5);
    done(&f);
}

GYTEST(sched_chunk_cap_and_max_running) {
    fixture f = make(100, 4, 100, 2, 6);
    add(&f, 1, 13, 1);
    add(&f, 2, 3, 1);
    add(&f, 3, 3, 1);
    gy_sched_batch b = step(&f, 0);
    CHECK(b.n_entries == 2 && b.n_tokens == 9);
    CHECK_ENTRY(b, 0, 1, 0, 6, 0, 0);
    CHECK_ENTRY(b, 1, 2, 0, 3, 1, 0);  /* request 3 waits: max_running = 2 */
    commit_none(&f, &b, 0);            /* 2 finishes (max_new_tokens 1) */
    b = step(&f, 0);
    CHECK(b.n_entries == 2);
    CHECK_ENTRY(b, 0, 1, 6, 6, 0, 0);
    CHECK_ENTRY(b, 1, 3, 0, 3, 1, 0);
    commit_none(&f, &b, 0);
    b = step(&f, 0);
    CHECK(b.n_entries == 1);
    CHECK_ENTRY(b, 0, 1, 12, 1, 1, 0);
    CHECK(commit_none(&f, &b, 0).n_finished == 1);
    done(&f);
}

/* Preemption in the decode pass, hand-checked: block_size 2, 4 blocks (8 tokens). */
GYTEST(sched_preempt_decode_and_recompute) {
    fixture f = make(4, 2, 16, 4, 0);
    add(&f, 1, 3, 3); /* 6 tokens: 3 blocks */
    add(&f, 2, 2, 3); /* 5 tokens: 3 blocks */
    /* step 1: both admitted; 1 holds 2 blocks (3 tokens), 2 holds 1 block; 1 free */
    gy_sched_batch b = step(&f, 0);
    CHECK(b.n_entries == 2 && b.n_preempted == 0);
    CHECK_ENTRY(b, 0, 1, 0, 3, 1, 0);
    CHECK_ENTRY(b, 1, 2, 0, 2, 1, 0);
    commit_none(&f, &b, 1); /* 1: G=1 C=3; 2: G=1 C=2 */
    /* step 2: decode 1 fits its 2 blocks (4 tokens); decode 2 takes the last free block */
    b = step(&f, 1);
    CHECK(b.n_entries == 2 && b.n_decode == 2);
    CHECK_ENTRY(b, 0, 1, 3, 1, 1, 1);
    CHECK_ENTRY(b, 1, 2, 2, 1, 1, 1);
    CHECK(gy_sched_block_counter_free_blocks(f.bc) == 0);
    commit_none(&f, &b, 2); /* 1: G=2 C=4; 2: G=2 C=3 */
    /* step 3: decode 1 needs a third block, none free: the newest (2) is preempted; 1 runs;
     * nothing is admitted in a step that preempted */
    b = step(&f, 2);
    CHECK(b.n_entries == 1 && b.n_preempted == 1 && b.preempted[0] == 2);
    CHECK_ENTRY(b, 0, 1, 4, 1, 1, 2);
    gy_sched_info i2 = info(&f, 2);
    CHECK(i2.state == GY_SCHED_STATE_PREEMPTED && i2.n_computed == 0 && i2.n_generated == 2);
    CHECK(i2.n_preemptions == 1 && gy_sched_block_counter_held(f.bc, 2) == 0);
    gy_sched_done d = commit_none(&f, &b, 3);
    CHECK(d.n_finished == 1 && d.finished[0] == 1); /* 1: G=3 = max */
    CHECK(gy_sched_block_counter_free_blocks(f.bc) == 4);
    /* step 4: 2 is recomputed from scratch: prompt + its 2 generated tokens, then samples #2 */
    b = step(&f, 3);
    CHECK(b.n_entries == 1 && b.n_preempted == 0);
    CHECK_ENTRY(b, 0, 2, 0, 4, 1, 2);
    CHECK(b.entries[0].is_prefill == 1);
    d = commit_none(&f, &b, 4);
    CHECK(d.n_finished == 1 && d.finished[0] == 2);
    i2 = info(&f, 2);
    CHECK(i2.n_generated == 3 && i2.finish == GY_SCHED_FINISH_LENGTH && i2.first_scheduled == 0);
    gy_sched_stats st;
    gy_sched_stats_get(f.s, &st);
    CHECK(st.n_preemptions == 1 && st.n_steps == 4 && st.free_blocks == 4);
    done(&f);
}

/* Preemption in the prefill pass whose victim already has an entry in the step: block_size 1,
 * 5 blocks, 4 tokens a step, chunks of at most 2. */
GYTEST(sched_preempt_removes_scheduled_victim) {
    fixture f = make(5, 1, 4, 4, 2);
    add(&f, 1, 4, 1); /* 5 blocks */
    add(&f, 2, 1, 4); /* 5 blocks */
    gy_sched_batch b = step(&f, 0);
    CHECK(b.n_entries == 2);
    CHECK_ENTRY(b, 0, 1, 0, 2, 0, 0);
    CHECK_ENTRY(b, 1, 2, 0, 1, 1, 0);
    commit_none(&f, &b, 0); /* 1: C=2 of 4; 2: G=1 C=1; free 2 */
    /* step 2: decode 2 takes 1 block (free 1); continuation 1 wants 2 more tokens = 2 blocks: the
     * newest running request is 2, already in the batch: its entry goes, its token returns to the
     * budget, its 2 blocks are freed; then 1 fits (free 3 - 2 = 1) */
    b = step(&f, 0);
    CHECK(b.n_entries == 1 && b.n_tokens == 2 && b.n_decode == 0);
    CHECK(b.n_preempted == 1 && b.preempted[0] == 2);
    CHECK_ENTRY(b, 0, 1, 2, 2, 1, 0);
    CHECK(gy_sched_block_counter_free_blocks(f.bc) == 1);
    gy_sched_done d = commit_none(&f, &b, 0);
    CHECK(d.n_finished == 1 && d.finished[0] == 1);
    /* step 3: 2 comes back as a prefill of prompt + 1 generated token */
    b = step(&f, 0);
    CHECK(b.n_entries == 1);
    CHECK_ENTRY(b, 0, 2, 0, 2, 1, 1);
    commit_none(&f, &b, 0);
    for (int64_t k = 2; k < 4; k++) {
        b = step(&f, 0);
        CHECK_ENTRY(b, 0, 2, k, 1, 1, k);
        d = commit_none(&f, &b, 0);
    }
    CHECK(d.n_finished == 1 && info(&f, 2).n_generated == 4);
    done(&f);
}

GYTEST(sched_prefill_only_parks_decodes) {
    /* 100 blocks of 4, 16 tokens a step: Seesaw's prefill phase */
    fixture f = make(100, 4, 16, 4, 0);
    add(&f, 1, 6, 3);
    add(&f, 2, 5, 3);
    gy_sched_prefill_only(f.s, 1);
    gy_sched_batch b = step(&f, 0);
    CHECK(b.n_entries == 2 && b.n_parked == 0); /* prompts are prefilled, and sample */
    CHECK_ENTRY(b, 0, 1, 0, 6, 1, 0);
    CHECK_ENTRY(b, 1, 2, 0, 5, 1, 0);
    commit_none(&f, &b, 1);
    add(&f, 3, 7, 2);
    b = step(&f, 1); /* both would decode: parked, oldest first, their KV released; 3 admitted */
    CHECK(b.n_parked == 2 && b.parked[0] == 1 && b.parked[1] == 2 && b.n_preempted == 0);
    CHECK(b.n_entries == 1);
    CHECK_ENTRY(b, 0, 3, 0, 7, 1, 0);
    CHECK(gy_sched_block_counter_held(f.bc, 1) == 0 && gy_sched_block_counter_held(f.bc, 2) == 0);
    CHECK(info(&f, 1).state == GY_SCHED_STATE_PREEMPTED && info(&f, 1).n_generated == 1);
    CHECK(info(&f, 1).n_preemptions == 0);
    gy_sched_stats st;
    gy_sched_stats_get(f.s, &st);
    CHECK(st.n_preemptions == 0 && st.n_running == 1 && st.n_preempted == 2);
    commit_none(&f, &b, 2);
    b = step(&f, 2);
    CHECK(b.n_parked == 1 && b.parked[0] == 3 && b.n_entries == 0);
    commit_none(&f, &b, 2);
    b = step(&f, 3); /* nothing runs: the parked ones wait, without blocking new prompts */
    CHECK(b.n_entries == 0 && b.n_parked == 0);
    commit_none(&f, &b, 3);
    add(&f, 4, 3, 1);
    b = step(&f, 3);
    CHECK(b.n_entries == 1);
    CHECK_ENTRY(b, 0, 4, 0, 3, 1, 0);
    gy_sched_done d = commit_none(&f, &b, 4);
    CHECK(d.n_finished == 1 && d.finished[0] == 4); /* one token: done at its prefill */
    /* decodes again: the parked requests are recomputed (their KV is the caller's to keep),
     * oldest first, each sampling its next token */
    gy_sched_prefill_only(f.s, 0);
    b = step(&f, 4);
    CHECK(b.n_entries == 3 && b.n_parked == 0);
    CHECK_ENTRY(b, 0, 1, 0, 7, 1, 1);
    CHECK_ENTRY(b, 1, 2, 0, 6, 1, 1);
    CHECK_ENTRY(b, 2, 3, 0, 3, 0, 1); /* (the budget: 16 tokens) */
    commit_none(&f, &b, 5);
    done(&f);
}

GYTEST(sched_submit_time_refusals) {
    fixture f = make(10, 4, 8, 4, 0);
    gy_sched_request r = {.id = 1, .prompt_len = 0, .max_new_tokens = 1};
    CHECK_STATUS(gy_sched_add(f.s, &r), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "prompt length") != NULL);
    r.prompt_len = 5;
    r.max_new_tokens = 0;
    CHECK_STATUS(gy_sched_add(f.s, &r), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "max_new_tokens") != NULL);
    r.prompt_len = 30;
    r.max_new_tokens = 11; /* 41 tokens: 11 blocks > 10 */
    CHECK_STATUS(gy_sched_add(f.s, &r), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "can never fit") != NULL);
    r.max_new_tokens = 10; /* 40 tokens: exactly 10 blocks */
    CHECK_OK(gy_sched_add(f.s, &r));
    CHECK_STATUS(gy_sched_add(f.s, &r), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "already in use") != NULL);
    r.id = 2;
    r.arrival = NAN;
    CHECK_STATUS(gy_sched_add(f.s, &r), GY_ERR_INVALID);
    gy_sched_stats st;
    gy_sched_stats_get(f.s, &st);
    CHECK(st.n_waiting == 1);
    gy_sched_config bad = {.total_blocks = 10, .block_size = 4, .max_batch_tokens = 0,
                           .max_running = 1};
    gy_sched_kv_ops ops = gy_sched_block_counter_ops(f.bc);
    gy_sched *s2 = NULL;
    CHECK_STATUS(gy_sched_init(&s2, &bad, &ops), GY_ERR_INVALID);
    bad.max_batch_tokens = 1;
    bad.watermark_blocks = 10;
    CHECK_STATUS(gy_sched_init(&s2, &bad, &ops), GY_ERR_INVALID);
    ops.reserve = NULL;
    bad.watermark_blocks = 0;
    CHECK_STATUS(gy_sched_init(&s2, &bad, &ops), GY_ERR_INVALID);
    CHECK(s2 == NULL);
    done(&f);
}

GYTEST(sched_protocol_errors) {
    fixture f = make(10, 4, 8, 4, 0);
    gy_sched_done d;
    CHECK_STATUS(gy_sched_commit(f.s, 0, NULL, 0, &d), GY_ERR_STATE);
    add(&f, 1, 3, 2);
    gy_sched_batch b = step(&f, 5);
    CHECK_STATUS(gy_sched_schedule(f.s, 5, &b), GY_ERR_STATE);
    CHECK_STATUS(gy_sched_commit(f.s, 5, NULL, 2, &d), GY_ERR_INVALID);
    CHECK_STATUS(gy_sched_commit(f.s, 4, NULL, 1, &d), GY_ERR_INVALID); /* time went back */
    uint8_t stop[1] = {1};
    CHECK_OK(gy_sched_commit(f.s, 6, stop, 1, &d));
    CHECK(d.n_finished == 1 && info(&f, 1).finish == GY_SCHED_FINISH_STOP);
    CHECK(info(&f, 1).finished_at == 6);
    CHECK_STATUS(gy_sched_schedule(f.s, 1, &b), GY_ERR_INVALID);
    CHECK_STATUS(gy_sched_schedule(f.s, INFINITY, &b), GY_ERR_INVALID);
    CHECK_STATUS(gy_sched_abort(f.s, 1), GY_ERR_STATE);
    CHECK_STATUS(gy_sched_abort(f.s, 99), GY_ERR_INVALID);
    gy_sched_info i;
    CHECK_STATUS(gy_sched_info_get(f.s, 99, &i), GY_ERR_INVALID);
    add(&f, 2, 3, 2);
    CHECK_STATUS(gy_sched_forget(f.s, 2), GY_ERR_STATE); /* not finished */
    CHECK_OK(gy_sched_forget(f.s, 1));
    CHECK_STATUS(gy_sched_info_get(f.s, 1, &i), GY_ERR_INVALID);
    add(&f, 1, 2, 1); /* the id can be reused */
    done(&f);
}

GYTEST(sched_abort_everywhere) {
    fixture f = make(20, 2, 4, 4, 0);
    add(&f, 1, 4, 5);
    add(&f, 2, 2, 5);
    add(&f, 3, 2, 5);
    gy_sched_batch b = step(&f, 0);
    CHECK(b.n_entries == 1); /* 1 takes the whole budget */
    CHECK_OK(gy_sched_abort(f.s, 3)); /* waiting */
    CHECK_OK(gy_sched_abort(f.s, 1)); /* in the step under way */
    CHECK(gy_sched_block_counter_held(f.bc, 1) == 0);
    CHECK_OK(gy_sched_forget(f.s, 1));
    add(&f, 1, 2, 1); /* a new request under the same id, not in the batch */
    gy_sched_done d = commit_none(&f, &b, 1);
    CHECK(d.n_finished == 0 && info(&f, 1).state == GY_SCHED_STATE_WAITING);
    CHECK(info(&f, 3).finish == GY_SCHED_FINISH_ABORT);
    b = step(&f, 1);
    CHECK(b.n_entries == 2);
    CHECK_ENTRY(b, 0, 2, 0, 2, 1, 0);
    CHECK_ENTRY(b, 1, 1, 0, 2, 1, 0);
    commit_none(&f, &b, 2);
    CHECK_OK(gy_sched_abort(f.s, 2)); /* running */
    gy_sched_stats st;
    gy_sched_stats_get(f.s, &st);
    CHECK(st.n_running == 0 && st.n_finished == 3 && st.free_blocks == 20);
    done(&f);
}

/* Letting go of a request another scheduler adopted: it leaves without finishing (nothing
 * counted), its blocks stay with their holder (the adopter's now), its entry in the step under
 * way is ignored, and its id is free again. */
GYTEST(sched_release_lets_go_without_finishing) {
    fixture f = make(20, 2, 4, 4, 0);
    add(&f, 1, 2, 5);
    add(&f, 2, 2, 5);
    add(&f, 3, 2, 5);
    gy_sched_batch b = step(&f, 0);
    CHECK(b.n_entries == 2); /* 1 and 2 fill the budget; 3 waits */
    const int64_t held = gy_sched_block_counter_held(f.bc, 1);
    CHECK(held == 1);
    CHECK_OK(gy_sched_release(f.s, 1)); /* in the step under way */
    CHECK_OK(gy_sched_release(f.s, 3)); /* waiting */
    CHECK(gy_sched_block_counter_held(f.bc, 1) == held);
    CHECK_STATUS(gy_sched_release(f.s, 1), GY_ERR_INVALID); /* no such request any more */
    gy_error_clear();
    gy_sched_done d = commit_none(&f, &b, 1);
    CHECK(d.n_finished == 0);
    gy_sched_stats st;
    gy_sched_stats_get(f.s, &st);
    CHECK(st.n_running == 1 && st.n_waiting == 0 && st.n_finished == 0);
    add(&f, 3, 2, 1); /* the id is free */
    CHECK(info(&f, 3).state == GY_SCHED_STATE_WAITING);
    gy_sched_kv_ops ops = gy_sched_block_counter_ops(f.bc);
    ops.release(ops.ctx, 1); /* what the adopter would do */
    done(&f);
}

/* A merge's instance adopts every request its parts run: past max_running the running set
 * grows (nothing refused, nothing preempted), every adopted request decodes in the next step, and
 * admission waits until fewer than max_running run. A growth that cannot allocate refuses the
 * adoption with nothing changed. */
GYTEST(sched_adopt_beyond_max_running_grows_the_running_set) {
    fixture f = make(64, 2, 16, 2, 0);
    for (int64_t id = 1; id <= 5; id++) {
        CHECK_OK(gy_sched_block_counter_reserve(f.bc, id, 4)); /* its KV, placed by the caller */
        const gy_sched_request q = {.id = id, .prompt_len = 4, .max_new_tokens = 3};
        const gy_sched_info in = {.state = GY_SCHED_STATE_RUNNING, .n_generated = 1,
                                  .n_computed = 4, .prefill_end = 4, .first_scheduled = 0,
                                  .first_token = 0};
        if (id == 3) { /* the first growth (2 -> 4) fails at its 4th array: refused, nothing
                        * changed (the arrays grown before it are only larger) */
            gy_fault_arm(GY_FAULT_ALLOC, 4);
            CHECK_STATUS(gy_sched_adopt(f.s, &q, &in), GY_ERR_SYSTEM);
            gy_error_clear();
            gy_fault_disarm_all();
            CHECK(gy_sched_running_capacity(f.s) == 2);
            CHECK_STATUS(gy_sched_info_get(f.s, 3, &(gy_sched_info){0}), GY_ERR_INVALID);
            gy_error_clear();
        }
        CHECK_OK(gy_sched_adopt(f.s, &q, &in));
    }
    CHECK(gy_sched_running_capacity(f.s) == 8);
    add(&f, 6, 2, 1);
    gy_sched_batch b = step(&f, 0);
    CHECK(b.n_entries == 5); /* five decodes; 6 waits */
    for (int64_t i = 0; i < 5; i++) CHECK_ENTRY(b, i, i + 1, 4, 1, 1, 1);
    commit_none(&f, &b, 0);
    b = step(&f, 1); /* the last tokens: still five running, 6 still waits */
    CHECK(b.n_entries == 5 && info(&f, 6).state == GY_SCHED_STATE_WAITING);
    gy_sched_done d = commit_none(&f, &b, 1);
    CHECK(d.n_finished == 5);
    b = step(&f, 2); /* none runs: 6 is admitted */
    CHECK_ENTRY(b, 0, 6, 0, 2, 1, 0);
    commit_none(&f, &b, 2);
    gy_sched_stats st;
    gy_sched_stats_get(f.s, &st);
    CHECK(st.n_preemptions == 0 && st.n_finished == 6);
    done(&f);
}

GYTEST(sched_arrival_priority_and_watermark) {
    gy_sched_block_counter *bc;
    CHECK_OK(gy_sched_block_counter_init(&bc, 10, 1));
    gy_sched_kv_ops ops = gy_sched_block_counter_ops(bc);
    gy_sched_config c = {.total_blocks = 10, .block_size = 1, .max_batch_tokens = 100,
                         .max_running = 8, .watermark_blocks = 2};
    gy_sched *s;
    CHECK_OK(gy_sched_init(&s, &c, &ops));
    gy_sched_request reqs[] = {
        {.id = 1, .prompt_len = 2, .max_new_tokens = 1, .arrival = 0, .priority = 1},
        {.id = 2, .prompt_len = 2, .max_new_tokens = 1, .arrival = 5, .priority = 0},
        {.id = 3, .prompt_len = 2, .max_new_tokens = 1, .arrival = 1, .priority = 0},
        {.id = 4, .prompt_len = 3, .max_new_tokens = 1, .arrival = 0, .priority = 1},
        {.id = 5, .prompt_len = 1, .max_new_tokens = 1, .arrival = 0, .priority = 1},
    };
    for (int i = 0; i < 5; i++) CHECK_OK(gy_sched_add(s, &reqs[i]));
    /* queue order: 3, 2 (priority 0 by arrival), then 1, 4, 5; at t=2, 2 is not visible;
     * admission: 3 (2 blocks, free 8), 1 (free 6), 4 needs 3 + watermark 2 <= 6 (free 3),
     * 5 needs 1 + 2 <= 3 (free 2) */
    gy_sched_batch b;
    CHECK_OK(gy_sched_schedule(s, 2, &b));
    CHECK(b.n_entries == 4);
    const int64_t order[] = {3, 1, 4, 5};
    for (int i = 0; i < 4 && i < b.n_entries; i++) CHECK(b.entries[i].id == order[i]);
    CHECK_OK(gy_sched_commit(s, 3, NULL, b.n_entries, NULL));
    CHECK_OK(gy_sched_schedule(s, 5, &b));
    CHECK(b.n_entries == 1 && b.entries[0].id == 2);
    CHECK_OK(gy_sched_commit(s, 6, NULL, b.n_entries, NULL));
    /* a request needing more than total - watermark blocks still runs once it is alone */
    gy_sched_request big = {.id = 9, .prompt_len = 9, .max_new_tokens = 1};
    CHECK_OK(gy_sched_add(s, &big));
    CHECK_OK(gy_sched_schedule(s, 6, &b));
    CHECK(b.n_entries == 1 && b.entries[0].id == 9 && b.entries[0].n_tokens == 9);
    CHECK_OK(gy_sched_commit(s, 6, NULL, b.n_entries, NULL));
    gy_sched_free(s);
    gy_sched_block_counter_free(bc);
}

static uint64_t lcg(uint64_t *x);

/* A block counter that fails a reserve when told to and writes down what each reserve and
 * release changed since its mark: the caller's half of undoing a step (batch.h, "Failure"). */
typedef struct {
    gy_sched_block_counter *bc;
    int64_t block_size;
    int fail_next;           /* the next reserve fails (GY_ERR_SYSTEM) */
    int64_t log_req[4096], log_held[4096];
    int64_t n_log;
} flaky;
static int64_t flaky_free(void *ctx) { return gy_sched_block_counter_free_blocks(((flaky *)ctx)->bc); }
static int64_t flaky_needed(void *ctx, int64_t req, int64_t n) {
    return gy_sched_block_counter_blocks_needed(((flaky *)ctx)->bc, req, n);
}
static void flaky_log(flaky *f, int64_t req) {
    f->log_req[f->n_log] = req;
    f->log_held[f->n_log++] = gy_sched_block_counter_held(f->bc, req);
}
static gy_status flaky_reserve(void *ctx, int64_t req, int64_t n) {
    flaky *f = ctx;
    if (f->fail_next) {
        f->fail_next = 0;
        return GY_FAIL(GY_ERR_SYSTEM, "the device went away");
    }
    flaky_log(f, req);
    return gy_sched_block_counter_reserve(f->bc, req, n);
}
static void flaky_release(void *ctx, int64_t req) {
    flaky_log(ctx, req);
    gy_sched_block_counter_release(((flaky *)ctx)->bc, req);
}
static void flaky_undo(flaky *f) {
    for (int64_t i = f->n_log - 1; i >= 0; i--) {
        gy_sched_block_counter_release(f->bc, f->log_req[i]);
        if (f->log_held[i] > 0)
            gy_sched_block_counter_reserve(f->bc, f->log_req[i], f->log_held[i] * f->block_size);
    }
    f->n_log = 0;
}

/* Everything a caller can see of a scheduler, to compare before and after an undo. */
typedef struct {
    gy_sched_info info[200];
    gy_sched_stats stats;
} sched_view;
static void sched_look(gy_sched *s, int64_t n_ids, sched_view *v) {
    memset(v, 0, sizeof *v);
    for (int64_t i = 0; i < n_ids; i++) gy_sched_info_get(s, i, &v->info[i]);
    gy_sched_stats_get(s, &v->stats);
}
static int sched_same(const sched_view *a, const sched_view *b, int64_t n_ids) {
    for (int64_t i = 0; i < n_ids; i++) {
        const gy_sched_info *x = &a->info[i], *y = &b->info[i];
        if (x->state != y->state || x->finish != y->finish || x->n_generated != y->n_generated ||
            x->n_computed != y->n_computed || x->prefill_end != y->prefill_end ||
            x->n_preemptions != y->n_preemptions ||
            memcmp(&x->first_scheduled, &y->first_scheduled, sizeof(double)) != 0)
            return 0;
    }
    return memcmp(&a->stats, &b->stats, sizeof a->stats) == 0;
}

/* A scheduler whose backend fails now and then, and whose steps are sometimes cancelled, runs
 * exactly like one that never fails: every failed schedule and every cancel leaves it as before
 * (and, with its ops undone, the retry makes the same batch as the reference's). */
GYTEST(sched_failed_and_cancelled_steps_change_nothing) {
    enum { N = 150 };
    const int64_t total = 24, bs = 2;
    flaky fl = {.block_size = bs};
    gy_sched_block_counter *ref_bc;
    CHECK_OK(gy_sched_block_counter_init(&fl.bc, total, bs));
    CHECK_OK(gy_sched_block_counter_init(&ref_bc, total, bs));
    gy_sched_kv_ops ops = {&fl, flaky_free, flaky_needed, flaky_reserve, flaky_release};
    gy_sched_kv_ops ref_ops = gy_sched_block_counter_ops(ref_bc);
    gy_sched_config c = {.total_blocks = total, .block_size = bs, .max_batch_tokens = 9,
                         .max_running = 5};
    gy_sched *s, *ref;
    CHECK_OK(gy_sched_init(&s, &c, &ops));
    CHECK_OK(gy_sched_init(&ref, &c, &ref_ops));
    uint64_t seed = 7;
    int64_t added = 0, finished = 0, failures = 0, cancels = 0;
    double now = 0;
    int same_batches = 1, unchanged = 1;
    for (int64_t it = 0; it < 5000 && finished < N; it++) {
        while (added < N && lcg(&seed) % 3 == 0) {
            gy_sched_request r = {.id = added, .prompt_len = 1 + (int64_t)(lcg(&seed) % 20),
                                  .max_new_tokens = 1 + (int64_t)(lcg(&seed) % 20), .arrival = now};
            CHECK_OK(gy_sched_add(s, &r));
            CHECK_OK(gy_sched_add(ref, &r));
            added++;
        }
        gy_sched_batch b, rb;
        CHECK_OK(gy_sched_schedule(ref, now, &rb));
        for (;;) {
            sched_view before, after;
            sched_look(s, added, &before);
            fl.n_log = 0;
            fl.fail_next = lcg(&seed) % 4 == 0;
            const gy_status st = gy_sched_schedule(s, now, &b);
            if (st != GY_OK) {
                CHECK(st == GY_ERR_SYSTEM);
                failures++;
                flaky_undo(&fl);
                sched_look(s, added, &after);
                unchanged &= sched_same(&before, &after, added);
                continue;
            }
            fl.fail_next = 0;
            if (lcg(&seed) % 5 == 0) {
                CHECK_OK(gy_sched_cancel(s));
                cancels++;
                flaky_undo(&fl);
                sched_look(s, added, &after);
                unchanged &= sched_same(&before, &after, added);
                continue;
            }
            break;
        }
        same_batches &= b.n_entries == rb.n_entries && b.n_preempted == rb.n_preempted &&
                        memcmp(b.entries, rb.entries, (size_t)b.n_entries * sizeof *b.entries) == 0;
        uint8_t stop[8];
        for (int64_t e = 0; e < b.n_entries; e++) {
            const uint64_t x = lcg(&seed) % 40;
            stop[e] = x == 0 ? GY_SCHED_END_STOP : x == 1 ? GY_SCHED_END_FAIL : GY_SCHED_END_NONE;
        }
        now += 1;
        gy_sched_done d, rd;
        CHECK_OK(gy_sched_commit(s, now, stop, b.n_entries, &d));
        CHECK_OK(gy_sched_commit(ref, now, stop, rb.n_entries, &rd));
        same_batches &= d.n_finished == rd.n_finished;
        finished += d.n_finished;
    }
    CHECK(finished == N);
    CHECK(same_batches);
    CHECK(unchanged);
    CHECK(failures > 20 && cancels > 20);
    int errors = 0;
    for (int64_t i = 0; i < N; i++) {
        gy_sched_info in;
        CHECK_OK(gy_sched_info_get(s, i, &in));
        errors += in.finish == GY_SCHED_FINISH_ERROR;
    }
    CHECK(errors > 0 && strcmp(gy_sched_finish_name(GY_SCHED_FINISH_ERROR), "error") == 0);
    CHECK(gy_sched_block_counter_free_blocks(fl.bc) == total);
    /* Refused: cancel with no step, and after an add since the schedule. */
    CHECK_STATUS(gy_sched_cancel(s), GY_ERR_STATE);
    gy_sched_request late = {.id = 900, .prompt_len = 2, .max_new_tokens = 2, .arrival = now};
    CHECK_OK(gy_sched_add(s, &late));
    gy_sched_batch b;
    CHECK_OK(gy_sched_schedule(s, now, &b));
    late.id = 901;
    CHECK_OK(gy_sched_add(s, &late));
    CHECK_STATUS(gy_sched_cancel(s), GY_ERR_STATE);
    CHECK_OK(gy_sched_commit(s, now, NULL, b.n_entries, NULL));
    gy_sched_free(s);
    gy_sched_free(ref);
    gy_sched_block_counter_free(fl.bc);
    gy_sched_block_counter_free(ref_bc);
}

static uint64_t lcg(uint64_t *x) {
    *x = *x * 6364136223846793005ULL + 1442695040888963407ULL;
    return *x >> 33;
}

/* A long random run; the exact batches are checked against a Python model in test_sched.py,
 * this checks invariants under the sanitizers. */
GYTEST(sched_random_run_invariants) {
    for (int trial = 0; trial < 4; trial++) {
        const int64_t total = 16 + 8 * trial, bs = 1 + trial, budget = 3 + 5 * trial;
        fixture f = make(total, bs, budget, 2 + trial, trial % 2 ? 4 : 0);
        uint64_t seed = 12345 + (uint64_t)trial;
        enum { N = 300 };
        int64_t generated[N] = {0}, max_new[N], computed[N] = {0}, finishes[N] = {0};
        int64_t prompt[N];
        int64_t added = 0, finished = 0;
        double now = 0;
        int prefill_only = 0; /* stretches of Seesaw's prefill phase */
        for (int64_t it = 0; it < 20000 && finished < N; it++) {
            if (lcg(&seed) % (prefill_only ? 5 : 30) == 0) {
                prefill_only = !prefill_only;
                gy_sched_prefill_only(f.s, prefill_only);
            }
            while (added < N && lcg(&seed) % 3 == 0) {
                prompt[added] = 1 + (int64_t)(lcg(&seed) % (uint64_t)(total * bs / 2));
                max_new[added] = 1 + (int64_t)(lcg(&seed) % (uint64_t)(total * bs / 2));
                gy_sched_request r = {.id = added, .prompt_len = prompt[added],
                                      .max_new_tokens = max_new[added], .arrival = now};
                CHECK_OK(gy_sched_add(f.s, &r));
                added++;
            }
            gy_sched_batch b;
            CHECK_OK(gy_sched_schedule(f.s, now, &b));
            CHECK(b.n_tokens <= budget && b.n_entries <= 2 + trial);
            CHECK(gy_sched_block_counter_free_blocks(f.bc) >= 0);
            for (int64_t p = 0; p < b.n_preempted; p++) computed[b.preempted[p]] = 0;
            for (int64_t p = 0; p < b.n_parked; p++) computed[b.parked[p]] = 0;
            CHECK(!prefill_only || b.n_decode == 0); /* nothing decodes in a prefill phase */
            CHECK(prefill_only || b.n_parked == 0);
            uint8_t stop[64];
            for (int64_t e = 0; e < b.n_entries; e++) {
                const gy_sched_entry *en = &b.entries[e];
                CHECK(en->pos == computed[en->id]);
                CHECK(en->sample_index == generated[en->id]);
                CHECK(en->samples == (en->pos + en->n_tokens == prompt[en->id] + generated[en->id]));
                stop[e] = lcg(&seed) % 50 == 0;
            }
            gy_sched_done d;
            now += 1;
            CHECK_OK(gy_sched_commit(f.s, now, stop, b.n_entries, &d));
            for (int64_t e = 0; e < b.n_entries; e++) {
                computed[b.entries[e].id] += b.entries[e].n_tokens;
                generated[b.entries[e].id] += b.entries[e].samples;
            }
            for (int64_t k = 0; k < d.n_finished; k++) {
                finishes[d.finished[k]]++;
                finished++;
            }
        }
        CHECK(finished == N);
        int ok = 1;
        for (int64_t i = 0; i < N; i++) {
            gy_sched_info in;
            CHECK_OK(gy_sched_info_get(f.s, i, &in));
            ok &= finishes[i] == 1 && in.n_generated == generated[i] && generated[i] <= max_new[i];
            ok &= in.finish == GY_SCHED_FINISH_STOP || generated[i] == max_new[i];
        }
        CHECK(ok);
        CHECK(gy_sched_block_counter_free_blocks(f.bc) == total);
        done(&f);
    }
}

GYTEST(sched_idmap_matches_array) {
    gy_idmap m = {0};
    enum { K = 2000 };
    int64_t model[K];
    for (int i = 0; i < K; i++) model[i] = -1;
    uint64_t seed = 7;
    int ok = 1;
    for (int it = 0; it < 100000; it++) {
        const int64_t k = (int64_t)(lcg(&seed) % K);
        const int64_t key = k * 1000003 - 5000; /* negative keys too */
        const int op = (int)(lcg(&seed) % 3);
        if (op == 0) {
            CHECK_OK(gy_idmap_put(&m, key, it));
            model[k] = it;
        } else if (op == 1) {
            ok &= gy_idmap_remove(&m, key) == (model[k] >= 0);
            model[k] = -1;
        } else {
            int64_t v = -1;
            const int found = gy_idmap_get(&m, key, &v);
            ok &= found == (model[k] >= 0) && (!found || v == model[k]);
        }
    }
    int64_t count = 0;
    for (int i = 0; i < K; i++) count += model[i] >= 0;
    ok &= count == m.count;
    CHECK(ok);
    gy_idmap_free(&m);
}

/* The same random workload over the block counter and over a real paged KV cache through the
 * adapter: the same batches, block tables as long as the counter says, nothing left behind. */
GYTEST(sched_kv_adapter_matches_block_counter) {
    gy_arena *arena;
    gy_arena_config ac = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 8,
                          .budget_bytes = 4 * 4096};
    CHECK_OK(gy_arena_init(&arena, &ac));
    /* a block = 2 (K, V) * 4 tokens * 1 head * 8 dims * 4 bytes = 256 bytes: 16 a page */
    gy_kv_config kc = {.layout = GY_KV_LAYOUT_PAGE, .n_layers = 1, .n_heads = 1, .head_dim = 8,
                       .block_size = 4, .elem_size = 4, .first_slot = 0, .slots_per_layer = 4};
    gy_kv_cache *kv;
    CHECK_OK(gy_kv_init(&kv, arena, &kc));
    CHECK_OK(gy_kv_grow(kv, 1));
    gy_sched_kv_adapter *ad;
    CHECK_OK(gy_sched_kv_adapter_init(&ad, kv));
    gy_sched_kv_ops real_ops = gy_sched_kv_adapter_ops(ad);
    gy_sched_config c = {.total_blocks = 16, .block_size = 4, .max_batch_tokens = 12,
                         .max_running = 5, .max_prefill_chunk = 5};
    gy_sched *real;
    CHECK_OK(gy_sched_init(&real, &c, &real_ops));
    fixture f = make(16, 4, 12, 5, 5);
    uint64_t seed = 99;
    int64_t added = 0, finished = 0, preemptions = 0;
    int same = 1, tables = 1;
    for (int64_t it = 0; it < 5000 && finished < 200; it++) {
        while (added < 200 && lcg(&seed) % 4 == 0) {
            gy_sched_request r = {.id = added, .prompt_len = 1 + (int64_t)(lcg(&seed) % 30),
                                  .max_new_tokens = 1 + (int64_t)(lcg(&seed) % 30)};
            CHECK_OK(gy_sched_add(f.s, &r));
            CHECK_OK(gy_sched_add(real, &r));
            added++;
        }
        gy_sched_batch a, b;
        CHECK_OK(gy_sched_schedule(f.s, (double)it, &a));
        CHECK_OK(gy_sched_schedule(real, (double)it, &b));
        same &= a.n_entries == b.n_entries && a.n_preempted == b.n_preempted;
        if (!same) break;
        same &= memcmp(a.entries, b.entries, (size_t)a.n_entries * sizeof *a.entries) == 0;
        preemptions += a.n_preempted;
        for (int64_t e = 0; e < b.n_entries; e++) {
            const int64_t seq = gy_sched_kv_adapter_seq(ad, b.entries[e].id);
            tables &= seq >= 0 && gy_kv_seq_n_blocks(kv, seq) ==
                                      gy_sched_block_counter_held(f.bc, b.entries[e].id);
        }
        uint8_t stop[8];
        for (int64_t e = 0; e < a.n_entries; e++) stop[e] = lcg(&seed) % 20 == 0;
        gy_sched_done da, db;
        CHECK_OK(gy_sched_commit(f.s, (double)it, stop, a.n_entries, &da));
        CHECK_OK(gy_sched_commit(real, (double)it, stop, b.n_entries, &db));
        same &= da.n_finished == db.n_finished;
        finished += da.n_finished;
    }
    CHECK(same && tables && finished == 200 && preemptions > 0);
    gy_kv_stats ks;
    gy_kv_stats_get(kv, &ks);
    CHECK(ks.n_sequences == 0 && ks.free_blocks == 16);
    gy_sched_free(real);
    gy_sched_kv_adapter_free(ad);
    done(&f);
    gy_kv_free(kv);
    gy_arena_free(arena);
}
