/* test_module.c: the gyges._C_test extension module: the entry points that only the tests, the
 * benchmarks and the emulated-GPU harness call, registered from the other files of this folder.
 * gyges._C stays the product's surface: what the package itself uses. */
#include "py_test.h"

static int gy_py_test_exec(PyObject *module) {
    /* The exception classes are made by gyges._C's init; loading this library only maps _C's
     * code, so make sure that init ran before any entry point here can raise. */
    PyObject *core = PyImport_ImportModule("gyges._C");
    if (core == NULL) return -1;
    Py_DECREF(core);
    if (gy_py_fault_add(module) < 0) return -1;
    if (gy_py_kernels_add(module) < 0) return -1;
    if (gy_py_cuda_add(module) < 0) return -1;
    if (gy_py_gemm_add(module) < 0) return -1;
    if (gy_py_sched_add(module) < 0) return -1;
    if (gy_py_sampler_add(module) < 0) return -1;
    if (gy_py_cost_model_add(module) < 0) return -1;
    return 0;
}

static PyModuleDef_Slot gy_py_test_slots[] = {
    {Py_mod_exec, gy_py_test_exec},
    {0, NULL},
};

static struct PyModuleDef gy_py_test_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gyges._C_test",
    .m_doc = "Test hooks of the C core for gyges' tests and benchmarks (gyges.testing wraps the "
             "fault hooks); not part of the package's interface.",
    .m_size = 0,
    .m_slots = gy_py_test_slots,
};

PyMODINIT_FUNC PyInit__C_test(void) { return PyModuleDef_Init(&gy_py_test_module); }
