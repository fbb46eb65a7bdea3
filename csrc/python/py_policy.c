/* py_policy.c: gyges._C.Policy, one of the cluster policies (policy/policy.h) with its
 * configuration and per-run state, callable on a view built by hand (gyges.cluster.Policy): how
 * a policy's decisions are tried and tested outside any executor. Both executors run policies
 * through the cluster controller instead (py_cluster.c, cluster/controller.h), which takes its
 * policy and configuration from one of these objects.
 *
 * The view arrives as bytes laid out like the C structs (gyges/cluster.py builds them with NumPy
 * dtypes that mirror gy_sim_inst_view and gy_sim_group; POLICY_INST_VIEW_SIZE and
 * POLICY_GROUP_SIZE let it check the sizes at import). The policies index the view with the
 * GPU-to-instance map, TP levels and group sizes, so every index they could follow is checked
 * (gy_cluster_view_check, the controller's own check) before calling them. Policies run in
 * microseconds, so the GIL is kept. */
#include "py_common.h"

#include <string.h>

#include "cluster/controller.h"
#include "policy/policy.h"

typedef struct {
    PyObject_HEAD
    const gy_sim_policy_ops *ops;
    gy_sim_policy_config config;
    void *state; /* (ops->state_size) bytes, zeroed at creation; NULL when 0 */
} GyPolicyObject;

static PyObject *gy_py_policy_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"name",          "decode_weight", "scale_down_free", "scale_up_cap",
                            "merge_wait",    "scale_up_load", "eager_scale_up",  "flying_tp",
                            "light_load", "buddy_strategy", "restore_wait", "idle_load",
                            "sp_min_prompt", "decode_tp", "prefill_tp", NULL};
    const char *name;
    gy_sim_policy_config cfg = gy_sim_policy_config_default();
    int eager = cfg.eager_scale_up;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|dddddpididddii", names, &name,
                                     &cfg.decode_weight, &cfg.scale_down_free, &cfg.scale_up_cap,
                                     &cfg.merge_wait, &cfg.scale_up_load, &eager, &cfg.flying_tp,
                                     &cfg.light_load, &cfg.buddy_strategy, &cfg.restore_wait,
                                     &cfg.idle_load, &cfg.sp_min_prompt, &cfg.decode_tp,
                                     &cfg.prefill_tp))
        return NULL;
    cfg.eager_scale_up = eager;
    const gy_sim_policy_ops *ops = gy_sim_policy_find(name);
    if (ops == NULL)
        return PyErr_Format(GY_PY_VALUE_ERROR, "unknown policy %s (known: %s)", name,
                            gy_sim_policy_names());
    GyPolicyObject *self = (GyPolicyObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->ops = ops;
    self->config = cfg;
    self->state = NULL;
    if (ops->state_size > 0) {
        self->state = PyMem_Calloc(1, ops->state_size);
        if (self->state == NULL) {
            Py_DECREF(self);
            return PyErr_NoMemory();
        }
    }
    return (PyObject *)self;
}

static void gy_py_policy_dealloc(GyPolicyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    PyMem_Free(self->state);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* The buffers a view borrows; released by gy_py_policy_view_release. */
typedef struct {
    Py_buffer inst, gpu_inst, capacity, pending;
    int n_held;
} gy_py_policy_buffers;

static void gy_py_policy_view_release(gy_py_policy_buffers *b) {
    Py_buffer *all[] = {&b->inst, &b->gpu_inst, &b->capacity, &b->pending};
    for (int i = 0; i < b->n_held; i++) PyBuffer_Release(all[i]);
    b->n_held = 0;
}

/* Borrows a C-contiguous buffer whose length is a multiple of `item`; its count in *n. */
static int gy_py_policy_array(PyObject *object, Py_buffer *view, Py_ssize_t item,
                              Py_ssize_t *n, const char *what) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyErr_Format(GY_PY_VALUE_ERROR, "%s must be a C-contiguous buffer", what);
        return -1;
    }
    if (view->len % item != 0) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s has %zd bytes, not a multiple of %zd", what,
                     view->len, item);
        PyBuffer_Release(view);
        return -1;
    }
    *n = view->len / item;
    return 0;
}

/* A power of two in [1, max] whose level the capacity table has. */
static int gy_py_policy_tp_ok(int32_t tp, int32_t max_tp) {
    return tp >= 1 && tp <= max_tp && gy_sim_level(tp) >= 0;
}

