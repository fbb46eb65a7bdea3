/* instance.c: a scheduler over a ballasted block counter, and request carry-over. */
#include "instance.h"

#include <string.h>

gy_status gy_sim_instance_init(gy_sim_instance *inst, const gy_sim_sched_params *p,
                               int64_t capacity, int64_t max_capacity) {
    memset(inst, 0, sizeof *inst);
    if (capacity < 1 || max_capacity < capacity)
        return GY_FAIL(GY_ERR_INVALID, "instance capacity must be in [1, max %lld], got %lld",
                       (long long)max_capacity, (long long)capacity);
    if (!(p->watermark >= 0 && p->watermark < 1))
        return GY_FAIL(GY_ERR_INVALID, "watermark must be in [0, 1), got %g", p->watermark);
    GY_TRY(gy_sched_block_counter_init(&inst->bc, max_capacity, p->block_size));
    const gy_sched_kv_ops ops = gy_sched_block_counter_ops(inst->bc);
    const gy_sched_config config = {
        .total_blocks = max_capacity,
        .block_size = p->block_size,
        .max_batch_tokens = p->max_batch_tokens,
        .max_running = p->max_running,
        .max_prefill_chunk = p->max_prefill_chunk,
        .watermark_blocks = (int64_t)(p->watermark * (double)capacity),
    };
    gy_status st = gy_sched_init(&inst->sched, &config, &ops);
    if (st != GY_OK) {
        gy_sim_instance_free(inst);
        return st;
    }
    inst->counter_total = max_capacity;
    inst->capacity = max_capacity;
    st = gy_sim_instance_set_capacity(inst, capacity);
    if (st != GY_OK) gy_sim_instance_free(inst);
    return st;
}

void gy_sim_instance_free(gy_sim_instance *inst) {
    if (inst == NULL) return;
    gy_sched_free(inst->sched); /* releases its requests' blocks through the counter */
    gy_sched_block_counter_free(inst->bc);
    memset(inst, 0, sizeof *inst);
}

int64_t gy_sim_instance_used(const gy_sim_instance *inst) {
    return inst->capacity - gy_sched_block_counter_free_blocks(inst->bc);
}

gy_status gy_sim_instance_set_capacity(gy_sim_instance *inst, int64_t capacity) {
    const int64_t used = gy_sim_instance_used(inst);
    if (capacity < used || capacity > inst->counter_total)
        return GY_FAIL(GY_ERR_STATE,
                       "cannot set an instance's KV capacity to %lld blocks: its requests hold "
                       "%lld and its counter has %lld",
                       (long long)capacity, (long long)used, (long long)inst->counter_total);
    gy_sched_block_counter_release(inst->bc, GY_SIM_BALLAST_ID);
    const int64_t ballast = inst->counter_total - capacity;
    if (ballast > 0) {
        const int64_t bs = gy_sched_config_of(inst->sched)->block_size;
        GY_TRY(gy_sched_block_counter_reserve(inst->bc, GY_SIM_BALLAST_ID, ballast * bs));
    }
    inst->capacity = capacity;
    return GY_OK;
}

gy_status gy_sim_instance_take(gy_sim_instance *inst, int64_t id, gy_sim_carry *out) {
    gy_sched_info in;
    GY_TRY(gy_sched_info_get(inst->sched, id, &in));
    const int64_t known = in.prompt_len + in.n_generated; /* T */
    if (in.state == GY_SCHED_STATE_RUNNING && in.n_computed >= in.prefill_end) {
        *out = (gy_sim_carry){.prompt = in.n_computed,
                              .max_new = in.max_new_tokens - in.n_generated + 1,
                              .kept = in.n_computed,
                              .gen_shift = in.n_generated - 1};
    } else if (in.state == GY_SCHED_STATE_RUNNING) {
        *out = (gy_sim_carry){.prompt = known,
                              .max_new = in.max_new_tokens - in.n_generated,
                              .kept = in.n_computed,
                              .gen_shift = in.n_generated};
    } else if (in.state == GY_SCHED_STATE_WAITING || in.state == GY_SCHED_STATE_PREEMPTED) {
        *out = (gy_sim_carry){.prompt = known,
                              .max_new = in.max_new_tokens - in.n_generated,
                              .kept = 0,
                              .gen_shift = in.n_generated};
    } else {
        return GY_FAIL(GY_ERR_STATE, "request %lld has finished; nothing to carry",
                       (long long)id);
    }
    GY_TRY(gy_sched_abort(inst->sched, id));
    return gy_sched_forget(inst->sched, id);
}

gy_status gy_sim_instance_put(gy_sim_instance *inst, int64_t id, const gy_sim_carry *c,
                              double arrival, int32_t priority) {
    const gy_sched_request r = {.id = id, .prompt_len = c->prompt, .max_new_tokens = c->max_new,
                                .arrival = arrival, .priority = priority};
    return gy_sched_add(inst->sched, &r);
}
