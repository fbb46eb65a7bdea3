/* py_sim.c: gyges._C.Simulator (csrc/sim/sim.h), the cost-model entry points the package uses
 * (sim_prefill_rates, sim_policy_names, buddy_plan) and the readers of cost-model parameters
 * (gyges._C_test's cost-model entry points use them too). Arguments arrive already checked by gyges/sim.py; results leave as bytes that the wrapper
 * views with NumPy dtypes mirroring the C structs. The GIL is released around gy_sim_run; a
 * simulator used from a second thread meanwhile raises BusyError. */
#include "py_common.h"

#include <math.h>
#include <string.h>

#include "policy/buddy.h"
#include "policy/cost.h"
#include "policy/pipeline.h"
#include "policy/policy.h"
#include "sim/sim.h"

typedef struct {
    PyObject_HEAD
    gy_sim *sim;
    gy_sim_cost_store cost;        /* the cost model's ctx: lives as long as the simulator */
    int busy;
} GySimulatorObject;

_Static_assert(GY_SIM_COST_LEVELS == GY_SIM_MAX_LEVELS,
               "cost.h and policy.h count TP levels alike");

/* A list of 1..GY_SIM_COST_LEVELS floats from params[name] into out; its length, or -1 with an
 * exception. */
static int gy_py_sim_levels(PyObject *params, const char *name, double *out) {
    PyObject *v = PyDict_GetItemString(params, name);
    if (v == NULL) {
        PyErr_Format(GY_PY_VALUE_ERROR, "cost parameters lack %s", name);
        return -1;
    }
    if (!PyList_Check(v) || PyList_GET_SIZE(v) < 1 || PyList_GET_SIZE(v) > GY_SIM_COST_LEVELS) {
        PyErr_Format(GY_PY_VALUE_ERROR, "cost parameter %s must be a list of 1 to %d floats",
                     name, GY_SIM_COST_LEVELS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v); i++) {
        out[i] = PyFloat_AsDouble(PyList_GET_ITEM(v, i));
        if (out[i] == -1.0 && PyErr_Occurred()) return -1;
    }
    return (int)PyList_GET_SIZE(v);
}

