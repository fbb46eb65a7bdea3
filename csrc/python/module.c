/* module.c: the gyges._C extension module: the registration of its exception classes
 * (py_errors.c) and of the functions and types defined in the other py_*.c files. */
#include "py_common.h"

static int gy_py_exec(PyObject *module) {
    if (gy_py_errors_add(module) < 0) return -1;
    if (gy_py_backends_add(module) < 0) return -1;
    if (gy_py_arena_add(module) < 0) return -1;
    if (gy_py_kv_add(module) < 0) return -1;
    if (gy_py_kv_patch_add(module) < 0) return -1;
    if (gy_py_kv_move_add(module) < 0) return -1;
    if (gy_py_model_add(module) < 0) return -1;
    if (gy_py_engine_add(module) < 0) return -1;
    if (gy_py_sim_add(module) < 0) return -1;
    if (gy_py_comm_add(module) < 0) return -1;
    if (gy_py_policy_add(module) < 0) return -1;
    if (gy_py_cluster_add(module) < 0) return -1;
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
