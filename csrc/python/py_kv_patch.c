/* py_kv_patch.c: gyges._C.KVDirty, the dirty bitmap of KV patching (kv/kv_dirty.h). */
#include "py_common.h"

#include "kv/kv_dirty.h"

typedef struct {
    PyObject_HEAD
    gy_kv_dirty *d;
} GyDirtyObject;

static PyObject *gy_py_dirty_type;

/* KVDirty(n_slots) */
static PyObject *gy_py_dirty_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    long long n;
    if (!PyArg_ParseTuple(args, "L", &n)) return NULL;
    gy_kv_dirty *d;
    gy_status s = gy_kv_dirty_init(&d, n);
    if (s != GY_OK) return gy_py_raise(s);
    GyDirtyObject *self = (GyDirtyObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        gy_kv_dirty_free(d);
        return NULL;
    }
    self->d = d;
    return (PyObject *)self;
}

static void gy_py_dirty_dealloc(GyDirtyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_kv_dirty_free(self->d);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* take(out): out a writable uint64 buffer of words() entries; returns the slots taken. */
static PyObject *gy_py_dirty_take(GyDirtyObject *self, PyObject *args) {
    PyObject *out_object;
    if (!PyArg_ParseTuple(args, "O", &out_object)) return NULL;
    Py_buffer out;
    if (gy_py_get_buffer(out_object, &out, (Py_ssize_t)gy_kv_dirty_words(self->d) * 8, 1, "out") < 0)
        return NULL;
    int64_t n;
    Py_BEGIN_ALLOW_THREADS
    n = gy_kv_dirty_take(self->d, out.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    return PyLong_FromLongLong(n);
}

static PyObject *gy_py_dirty_mark(GyDirtyObject *self, PyObject *args) {
    PyObject *kv_object;
    long long seq, pos, n;
    if (!PyArg_ParseTuple(args, "OLLL", &kv_object, &seq, &pos, &n)) return NULL;
    struct gy_kv_cache *kv = gy_py_kv_unwrap(kv_object);
    if (kv == NULL) return NULL;
    gy_status s = gy_kv_dirty_mark(self->d, kv, seq, pos, n);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_dirty_count(GyDirtyObject *self, PyObject *unused) {
    return PyLong_FromLongLong(gy_kv_dirty_count(self->d));
}
static PyObject *gy_py_dirty_marked(GyDirtyObject *self, PyObject *unused) {
    return PyLong_FromLongLong(gy_kv_dirty_marked(self->d));
}
static PyObject *gy_py_dirty_words(GyDirtyObject *self, PyObject *unused) {
    return PyLong_FromLongLong(gy_kv_dirty_words(self->d));
}
static PyObject *gy_py_dirty_slots(GyDirtyObject *self, PyObject *unused) {
    return PyLong_FromLongLong(gy_kv_dirty_slots(self->d));
}

static PyMethodDef gy_py_dirty_methods[] = {
    {"take", (PyCFunction)gy_py_dirty_take, METH_VARARGS, "take(out_uint64) -> slots taken"},
    {"mark", (PyCFunction)gy_py_dirty_mark, METH_VARARGS, "mark(kv, seq, pos, n)"},
    {"count", (PyCFunction)gy_py_dirty_count, METH_NOARGS, "count() -> slots set now"},
    {"marked", (PyCFunction)gy_py_dirty_marked, METH_NOARGS, "marked() -> tokens marked so far"},
    {"words", (PyCFunction)gy_py_dirty_words, METH_NOARGS, "words() -> uint64 words a take fills"},
    {"slots", (PyCFunction)gy_py_dirty_slots, METH_NOARGS, "slots() -> slots covered"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot gy_py_dirty_slots_table[] = {
    {Py_tp_new, gy_py_dirty_new},
    {Py_tp_dealloc, gy_py_dirty_dealloc},
    {Py_tp_methods, gy_py_dirty_methods},
    {Py_tp_doc, "KVDirty(n_slots): which KV token slots were written since the last take."},
    {0, NULL},
};

static PyType_Spec gy_py_dirty_spec = {
    .name = "gyges._C.KVDirty",
    .basicsize = sizeof(GyDirtyObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_dirty_slots_table,
};

gy_kv_dirty *gy_py_dirty_unwrap(PyObject *object) {
    if (!PyObject_TypeCheck(object, (PyTypeObject *)gy_py_dirty_type)) {
        PyErr_SetString(GY_PY_TYPE_ERROR, "expected a gyges._C.KVDirty");
        return NULL;
    }
    return ((GyDirtyObject *)object)->d;
}

int gy_py_kv_patch_add(PyObject *module) {
    gy_py_dirty_type = PyType_FromModuleAndSpec(module, &gy_py_dirty_spec, NULL);
    if (gy_py_dirty_type == NULL || PyModule_AddObjectRef(module, "KVDirty", gy_py_dirty_type) < 0)
        return -1;
    return 0;
}
