/* step.c: the steps of a simulated instance. Its scheduler (sched/batch.h) picks the batch; the
 * cost model prices it (policy/cost.h for a TP group, policy/pipeline.h for a pipeline), plus
 * the KV a swap moves over PCIe and a buddy exchange's remote attention; at its end the tokens,
 * the throughput bins and the finished requests are committed. Steps run back to back while the
 * instance has work; a step that computes nothing new (only kept KV) takes no time. */
#include "sim_impl.h"

#include <math.h>

/* Grows the bins so that time t has one. */
static gy_status gy_sim_bin_at(gy_sim *s, double t, int64_t *bin) {
    int64_t b = (int64_t)floor((t - s->t0) / s->config.sample_interval);
    if (b < 0) b = 0;
    while (s->n_bins <= b) {
        if (s->n_bins >= s->cap_bins) {
            const int64_t c = s->cap_bins ? 2 * s->cap_bins : 1024;
            double *o = gy_realloc(s->bin_out, (size_t)c * sizeof *o);
            if (o == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for bins");
            s->bin_out = o;
            double *p = gy_realloc(s->bin_prompt, (size_t)c * sizeof *p);
            if (p == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for bins");
            s->bin_prompt = p;
            s->cap_bins = c;
        }
        s->bin_out[s->n_bins] = s->bin_prompt[s->n_bins] = 0.0;
        s->n_bins++;
    }
    *bin = b;
    return GY_OK;
}

/* The share of the host's other GPUs whose instances are stepping as `slot` starts a step (a CPU
 * host's workers share its cores and memory bandwidth: cost ops host_shared). */
static double gy_sim_busy_share(const gy_sim *s, int32_t slot) {
    const gy_sim_inst *i = &s->inst[slot];
    const int32_t others = s->config.gpus_per_host - i->width;
    if (others <= 0) return 0.0;
    int32_t busy = 0;
    for (int64_t k = 0; k < s->n_slots; k++) {
        const gy_sim_inst *o = &s->inst[k];
        if (k != slot && o->alive && o->stepping && o->host == i->host) busy += o->width;
    }
    return (double)busy / (double)others;
}

/* Starts steps on an idle instance until one takes time (or there is no work). */
gy_status gy_sim_start_step(gy_sim *s, int32_t slot) {
    for (int64_t guard = 0;; guard++) {
        gy_sim_inst *i = &s->inst[slot];
        if (i->stepping || i->barrier || i->stopped) return GY_OK;
        if (guard > (INT64_C(1) << 24))
            return GY_FAIL(GY_ERR_STATE, "instance at GPU %d made no progress in %lld steps",
                           (int)i->gpu_first, (long long)guard);
        GY_TRY(gy_sched_schedule(i->core.sched, s->now, &i->batch));
        double swap_out = 0, swap_in = 0; /* tokens of KV this step moves to host memory, back */
        double park_out = 0, park_in = 0;  /* the same of parked requests (beside the step) */
        for (int64_t k = 0; k < i->batch.n_preempted; k++) {
            gy_sim_req *q = &s->req[i->batch.preempted[k]];
            if (s->config.swap_bw > 0) { /* its KV goes to host memory and comes back */
                q->kept = q->computed;
                q->swapped = q->computed > 0;
                swap_out += (double)q->computed;
            } else { /* its KV is released: recompute for real */
                q->kept = q->computed = 0;
            }
            s->out[i->batch.preempted[k]].preemptions++;
            s->stats.n_preemptions++;
        }
        for (int64_t k = 0; k < i->batch.n_parked; k++) { /* prefill only: to host memory */
            gy_sim_req *q = &s->req[i->batch.parked[k]];
            q->kept = q->computed;
            q->swapped = q->computed > 0 ? 2 : 0;
            park_out += (double)q->computed;
        }
        if (i->batch.n_entries == 0) { /* (KV parked by a step with nothing to compute goes
                                        * out in the background: counted, not timed) */
            s->stats.swap_out_bytes += park_out * s->config.kv_token_bytes;
            GY_TRY(gy_sched_commit(i->core.sched, s->now, NULL, 0, NULL));
            return GY_OK;
        }
        gy_sim_step_shape shape = {0};
        double victim_tokens = 0; /* buddy: query tokens of requests whose KV is partly remote */
        for (int64_t k = 0; k < i->batch.n_entries; k++) {
            const gy_sched_entry *e = &i->batch.entries[k];
            if (isnan(s->out[e->id].scheduled)) s->out[e->id].scheduled = s->now;
            if (s->req[e->id].swapped) { /* re-admitted: its KV comes back from host memory */
                *(s->req[e->id].swapped == 2 ? &park_in : &swap_in) += (double)s->req[e->id].kept;
                s->req[e->id].swapped = 0;
            }
            const int64_t end = e->pos + e->n_tokens;
            const int64_t kept = s->req[e->id].kept;
            const int64_t start = e->pos > kept ? e->pos : kept;
            if (end <= start) continue; /* all of it kept */
            if (s->req[e->id].victim) victim_tokens += (double)(end - start);
            shape.n_tokens += end - start;
            shape.n_seqs++;
            shape.n_samples += e->samples;
            shape.kv_read_tokens += (double)end;
            shape.attn_pairs += ((double)end * (double)(end + 1) -
                                 (double)start * (double)(start + 1)) / 2.0;
        }
        if (s->config.cost.host_shared) shape.busy_share = gy_sim_busy_share(s, slot);
        const int busy = i->xform != GY_SIM_XFORM_NONE && i->xform != GY_SIM_XFORM_EXCHANGING;
        double dt = i->n_stages > 0
                        ? gy_sim_pipeline_step_time(gy_sim_inst_pipe(s, i), i->layers, busy,
                                                    &shape)
                        : s->config.cost.step_time(s->config.cost.ctx, i->tp, busy, &shape);
        if (i->xform == GY_SIM_XFORM_EXCHANGING && victim_tokens > 0) {
            const gy_sim_pipeline *p = gy_sim_inst_pipe(s, i);
            double left = i->exch_len > 0 ? 1.0 - (s->now - i->exch_start) / i->exch_len : 0.0;
            if (left < 0) left = 0;
            if (left > 1) left = 1;
            const double remote = gy_sim_pipeline_remote_time(
                p, left * (double)p->n_layers * (double)(i->n_stages - 1) / i->n_stages,
                victim_tokens);
            dt += remote;
            i->exch_debt += remote; /* the link carried it before the exchange's bytes */
        }
        /* over every GPU's PCIe link at once: a parked request's copies overlap the step (Seesaw
         * copies asynchronously), a preempted one's stall it */
        const double per_token = s->config.swap_bw > 0
                                     ? s->config.kv_token_bytes /
                                           (s->config.swap_bw * (double)i->width)
                                     : 0.0;
        const double park = (park_out + park_in) * per_token;
        if (park > dt) {
            s->stats.swap_s += park - dt;
            dt = park;
        }
        const double swap = (swap_out + swap_in) * per_token;
        dt += swap;
        s->stats.swap_s += swap;
        s->stats.swap_out_bytes += (swap_out + park_out) * s->config.kv_token_bytes;
        s->stats.swap_in_bytes += (swap_in + park_in) * s->config.kv_token_bytes;
        if (!(dt >= 0) || !isfinite(dt))
            return GY_FAIL(GY_ERR_STATE, "the cost model gave a step time of %g s", dt);
        if (dt > 0) {
            i->stepping = 1;
            return gy_sim_push(s, s->now + dt, GY_SIM_EV_STEP, slot, i->gen);
        }
        int finished = 0; /* a step over kept KV only: done at once */
        GY_TRY(gy_sim_finish_step(s, slot, &finished));
    }
}

static gy_status gy_sim_finish_request(gy_sim *s, int32_t slot, int64_t r) {
    gy_sim_req *q = &s->req[r];
    if (q->generated != s->out[r].output_tokens)
        return GY_FAIL(GY_ERR_STATE, "request %lld finished with %lld of %lld output tokens",
                       (long long)r, (long long)q->generated,
                       (long long)s->out[r].output_tokens);
    s->out[r].finish = s->now;
    s->out[r].status = GY_SIM_REQ_FINISHED;
    gy_sim_unlink(s, r);
    s->stats.n_finished++;
    return gy_sched_forget(s->inst[slot].core.sched, r);
}

gy_status gy_sim_finish_step(gy_sim *s, int32_t slot, int *finished_any) {
    gy_sim_inst *i = &s->inst[slot];
    gy_sched_done done;
    GY_TRY(gy_sched_commit(i->core.sched, s->now, NULL, i->batch.n_entries, &done));
    s->stats.n_steps++;
    int64_t bin = -1;
    for (int64_t k = 0; k < i->batch.n_entries; k++) {
        const gy_sched_entry *e = &i->batch.entries[k];
        gy_sim_req *q = &s->req[e->id];
        gy_sim_request_out *o = &s->out[e->id];
        const int64_t end = e->pos + e->n_tokens;
        if (e->is_prefill) {
            const int64_t upto = end < o->input_tokens ? end : o->input_tokens;
            if (upto > q->prefill_done) {
                if (bin < 0) GY_TRY(gy_sim_bin_at(s, s->now, &bin));
                s->bin_prompt[bin] += (double)(upto - q->prefill_done);
                i->pending_prefill -= upto - q->prefill_done;
                q->prefill_done = upto;
            }
        }
        if (q->kept > 0 && end >= q->kept) q->kept = 0;
        if (end > q->computed) q->computed = end;
        if (!e->samples) continue;
        const int64_t index = q->gen_offset + e->sample_index;
        if (index > q->generated)
            return GY_FAIL(GY_ERR_STATE, "request %lld sampled token %lld with only %lld before",
                           (long long)e->id, (long long)index, (long long)q->generated);
        if (index < q->generated) continue; /* the token it had before a carry-over */
        q->generated++;
        i->pending_output--;
        if (q->generated == 1) o->first_token = s->now;
        if (bin < 0) GY_TRY(gy_sim_bin_at(s, s->now, &bin));
        s->bin_out[bin] += 1.0;
        if (s->config.record_tokens) {
            GY_SIM_GROW(s->tokens, s->n_tokens, s->cap_tokens);
            s->tokens[s->n_tokens++] = (gy_sim_token){.request = e->id, .time = s->now};
        }
    }
    for (int64_t k = 0; k < done.n_finished; k++)
        GY_TRY(gy_sim_finish_request(s, slot, done.finished[k]));
    *finished_any = done.n_finished > 0;
    return GY_OK;
}
