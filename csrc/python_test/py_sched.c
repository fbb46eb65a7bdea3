/* py_sched.c: gyges._C_test.Scheduler, the batch scheduler (csrc/sched/batch.h) over a block
 * counter, for the tests that check it against a Python model of its policy (the engine and the
 * simulator schedule from C). Everything comes back as plain Python values. The GIL is released
 * around the C work; a scheduler used from a second thread meanwhile raises BusyError instead of
 * racing. */
#include "py_test.h"

#include "sched/batch.h"
#include "sched/block_counter.h"

typedef struct {
    PyObject_HEAD
    gy_sched_block_counter *bc;
    gy_sched *s;
    int busy; /* set (under the GIL) while a call runs without it */
} GySchedulerObject;

static PyObject *gy_py_scheduler_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"total_blocks", "block_size", "max_batch_tokens", "max_running",
                            "max_prefill_chunk", "watermark_blocks", NULL};
    long long total_blocks, block_size, max_batch_tokens, max_running, chunk = 0, watermark = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LLLL|LL", names, &total_blocks, &block_size,
                                     &max_batch_tokens, &max_running, &chunk, &watermark))
        return NULL;
    gy_sched_block_counter *bc = NULL;
    gy_status st = gy_sched_block_counter_init(&bc, total_blocks, block_size);
    if (st != GY_OK) return gy_py_raise(st);
    const gy_sched_kv_ops ops = gy_sched_block_counter_ops(bc);
    const gy_sched_config config = {
        .total_blocks = total_blocks,
        .block_size = block_size,
        .max_batch_tokens = max_batch_tokens,
        .max_running = max_running,
        .max_prefill_chunk = chunk,
        .watermark_blocks = watermark,
    };
    gy_sched *s = NULL;
    st = gy_sched_init(&s, &config, &ops);
    if (st != GY_OK) {
        gy_sched_block_counter_free(bc);
        return gy_py_raise(st);
    }
    GySchedulerObject *self = (GySchedulerObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        gy_sched_free(s);
        gy_sched_block_counter_free(bc);
        return NULL;
    }
    self->bc = bc;
    self->s = s;
    return (PyObject *)self;
}

static void gy_py_scheduler_dealloc(GySchedulerObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_sched_free(self->s); /* before the counter its ops point into */
    gy_sched_block_counter_free(self->bc);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* Raises BusyError when another thread is inside this scheduler. */
static int gy_py_scheduler_enter(GySchedulerObject *self) {
    if (self->busy) {
        PyErr_SetString(gy_py_error_class(GY_ERR_BUSY),
                        "the scheduler is in use by another thread");
        return -1;
    }
    return 0;
}

#define GY_PY_SCHED_CALL(self, status, call)                                                       \
    do {                                                                                           \
        (self)->busy = 1;                                                                          \
        Py_BEGIN_ALLOW_THREADS                                                                     \
        (status) = (call);                                                                         \
        Py_END_ALLOW_THREADS                                                                       \
        (self)->busy = 0;                                                                          \
    } while (0)

static PyObject *gy_py_scheduler_add(GySchedulerObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"id", "prompt_len", "max_new_tokens", "arrival", "priority", NULL};
    long long id, prompt_len, max_new;
    double arrival = 0.0;
    int priority = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LLL|di", names, &id, &prompt_len, &max_new,
                                     &arrival, &priority))
        return NULL;
    if (gy_py_scheduler_enter(self) < 0) return NULL;
    const gy_sched_request r = {.id = id, .prompt_len = prompt_len, .max_new_tokens = max_new,
                                .arrival = arrival, .priority = priority};
    const gy_status st = gy_sched_add(self->s, &r);
    if (st != GY_OK) return gy_py_raise(st);
    Py_RETURN_NONE;
}

/* schedule(now) -> (entries, preempted): entries a list of
 * (id, pos, n_tokens, samples, sample_index, is_prefill), preempted a list of ids. */
