/* py_cuda.c: entry points to the CUDA backend (device queries, kernel launches for the tests). */
#include "py_common.h"

static PyMethodDef gy_py_cuda_methods[] = {
    {NULL, NULL, 0, NULL},
};

int gy_py_cuda_add(PyObject *module) { return PyModule_AddFunctions(module, gy_py_cuda_methods); }
