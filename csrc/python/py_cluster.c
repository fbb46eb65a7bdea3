/* py_cluster.c: gyges._C.Controller, the cluster controller (cluster/controller.h) with a Python
 * executor: gyges/experiment.py's real host. The executor is any object with
 *
 *   instances()                           -> bytes of gy_sim_inst_view rows (INST_VIEW_DTYPE),
 *                                            the instances in GPU order
 *   assign(id, action, gpu_first, tp, tp_work)  a request's decision (1 place, 2 defer,
 *                                            3 reject; tp_work: a placement as TP work)
 *   reconfigure(kind, gpu_first, size, layers, target) -> whether it started (0 merge,
 *                                            1 split, 4 bind, 5 release, 6 re-split of a
 *                                            pipeline to the split `layers`, a tuple; ()
 *                                            otherwise; 7 drop replicas into a buddy group,
 *                                            8 restore it; 9 migrate a running request to the
 *                                            instance at GPU `target`, -1 for other kinds)
 *
 * which the controller calls while it decides; the simulator's executor is C (sim/sim.c). An
 * exception raised by an op ends the call with that same exception. The GIL is kept: the
 * controller runs in microseconds and the ops are Python. */
#include "py_common.h"

#include <string.h>

#include "cluster/controller.h"

const gy_sim_policy_ops *gy_py_policy_unwrap(PyObject *object, gy_sim_policy_config *config);

typedef struct {
    PyObject_HEAD
    gy_cluster *cluster;
    PyObject *executor;
    gy_sim_pipeline pipeline; /* a pipeline cluster's cost model (config.pipeline points here) */
    gy_sim_cost_store cost_store; /* the view's cost model (config.cost points at cost_ops, */
    gy_sim_cost_ops cost_ops;     /* whose ctx points into cost_store) */
} GyControllerObject;

/* An op's Python exception stays set; the controller's error only unwinds it. */
#define GY_PY_OP_FAILED GY_FAIL(GY_ERR_STATE, "the executor raised an exception")