/* view = (now, n_gpus, gpus_per_host, max_tp, block_size, watermark, inst, gpu_inst, capacity,
 * pending[, replicated, base_tp]): fills *v over the borrowed buffers after checking every index
 * the policies follow. */
static int gy_py_policy_view(PyObject *tuple, gy_sim_view *v, gy_py_policy_buffers *b) {
    PyObject *inst, *gpu_inst, *capacity, *pending;
    int n_gpus, gpus_per_host, max_tp, replicated = 0, base_tp = 1;
    long long block_size;
    double now, watermark;
    memset(b, 0, sizeof *b);
    if (!PyArg_ParseTuple(tuple, "diiiLdOOOO|ii;view: (now, n_gpus, gpus_per_host, max_tp, "
                                 "block_size, watermark, inst, gpu_inst, capacity, pending, "
                                 "replicated, base_tp)",
                          &now, &n_gpus, &gpus_per_host, &max_tp, &block_size, &watermark, &inst,
                          &gpu_inst, &capacity, &pending, &replicated, &base_tp))
        return -1;
    Py_ssize_t n_inst, n_map, n_cap, n_pending;
    if (gy_py_policy_array(inst, &b->inst, sizeof(gy_sim_inst_view), &n_inst, "view inst") < 0)
        return -1;
    b->n_held = 1;
    if (gy_py_policy_array(gpu_inst, &b->gpu_inst, sizeof(int32_t), &n_map, "view gpu_inst") < 0)
        goto fail;
    b->n_held = 2;
    if (gy_py_policy_array(capacity, &b->capacity, sizeof(int64_t), &n_cap, "view capacity") < 0)
        goto fail;
    b->n_held = 3;
    if (gy_py_policy_array(pending, &b->pending, sizeof(gy_sim_group), &n_pending,
                           "view pending") < 0)
        goto fail;
    b->n_held = 4;
    const gy_sim_inst_view *iv = b->inst.buf;
    const int32_t *map = b->gpu_inst.buf;
    const int64_t *cap = b->capacity.buf;
    const gy_sim_group *pv = b->pending.buf;
    if (n_map != n_gpus || n_inst > n_gpus || n_cap < gy_sim_level(max_tp) + 1 ||
        n_pending > INT32_MAX) {
        PyErr_Format(GY_PY_VALUE_ERROR,
                     "bad view: %zd instances, %zd GPU entries for %d GPUs, %zd capacity levels "
                     "(max_tp %d needs %d)",
                     n_inst, n_map, n_gpus, n_cap, max_tp, gy_sim_level(max_tp) + 1);
        goto fail;
    }
    *v = (gy_sim_view){.now = now, .n_gpus = n_gpus, .gpus_per_host = gpus_per_host,
                       .max_tp = max_tp, .n_inst = (int32_t)n_inst, .inst = iv, .gpu_inst = map,
                       .capacity = cap, .block_size = block_size, .watermark = watermark,
                       .n_pending = (int32_t)n_pending, .pending = pv,
                       .replicated = replicated, .base_tp = base_tp};
    /* every index the policies could follow (the controller checks its executors' views so) */
    const gy_status st = gy_cluster_view_check(v);
    if (st != GY_OK) {
        gy_py_raise(st);
        goto fail;
    }
    return 0;
fail:
    gy_py_policy_view_release(b);
    return -1;
}

/* (action, target, (group first, size, footprint), ((kind, gpu_first, size), ...)); a MIGRATE
 * op is (kind, gpu_first, size, target) */
static PyObject *gy_py_policy_decision(const GyPolicyObject *self, const gy_sim_decision *d,
                                       int32_t n_inst) {
    if (d->n_ops < 0 || d->n_ops > GY_SIM_MAX_OPS ||
        (d->action == GY_SIM_ACTION_PLACE && (d->target < 0 || d->target >= n_inst)))
        return PyErr_Format(gy_py_error_class(GY_ERR_STATE),
                            "policy %s returned action %d, target %d of %d instances, %d ops",
                            self->ops->name, (int)d->action, (int)d->target, (int)n_inst,
                            (int)d->n_ops);
    PyObject *ops = PyTuple_New(d->n_ops);
    if (ops == NULL) return NULL;
    for (int32_t k = 0; k < d->n_ops; k++) {
        PyObject *op = d->ops[k].kind == GY_SIM_OP_MIGRATE /* (..., target) */
                           ? Py_BuildValue("(iiii)", (int)d->ops[k].kind, (int)d->ops[k].gpu_first,
                                           (int)d->ops[k].size, (int)d->ops[k].target)
                           : Py_BuildValue("(iii)", (int)d->ops[k].kind, (int)d->ops[k].gpu_first,
                                           (int)d->ops[k].size);
        if (op == NULL) {
            Py_DECREF(ops);
            return NULL;
        }
        PyTuple_SET_ITEM(ops, k, op);
    }
    return Py_BuildValue("(ii(iiL)Ni)", (int)d->action, (int)d->target, (int)d->group.gpu_first,
                         (int)d->group.size, (long long)d->group.footprint, ops,
                         (int)d->tp_work);
}

