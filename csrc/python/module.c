/* module.c: the gyges._C extension module: its exception classes and the registration of the
 * functions and types defined in the other py_*.c files. */
#include "py_common.h"

/* One exception class per gy_status; all derive from gyges._C.Error. The mapping is fixed at
 * import, so it is kept in a static table rather than looked up on every failure. */
static PyObject *gy_py_errors[GY_STATUS_COUNT];
/* An InvalidArgumentError that is also a TypeError: an argument of the wrong type. */
static PyObject *gy_py_argument_type_error;

PyObject *gy_py_type_error(void) { return gy_py_argument_type_error; }

PyObject *gy_py_sequence(PyObject *object, const char *message) {
    PyObject *seq = PySequence_Fast(object, message);
    if (seq == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_SetString(gy_py_argument_type_error, message);
    }
    return seq;
}

/* A tuple/list of at most `cap` numbers into `out`, as int64 (`floats` 0) or double (1);
 * returns the count or -1. One reader for both, so their checks and messages agree. */
static Py_ssize_t gy_py_numbers(PyObject *seq_object, void *out, Py_ssize_t cap,
                                const char *what, int floats) {
    PyObject *seq = gy_py_sequence(seq_object, floats ? "expected a sequence of numbers"
                                                      : "expected a sequence of ints");
    if (seq == NULL) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > cap) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s has %zd entries, at most %zd", what, n, cap);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (floats) ((double *)out)[i] = PyFloat_AsDouble(item);
        else ((int64_t *)out)[i] = PyLong_AsLongLong(item);
        if (PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return n;
}

Py_ssize_t gy_py_int64s(PyObject *seq_object, int64_t *out, Py_ssize_t cap, const char *what) {
    return gy_py_numbers(seq_object, out, cap, what, 0);
}

Py_ssize_t gy_py_doubles(PyObject *seq_object, double *out, Py_ssize_t cap, const char *what) {
    return gy_py_numbers(seq_object, out, cap, what, 1);
}

PyObject *gy_py_error_class(gy_status status) {
    if (status <= GY_OK || status >= GY_STATUS_COUNT) status = GY_ERR_STATE;
    return gy_py_errors[status];
}

PyObject *gy_py_raise(gy_status status) {
    if (status <= GY_OK || status >= GY_STATUS_COUNT) status = GY_ERR_STATE;
    const char *message = gy_error_message();
    PyErr_SetString(gy_py_errors[status], message[0] ? message : gy_status_name(status));
    gy_error_clear();
    return NULL;
}

int gy_py_get_buffer(PyObject *object, Py_buffer *view, Py_ssize_t bytes, int writable,
                     const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(GY_PY_VALUE_ERROR, "%s must be a %sC-contiguous buffer", what,
                     writable ? "writable " : "");
        return -1;
    }
    if (view->len != bytes) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s has %zd bytes, expected %zd", what, view->len, bytes);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* name, base classes beside Error, docstring */
static const struct {
    gy_status status;
    const char *name;
    PyObject **extra_base;
    const char *doc;
} gy_py_error_specs[] = {
    {GY_ERR_INVALID, "InvalidArgumentError", &PyExc_ValueError, "An argument was out of range or malformed."},
    {GY_ERR_OUT_OF_MEMORY, "OutOfMemoryError", &PyExc_MemoryError, "A worker's physical memory budget would be exceeded."},
    {GY_ERR_STATE, "StateError", NULL, "The call does not fit the current state (double map, double free...)."},
    {GY_ERR_BUSY, "BusyError", NULL, "A live view or an operation under way holds the resource."},
    {GY_ERR_SYSTEM, "SystemCallError", &PyExc_OSError, "The operating system refused a memory operation."},
    {GY_ERR_CUDA, "CudaError", NULL, "The CUDA driver or runtime refused an operation."},
    {GY_ERR_UNAVAILABLE, "UnavailableError", NULL, "The backend or device is not available here."},
    {GY_ERR_LIMIT, "LimitError", NULL, "A fixed limit (such as vm.max_map_count) would be crossed."},
    {GY_ERR_FORMAT, "FormatError", &PyExc_ValueError, "Malformed input data."},
};