int gy_py_sim_cost_params(PyObject *params, const char *kind, gy_sim_cost_store *store,
                          gy_sim_cost_ops *ops) {
    gy_sim_roofline *roof = &store->roofline;
    gy_sim_cost_constant *cst = &store->constant;
    gy_sim_cost_profiled *prof = &store->profiled;
    if (!PyDict_Check(params)) {
        PyErr_SetString(GY_PY_TYPE_ERROR, "cost parameters must be a dict");
        return -1;
    }
#define GY_PY_SIM_FIELD(dst, name, is_int)                                                         \
    do {                                                                                           \
        PyObject *v_ = PyDict_GetItemString(params, name);                                         \
        if (v_ == NULL) {                                                                          \
            PyErr_Format(GY_PY_VALUE_ERROR, "cost parameters lack %s", name);                         \
            return -1;                                                                             \
        }                                                                                          \
        if (is_int) {                                                                              \
            const long x_ = PyLong_AsLong(v_);                                                     \
            if (x_ == -1 && PyErr_Occurred()) return -1;                                           \
            *(int32_t *)(dst) = (int32_t)x_;                                                       \
        } else {                                                                                   \
            const double x_ = PyFloat_AsDouble(v_);                                                \
            if (x_ == -1.0 && PyErr_Occurred()) return -1;                                         \
            *(double *)(dst) = x_;                                                                 \
        }                                                                                          \
    } while (0)
    gy_status st;
    if (strcmp(kind, "roofline") == 0) {
        memset(roof, 0, sizeof *roof);
        GY_PY_SIM_FIELD(&roof->weight_bytes, "weight_bytes", 0);
        GY_PY_SIM_FIELD(&roof->matmul_params, "matmul_params", 0);
        GY_PY_SIM_FIELD(&roof->lm_head_params, "lm_head_params", 0);
        GY_PY_SIM_FIELD(&roof->attn_flops_per_pair, "attn_flops_per_pair", 0);
        GY_PY_SIM_FIELD(&roof->kv_bytes_per_token, "kv_bytes_per_token", 0);
        GY_PY_SIM_FIELD(&roof->allreduce_bytes_per_token, "allreduce_bytes_per_token", 0);
        GY_PY_SIM_FIELD(&roof->ffn_bytes, "ffn_bytes", 0);
        GY_PY_SIM_FIELD(&roof->expert_bytes, "expert_bytes", 0);
        GY_PY_SIM_FIELD(&roof->n_experts, "n_experts", 1);
        GY_PY_SIM_FIELD(&roof->experts_per_tok, "experts_per_tok", 1);
        GY_PY_SIM_FIELD(&roof->kv_heads, "kv_heads", 1);
        GY_PY_SIM_FIELD(&roof->n_layers, "n_layers", 1);
        GY_PY_SIM_FIELD(&roof->hbm_bw, "hbm_bw", 0);
        GY_PY_SIM_FIELD(&roof->peak_flops, "peak_flops", 0);
        GY_PY_SIM_FIELD(&roof->link_bw, "link_bw", 0);
        GY_PY_SIM_FIELD(&roof->eff_bw, "eff_bw", 0);
        GY_PY_SIM_FIELD(&roof->eff_flops, "eff_flops", 0);
        GY_PY_SIM_FIELD(&roof->eff_link, "eff_link", 0);
        GY_PY_SIM_FIELD(&roof->eff_xfer, "eff_xfer", 0);
        GY_PY_SIM_FIELD(&roof->step_overhead, "step_overhead", 0);
        GY_PY_SIM_FIELD(&roof->allreduce_latency, "allreduce_latency", 0);
        GY_PY_SIM_FIELD(&roof->phase_latency_per_layer, "phase_latency_per_layer", 0);
        GY_PY_SIM_FIELD(&roof->transform_slowdown, "transform_slowdown", 0);
        if (PyDict_GetItemString(params, "sequence_parallel") != NULL) /* (else tensor parallel) */
            GY_PY_SIM_FIELD(&roof->sequence_parallel, "sequence_parallel", 1);
        if (PyDict_GetItemString(params, "pipeline_degree") != NULL) /* (else no pipelines) */
            GY_PY_SIM_FIELD(&roof->pipeline_degree, "pipeline_degree", 1);
        if (PyDict_GetItemString(params, "reshard") != NULL) { /* (else Gyges' phases) */
            GY_PY_SIM_FIELD(&roof->reshard, "reshard", 1);
            GY_PY_SIM_FIELD(&roof->host_bw, "host_bw", 0);
        }
        st = gy_sim_roofline_check(roof);
        if (st != GY_OK) {
            gy_py_raise(st);
            return -1;
        }
        *ops = gy_sim_cost_roofline_ops(roof);
        return 0;
    }
    if (strcmp(kind, "profiled") == 0) {
        memset(prof, 0, sizeof *prof);
        double *levels[] = {prof->base, prof->per_token, prof->per_sample, prof->per_kv_read,
                            prof->per_pair};
        static const char *names[] = {"base", "per_token", "per_sample", "per_kv_read",
                                      "per_pair"};
        for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
            const int n = gy_py_sim_levels(params, names[k], levels[k]);
            if (n < 0) return -1;
            if (k > 0 && n != prof->n_levels) {
                PyErr_Format(GY_PY_VALUE_ERROR, "cost parameter %s has %d TP levels, base %d",
                             names[k], n, (int)prof->n_levels);
                return -1;
            }
            prof->n_levels = n;
        }
        GY_PY_SIM_FIELD(&prof->transform_slowdown, "transform_slowdown", 0);
        GY_PY_SIM_FIELD(&prof->kv_bytes_per_token, "kv_bytes_per_token", 0);
        GY_PY_SIM_FIELD(&prof->ffn_bytes, "ffn_bytes", 0);
        GY_PY_SIM_FIELD(&prof->n_layers, "n_layers", 1);
        GY_PY_SIM_FIELD(&prof->xfer_bw, "xfer_bw", 0);
        GY_PY_SIM_FIELD(&prof->phase_latency_per_layer, "phase_latency_per_layer", 0);
        if (PyDict_GetItemString(params, "alone_base") != NULL) { /* (else one set) */
            double *alone[] = {prof->alone.base, prof->alone.per_token, prof->alone.per_sample,
                               prof->alone.per_kv_read, prof->alone.per_pair};
            static const char *alone_names[] = {"alone_base", "alone_per_token",
                                                "alone_per_sample", "alone_per_kv_read",
                                                "alone_per_pair"};
            for (size_t k = 0; k < sizeof alone_names / sizeof alone_names[0]; k++) {
                const int n = gy_py_sim_levels(params, alone_names[k], alone[k]);
                if (n < 0) return -1;
                if (n != prof->n_levels) {
                    PyErr_Format(GY_PY_VALUE_ERROR, "cost parameter %s has %d TP levels, base "
                                 "%d", alone_names[k], n, (int)prof->n_levels);
                    return -1;
                }
            }
            prof->has_alone = 1;
        }
        st = gy_sim_cost_profiled_check(prof);
        if (st != GY_OK) {
            gy_py_raise(st);
            return -1;
        }
        *ops = gy_sim_cost_profiled_ops(prof);
        return 0;
    }
    if (strcmp(kind, "constant") == 0) {
        memset(cst, 0, sizeof *cst);
        GY_PY_SIM_FIELD(&cst->step_time, "step_time", 0);
        GY_PY_SIM_FIELD(&cst->phase_time, "phase_time", 0);
        GY_PY_SIM_FIELD(&cst->transform_slowdown, "transform_slowdown", 0);
        st = gy_sim_cost_constant_check(cst);
        if (st != GY_OK) {
            gy_py_raise(st);
            return -1;
        }
        *ops = gy_sim_cost_constant_ops(cst);
        return 0;
    }