/* place(view, request): request = (id, prompt, output, footprint, min_tp, deferred,
 * group_first, group_size, arrival, priority). */
static PyObject *gy_py_policy_place(GyPolicyObject *self, PyObject *args) {
    PyObject *view_tuple;
    long long id, prompt, output, footprint;
    int min_tp, deferred, group_first, group_size, priority;
    double arrival;
    if (!PyArg_ParseTuple(args, "O(LLLLiiiidi);place(view, (id, prompt, output, footprint, "
                                "min_tp, deferred, group_first, group_size, arrival, priority))",
                          &view_tuple, &id, &prompt, &output, &footprint, &min_tp, &deferred,
                          &group_first, &group_size, &arrival, &priority))
        return NULL;
    gy_sim_view v;
    gy_py_policy_buffers b;
    if (gy_py_policy_view(view_tuple, &v, &b) < 0) return NULL;
    PyObject *result = NULL;
    if (prompt < 1 || output < 0 || footprint < 1 || min_tp < 0 ||
        (min_tp > 0 && gy_sim_level(min_tp) < 0) || group_size < 0 ||
        (group_size > 0 && (!gy_py_policy_tp_ok(group_size, v.max_tp) || group_first < 0 ||
                            group_first % group_size || group_first + group_size > v.n_gpus))) {
        PyErr_Format(GY_PY_VALUE_ERROR,
                     "bad request view: prompt %lld, output %lld, footprint %lld, min_tp %d "
                     "(0 or a power of two), group (%d, %d) (none or an aligned group <= max_tp)",
                     prompt, output, footprint, min_tp, group_first, group_size);
        goto done;
    }
    const gy_sim_req_view r = {.id = id, .prompt = prompt, .output = output,
                               .footprint = footprint, .min_tp = min_tp, .deferred = deferred != 0,
                               .group = {group_first, group_size, 0}, .arrival = arrival,
                               .priority = priority};
    gy_sim_decision d;
    memset(&d, 0, sizeof d);
    const gy_status s = self->ops->place(self->state, &self->config, &v, &r, &d);
    if (s != GY_OK) {
        gy_py_raise(s);
        goto done;
    }
    if (d.action != GY_SIM_ACTION_PLACE && d.action != GY_SIM_ACTION_DEFER &&
        d.action != GY_SIM_ACTION_REJECT) {
        PyErr_Format(gy_py_error_class(GY_ERR_STATE), "policy %s returned action %d for a "
                                                      "request",
                     self->ops->name, (int)d.action);
        goto done;
    }
    result = gy_py_policy_decision(self, &d, v.n_inst);
done:
    gy_py_policy_view_release(&b);
    return result;
}

/* rebalance(view): ops only (action NONE); no ops when the policy has no rebalance. */
static PyObject *gy_py_policy_rebalance(GyPolicyObject *self, PyObject *args) {
    PyObject *view_tuple;
    if (!PyArg_ParseTuple(args, "O", &view_tuple)) return NULL;
    gy_sim_view v;
    gy_py_policy_buffers b;
    if (gy_py_policy_view(view_tuple, &v, &b) < 0) return NULL;
    gy_sim_decision d;
    memset(&d, 0, sizeof d);
    PyObject *result = NULL;
    if (self->ops->rebalance != NULL) {
        const gy_status s = self->ops->rebalance(self->state, &self->config, &v, &d);
        if (s != GY_OK) {
            gy_py_raise(s);
            goto done;
        }
    }
    d.action = GY_SIM_ACTION_NONE;
    result = gy_py_policy_decision(self, &d, v.n_inst);
done:
    gy_py_policy_view_release(&b);
    return result;
}

