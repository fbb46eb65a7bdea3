/* py_sched.c: gyges._C.Scheduler and the sampler entry points (not yet written). */
#include "py_common.h"

int gy_py_sched_add(PyObject *module) { return 0; }