#undef GY_PY_SIM_FIELD
    PyErr_Format(GY_PY_VALUE_ERROR, "unknown cost model kind %s (roofline, profiled, constant)",
                 kind);
    return -1;
}

/* Reads a pipeline's parameters (gyges.costmodel.PipelineCost.params()) and checks them; -1 with
 * an exception. */
int gy_py_sim_pipeline_params(PyObject *params, gy_sim_pipeline *p) {
    if (!PyDict_Check(params)) {
        PyErr_SetString(GY_PY_TYPE_ERROR, "pipeline parameters must be a dict");
        return -1;
    }
    memset(p, 0, sizeof *p);
    struct { const char *name; double *dst; } f[] = {
        {"layer_bytes", &p->layer_bytes}, {"layer_params", &p->layer_params},
        {"attn_flops_per_pair", &p->attn_flops_per_pair}, {"kv_layer", &p->kv_layer},
        {"lm_head_params", &p->lm_head_params}, {"head_bytes", &p->head_bytes},
        {"act_bytes", &p->act_bytes}, {"link_bw", &p->link_bw},
        {"link_latency", &p->link_latency}, {"eff_xfer", &p->eff_xfer},
        {"step_overhead", &p->step_overhead}, {"transform_slowdown", &p->transform_slowdown},
        {"stop_time", &p->stop_time},
    };
    for (size_t k = 0; k < sizeof f / sizeof f[0]; k++) {
        PyObject *v = PyDict_GetItemString(params, f[k].name);
        if (v == NULL) {
            PyErr_Format(GY_PY_VALUE_ERROR, "pipeline parameters lack %s", f[k].name);
            return -1;
        }
        *f[k].dst = PyFloat_AsDouble(v);
        if (*f[k].dst == -1.0 && PyErr_Occurred()) return -1;
    }
    struct { const char *name; int64_t *dst; } n[] = {
        {"block_size", &p->block_size}, {"fixed_blocks", &p->fixed_blocks}};
    for (size_t k = 0; k < sizeof n / sizeof n[0]; k++) {
        PyObject *v = PyDict_GetItemString(params, n[k].name);
        if (v == NULL) {
            PyErr_Format(GY_PY_VALUE_ERROR, "pipeline parameters lack %s", n[k].name);
            return -1;
        }
        *n[k].dst = PyLong_AsLongLong(v);
        if (*n[k].dst == -1 && PyErr_Occurred()) return -1;
    }
    PyObject *host = PyDict_GetItemString(params, "host_bw"); /* optional: 0 */
    if (host != NULL) {
        p->host_bw = PyFloat_AsDouble(host);
        if (p->host_bw == -1.0 && PyErr_Occurred()) return -1;
    }
    PyObject *micro = PyDict_GetItemString(params, "micro_batches"); /* optional: 0 (one batch) */
    if (micro != NULL) {
        const long v = PyLong_AsLong(micro);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v < 0 || v > INT32_MAX) {
            PyErr_Format(GY_PY_VALUE_ERROR, "micro_batches must be in [0, 2^31), got %ld", v);
            return -1;
        }
        p->micro_batches = (int32_t)v;
    }
    PyObject *flush = PyDict_GetItemString(params, "flush"); /* optional: 0 */
    if (flush != NULL) {
        const int v = PyObject_IsTrue(flush);
        if (v < 0) return -1;
        p->flush = v;
    }
    PyObject *layers = PyDict_GetItemString(params, "n_layers");
    PyObject *stages = PyDict_GetItemString(params, "stages");
    if (layers == NULL || stages == NULL || !PyList_Check(stages)) {
        PyErr_SetString(GY_PY_VALUE_ERROR, "pipeline parameters lack n_layers or a list stages");
        return -1;
    }
    p->n_layers = (int32_t)PyLong_AsLong(layers);
    if (p->n_layers == -1 && PyErr_Occurred()) return -1;
    const Py_ssize_t ns = PyList_GET_SIZE(stages);
    if (ns < 2 || ns > GY_SIM_MAX_STAGES) {
        PyErr_Format(GY_PY_VALUE_ERROR, "a pipeline has 2 to %d stages, got %zd",
                     GY_SIM_MAX_STAGES, ns);
        return -1;
    }
    p->n_stages = (int32_t)ns;
    for (Py_ssize_t i = 0; i < ns; i++) {
        PyObject *d = PyList_GET_ITEM(stages, i);
        if (!PyDict_Check(d)) {
            PyErr_SetString(GY_PY_TYPE_ERROR, "pipeline stages must be dicts");
            return -1;
        }
        gy_sim_pipe_stage *g = &p->stage[i];
        struct { const char *name; double *dst; } sf[] = {
            {"budget_bytes", &g->budget_bytes}, {"hbm_bw", &g->hbm_bw},
            {"peak_flops", &g->peak_flops}, {"eff_bw", &g->eff_bw},
            {"eff_flops", &g->eff_flops}};
        for (size_t k = 0; k < sizeof sf / sizeof sf[0]; k++) {
            PyObject *v = PyDict_GetItemString(d, sf[k].name);
            if (v == NULL) {
                PyErr_Format(GY_PY_VALUE_ERROR, "pipeline stage %zd lacks %s", i, sf[k].name);
                return -1;
            }
            *sf[k].dst = PyFloat_AsDouble(v);
            if (*sf[k].dst == -1.0 && PyErr_Occurred()) return -1;
        }
    }
    const gy_status st = gy_sim_pipeline_check(p);
    if (st != GY_OK) {
        gy_py_raise(st);
        return -1;
    }
    return 0;
}