static PyObject *gy_py_policy_get_name(GyPolicyObject *self, void *closure) {
    return PyUnicode_FromString(self->ops->name);
}

static PyObject *gy_py_policy_get_rebalances(GyPolicyObject *self, void *closure) {
    return PyBool_FromLong(self->ops->rebalance != NULL);
}

static PyObject *gy_py_policy_get_monitors(GyPolicyObject *self, void *closure) {
    return PyBool_FromLong(self->ops->rebalance != NULL && self->ops->monitor);
}

static PyObject *gy_py_policy_get_config(GyPolicyObject *self, void *closure) {
    const gy_sim_policy_config *c = &self->config;
    return Py_BuildValue("{sdsdsdsdsdsOsisdsdsisdsdsisi}", "decode_weight", c->decode_weight,
                         "scale_down_free", c->scale_down_free, "scale_up_cap", c->scale_up_cap,
                         "merge_wait", c->merge_wait, "scale_up_load", c->scale_up_load,
                         "eager_scale_up", c->eager_scale_up ? Py_True : Py_False, "flying_tp",
                         (int)c->flying_tp, "light_load", c->light_load, "idle_load",
                         c->idle_load, "buddy_strategy",
                         (int)c->buddy_strategy, "restore_wait", c->restore_wait,
                         "sp_min_prompt", c->sp_min_prompt, "decode_tp", (int)c->decode_tp,
                         "prefill_tp", (int)c->prefill_tp);
}

static PyMethodDef gy_py_policy_methods[] = {
    {"place", (PyCFunction)gy_py_policy_place, METH_VARARGS,
     "place(view, request) -> (action, target, group, ops)"},
    {"rebalance", (PyCFunction)gy_py_policy_rebalance, METH_VARARGS,
     "rebalance(view) -> (0, 0, group, ops)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef gy_py_policy_getset[] = {
    {"name", (getter)gy_py_policy_get_name, NULL, "the policy's name", NULL},
    {"rebalances", (getter)gy_py_policy_get_rebalances, NULL,
     "whether it transforms on its own (has a rebalance)", NULL},
    {"monitors", (getter)gy_py_policy_get_monitors, NULL,
     "whether it rebalances at every tick too (it watches the load)", NULL},
    {"config", (getter)gy_py_policy_get_config, NULL, "its gy_sim_policy_config", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot gy_py_policy_slots[] = {
    {Py_tp_new, gy_py_policy_new},
    {Py_tp_dealloc, gy_py_policy_dealloc},
    {Py_tp_methods, gy_py_policy_methods},
    {Py_tp_getset, gy_py_policy_getset},
    {Py_tp_doc, "Policy(name, decode_weight, scale_down_free, scale_up_cap, merge_wait, "
                "scale_up_load, eager_scale_up): a cluster policy of csrc/policy/policy.h with its "
                "state; use gyges.cluster.Policy, which builds the views."},
    {0, NULL},
};

static PyType_Spec gy_py_policy_spec = {
    .name = "gyges._C.Policy",
    .basicsize = sizeof(GyPolicyObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_policy_slots,
};

static PyObject *gy_py_policy_type; /* set once by gy_py_policy_add; the module keeps it alive */

const gy_sim_policy_ops *gy_py_policy_unwrap(PyObject *object, gy_sim_policy_config *config) {
    if (!PyObject_TypeCheck(object, (PyTypeObject *)gy_py_policy_type)) {
        PyErr_Format(GY_PY_TYPE_ERROR, "policy must be a gyges._C.Policy, not %.100s",
                     Py_TYPE(object)->tp_name);
        return NULL;
    }
    const GyPolicyObject *p = (const GyPolicyObject *)object;
    *config = p->config;
    return p->ops;
}

int gy_py_policy_add(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &gy_py_policy_spec, NULL);
    if (type == NULL) return -1;
    if (PyModule_AddObjectRef(module, "Policy", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    gy_py_policy_type = type;
    Py_DECREF(type);
    if (PyModule_AddIntConstant(module, "POLICY_INST_VIEW_SIZE", sizeof(gy_sim_inst_view)) < 0 ||
        PyModule_AddIntConstant(module, "POLICY_GROUP_SIZE", sizeof(gy_sim_group)) < 0)
        return -1;
    return 0;
}
