/* instance.h: one serving instance of the simulator: the real batch scheduler (sched/batch.h)
 * over a block counter (sched/block_counter.h) whose usable size can change while it runs, and
 * the carrying of a request's progress from one instance's scheduler to another's.
 *
 * Capacity. A transformation changes an instance's KV capacity (scale-up: the FFN shards it
 * drops become KV room). The counter is created with the largest capacity the instance can
 * reach; a ballast holder (id GY_SIM_BALLAST_ID, never a request) keeps the rest occupied, so
 * the scheduler sees exactly the current capacity through the unchanged counter ops.
 *
 * Carry-over. The scheduler has no call to adopt a request with computed KV, so a request moves
 * as a new submission whose prompt is what it already knows, and whose KV the simulator counts
 * as kept (free to "recompute": the cost model charges only tokens at positions >= kept):
 *   running, decoding (C == T - 1): prompt' = C, max_new' = M - G + 1, kept = C; the prefill of
 *     prompt' samples again the token it last sampled (gen_shift = G - 1 says so);
 *   running, prefilling (C < E = T): prompt' = T, max_new' = M - G, kept = C, gen_shift = G;
 *   queued (waiting or preempted): prompt' = T, max_new' = M - G, kept = 0, gen_shift = G.
 * The simulator maps the new scheduler's generated counts back with gen_offset += gen_shift. */
#ifndef GY_SIM_INSTANCE_H
#define GY_SIM_INSTANCE_H

#include <stdint.h>

#include "../core/status.h"
#include "../sched/batch.h"
#include "../sched/block_counter.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_SIM_BALLAST_ID INT64_C(-1)

/* The per-instance scheduler settings (the same for every instance). */
typedef struct gy_sim_sched_params {
    int64_t block_size;        /* tokens per KV block */
    int64_t max_batch_tokens;  /* tokens per step */
    int64_t max_running;       /* running requests */
    int64_t max_prefill_chunk; /* 0: no cap below max_batch_tokens */
    double watermark;          /* fraction of the blocks admission keeps free, in [0, 1) */
} gy_sim_sched_params;

typedef struct gy_sim_instance {
    gy_sched_block_counter *bc;
    gy_sched *sched;
    int64_t capacity;      /* blocks usable now */
    int64_t counter_total; /* blocks of the counter (>= capacity) */
} gy_sim_instance;

/* What moves with a request (see the header comment). */
typedef struct gy_sim_carry {
    int64_t prompt;     /* prompt' */
    int64_t max_new;    /* max_new' */
    int64_t kept;       /* tokens whose KV it keeps */
    int64_t gen_shift;  /* add to the request's gen_offset */
} gy_sim_carry;

/* `capacity` usable blocks now, up to `max_capacity` later. */
gy_status gy_sim_instance_init(gy_sim_instance *inst, const gy_sim_sched_params *p,
                               int64_t capacity, int64_t max_capacity);
void gy_sim_instance_free(gy_sim_instance *inst);
/* Refuses (GY_ERR_STATE) a capacity below the blocks requests hold or above the maximum. */
gy_status gy_sim_instance_set_capacity(gy_sim_instance *inst, int64_t capacity);
/* Blocks requests hold (the ballast excluded). */
int64_t gy_sim_instance_used(const gy_sim_instance *inst);
/* Takes request `id` out of the scheduler (no step may be in flight) and says what moves. */
gy_status gy_sim_instance_take(gy_sim_instance *inst, int64_t id, gy_sim_carry *out);
/* Submits a request: a fresh one is {prompt, max_new, 0, 0}. */
gy_status gy_sim_instance_put(gy_sim_instance *inst, int64_t id, const gy_sim_carry *c,
                              double arrival, int32_t priority);

#ifdef __cplusplus
}
#endif
#endif
