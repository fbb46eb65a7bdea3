/* py_fault.c: the fault-injection hook (core/fault.h) for tests: gyges.testing wraps it. The
 * sites and their counters are gyges._C's (this extension links them from there). */
#include "py_test.h"

#include "core/fault.h"

static int gy_py_fault_site(PyObject *args, int *site, long long *n, int with_n) {
    if (with_n ? !PyArg_ParseTuple(args, "iL", site, n) : !PyArg_ParseTuple(args, "i", site)) return -1;
    if (*site < 0 || *site >= GY_FAULT_SITE_COUNT) {
        PyErr_Format(GY_PY_VALUE_ERROR, "fault site %d is not in [0, %d)", *site, GY_FAULT_SITE_COUNT);
        return -1;
    }
    return 0;
}

/* fault_arm(site, n): the n-th event of the site from now fails (0: count only). */
static PyObject *gy_py_fault_arm(PyObject *module, PyObject *args) {
    int site;
    long long n;
    if (gy_py_fault_site(args, &site, &n, 1) < 0) return NULL;
    if (n < 0) return PyErr_Format(GY_PY_VALUE_ERROR, "fault event number must be >= 0, got %lld", n);
    gy_fault_arm((gy_fault_site)site, n);
    Py_RETURN_NONE;
}

static PyObject *gy_py_fault_disarm(PyObject *module, PyObject *unused) {
    gy_fault_disarm_all();
    Py_RETURN_NONE;
}

static PyObject *gy_py_fault_count(PyObject *module, PyObject *args) {
    int site;
    long long n;
    if (gy_py_fault_site(args, &site, &n, 0) < 0) return NULL;
    return PyLong_FromLongLong(gy_fault_count((gy_fault_site)site));
}

static PyObject *gy_py_fault_fired(PyObject *module, PyObject *unused) {
    return PyLong_FromLongLong(gy_fault_fired());
}

static PyMethodDef gy_py_fault_functions[] = {
    {"fault_arm", gy_py_fault_arm, METH_VARARGS, "fault_arm(site, n): the n-th event fails (0: count)"},
    {"fault_disarm", gy_py_fault_disarm, METH_NOARGS, "fault_disarm(): stop counting and failing"},
    {"fault_count", gy_py_fault_count, METH_VARARGS, "fault_count(site) -> events since armed"},
    {"fault_fired", gy_py_fault_fired, METH_NOARGS, "fault_fired() -> faults fired so far"},
    {NULL, NULL, 0, NULL},
};

int gy_py_fault_add(PyObject *module) {
    if (PyModule_AddFunctions(module, gy_py_fault_functions) < 0) return -1;
    for (int s = 0; s < GY_FAULT_SITE_COUNT; s++) {
        char name[64];
        snprintf(name, sizeof name, "FAULT_%s", gy_fault_site_name((gy_fault_site)s));
        for (char *c = name; *c; c++) *c = (char)(*c >= 'a' && *c <= 'z' ? *c - 32 : *c);
        if (PyModule_AddIntConstant(module, name, s) < 0) return -1;
    }
    return 0;
}
