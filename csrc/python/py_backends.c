/* py_backends.c: what this build and machine offer the package: whether CUDA is built in
 * (WITH_CUDA), how many devices there are (cuda_device_count), whether the CUDA forward pass is
 * in this build (cuda_forward_unavailable), a device's memory (cuda_device_memory), and which instruction set the CPU kernels use
 * (set_cpu_isa, the GYGES_CPU_ISA switch of gyges/__init__.py). */
#include "py_common.h"

#include <string.h>

#include "cpu/isa.h"
#include "engine/forward_cuda.h"
#ifdef GY_WITH_CUDA
#include "kernels/device.h"
#endif

/* cuda_device_count() -> the number of CUDA devices; 0 without a driver, a device or CUDA. */
static PyObject *gy_py_cuda_device_count(PyObject *module, PyObject *unused) {
    int32_t count = 0;
#ifdef GY_WITH_CUDA
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_cuda_device_count(&count);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) {
        gy_error_clear(); /* "no device" is an answer here, not an error */
        count = 0;
    }
#endif
    return PyLong_FromLong(count);
}

/* cuda_device_memory(device) -> its memory in bytes (what gpu_memory_utilization is a fraction
 * of); GY_ERR_UNAVAILABLE without CUDA or the device. */
static PyObject *gy_py_cuda_device_memory(PyObject *module, PyObject *args) {
    int device;
    if (!PyArg_ParseTuple(args, "i", &device)) return NULL;
#ifdef GY_WITH_CUDA
    gy_cuda_device_info info;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_cuda_device_info_get(&info, device);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    return PyLong_FromUnsignedLongLong(info.total_bytes);
#else
    return gy_py_raise(GY_FAIL(GY_ERR_UNAVAILABLE, "gyges was built without CUDA: no device %d",
                               device));
#endif
}

/* cuda_forward_unavailable() -> None when the CUDA forward pass is built in, else the reason. */
static PyObject *gy_py_cuda_forward_unavailable(PyObject *module, PyObject *unused) {
    const char *why = gy_forward_cuda_unavailable();
    if (why == NULL) Py_RETURN_NONE;
    return PyUnicode_FromString(why);
}

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
    {"cuda_device_count", gy_py_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> number of CUDA devices; 0 without a driver, a device or CUDA support"},
    {"cuda_device_memory", gy_py_cuda_device_memory, METH_VARARGS,
     "cuda_device_memory(device) -> the device's memory in bytes"},
    {"cuda_forward_unavailable", gy_py_cuda_forward_unavailable, METH_NOARGS,
     "cuda_forward_unavailable() -> None, or why the CUDA forward pass is not in this build"},
    {"set_cpu_isa", gy_py_set_cpu_isa, METH_VARARGS,
     "set_cpu_isa(name): the CPU kernels' path, 'portable' or 'avx512' (the same bits)"},
    {NULL, NULL, 0, NULL},
};

int gy_py_backends_add(PyObject *module) {
#ifdef GY_WITH_CUDA
    if (PyModule_AddIntConstant(module, "WITH_CUDA", 1) < 0) return -1;
#else
    if (PyModule_AddIntConstant(module, "WITH_CUDA", 0) < 0) return -1;
#endif
    return PyModule_AddFunctions(module, gy_py_backend_functions);
}
