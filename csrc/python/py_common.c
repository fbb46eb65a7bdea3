/* py_common.c: reading the arguments the C core never sees: sequences of numbers and borrowed
 * buffers, refused with gyges errors that name the argument. */
#include "py_common.h"

PyObject *gy_py_sequence(PyObject *object, const char *message) {
    PyObject *seq = PySequence_Fast(object, message);
    if (seq == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_SetString(GY_PY_TYPE_ERROR, message);
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