int gy_py_sim_split(PyObject *o, int32_t n, int32_t *layers, const char *what) {
    int64_t v[GY_SIM_MAX_STAGES];
    const Py_ssize_t got = gy_py_int64s(o, v, GY_SIM_MAX_STAGES, what);
    if (got < 0) return -1;
    if (got != n) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s needs %d stages, got %zd", what, (int)n, got);
        return -1;
    }
    for (int32_t i = 0; i < n; i++) layers[i] = (int32_t)v[i];
    return 0;
}

static PyObject *gy_py_simulator_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"hosts", "gpus_per_host", "max_tp", "layout", "capacity",
                            "capacity_mid", "block_size", "max_batch_tokens", "max_running",
                            "max_prefill_chunk", "watermark", "cost_kind", "cost_params",
                            "policy", "decode_weight", "scale_down_free", "scale_up_load",
                            "scale_up_cap", "merge_wait", "eager_scale_up",
                            "sample_interval", "record_tokens", "arrival", "input_tokens",
                            "output_tokens", "priority", "max_input", "replicated",
                            "switch_time", "flying_tp", "light_load", "pipeline",
                            "pipe_layers", "buddy", "buddy_group", "live_restore",
                            "buddy_strategy", "restore_wait", "swap_bw", "kv_token_bytes",
                            "migrate_bw", "idle_load", "sequence_parallel", "sp_min_prompt",
                            "stop_transforming", "decode_tp", "prefill_tp", NULL};
    int hosts, gpus_per_host, max_tp, eager, record_tokens;
    long long block_size, max_batch_tokens, max_running, max_prefill_chunk;
    double watermark, decode_weight, scale_down_free, scale_up_load, scale_up_cap, merge_wait,
        sample_interval;
    const char *cost_kind, *policy_name;
    PyObject *layout_o, *cap_o, *mid_o, *cost_params, *arr_o, *in_o, *out_o, *prio_o,
        *max_in_o = Py_None, *pipe_o = Py_None, *pipe_layers_o = Py_None;
    const gy_sim_policy_config defaults = gy_sim_policy_config_default();
    int replicated = 0, flying_tp = defaults.flying_tp;
    double switch_time = 0.0, light_load = defaults.light_load, idle_load = defaults.idle_load;
    int buddy = 0, buddy_group = 1, live_restore = 1, buddy_strategy = defaults.buddy_strategy;
    double restore_wait = defaults.restore_wait, swap_bw = 0.0, kv_token_bytes = 0.0,
           migrate_bw = 0.0, sp_min_prompt = defaults.sp_min_prompt;
    int sequence_parallel = 0, stop_transforming = 0, decode_tp = defaults.decode_tp,
        prefill_tp = defaults.prefill_tp;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "iiiOOOLLLLdsOsdddddpdpOOOO|OpdidOOpipidddddpdpii", names, &hosts,
            &gpus_per_host, &max_tp, &layout_o, &cap_o, &mid_o, &block_size, &max_batch_tokens, &max_running,
            &max_prefill_chunk, &watermark, &cost_kind, &cost_params, &policy_name,
            &decode_weight, &scale_down_free, &scale_up_load, &scale_up_cap, &merge_wait, &eager,
            &sample_interval, &record_tokens, &arr_o, &in_o, &out_o, &prio_o, &max_in_o,
            &replicated, &switch_time, &flying_tp, &light_load, &pipe_o, &pipe_layers_o, &buddy,
            &buddy_group, &live_restore, &buddy_strategy, &restore_wait, &swap_bw, &kv_token_bytes,
            &migrate_bw, &idle_load, &sequence_parallel, &sp_min_prompt, &stop_transforming,
            &decode_tp, &prefill_tp))
        return NULL;
    gy_sim_pipeline pipeline;
    int32_t pipe_layers[GY_SIM_MAX_STAGES] = {0};
    if (pipe_o != Py_None &&
        (gy_py_sim_pipeline_params(pipe_o, &pipeline) < 0 ||
         gy_py_sim_split(pipe_layers_o, pipeline.n_stages, pipe_layers, "pipe_layers") < 0))
        return NULL;
    const gy_sim_policy_ops *policy = gy_sim_policy_find(policy_name);
    if (policy == NULL)
        return PyErr_Format(GY_PY_VALUE_ERROR, "unknown policy %s (known: %s)", policy_name,
                            gy_sim_policy_names());
    int64_t layout64[64], cap[GY_SIM_MAX_LEVELS], mid[GY_SIM_MAX_LEVELS];
    const Py_ssize_t n_layout = gy_py_int64s(layout_o, layout64, 64, "layout");
    if (n_layout < 0) return NULL;
    const Py_ssize_t n_cap = gy_py_int64s(cap_o, cap, GY_SIM_MAX_LEVELS, "capacity");
    if (n_cap < 0) return NULL;
    const Py_ssize_t n_mid = gy_py_int64s(mid_o, mid, GY_SIM_MAX_LEVELS, "capacity_mid");
    if (n_mid < 0) return NULL;
    if (n_cap != n_mid || gy_sim_level(max_tp) < 0 || n_cap != gy_sim_level(max_tp) + 1)
        return PyErr_Format(GY_PY_VALUE_ERROR,
                            "capacity and capacity_mid need log2(max_tp) + 1 = %d entries",
                            gy_sim_level(max_tp) + 1);
    int64_t max_input[GY_SIM_MAX_LEVELS];
    if (max_in_o != Py_None) {
        const Py_ssize_t n_in = gy_py_int64s(max_in_o, max_input, GY_SIM_MAX_LEVELS, "max_input");
        if (n_in < 0) return NULL;
        if (n_in != n_cap)
            return PyErr_Format(GY_PY_VALUE_ERROR, "max_input needs log2(max_tp) + 1 = %d entries",
                                (int)n_cap);
    }
    int32_t layout[64];
    for (Py_ssize_t i = 0; i < n_layout; i++) layout[i] = (int32_t)layout64[i];

    GySimulatorObject *self = (GySimulatorObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    gy_sim_config c = {
        .hosts = hosts, .gpus_per_host = gpus_per_host, .max_tp = max_tp,
        .n_layout = (int32_t)n_layout, .layout = layout, .capacity = cap, .capacity_mid = mid,
        .max_input = max_in_o == Py_None ? NULL : max_input,
        .sched = {.block_size = block_size, .max_batch_tokens = max_batch_tokens,
                  .max_running = max_running, .max_prefill_chunk = max_prefill_chunk,
                  .watermark = watermark},
        .policy = policy,
        .policy_config = {.decode_weight = decode_weight, .scale_down_free = scale_down_free,
                          .scale_up_load = scale_up_load, .scale_up_cap = scale_up_cap,
                          .merge_wait = merge_wait,
                          .eager_scale_up = eager,
                          .flying_tp = flying_tp, .light_load = light_load,
                          .idle_load = idle_load, .buddy_strategy = buddy_strategy,
                          .restore_wait = restore_wait,
                          .max_migrations = defaults.max_migrations,
                          .sp_min_prompt = sp_min_prompt, .decode_tp = decode_tp,
                          .prefill_tp = prefill_tp},
        .sample_interval = sample_interval,
        .record_tokens = record_tokens,
        .replicated = replicated,
        .switch_time = switch_time,
        .sequence_parallel = sequence_parallel,
        .stop_transforming = stop_transforming,
        .pipeline = pipe_o == Py_None ? NULL : &pipeline,
        .pipe_layers = pipe_layers,
        .buddy = buddy,
        .buddy_group = buddy_group,
        .live_restore = live_restore,
        .swap_bw = swap_bw,
        .kv_token_bytes = kv_token_bytes,
        .migrate_bw = migrate_bw,
    };
    if (gy_py_sim_cost_params(cost_params, cost_kind, &self->cost, &c.cost) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    Py_buffer arr = {0}, in = {0}, out = {0}, prio = {0};
    int have = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(arr_o, &arr, PyBUF_C_CONTIGUOUS) < 0) goto done;
    have = 1;
    const Py_ssize_t n = arr.len / 8;
    if (gy_py_get_buffer(in_o, &in, n * 8, 0, "input_tokens") < 0) goto done;
    have = 2;
    if (gy_py_get_buffer(out_o, &out, n * 8, 0, "output_tokens") < 0) goto done;
    have = 3;
    if (gy_py_get_buffer(prio_o, &prio, n * 4, 0, "priority") < 0) goto done;
    have = 4;
    const gy_sim_trace t = {.n = n, .arrival = arr.buf, .input_tokens = in.buf,
                            .output_tokens = out.buf, .priority = prio.buf};
    gy_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gy_sim_init(&self->sim, &c, &t);
    Py_END_ALLOW_THREADS
    if (st != GY_OK) {
        gy_py_raise(st);
        goto done;
    }
    result = (PyObject *)self;
done:
    if (have >= 4) PyBuffer_Release(&prio);
    if (have >= 3) PyBuffer_Release(&out);
    if (have >= 2) PyBuffer_Release(&in);
    if (have >= 1) PyBuffer_Release(&arr);
    if (result == NULL) Py_DECREF(self);
    return result;
}