static int gy_py_add_errors(PyObject *module) {
    PyObject *base = PyErr_NewExceptionWithDoc("gyges._C.Error", "Base class of every gyges error.",
                                               NULL, NULL);
    if (base == NULL || PyModule_AddObjectRef(module, "Error", base) < 0) {
        Py_XDECREF(base);
        return -1;
    }
    for (size_t i = 0; i < sizeof gy_py_error_specs / sizeof gy_py_error_specs[0]; i++) {
        char qualified[96];
        snprintf(qualified, sizeof qualified, "gyges._C.%s", gy_py_error_specs[i].name);
        PyObject *bases = gy_py_error_specs[i].extra_base
                              ? PyTuple_Pack(2, base, *gy_py_error_specs[i].extra_base)
                              : PyTuple_Pack(1, base);
        if (bases == NULL) goto fail;
        PyObject *cls = PyErr_NewExceptionWithDoc(qualified, gy_py_error_specs[i].doc, bases, NULL);
        Py_DECREF(bases);
        if (cls == NULL) goto fail;
        if (PyModule_AddObjectRef(module, gy_py_error_specs[i].name, cls) < 0) {
            Py_DECREF(cls);
            goto fail;
        }
        gy_py_errors[gy_py_error_specs[i].status] = cls; /* the module keeps it alive */
        Py_DECREF(cls);
    }
    gy_py_errors[GY_OK] = base;
    Py_DECREF(base);
    PyObject *bases = PyTuple_Pack(2, gy_py_errors[GY_ERR_INVALID], PyExc_TypeError);
    if (bases == NULL) return -1;
    PyObject *cls = PyErr_NewExceptionWithDoc(
        "gyges._C.ArgumentTypeError",
        "An argument of the wrong type; the message names the parameter and the value.", bases, NULL);
    Py_DECREF(bases);
    if (cls == NULL || PyModule_AddObjectRef(module, "ArgumentTypeError", cls) < 0) {
        Py_XDECREF(cls);
        return -1;
    }
    gy_py_argument_type_error = cls; /* the module keeps it alive */
    Py_DECREF(cls);
    return 0;
fail:
    Py_DECREF(base);
    return -1;
}

static int gy_py_exec(PyObject *module) {
    if (gy_py_add_errors(module) < 0) return -1;
    if (gy_py_arena_add(module) < 0) return -1;
    if (gy_py_kv_add(module) < 0) return -1;
    if (gy_py_kv_patch_add(module) < 0) return -1;
    if (gy_py_kv_mover_add(module) < 0) return -1;
    if (gy_py_kernels_add(module) < 0) return -1;
    if (gy_py_cuda_add(module) < 0) return -1;
    if (gy_py_sched_add(module) < 0) return -1;
    if (gy_py_model_add(module) < 0) return -1;
    if (gy_py_engine_add(module) < 0) return -1;
    if (gy_py_sim_add(module) < 0) return -1;
    if (gy_py_comm_add(module) < 0) return -1;
    if (gy_py_policy_add(module) < 0) return -1;
    if (gy_py_cluster_add(module) < 0) return -1;
    if (gy_py_forward_cuda_add(module) < 0) return -1;
    if (gy_py_fault_add(module) < 0) return -1;
#ifdef GY_WITH_CUDA
    if (PyModule_AddIntConstant(module, "WITH_CUDA", 1) < 0) return -1;
#else
    if (PyModule_AddIntConstant(module, "WITH_CUDA", 0) < 0) return -1;
#endif
    return 0;
}

static PyModuleDef_Slot gy_py_slots[] = {
    {Py_mod_exec, gy_py_exec},
    {0, NULL},
};

static struct PyModuleDef gy_py_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gyges._C",
    .m_doc = "The C core of gyges. Use the gyges package; these entry points do not check types.",
    .m_size = 0,
    .m_slots = gy_py_slots,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&gy_py_module); }