static PyObject *gy_py_scheduler_schedule(GySchedulerObject *self, PyObject *args) {
    double now;
    if (!PyArg_ParseTuple(args, "d", &now)) return NULL;
    if (gy_py_scheduler_enter(self) < 0) return NULL;
    gy_sched_batch b;
    gy_status st;
    GY_PY_SCHED_CALL(self, st, gy_sched_schedule(self->s, now, &b));
    if (st != GY_OK) return gy_py_raise(st);
    PyObject *entries = PyList_New((Py_ssize_t)b.n_entries);
    PyObject *preempted = PyList_New((Py_ssize_t)b.n_preempted);
    if (entries == NULL || preempted == NULL) goto fail;
    for (int64_t i = 0; i < b.n_entries; i++) {
        const gy_sched_entry *e = &b.entries[i];
        PyObject *t = Py_BuildValue("(LLLNLN)", (long long)e->id, (long long)e->pos,
                                    (long long)e->n_tokens, PyBool_FromLong(e->samples),
                                    (long long)e->sample_index, PyBool_FromLong(e->is_prefill));
        if (t == NULL) goto fail;
        PyList_SET_ITEM(entries, (Py_ssize_t)i, t);
    }
    for (int64_t i = 0; i < b.n_preempted; i++) {
        PyObject *id = PyLong_FromLongLong(b.preempted[i]);
        if (id == NULL) goto fail;
        PyList_SET_ITEM(preempted, (Py_ssize_t)i, id);
    }
    PyObject *result = PyTuple_Pack(2, entries, preempted);
    Py_DECREF(entries);
    Py_DECREF(preempted);
    return result;
fail:
    /* The step is under way in C; the caller still has to commit it (with no stops). */
    Py_XDECREF(entries);
    Py_XDECREF(preempted);
    return NULL;
}

/* commit(now, stopped=()) -> list of finished ids. `stopped` holds the ids of requests whose
 * token this step ended them (EOS); each must be an entry of the step that samples. */
static PyObject *gy_py_scheduler_commit(GySchedulerObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"now", "stopped", NULL};
    double now;
    PyObject *stopped = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "d|O", names, &now, &stopped)) return NULL;
    if (gy_py_scheduler_enter(self) < 0) return NULL;
    /* stop flags are aligned with the entries of the step under way */
    gy_sched_stats stats;
    gy_sched_stats_get(self->s, &stats);
    uint8_t *flags = NULL;
    PyObject *seq = NULL, *result = NULL;
    int64_t n = 0;
    const gy_sched_entry *entries = gy_sched_step_entries(self->s, &n);
    /* with no step under way, gy_sched_commit itself raises the StateError */
    if (stats.in_flight && stopped != NULL && stopped != Py_None) {
        seq = gy_py_sequence(stopped, "stopped must be a sequence of request ids");
        if (seq == NULL) return NULL;
        flags = PyMem_Calloc((size_t)(n > 0 ? n : 1), 1);
        if (flags == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        const Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
        for (Py_ssize_t j = 0; j < m; j++) {
            const long long id = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, j));
            if (id == -1 && PyErr_Occurred()) goto done;
            int64_t i = 0;
            while (i < n && !(entries[i].id == id && entries[i].samples)) i++;
            if (i == n) {
                PyErr_Format(GY_PY_VALUE_ERROR,
                             "request %lld does not sample a token in the step under way", id);
                goto done;
            }
            flags[i] = 1;
        }
    }
    gy_sched_done d;
    gy_status st;
    GY_PY_SCHED_CALL(self, st, gy_sched_commit(self->s, now, flags, n, &d));
    if (st != GY_OK) {
        gy_py_raise(st);
        goto done;
    }
    result = PyList_New((Py_ssize_t)d.n_finished);
    if (result == NULL) goto done;
    for (int64_t i = 0; i < d.n_finished; i++) {
        PyObject *id = PyLong_FromLongLong(d.finished[i]);
        if (id == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, (Py_ssize_t)i, id);
    }
done:
    PyMem_Free(flags);
    Py_XDECREF(seq);
    return result;
}