static void gy_py_simulator_dealloc(GySimulatorObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_sim_free(self->sim);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static int gy_py_simulator_enter(GySimulatorObject *self) {
    if (self->busy) {
        PyErr_SetString(gy_py_error_class(GY_ERR_BUSY), "the simulator is in use by another thread");
        return -1;
    }
    if (self->sim == NULL) {
        PyErr_SetString(gy_py_error_class(GY_ERR_STATE), "the simulator was not initialised");
        return -1;
    }
    return 0;
}

static PyObject *gy_py_simulator_run(GySimulatorObject *self, PyObject *args) {
    double until = INFINITY;
    if (!PyArg_ParseTuple(args, "|d", &until)) return NULL;
    if (gy_py_simulator_enter(self) < 0) return NULL;
    gy_status st;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = gy_sim_run(self->sim, until);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (st != GY_OK) return gy_py_raise(st);
    gy_sim_stats s;
    gy_sim_stats_get(self->sim, &s);
    return PyBool_FromLong(s.done);
}

static PyObject *gy_py_simulator_check(GySimulatorObject *self, PyObject *unused) {
    if (gy_py_simulator_enter(self) < 0) return NULL;
    const gy_status st = gy_sim_check(self->sim);
    if (st != GY_OK) return gy_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *gy_py_simulator_stats(GySimulatorObject *self, PyObject *unused) {
    if (gy_py_simulator_enter(self) < 0) return NULL;
    gy_sim_stats s;
    gy_sim_stats_get(self->sim, &s);
    return Py_BuildValue(
        "{sdsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsNsLsdsdsLsLsLsdsdsdsdsdsdsdsLsd}", "now", s.now,
        "requests",
        (long long)s.n_requests,
        "arrived", (long long)s.n_arrived, "finished", (long long)s.n_finished, "rejected",
        (long long)s.n_rejected, "deferred", (long long)s.n_deferred, "steps",
        (long long)s.n_steps, "events", (long long)s.n_events, "preemptions",
        (long long)s.n_preemptions, "migrations", (long long)s.n_migrations, "merges",
        (long long)s.n_merges, "splits", (long long)s.n_splits, "transforming",
        (long long)s.n_transforming, "ops_refused", (long long)s.n_ops_refused, "decisions",
        (long long)s.n_decisions, "rebalances", (long long)s.n_rebalances, "binds",
        (long long)s.n_binds, "releases", (long long)s.n_releases, "paused",
        (long long)s.n_paused, "recomputed", (long long)s.n_recomputed, "done",
        PyBool_FromLong(s.done), "resplits", (long long)s.n_resplits, "resplit_migration_s",
        s.resplit_migration_s, "resplit_stop_s", s.resplit_stop_s, "drops", (long long)s.n_drops,
        "restores", (long long)s.n_restores, "victims", (long long)s.n_victims, "exchange_s",
        s.exchange_s, "restore_s", s.restore_s, "exchange_bytes", s.exchange_bytes,
        "restore_bytes", s.restore_bytes, "swap_s", s.swap_s, "swap_out_bytes", s.swap_out_bytes,
        "swap_in_bytes", s.swap_in_bytes, "live_migrations", (long long)s.n_live_migrations,
        "migrate_bytes", s.migrate_bytes);
}

#define GY_PY_SIM_BYTES(fn, getter, type)                                                          \
    static PyObject *fn(GySimulatorObject *self, PyObject *unused) {                               \
        if (gy_py_simulator_enter(self) < 0) return NULL;                                          \
        int64_t n = 0;                                                                             \
        const type *p = getter(self->sim, &n);                                                     \
        return PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)(n * (int64_t)sizeof(type))); \
    }

