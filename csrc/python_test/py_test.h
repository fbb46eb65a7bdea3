/* py_test.h: what the files of gyges._C_test share. The test extension is linked against
 * gyges._C (setup.py): the core, py_common.h's helpers and the exception classes they raise are
 * gyges._C's own, so a test entry point raises the very gyges.Error classes the package does, and
 * a fault armed here fails an allocation made by gyges._C. */
#ifndef GY_PY_TEST_H
#define GY_PY_TEST_H

#include "python/py_common.h"

/* Each file adds its functions to the module; 0 on success, -1 with an exception. */
int gy_py_fault_add(PyObject *module);
int gy_py_kernels_add(PyObject *module);
int gy_py_cuda_add(PyObject *module);
int gy_py_gemm_add(PyObject *module);

#endif
