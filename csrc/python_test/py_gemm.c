/* py_gemm.c: the CUDA forward pass's cuBLAS GEMM wrapper (csrc/kernels/gemm.h) on host NumPy
 * buffers, for the tests that check it against NumPy, and whether cuBLAS loads. Like py_cuda.c's
 * kernel entry points: every buffer is copied to a fresh device allocation, the GEMM runs on the
 * default stream, y is copied in (accumulate mode reads it) and back. Shapes and dtypes are
 * checked before the device is touched. */
#include "py_test.h"

#ifdef GY_WITH_CUDA
#include "core/dtype.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"
#endif

#ifdef GY_WITH_CUDA

/* cuda_blas_available() -> None when cuBLAS loads, else the reason. */
static PyObject *gy_py_cuda_blas_available(PyObject *module, PyObject *unused) {
    gy_status s = gy_cuda_blas_available();
    if (s == GY_OK) Py_RETURN_NONE;
    PyObject *why = PyUnicode_FromString(gy_error_message());
    gy_error_clear();
    return why;
}

/* GIL released: the device part of cuda_gemm. */
static gy_status gy_py_gemm_run(Py_buffer *y, Py_buffer *x, Py_buffer *w, Py_buffer *bias,
                                int y_dtype, int64_t ldy, int x_dtype, int64_t ldx, int w_dtype,
                                int orientation, int64_t m, int64_t n_in, int64_t n_out,
                                int accumulate) {
    void *dy = NULL, *dx = NULL, *dw = NULL, *db = NULL;
    gy_cuda_blas *blas = NULL;
    gy_status s = gy_cuda_set_device(0);
    if (s == GY_OK) s = gy_cuda_malloc(&dy, (uint64_t)y->len);
    if (s == GY_OK) s = gy_cuda_malloc(&dx, (uint64_t)x->len);
    if (s == GY_OK) s = gy_cuda_malloc(&dw, (uint64_t)w->len);
    if (s == GY_OK && bias != NULL) s = gy_cuda_malloc(&db, (uint64_t)bias->len);
    if (s == GY_OK) s = gy_cuda_memcpy_htod(dy, y->buf, (uint64_t)y->len);
    if (s == GY_OK) s = gy_cuda_memcpy_htod(dx, x->buf, (uint64_t)x->len);
    if (s == GY_OK) s = gy_cuda_memcpy_htod(dw, w->buf, (uint64_t)w->len);
    if (s == GY_OK && bias != NULL) s = gy_cuda_memcpy_htod(db, bias->buf, (uint64_t)bias->len);
    if (s == GY_OK) s = gy_cuda_blas_init(&blas, NULL);
    if (s == GY_OK)
        s = gy_cuda_gemm(dy, (gy_dtype)y_dtype, ldy, dx, (gy_dtype)x_dtype, ldx, dw,
                         (gy_dtype)w_dtype, (gy_gemm_weight)orientation, db, m, n_in, n_out,
                         accumulate, blas);
    if (s == GY_OK) s = gy_cuda_stream_synchronize(NULL);
    if (s == GY_OK) s = gy_cuda_memcpy_dtoh(y->buf, dy, (uint64_t)y->len);
    gy_cuda_blas_free(blas);
    gy_cuda_free(dy);
    gy_cuda_free(dx);
    gy_cuda_free(dw);
    gy_cuda_free(db);
    return s;
}

/* cuda_gemm(y, x, w, bias, y_dtype, x_dtype, w_dtype, orientation, m, n_in, n_out, ldx, ldy,
 *           accumulate): y = x @ W (+ bias) (+ y), see gemm.h. Buffers: y at least
 * ((m-1)*ldy + n_out) elements of y_dtype, x likewise with ldx and n_in, w exactly n_in*n_out
 * elements of w_dtype, bias None or n_out float32. */
static PyObject *gy_py_cuda_gemm(PyObject *module, PyObject *args) {
    PyObject *objects[4];
    int y_dtype, x_dtype, w_dtype, orientation, accumulate;
    long long m, n_in, n_out, ldx, ldy;
    if (!PyArg_ParseTuple(args, "OOOOiiiiLLLLLp", &objects[0], &objects[1], &objects[2],
                          &objects[3], &y_dtype, &x_dtype, &w_dtype, &orientation, &m, &n_in,
                          &n_out, &ldx, &ldy, &accumulate))
        return NULL;
    /* Everything the device would refuse, before the device. */
    gy_status s = gy_cuda_gemm_check((gy_dtype)y_dtype, ldy, (gy_dtype)x_dtype, ldx,
                                     (gy_dtype)w_dtype, (gy_gemm_weight)orientation, m, n_in,
                                     n_out);
    if (s != GY_OK) return gy_py_raise(s);
    const int has_bias = objects[3] != Py_None;
    const Py_ssize_t need[4] = {
        (Py_ssize_t)((m > 0 ? (m - 1) * ldy + n_out : 0) * gy_dtype_size((gy_dtype)y_dtype)),
        (Py_ssize_t)((m > 0 ? (m - 1) * ldx + n_in : 0) * gy_dtype_size((gy_dtype)x_dtype)),
        (Py_ssize_t)(n_in * n_out * gy_dtype_size((gy_dtype)w_dtype)),
        (Py_ssize_t)(n_out * 4),
    };
    static const char *const what[4] = {"y", "x", "w", "bias"};
    Py_buffer views[4];
    int held = 0;
    PyObject *result = NULL;
    for (; held < 3 + has_bias; held++) {
        const int writable = held == 0;
        if (PyObject_GetBuffer(objects[held], &views[held],
                               PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
            goto done;
        const int exact = held >= 2; /* w and bias exactly; y and x at least */
        if (exact ? views[held].len != need[held] : views[held].len < need[held]) {
            PyErr_Format(GY_PY_VALUE_ERROR, "cuda_gemm: %s has %zd bytes, needs %s%zd", what[held],
                         views[held].len, exact ? "" : "at least ", need[held]);
            held++;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    s = gy_py_gemm_run(&views[0], &views[1], &views[2], has_bias ? &views[3] : NULL, y_dtype, ldy,
                       x_dtype, ldx, w_dtype, orientation, m, n_in, n_out, accumulate);
    Py_END_ALLOW_THREADS
    result = s == GY_OK ? Py_NewRef(Py_None) : gy_py_raise(s);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    return result;
}

#else /* no CUDA in this build */

static PyObject *gy_py_cuda_unavailable(PyObject *module, PyObject *args) {
    return PyErr_Format(gy_py_error_class(GY_ERR_UNAVAILABLE),
                        "gyges was not built with CUDA (nvcc was not found at build time, or "
                        "GYGES_CUDA=0)");
}

static PyObject *gy_py_cuda_blas_available(PyObject *module, PyObject *unused) {
    return PyUnicode_FromString("gyges was not built with CUDA");
}

#define gy_py_cuda_gemm gy_py_cuda_unavailable

#endif

static PyMethodDef gy_py_gemm_functions[] = {
    {"cuda_blas_available", gy_py_cuda_blas_available, METH_NOARGS,
     "cuda_blas_available() -> None, or why cuBLAS cannot be loaded"},
    {"cuda_gemm", gy_py_cuda_gemm, METH_VARARGS,
     "cuda_gemm(y, x, w, bias, y_dtype, x_dtype, w_dtype, orientation, m, n_in, n_out, ldx, ldy, "
     "accumulate)"},
    {NULL, NULL, 0, NULL},
};

int gy_py_gemm_add(PyObject *module) { return PyModule_AddFunctions(module, gy_py_gemm_functions); }