static gy_status gy_py_op_instances(void *ctx, gy_sim_inst_view *rows, int32_t cap, int32_t *n) {
    GyControllerObject *self = ctx;
    PyObject *result = PyObject_CallMethod(self->executor, "instances", NULL);
    if (result == NULL) return GY_PY_OP_FAILED;
    Py_buffer view;
    if (PyObject_GetBuffer(result, &view, PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(result);
        return GY_PY_OP_FAILED;
    }
    const Py_ssize_t item = (Py_ssize_t)sizeof(gy_sim_inst_view);
    gy_status s = GY_OK;
    if (view.len % item != 0 || view.len / item < 1 || view.len / item > cap)
        s = GY_FAIL(GY_ERR_STATE, "the executor's instances() gave %zd bytes, not 1 to %d rows "
                                  "of %zd",
                    view.len, (int)cap, item);
    else {
        memcpy(rows, view.buf, (size_t)view.len);
        *n = (int32_t)(view.len / item);
    }
    PyBuffer_Release(&view);
    Py_DECREF(result);
    return s;
}

static gy_status gy_py_op_assign(void *ctx, const gy_cluster_request *r, int32_t action,
                                 int32_t gpu_first, int32_t tp) {
    GyControllerObject *self = ctx;
    PyObject *result = PyObject_CallMethod(self->executor, "assign", "Liiii", (long long)r->id,
                                           (int)action, (int)gpu_first, (int)tp,
                                           (int)r->tp_work);
    if (result == NULL) return GY_PY_OP_FAILED;
    Py_DECREF(result);
    return GY_OK;
}

static gy_status gy_py_op_reconfigure(void *ctx, const gy_sim_op *op, int32_t *started) {
    GyControllerObject *self = ctx;
    const int32_t n = op->kind == GY_SIM_OP_RESPLIT ? op->size : 0; /* size: its stages */
    PyObject *layers = PyTuple_New(n);
    if (layers == NULL) return GY_PY_OP_FAILED;
    for (int32_t i = 0; i < n; i++) PyTuple_SET_ITEM(layers, i, PyLong_FromLong(op->layers[i]));
    PyObject *result = PyObject_CallMethod(
        self->executor, "reconfigure", "iiiNi", (int)op->kind, (int)op->gpu_first, (int)op->size,
        layers, op->kind == GY_SIM_OP_MIGRATE ? (int)op->target : -1);
    if (result == NULL) return GY_PY_OP_FAILED;
    const int truth = PyObject_IsTrue(result);
    Py_DECREF(result);
    if (truth < 0) return GY_PY_OP_FAILED;
    *started = truth;
    return GY_OK;
}

static const gy_cluster_ops gy_py_cluster_ops = {
    .instances = gy_py_op_instances,
    .assign = gy_py_op_assign,
    .reconfigure = gy_py_op_reconfigure,
    .decided = NULL,
};

/* The result of a controller call: None, the op's own exception, or the controller's error. */
static PyObject *gy_py_controller_result(gy_status s) {
    if (s == GY_OK) Py_RETURN_NONE;
    if (PyErr_Occurred()) return NULL;
    return gy_py_raise(s);
}

static PyObject *gy_py_controller_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"executor",   "policy",     "n_gpus",    "gpus_per_host",
                            "max_tp",     "capacity",   "block_size", "watermark",
                            "replicated", "base_tp",    "pipeline",  "buddy",
                            "prefill_rate", "cost_kind", "cost_params", NULL};
    PyObject *executor, *policy, *capacity_object, *pipeline_object = Py_None,
             *rate_object = Py_None, *cost_params = Py_None;
    const char *cost_kind = NULL;
    int n_gpus, gpus_per_host, max_tp, replicated = 0, base_tp = 1, buddy = 0;
    long long block_size;
    double watermark;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOiiiOLd|piOpOzO", names, &executor,
                                     &policy, &n_gpus, &gpus_per_host, &max_tp, &capacity_object,
                                     &block_size, &watermark, &replicated, &base_tp,
                                     &pipeline_object, &buddy, &rate_object, &cost_kind,
                                     &cost_params))
        return NULL;
    if ((cost_kind == NULL) != (cost_params == Py_None))
        return PyErr_Format(GY_PY_VALUE_ERROR, "cost_kind and cost_params come together");
    gy_sim_pipeline pipeline;
    if (pipeline_object != Py_None && gy_py_sim_pipeline_params(pipeline_object, &pipeline) < 0)
        return NULL;
    gy_cluster_config config = {.n_gpus = n_gpus, .gpus_per_host = gpus_per_host,
                                .max_tp = max_tp, .block_size = block_size,
                                .watermark = watermark, .replicated = replicated,
                                .base_tp = base_tp, .buddy = buddy};
    config.policy = gy_py_policy_unwrap(policy, &config.policy_config);
    if (config.policy == NULL) return NULL;
    int64_t capacity[GY_SIM_MAX_LEVELS];
    const Py_ssize_t levels =
        gy_py_int64s(capacity_object, capacity, GY_SIM_MAX_LEVELS, "capacity");
    if (levels < 0) return NULL;
    if (gy_sim_level(max_tp) < 0 || levels != gy_sim_level(max_tp) + 1)
        return PyErr_Format(GY_PY_VALUE_ERROR, "capacity lists %zd TP levels; max_tp=%d needs "
                                               "%d",
                            levels, max_tp, gy_sim_level(max_tp) + 1);
    for (Py_ssize_t l = 0; l < levels; l++)
        if (capacity[l] < 0)
            return PyErr_Format(GY_PY_VALUE_ERROR, "capacity of TP%d is %lld blocks", 1 << l,
                                (long long)capacity[l]);
    config.capacity = capacity;
    double rates[GY_SIM_MAX_LEVELS];
    if (rate_object != Py_None) { /* gy_cluster_init checks each */
        const Py_ssize_t n = gy_py_doubles(rate_object, rates, GY_SIM_MAX_LEVELS, "prefill_rate");
        if (n < 0) return NULL;
        if (n != levels)
            return PyErr_Format(GY_PY_VALUE_ERROR, "prefill_rate lists %zd TP levels; max_tp=%d "
                                                   "needs %zd", n, max_tp, levels);
        config.prefill_rate = rates;
    }
    GyControllerObject *self = (GyControllerObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->executor = Py_NewRef(executor);
    if (pipeline_object != Py_None) {
        self->pipeline = pipeline;
        config.pipeline = &self->pipeline;
    }
    if (cost_kind != NULL) {
        if (gy_py_sim_cost_params(cost_params, cost_kind, &self->cost_store, &self->cost_ops) < 0) {
            Py_DECREF(self);
            return NULL;
        }
        config.cost = &self->cost_ops;
    }
    const gy_status s = gy_cluster_init(&self->cluster, &config, &gy_py_cluster_ops, self);
    if (s != GY_OK) {
        Py_DECREF(self);
        return gy_py_raise(s);
    }
    return (PyObject *)self;
}

