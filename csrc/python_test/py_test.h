/* py_test.h: what the files of gyges._C_test share. The test extension is linked against
 * gyges._C (setup.py): the core, py_common.h's helpers and the exception classes they raise are
 * gyges._C's own, so a test entry point raises the very gyges.Error classes the package does, and
 * a fault armed here fails an allocation made by gyges._C. */
#ifndef GY_PY_TEST_H
#define GY_PY_TEST_H

#include "python/py_common.h"

/* Each file adds its functions and types to the module; 0 on success, -1 with an exception. */
int gy_py_fault_add(PyObject *module);
int gy_py_kernels_add(PyObject *module);
int gy_py_cuda_add(PyObject *module);
int gy_py_gemm_add(PyObject *module);
int gy_py_sched_add(PyObject *module);
int gy_py_sampler_add(PyObject *module);
int gy_py_cost_model_add(PyObject *module);

/* From py_sampler.c, for the CUDA sampler's entry point too: parses `rows` sampler rows
 * (temperature, top_k, top_p, seed, token_index[, min_p]) from a sequence into two new arrays
 * (free both with PyMem_Free), each row checked against `vocab` when it is > 0 (the error names
 * the row). 0, or -1 with an exception and nothing to free. */
struct gy_sampler_params;
int gy_py_sampler_rows(PyObject *rows_object, long long rows, int64_t vocab,
                       struct gy_sampler_params **params, int64_t **index);

#endif
