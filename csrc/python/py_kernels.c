/* py_kernels.c: entry points to the CPU kernels, used by the engine and by the kernel tests. */
#include "py_common.h"

static PyMethodDef gy_py_kernel_methods[] = {
    {NULL, NULL, 0, NULL},
};

int gy_py_kernels_add(PyObject *module) { return PyModule_AddFunctions(module, gy_py_kernel_methods); }
