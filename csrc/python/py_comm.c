/* py_comm.c: gyges._C.Comm, a communicator among worker threads (comm/comm.h). Its collectives
 * are called from C by the ranks of an engine; Python creates it and reads its statistics. */
#include "py_common.h"

#include "comm/comm.h"

typedef struct {
    PyObject_HEAD
    gy_comm *comm;
} GyCommObject;

static PyObject *gy_py_comm_type;

struct gy_comm *gy_py_comm_unwrap(PyObject *object) {
    if (!PyObject_TypeCheck(object, (PyTypeObject *)gy_py_comm_type)) {
        PyErr_SetString(PyExc_TypeError, "expected a gyges._C.Comm");
        return NULL;
    }
    return ((GyCommObject *)object)->comm;
}

static PyObject *gy_py_comm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"size", NULL};
    int size;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i", names, &size)) return NULL;
    gy_comm *comm;
    gy_status s = gy_comm_init(&comm, size);
    if (s != GY_OK) return gy_py_raise(s);
    GyCommObject *self = (GyCommObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        gy_comm_free(comm);
        return NULL;
    }
    self->comm = comm;
    return (PyObject *)self;
}

static void gy_py_comm_dealloc(GyCommObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_comm_free(self->comm);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyObject *gy_py_comm_stats(GyCommObject *self, PyObject *unused) {
    gy_comm_stats st;
    gy_comm_stats_get(self->comm, &st);
    const int32_t n = gy_comm_size(self->comm);
    PyObject *sent = PyList_New(n), *received = PyList_New(n);
    if (sent == NULL || received == NULL) {
        Py_XDECREF(sent);
        Py_XDECREF(received);
        return NULL;
    }
    for (int32_t i = 0; i < n; i++) {
        PyList_SET_ITEM(sent, i, PyLong_FromUnsignedLongLong(st.bytes_sent[i]));
        PyList_SET_ITEM(received, i, PyLong_FromUnsignedLongLong(st.bytes_received[i]));
    }
    return Py_BuildValue("{sKsNsN}", "calls", (unsigned long long)st.calls, "bytes_sent", sent,
                         "bytes_received", received);
}

static PyObject *gy_py_comm_reset(GyCommObject *self, PyObject *unused) {
    gy_comm_stats_reset(self->comm);
    Py_RETURN_NONE;
}

static PyObject *gy_py_comm_get_size(GyCommObject *self, void *closure) {
    return PyLong_FromLong(gy_comm_size(self->comm));
}

static PyMethodDef gy_py_comm_methods[] = {
    {"stats", (PyCFunction)gy_py_comm_stats, METH_NOARGS, "stats() -> dict"},
    {"reset_stats", (PyCFunction)gy_py_comm_reset, METH_NOARGS, "reset_stats()"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef gy_py_comm_getset[] = {
    {"size", (getter)gy_py_comm_get_size, NULL, "ranks", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot gy_py_comm_slots[] = {
    {Py_tp_new, gy_py_comm_new},
    {Py_tp_dealloc, gy_py_comm_dealloc},
    {Py_tp_methods, gy_py_comm_methods},
    {Py_tp_getset, gy_py_comm_getset},
    {Py_tp_doc, "Comm(size): a shared-memory communicator among worker threads."},
    {0, NULL},
};

static PyType_Spec gy_py_comm_spec = {
    .name = "gyges._C.Comm",
    .basicsize = sizeof(GyCommObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_comm_slots,
};

int gy_py_comm_add(PyObject *module) {
    gy_py_comm_type = PyType_FromModuleAndSpec(module, &gy_py_comm_spec, NULL);
    if (gy_py_comm_type == NULL || PyModule_AddObjectRef(module, "Comm", gy_py_comm_type) < 0)
        return -1;
    return 0;
}
