/* migrate.c: Llumnix's live migration (GY_SIM_OP_MIGRATE, sim.h's migrate_bw): one running
 * request moves to another instance with its KV, which crosses the link while the request keeps
 * running; it switches between two of its source's steps, keeping its progress, and is dropped
 * when its source or destination changed meanwhile. */
#include "sim_impl.h"

/* Request r's KV has crossed: it moves to its destination between two of its source's steps,
 * keeping its progress (the destination re-admits it over kept KV). Dropped when it finished,
 * moved with a transformation meanwhile, or the destination is gone or busy. */
static gy_status gy_sim_migrate_switch(gy_sim *s, int64_t r) {
    gy_sim_req *q = &s->req[r];
    const int32_t from = q->migrate_from;
    q->migrating = 0;
    if (q->slot != from) return GY_OK;
    const int32_t to = q->migrate_to >= 0 && q->migrate_to < s->n_gpus ? s->gpu_slot[q->migrate_to] : -1;
    if (to < 0 || to == from || s->inst[to].gpu_first != q->migrate_to ||
        s->inst[to].xform != GY_SIM_XFORM_NONE || s->inst[to].bound)
        return GY_OK;
    s->stats.migrate_bytes += (double)q->computed * s->config.kv_token_bytes;
    s->stats.n_live_migrations++;
    GY_TRY(gy_sim_carry_over(s, r, to));
    return gy_sim_start_step(s, to);
}

gy_status gy_sim_on_migrated(gy_sim *s, int64_t r) {
    gy_sim_req *q = &s->req[r];
    if (q->migrating != 1) return GY_FAIL(GY_ERR_STATE, "request %lld: a stale migration", (long long)r);
    if (q->slot != q->migrate_from) { /* finished or moved meanwhile */
        q->migrating = 0;
        return GY_OK;
    }
    if (!s->inst[q->slot].stepping) {
        GY_TRY(gy_sim_migrate_switch(s, r));
        return gy_sim_start_step(s, q->migrate_from);
    }
    q->migrating = 2; /* after the step in flight (its batch may hold r) */
    s->inst[q->slot].n_migrated++;
    return GY_OK;
}

/* The migrations that crossed while slot stepped. */
gy_status gy_sim_migrate_crossed(gy_sim *s, int32_t slot) {
    if (s->inst[slot].n_migrated == 0) return GY_OK;
    s->inst[slot].n_migrated = 0;
    for (int64_t r = s->inst[slot].head; r >= 0;) {
        const int64_t next = s->req[r].next;
        if (s->req[r].migrating == 2) GY_TRY(gy_sim_migrate_switch(s, r));
        r = next;
    }
    return GY_OK;
}

/* A live migration out of the instance at op->gpu_first to the one at op->target: of its
 * running requests not moving yet whose footprint fits the destination's free blocks, the one
 * with the least KV (cheapest to move) starts; its KV takes computed tokens x kv_token_bytes /
 * migrate_bw while it keeps running. */
gy_status gy_sim_try_migrate(gy_sim *s, const gy_sim_op *op, int32_t *started) {
    const int32_t from = gy_sim_slot_at(s, op->gpu_first, 0), to = gy_sim_slot_at(s, op->target, 0);
    if (!(s->config.migrate_bw > 0) || from < 0 || to < 0 || from == to) return GY_OK;
    const gy_sim_inst *a = &s->inst[from], *b = &s->inst[to];
    if (a->xform != GY_SIM_XFORM_NONE || b->xform != GY_SIM_XFORM_NONE || a->bound || b->bound)
        return GY_OK;
    const int64_t room = b->core.capacity - gy_sim_instance_used(&b->core);
    int64_t best = -1;
    for (int64_t r = a->head; r >= 0; r = s->req[r].next) {
        const gy_sim_req *q = &s->req[r];
        gy_sched_info info;
        if (q->migrating || q->footprint > room || q->computed <= 0 ||
            gy_sched_info_get(a->core.sched, r, &info) != GY_OK ||
            info.state != GY_SCHED_STATE_RUNNING)
            continue;
        if (best < 0 || q->computed < s->req[best].computed) best = r;
    }
    gy_error_clear(); /* (a request the scheduler no longer knows is simply not a candidate) */
    if (best < 0) return GY_OK;
    gy_sim_req *q = &s->req[best];
    q->migrating = 1;
    q->migrate_from = from;
    q->migrate_to = op->target;
    *started = 1;
    return gy_sim_push(s, s->now + (double)q->computed * s->config.kv_token_bytes /
                                       s->config.migrate_bw,
                       GY_SIM_EV_MIGRATED, best, 0);
}
