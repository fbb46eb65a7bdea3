/* py_errors.c: the exception classes of gyges._C: one per gy_status, all derived from
 * gyges._C.Error, made at import, and the raising of the one that fits a status. Every file of
 * both extensions raises through here (gyges._C_test links it from gyges._C): one set of classes
 * in a process. */
#include "py_common.h"

/* One exception class per gy_status; all derive from gyges._C.Error. The mapping is fixed at
 * import, so it is kept in a static table rather than looked up on every failure. */
static PyObject *gy_py_errors[GY_STATUS_COUNT];
/* An InvalidArgumentError that is also a TypeError: an argument of the wrong type. */
static PyObject *gy_py_argument_type_error;

PyObject *gy_py_type_error(void) { return gy_py_argument_type_error; }

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

int gy_py_errors_add(PyObject *module) {
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