static void gy_py_controller_dealloc(GyControllerObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_cluster_free(self->cluster);
    Py_XDECREF(self->executor);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* arrive(id, prompt, output, footprint, min_tp, priority, arrival, now) */
static PyObject *gy_py_controller_arrive(GyControllerObject *self, PyObject *args) {
    gy_cluster_request r;
    memset(&r, 0, sizeof r);
    int min_tp, priority;
    long long id, prompt, output, footprint;
    double now;
    if (!PyArg_ParseTuple(args, "LLLLiidd", &id, &prompt, &output, &footprint, &min_tp,
                          &priority, &r.arrival, &now))
        return NULL;
    r.id = id;
    r.prompt = prompt;
    r.output = output;
    r.footprint = footprint;
    r.min_tp = min_tp;
    r.priority = priority;
    return gy_py_controller_result(gy_cluster_arrive(self->cluster, &r, now));
}

/* step_ended(gpu_first, tp, finished, now) */
static PyObject *gy_py_controller_step_ended(GyControllerObject *self, PyObject *args) {
    int gpu_first, tp, finished;
    double now;
    if (!PyArg_ParseTuple(args, "iipd", &gpu_first, &tp, &finished, &now)) return NULL;
    return gy_py_controller_result(
        gy_cluster_step_ended(self->cluster, gpu_first, tp, finished, now));
}

/* reconfigured(rebalance, now) */
static PyObject *gy_py_controller_reconfigured(GyControllerObject *self, PyObject *args) {
    int rebalance;
    double now;
    if (!PyArg_ParseTuple(args, "pd", &rebalance, &now)) return NULL;
    return gy_py_controller_result(gy_cluster_reconfigured(self->cluster, rebalance, now));
}

static PyObject *gy_py_controller_tick(GyControllerObject *self, PyObject *args) {
    double now;
    if (!PyArg_ParseTuple(args, "d", &now)) return NULL;
    return gy_py_controller_result(gy_cluster_tick(self->cluster, now));
}

static PyObject *gy_py_controller_held(GyControllerObject *self, PyObject *args) {
    int gpu_first, tp;
    if (!PyArg_ParseTuple(args, "ii", &gpu_first, &tp)) return NULL;
    return PyBool_FromLong(gy_cluster_held(self->cluster, gpu_first, tp));
}

static PyObject *gy_py_controller_stats(GyControllerObject *self, PyObject *unused) {
    gy_cluster_stats s;
    gy_cluster_stats_get(self->cluster, &s);
    return Py_BuildValue("{sLsLsLsLsLsLsLsL}", "decisions", (long long)s.n_decisions,
                         "rebalances", (long long)s.n_rebalances, "ops", (long long)s.n_ops,
                         "ops_refused", (long long)s.n_ops_refused, "merges_started",
                         (long long)s.n_merges_started, "splits_started",
                         (long long)s.n_splits_started, "rejected", (long long)s.n_rejected,
                         "deferred", (long long)s.n_deferred);
}

/* deferred() -> [(id, group_first, group_size), ...] in the order they were deferred */
static PyObject *gy_py_controller_deferred(GyControllerObject *self, PyObject *unused) {
    int64_t n = 0;
    const gy_sim_group *groups = NULL;
    const gy_cluster_request *r = gy_cluster_deferred(self->cluster, &n, &groups);
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (out == NULL) return NULL;
    for (int64_t k = 0; k < n; k++) {
        PyObject *row = Py_BuildValue("(Lii)", (long long)r[k].id, (int)groups[k].gpu_first,
                                      (int)groups[k].size);
        if (row == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)k, row);
    }
    return out;
}

static PyMethodDef gy_py_controller_methods[] = {
    {"arrive", (PyCFunction)gy_py_controller_arrive, METH_VARARGS,
     "arrive(id, prompt, output, footprint, min_tp, priority, arrival, now): decide a new "
     "request"},
    {"step_ended", (PyCFunction)gy_py_controller_step_ended, METH_VARARGS,
     "step_ended(gpu_first, tp, finished, now): an instance's step ended"},
    {"reconfigured", (PyCFunction)gy_py_controller_reconfigured, METH_VARARGS,
     "reconfigured(rebalance, now): a reconfiguration (or its last phase) ended"},
    {"tick", (PyCFunction)gy_py_controller_tick, METH_VARARGS,
     "tick(now): time passed; the deferred requests are decided again"},
    {"held", (PyCFunction)gy_py_controller_held, METH_VARARGS,
     "held(gpu_first, tp): whether the policy holds that instance"},
    {"stats", (PyCFunction)gy_py_controller_stats, METH_NOARGS, "the controller's counts"},
    {"deferred", (PyCFunction)gy_py_controller_deferred, METH_NOARGS,
     "the requests waiting at the cluster: [(id, group_first, group_size)]"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot gy_py_controller_slots[] = {
    {Py_tp_new, gy_py_controller_new},
    {Py_tp_dealloc, gy_py_controller_dealloc},
    {Py_tp_methods, gy_py_controller_methods},
    {Py_tp_doc, "Controller(executor, policy, n_gpus, gpus_per_host, max_tp, capacity, "
                "block_size, watermark): csrc/cluster/controller.h over a Python executor"},
    {0, NULL},
};

static PyType_Spec gy_py_controller_spec = {
    .name = "gyges._C.Controller",
    .basicsize = sizeof(GyControllerObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_controller_slots,
};

int gy_py_cluster_add(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &gy_py_controller_spec, NULL);
    if (type == NULL) return -1;
    const int rc = PyModule_AddObjectRef(module, "Controller", type);
    Py_DECREF(type);
    return rc;
}
