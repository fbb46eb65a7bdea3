/* py_cost_model.c: the C cost models (csrc/policy/cost.h, pipeline.h) evaluated on one shape,
 * for the tests that check them against their Python reference, gyges.cluster.costmodel; the
 * simulator and the policies price by them from C. The parameters are read by py_sim.c's readers,
 * as the simulator's are. */
#include "py_test.h"

#include "policy/cost.h"
#include "policy/pipeline.h"

/* sim_step_time(kind, params, tp, transforming, n_tokens, n_seqs, n_samples, kv_read, pairs
 *               [, busy_share]) */
static PyObject *gy_py_sim_step_time(PyObject *module, PyObject *args) {
    const char *kind;
    PyObject *params;
    int tp, transforming;
    long long n_tokens, n_seqs, n_samples;
    double kv_read, pairs, busy_share = 0.0;
    if (!PyArg_ParseTuple(args, "sOipLLLdd|d", &kind, &params, &tp, &transforming, &n_tokens,
                          &n_seqs, &n_samples, &kv_read, &pairs, &busy_share))
        return NULL;
    gy_sim_cost_store store;
    gy_sim_cost_ops ops;
    if (gy_py_sim_cost_params(params, kind, &store, &ops) < 0) return NULL;
    const gy_sim_step_shape s = {.n_tokens = n_tokens, .n_seqs = n_seqs, .n_samples = n_samples,
                                 .kv_read_tokens = kv_read, .attn_pairs = pairs,
                                 .busy_share = busy_share};
    return PyFloat_FromDouble(ops.step_time(ops.ctx, tp, transforming, &s));
}

/* sim_phase_time(kind, params, phase, tp_from, tp_to, kv_tokens) -> (seconds, bytes per GPU) */
static PyObject *gy_py_sim_phase_time(PyObject *module, PyObject *args) {
    const char *kind;
    PyObject *params;
    int phase, tp_from, tp_to;
    double kv_tokens;
    if (!PyArg_ParseTuple(args, "sOiiid", &kind, &params, &phase, &tp_from, &tp_to, &kv_tokens))
        return NULL;
    if (phase < 0 || phase >= GY_SIM_PHASE_KIND_COUNT)
        return PyErr_Format(GY_PY_VALUE_ERROR, "unknown phase kind %d", phase);
    gy_sim_cost_store store;
    gy_sim_cost_ops ops;
    if (gy_py_sim_cost_params(params, kind, &store, &ops) < 0) return NULL;
    const gy_sim_phase_shape p = {.kind = phase, .tp_from = tp_from, .tp_to = tp_to,
                                  .kv_tokens = kv_tokens};
    double bytes = 0;
    const double t = ops.phase_time(ops.ctx, &p, &bytes);
    return Py_BuildValue("(dd)", t, bytes);
}

/* sim_pipeline(params, cur, tgt, n_tokens, n_seqs, n_samples, kv_read, pairs, kv_tokens) ->
 * {step, capacity, shrink, migration, weight_bytes, kv_bytes}: pipeline.h's C evaluation, for
 * gyges.costmodel.PipelineCost's reference check (step at cur, capacity of cur, a re-split
 * cur -> tgt). */
static PyObject *gy_py_sim_pipeline(PyObject *module, PyObject *args) {
    PyObject *params, *cur_o, *tgt_o;
    long long n_tokens, n_seqs, n_samples;
    double kv_read, pairs, kv_tokens;
    if (!PyArg_ParseTuple(args, "OOOLLLddd", &params, &cur_o, &tgt_o, &n_tokens, &n_seqs,
                          &n_samples, &kv_read, &pairs, &kv_tokens))
        return NULL;
    gy_sim_pipeline p;
    int32_t cur[GY_SIM_MAX_STAGES], tgt[GY_SIM_MAX_STAGES];
    if (gy_py_sim_pipeline_params(params, &p) < 0 ||
        gy_py_sim_split(cur_o, p.n_stages, cur, "cur") < 0 ||
        gy_py_sim_split(tgt_o, p.n_stages, tgt, "tgt") < 0)
        return NULL;
    if (!gy_sim_pipeline_split_ok(&p, cur) || !gy_sim_pipeline_split_ok(&p, tgt))
        return PyErr_Format(GY_PY_VALUE_ERROR, "cur and tgt must split the model's %d layers",
                            (int)p.n_layers);
    const gy_sim_step_shape s = {.n_tokens = n_tokens, .n_seqs = n_seqs, .n_samples = n_samples,
                                 .kv_read_tokens = kv_read, .attn_pairs = pairs};
    double wb = 0, kb = 0;
    const double mig = gy_sim_pipeline_migration_time(&p, cur, tgt, kv_tokens, &wb, &kb);
    return Py_BuildValue("{sdsLsLsdsdsd}", "step", gy_sim_pipeline_step_time(&p, cur, 0, &s),
                         "capacity", (long long)gy_sim_pipeline_capacity(&p, cur), "shrink",
                         (long long)gy_sim_pipeline_shrink_capacity(&p, cur, tgt), "migration",
                         mig, "weight_bytes", wb, "kv_bytes", kb);
}

static PyMethodDef gy_py_cost_model_functions[] = {
    {"sim_step_time", gy_py_sim_step_time, METH_VARARGS,
     "sim_step_time(kind, params, tp, transforming, n_tokens, n_seqs, n_samples, kv_read, pairs)"},
    {"sim_phase_time", gy_py_sim_phase_time, METH_VARARGS,
     "sim_phase_time(kind, params, phase, tp_from, tp_to, kv_tokens) -> (seconds, bytes per GPU)"},
    {"sim_pipeline", gy_py_sim_pipeline, METH_VARARGS,
     "sim_pipeline(params, cur, tgt, n_tokens, n_seqs, n_samples, kv_read, pairs, kv_tokens) -> "
     "dict"},
    {NULL, NULL, 0, NULL},
};

int gy_py_cost_model_add(PyObject *module) {
    return PyModule_AddFunctions(module, gy_py_cost_model_functions);
}