static PyObject *gy_py_scheduler_abort(GySchedulerObject *self, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    if (gy_py_scheduler_enter(self) < 0) return NULL;
    const gy_status st = gy_sched_abort(self->s, id);
    if (st != GY_OK) return gy_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *gy_py_scheduler_forget(GySchedulerObject *self, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    if (gy_py_scheduler_enter(self) < 0) return NULL;
    const gy_status st = gy_sched_forget(self->s, id);
    if (st != GY_OK) return gy_py_raise(st);
    Py_RETURN_NONE;
}

/* NaN (not yet) becomes None. */
static PyObject *gy_py_scheduler_time(double t) {
    if (t != t) Py_RETURN_NONE;
    return PyFloat_FromDouble(t);
}

static PyObject *gy_py_scheduler_info(GySchedulerObject *self, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    if (gy_py_scheduler_enter(self) < 0) return NULL;
    gy_sched_info in;
    const gy_status st = gy_sched_info_get(self->s, id, &in);
    if (st != GY_OK) return gy_py_raise(st);
    return Py_BuildValue(
        "{sssssLsLsisLsLsLsLsdsNsNsNsL}", "state", gy_sched_state_name(in.state), "finish",
        gy_sched_finish_name(in.finish), "prompt_len", (long long)in.prompt_len, "max_new_tokens",
        (long long)in.max_new_tokens, "priority", (int)in.priority, "n_generated",
        (long long)in.n_generated, "n_computed", (long long)in.n_computed, "prefill_end",
        (long long)in.prefill_end, "n_preemptions", (long long)in.n_preemptions, "arrival",
        in.arrival, "first_scheduled", gy_py_scheduler_time(in.first_scheduled), "first_token",
        gy_py_scheduler_time(in.first_token), "finished_at", gy_py_scheduler_time(in.finished_at),
        "blocks_held", (long long)gy_sched_block_counter_held(self->bc, id));
}

static PyObject *gy_py_scheduler_stats(GySchedulerObject *self, PyObject *unused) {
    if (gy_py_scheduler_enter(self) < 0) return NULL;
    gy_sched_stats st;
    gy_sched_stats_get(self->s, &st);
    return Py_BuildValue("{sLsLsLsLsLsLsLsLsLsN}", "waiting", (long long)st.n_waiting,
                         "preempted", (long long)st.n_preempted, "running",
                         (long long)st.n_running, "finished", (long long)st.n_finished, "steps",
                         (long long)st.n_steps, "preemptions", (long long)st.n_preemptions,
                         "free_blocks", (long long)st.free_blocks, "total_blocks",
                         (long long)gy_sched_block_counter_total_blocks(self->bc), "holders",
                         (long long)gy_sched_block_counter_n_holders(self->bc), "in_flight",
                         PyBool_FromLong(st.in_flight));
}

static PyMethodDef gy_py_scheduler_methods[] = {
    {"add", (PyCFunction)(void (*)(void))gy_py_scheduler_add, METH_VARARGS | METH_KEYWORDS,
     "add(id, prompt_len, max_new_tokens, arrival=0.0, priority=0)"},
    {"schedule", (PyCFunction)gy_py_scheduler_schedule, METH_VARARGS,
     "schedule(now) -> ([(id, pos, n_tokens, samples, sample_index, is_prefill)], [preempted id])"},
    {"commit", (PyCFunction)(void (*)(void))gy_py_scheduler_commit, METH_VARARGS | METH_KEYWORDS,
     "commit(now, stopped=()) -> [finished id]"},
    {"abort", (PyCFunction)gy_py_scheduler_abort, METH_VARARGS, "abort(id)"},
    {"forget", (PyCFunction)gy_py_scheduler_forget, METH_VARARGS, "forget(id): drop a finished request"},
    {"info", (PyCFunction)gy_py_scheduler_info, METH_VARARGS, "info(id) -> dict"},
    {"stats", (PyCFunction)gy_py_scheduler_stats, METH_NOARGS, "stats() -> dict"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot gy_py_scheduler_slots[] = {
    {Py_tp_new, gy_py_scheduler_new},
    {Py_tp_dealloc, gy_py_scheduler_dealloc},
    {Py_tp_methods, gy_py_scheduler_methods},
    {Py_tp_doc, "Scheduler(total_blocks, block_size, max_batch_tokens, max_running, "
                "max_prefill_chunk=0, watermark_blocks=0): continuous batching over a block "
                "counter (csrc/sched/batch.h states the policy)."},
    {0, NULL},
};

static PyType_Spec gy_py_scheduler_spec = {
    .name = "gyges._C_test.Scheduler",
    .basicsize = sizeof(GySchedulerObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_scheduler_slots,
};

int gy_py_sched_add(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &gy_py_scheduler_spec, NULL);
    if (type == NULL) return -1;
    if (PyModule_AddObjectRef(module, "Scheduler", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    Py_DECREF(type);
    return 0;
}