GY_PY_SIM_BYTES(gy_py_simulator_requests, gy_sim_requests, gy_sim_request_out)
GY_PY_SIM_BYTES(gy_py_simulator_samples, gy_sim_samples, gy_sim_sample)
GY_PY_SIM_BYTES(gy_py_simulator_layout, gy_sim_layout, gy_sim_layout_event)
GY_PY_SIM_BYTES(gy_py_simulator_transforms, gy_sim_transforms, gy_sim_transform_out)
GY_PY_SIM_BYTES(gy_py_simulator_tokens, gy_sim_tokens, gy_sim_token)

static PyObject *gy_py_simulator_bins(GySimulatorObject *self, PyObject *unused) {
    if (gy_py_simulator_enter(self) < 0) return NULL;
    int64_t n = 0;
    const double *prompt = NULL;
    const double *output = gy_sim_bins(self->sim, &n, &prompt);
    if (n == 0) return Py_BuildValue("(y#y#)", "", (Py_ssize_t)0, "", (Py_ssize_t)0);
    return Py_BuildValue("(y#y#)", (const char *)output, (Py_ssize_t)(n * 8),
                         (const char *)prompt, (Py_ssize_t)(n * 8));
}

static PyMethodDef gy_py_simulator_methods[] = {
    {"run", (PyCFunction)gy_py_simulator_run, METH_VARARGS,
     "run(until=inf) -> done: processes the events at or before `until`"},
    {"check", (PyCFunction)gy_py_simulator_check, METH_NOARGS, "check(): invariants or StateError"},
    {"stats", (PyCFunction)gy_py_simulator_stats, METH_NOARGS, "stats() -> dict"},
    {"requests", (PyCFunction)gy_py_simulator_requests, METH_NOARGS, "per-request records (bytes)"},
    {"samples", (PyCFunction)gy_py_simulator_samples, METH_NOARGS, "time-series samples (bytes)"},
    {"layout", (PyCFunction)gy_py_simulator_layout, METH_NOARGS, "instance events (bytes)"},
    {"transforms", (PyCFunction)gy_py_simulator_transforms, METH_NOARGS, "transformations (bytes)"},
    {"tokens", (PyCFunction)gy_py_simulator_tokens, METH_NOARGS, "token times (bytes)"},
    {"bins", (PyCFunction)gy_py_simulator_bins, METH_NOARGS, "(output, prompt) tokens per bin"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot gy_py_simulator_slots[] = {
    {Py_tp_new, gy_py_simulator_new},
    {Py_tp_dealloc, gy_py_simulator_dealloc},
    {Py_tp_methods, gy_py_simulator_methods},
    {Py_tp_doc, "Simulator(...): the cluster simulator of csrc/sim/sim.h; build it with "
                "gyges.sim.run, which checks the arguments."},
    {0, NULL},
};

static PyType_Spec gy_py_simulator_spec = {
    .name = "gyges._C.Simulator",
    .basicsize = sizeof(GySimulatorObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_simulator_slots,
};

/* sim_prefill_rates(kind, params, max_tp, chunk) -> [tokens/s of TP1, TP2, ..., max_tp] */
static PyObject *gy_py_sim_prefill_rates(PyObject *module, PyObject *args) {
    const char *kind;
    PyObject *params;
    int max_tp;
    long long chunk;
    if (!PyArg_ParseTuple(args, "sOiL", &kind, &params, &max_tp, &chunk)) return NULL;
    if (gy_sim_level(max_tp) < 0)
        return PyErr_Format(GY_PY_VALUE_ERROR, "max_tp must be a power of two, got %d", max_tp);
    gy_sim_cost_store store;
    gy_sim_cost_ops ops;
    if (gy_py_sim_cost_params(params, kind, &store, &ops) < 0) return NULL;
    double rates[GY_SIM_MAX_LEVELS];
    const int levels = gy_sim_level(max_tp) + 1;
    const gy_status s = gy_sim_prefill_rates(&ops, levels, chunk, rates);
    if (s != GY_OK) return gy_py_raise(s);
    PyObject *list = PyList_New(levels);
    for (int l = 0; list != NULL && l < levels; l++) {
        PyObject *v = PyFloat_FromDouble(rates[l]);
        if (v == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, l, v);
    }
    return list;
}

/* buddy_plan(n, required, param_bytes, strategy, kv_bytes) -> ([group of each], met, freed) */
static PyObject *gy_py_buddy_plan(PyObject *module, PyObject *args) {
    int n, strategy;
    double required, param_bytes, kv_bytes;
    if (!PyArg_ParseTuple(args, "iddid", &n, &required, &param_bytes, &strategy, &kv_bytes))
        return NULL;
    if (n < 1 || n > (1 << 20)) return PyErr_Format(GY_PY_VALUE_ERROR, "n must be in [1, 2^20]");
    int32_t *group_of = PyMem_Malloc((size_t)n * sizeof *group_of);
    if (group_of == NULL) return PyErr_NoMemory();
    int32_t met = 0;
    double freed = 0;
    const gy_status s = gy_buddy_plan(n, required, param_bytes, strategy, kv_bytes, group_of, &met,
                                      &freed);
    PyObject *list = s == GY_OK ? PyList_New(n) : NULL;
    for (int i = 0; list != NULL && i < n; i++) {
        PyObject *v = PyLong_FromLong(group_of[i]);
        if (v == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, v);
    }
    PyMem_Free(group_of);
    if (s != GY_OK) return gy_py_raise(s);
    if (list == NULL) return NULL;
    return Py_BuildValue("(NOd)", list, met ? Py_True : Py_False, freed);
}

static PyObject *gy_py_sim_policy_names(PyObject *module, PyObject *unused) {
    return PyUnicode_FromString(gy_sim_policy_names());
}

static PyMethodDef gy_py_sim_functions[] = {
    {"sim_prefill_rates", gy_py_sim_prefill_rates, METH_VARARGS,
     "sim_prefill_rates(kind, params, max_tp, chunk) -> prompt tokens/s of each TP level"},
    {"sim_policy_names", gy_py_sim_policy_names, METH_NOARGS, "the policies, comma-separated"},
    {"buddy_plan", gy_py_buddy_plan, METH_VARARGS,
     "buddy_plan(n, required, param_bytes, strategy, kv_bytes) -> (groups, met, freed)"},
    {NULL, NULL, 0, NULL},
};

int gy_py_sim_add(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &gy_py_simulator_spec, NULL);
    if (type == NULL) return -1;
    if (PyModule_AddObjectRef(module, "Simulator", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    Py_DECREF(type);
    return PyModule_AddFunctions(module, gy_py_sim_functions);
}
