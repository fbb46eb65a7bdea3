/* py_backends.c: what this build and machine offer the package: the CPU kernels' instruction set
 * (set_cpu_isa, the GYGES_CPU_ISA switch of gyges/__init__.py). */
#include "py_common.h"

#include <string.h>

#include "cpu/isa.h"

/* set_cpu_isa(name): the CPU kernels' path, 'portable' or 'avx512', for the whole process. */
static PyObject *gy_py_set_cpu_isa(PyObject *module, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    for (int i = 0; i < GY_CPU_ISA_COUNT; i++)
        if (strcmp(name, gy_cpu_isa_name((gy_cpu_isa)i)) == 0) {
            gy_status s = gy_cpu_isa_set((gy_cpu_isa)i);
            if (s != GY_OK) return gy_py_raise(s);
            Py_RETURN_NONE;
        }
    return PyErr_Format(GY_PY_VALUE_ERROR, "unknown kernel path '%s' (portable, avx512)", name);
}

static PyMethodDef gy_py_backend_functions[] = {
    {"set_cpu_isa", gy_py_set_cpu_isa, METH_VARARGS,
     "set_cpu_isa(name): the CPU kernels' path, 'portable' or 'avx512' (the same bits)"},
    {NULL, NULL, 0, NULL},
};

int gy_py_backends_add(PyObject *module) {
    return PyModule_AddFunctions(module, gy_py_backend_functions);
}
