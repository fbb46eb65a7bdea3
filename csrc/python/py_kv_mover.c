/* py_kv_mover.c: gyges._C.KVMover (kv/kv_mover.h). Items are
 * tuples (src KVCache, src_seq, src_head, n_heads, n_tokens, dst KVCache, dst_seq[, dst_head]). */
#include "py_common.h"

#include "kv/kv_mover.h"

/* Parses `list` into a new array (free it); NULL with an exception on failure. */
static gy_kv_move_item *gy_py_move_items(PyObject *list, Py_ssize_t *n_out) {
    const Py_ssize_t n = PySequence_Size(list);
    if (n < 0) return NULL;
    gy_kv_move_item *items = calloc((size_t)(n > 0 ? n : 1), sizeof *items);
    if (items == NULL) return (gy_kv_move_item *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(list, i), *src, *dst;
        long long src_seq, src_head, n_heads, n_tokens, dst_seq, dst_head = 0;
        int ok = item && PyArg_ParseTuple(item, "OLLLLOL|L", &src, &src_seq, &src_head, &n_heads,
                                          &n_tokens, &dst, &dst_seq, &dst_head);
        Py_XDECREF(item); /* the caches are kept alive by the list */
        if (ok) {
            items[i] = (gy_kv_move_item){.src = gy_py_kv_unwrap(src), .dst = gy_py_kv_unwrap(dst),
                                         .src_seq = src_seq, .dst_seq = dst_seq, .src_head = src_head,
                                         .n_heads = n_heads, .n_tokens = n_tokens,
                                         .dst_head = dst_head};
            ok = items[i].src != NULL && items[i].dst != NULL;
        }
        if (!ok) {
            free(items);
            return NULL;
        }
    }
    *n_out = n;
    return items;
}

typedef struct {
    PyObject_HEAD
    gy_kv_mover *mover;
    PyObject *planned; /* the planned items' list: keeps their caches alive until finish */
    PyThread_type_lock lock; /* read() runs on another thread; one call at a time */
} GyKVMoverObject;

static PyObject *gy_py_mover_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "", names)) return NULL;
    GyKVMoverObject *self = (GyKVMoverObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->lock = PyThread_allocate_lock();
    gy_status s = gy_kv_mover_init(&self->mover);
    if (self->lock == NULL || s != GY_OK) {
        PyObject *error = self->lock == NULL ? PyErr_NoMemory() : gy_py_raise(s);
        Py_DECREF(self);
        return error;
    }
    return (PyObject *)self;
}

static void gy_py_mover_dealloc(GyKVMoverObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_kv_mover_free(self->mover);
    if (self->lock) PyThread_free_lock(self->lock);
    Py_XDECREF(self->planned);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* Takes the mover's lock without holding the GIL (a read() on another thread may hold it). */
static void gy_py_mover_lock(GyKVMoverObject *self) {
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    Py_END_ALLOW_THREADS
}

static PyObject *gy_py_mover_plan(GyKVMoverObject *self, PyObject *args) {
    PyObject *list;
    long long layer;
    if (!PyArg_ParseTuple(args, "OL", &list, &layer)) return NULL;
    Py_ssize_t n;
    gy_kv_move_item *items = gy_py_move_items(list, &n);
    if (items == NULL) return NULL;
    gy_py_mover_lock(self);
    const gy_status s = gy_kv_mover_plan(self->mover, items, n, layer);
    Py_XSETREF(self->planned, s == GY_OK ? Py_NewRef(list) : NULL);
    PyThread_release_lock(self->lock);
    free(items);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_mover_read(GyKVMoverObject *self, PyObject *unused) {
    (void)unused;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    s = gy_kv_mover_read(self->mover);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_mover_finish(GyKVMoverObject *self, PyObject *args) {
    PyObject *list;
    long long layer;
    int threads = 2;
    if (!PyArg_ParseTuple(args, "OL|i", &list, &layer, &threads)) return NULL;
    Py_ssize_t n;
    gy_kv_move_item *items = gy_py_move_items(list, &n);
    if (items == NULL) return NULL;
    gy_kv_move_stats st;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    s = gy_kv_mover_finish(self->mover, items, n, layer, threads, &st);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    free(items);
    Py_CLEAR(self->planned);
    if (s != GY_OK) return gy_py_raise(s);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:L,s:L,s:K,s:L,s:L}", "bytes_moved",
                         (unsigned long long)st.bytes_moved, "bytes_early",
                         (unsigned long long)st.bytes_early, "bytes_late",
                         (unsigned long long)st.bytes_late, "bytes_in_place",
                         (unsigned long long)st.bytes_in_place, "items_reused", (long long)st.items_reused,
                         "items_stale", (long long)st.items_stale, "stage_bytes",
                         (unsigned long long)st.stage_bytes, "runs_direct", (long long)st.runs_direct,
                         "runs_parked", (long long)st.runs_parked);
}

static PyMethodDef gy_py_mover_methods[] = {
    {"plan", (PyCFunction)gy_py_mover_plan, METH_VARARGS,
     "plan(items, layer): remember what the next move of `layer` reads early"},
    {"read", (PyCFunction)gy_py_mover_read, METH_NOARGS,
     "read(): copy the planned tokens into the stage (any thread, beside a step)"},
    {"finish", (PyCFunction)gy_py_mover_finish, METH_VARARGS,
     "finish(items, layer, threads=2) -> stats: read what is missing, then write everything"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot gy_py_mover_slots[] = {
    {Py_tp_new, gy_py_mover_new},
    {Py_tp_dealloc, gy_py_mover_dealloc},
    {Py_tp_methods, gy_py_mover_methods},
    {Py_tp_doc, "KVMover(): moves one layer's K/V between caches, reading early beside a step"},
    {0, NULL},
};

static PyType_Spec gy_py_mover_spec = {
    .name = "gyges._C.KVMover",
    .basicsize = sizeof(GyKVMoverObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_mover_slots,
};

int gy_py_kv_mover_add(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &gy_py_mover_spec, NULL);
    if (type == NULL) return -1;
    const int r = PyModule_AddObjectRef(module, "KVMover", type);
    Py_DECREF(type);
    return r;
}
