/* py_cuda.c: entry points to the CUDA backend: device queries, raw copies to and from device
 * addresses (for the CUDA arena's tests), and launches of the kernels of csrc/kernels/ on host
 * NumPy buffers, for the tests that check them against NumPy.
 *
 * The kernel entry points are deliberately simple: every buffer argument is copied to a fresh
 * device allocation, the kernel runs on the default stream, and the writable ones are copied
 * back. Outputs are copied in too, so whatever the kernel does not write (poison, guard values)
 * comes back unchanged and a test can see it. The GIL is released around the device work.
 *
 * In a build without CUDA, cuda_device_count() answers 0 and every other entry point raises
 * gyges.UnavailableError. */
#include "py_common.h"

#ifdef GY_WITH_CUDA
#include "cpu/dtype.h"
#include "kernels/kernels.h"
#include "kv/kv_layout.h"
#endif

#ifdef GY_WITH_CUDA

/* ---- host buffers that travel to the device ---- */

typedef struct gy_py_dev {
    Py_buffer view;
    int held;      /* view holds a buffer (optional arguments may be None) */
    int writeback; /* an output: copied back to the host buffer after the kernel */
    void *dev;     /* device copy, or NULL */
} gy_py_dev;

/* Borrows `object` as a C-contiguous buffer of `bytes` bytes (any length when bytes < 0),
 * writable when it is an output. 0, or -1 with an exception set. */
static int gy_py_dev_get(gy_py_dev *d, PyObject *object, Py_ssize_t bytes, int writeback,
                         const char *what) {
    if (bytes >= 0) {
        if (gy_py_get_buffer(object, &d->view, bytes, writeback, what) < 0) return -1;
    } else {
        int flags = PyBUF_C_CONTIGUOUS | (writeback ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(object, &d->view, flags) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be a %sC-contiguous buffer", what,
                         writeback ? "writable " : "");
            return -1;
        }
    }
    d->held = 1;
    d->writeback = writeback;
    return 0;
}

/* Like gy_py_dev_get for an int32 table; its length in entries goes to *n. */
static int gy_py_dev_get_int32(gy_py_dev *d, PyObject *object, int64_t *n, const char *what) {
    if (gy_py_dev_get(d, object, -1, 0, what) < 0) return -1;
    if (d->view.len % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "%s must hold int32 values (%zd bytes)", what, d->view.len);
        return -1;
    }
    *n = (int64_t)(d->view.len / 4);
    return 0;
}

/* GIL released. Allocates and fills the device copies. */
static gy_status gy_py_dev_upload(gy_py_dev *d, int n) {
    for (int i = 0; i < n; i++) {
        if (!d[i].held) continue;
        GY_TRY(gy_cuda_malloc(&d[i].dev, (uint64_t)d[i].view.len));
        GY_TRY(gy_cuda_memcpy_htod(d[i].dev, d[i].view.buf, (uint64_t)d[i].view.len));
    }
    return GY_OK;
}

/* GIL released. After the launch that returned `s`: waits, copies the outputs back when all went
 * well, and frees the device copies in every case. */
static gy_status gy_py_dev_finish(gy_py_dev *d, int n, gy_status s) {
    if (s == GY_OK) s = gy_cuda_stream_synchronize(NULL);
    for (int i = 0; i < n && s == GY_OK; i++)
        if (d[i].held && d[i].writeback)
            s = gy_cuda_memcpy_dtoh(d[i].view.buf, d[i].dev, (uint64_t)d[i].view.len);
    for (int i = 0; i < n; i++) {
        gy_cuda_free(d[i].dev);
        d[i].dev = NULL;
    }
    return s;
}

static void gy_py_dev_release(gy_py_dev *d, int n) {
    for (int i = 0; i < n; i++)
        if (d[i].held) {
            PyBuffer_Release(&d[i].view);
            d[i].held = 0;
        }
}

/* Runs `launch` between upload and finish with the GIL released, then turns the status into
 * None or an exception, and releases the buffers. */
#define GY_PY_DEV_RUN(d, n, launch)                                                                \
    do {                                                                                           \
        gy_status gy_run_s_;                                                                       \
        Py_BEGIN_ALLOW_THREADS                                                                     \
        gy_run_s_ = gy_py_dev_upload((d), (n));                                                    \
        if (gy_run_s_ == GY_OK) gy_run_s_ = (launch);                                              \
        gy_run_s_ = gy_py_dev_finish((d), (n), gy_run_s_);                                         \
        Py_END_ALLOW_THREADS                                                                       \
        gy_py_dev_release((d), (n));                                                               \
        if (gy_run_s_ != GY_OK) return gy_py_raise(gy_run_s_);                                     \
        Py_RETURN_NONE;                                                                            \
    } while (0)

static int64_t gy_py_dtype_size(int dtype) {
    gy_status s = gy_dtype_check((gy_dtype)dtype, "dtype");
    if (s != GY_OK) {
        gy_py_raise(s);
        return -1;
    }
    return gy_dtype_size((gy_dtype)dtype);
}

/* A KV layout from (kind, block_size, n_heads, head_dim, elem_size, n_blocks). */
static int gy_py_layout(PyObject *tuple, gy_kv_layout *out) {
    int kind;
    long long block_size, n_heads, head_dim, elem_size, n_blocks;
    if (!PyArg_ParseTuple(tuple, "iLLLLL;a layout is (kind, block_size, n_heads, head_dim, "
                                 "elem_size, n_blocks)",
                          &kind, &block_size, &n_heads, &head_dim, &elem_size, &n_blocks))
        return -1;
    gy_status s = gy_kv_layout_init(out, (gy_kv_layout_kind)kind, block_size, n_heads, head_dim,
                                    elem_size, n_blocks);
    if (s != GY_OK) {
        gy_py_raise(s);
        return -1;
    }
    return 0;
}

/* The block table must cover tokens [start, start + n_tokens). */
static int gy_py_check_table(const gy_kv_layout *layout, int64_t n_table, long long start,
                             long long n_tokens) {
    if (n_tokens == 0) return 0;
    const long long need = (start + n_tokens + layout->block_size - 1) / layout->block_size;
    if (start < 0 || need > n_table) {
        PyErr_Format(PyExc_ValueError,
                     "block_table has %lld entries; tokens [%lld, %lld) need %lld (start >= 0)",
                     (long long)n_table, start, start + n_tokens, need);
        return -1;
    }
    return 0;
}

static Py_ssize_t gy_py_layout_bytes(const gy_kv_layout *layout) {
    return (Py_ssize_t)(gy_kv_layout_layer_elems(layout) * layout->elem_size);
}

/* ---- devices ---- */

static PyObject *gy_py_cuda_device_count(PyObject *self, PyObject *unused) {
    int32_t count = 0;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_cuda_device_count(&count);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) {
        gy_error_clear(); /* "no device" is an answer here, not an error */
        count = 0;
    }
    return PyLong_FromLong(count);
}

static PyObject *gy_py_cuda_device_info(PyObject *self, PyObject *args) {
    int device;
    if (!PyArg_ParseTuple(args, "i", &device)) return NULL;
    gy_cuda_device_info info;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_cuda_device_info_get(&info, device);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    return Py_BuildValue("{sisss(ii)sisKsK}", "index", device, "name", info.name,
                         "compute_capability", (int)info.major, (int)info.minor,
                         "multiprocessors", (int)info.multiprocessors, "total_bytes",
                         (unsigned long long)info.total_bytes, "free_bytes",
                         (unsigned long long)info.free_bytes);
}

/* memcpy_htod(address, src): copies the bytes of a host buffer to a device address (e.g. inside a
 * CUDA arena's mapped slots). The caller guarantees the range is mapped device memory. */
static PyObject *gy_py_cuda_memcpy_htod(PyObject *self, PyObject *args) {
    unsigned long long address;
    PyObject *src;
    if (!PyArg_ParseTuple(args, "KO", &address, &src)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(src, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_cuda_memcpy_htod((void *)(uintptr_t)address, view.buf, (uint64_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

/* memcpy_dtoh(dst, address): fills a writable host buffer from a device address. */
static PyObject *gy_py_cuda_memcpy_dtoh(PyObject *self, PyObject *args) {
    PyObject *dst;
    unsigned long long address;
    if (!PyArg_ParseTuple(args, "OK", &dst, &address)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(dst, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_cuda_memcpy_dtoh(view.buf, (const void *)(uintptr_t)address, (uint64_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

/* ---- KV movement ---- */

/* kv_scatter(storage, layout, k, v, block_table, start, n_tokens) */
static PyObject *gy_py_cuda_kv_scatter(PyObject *self, PyObject *args) {
    PyObject *storage, *layout_t, *k, *v, *table;
    long long start, n_tokens;
    if (!PyArg_ParseTuple(args, "OOOOOLL", &storage, &layout_t, &k, &v, &table, &start,
                          &n_tokens))
        return NULL;
    gy_kv_layout layout;
    if (gy_py_layout(layout_t, &layout) < 0) return NULL;
    if (n_tokens < 0) return PyErr_Format(PyExc_ValueError, "n_tokens must be >= 0");
    const Py_ssize_t kv_bytes = (Py_ssize_t)(n_tokens * layout.n_heads * layout.head_dim *
                                             layout.elem_size);
    gy_py_dev d[4];
    memset(d, 0, sizeof d);
    int64_t n_table = 0;
    if (gy_py_dev_get(&d[0], storage, gy_py_layout_bytes(&layout), 1, "storage") < 0 ||
        gy_py_dev_get(&d[1], k, kv_bytes, 0, "k") < 0 ||
        gy_py_dev_get(&d[2], v, kv_bytes, 0, "v") < 0 ||
        gy_py_dev_get_int32(&d[3], table, &n_table, "block_table") < 0)
        goto fail;
    if (gy_py_check_table(&layout, n_table, start, n_tokens) < 0) goto fail;
    GY_PY_DEV_RUN(d, 4, gy_cuda_kv_scatter(d[0].dev, &layout, d[1].dev, d[2].dev, d[3].dev, start,
                                           n_tokens, NULL));
fail:
    gy_py_dev_release(d, 4);
    return NULL;
}

/* kv_gather(k, v, storage, layout, block_table, start, n_tokens) */
static PyObject *gy_py_cuda_kv_gather(PyObject *self, PyObject *args) {
    PyObject *storage, *layout_t, *k, *v, *table;
    long long start, n_tokens;
    if (!PyArg_ParseTuple(args, "OOOOOLL", &k, &v, &storage, &layout_t, &table, &start, &n_tokens))
        return NULL;
    gy_kv_layout layout;
    if (gy_py_layout(layout_t, &layout) < 0) return NULL;
    if (n_tokens < 0) return PyErr_Format(PyExc_ValueError, "n_tokens must be >= 0");
    const Py_ssize_t kv_bytes = (Py_ssize_t)(n_tokens * layout.n_heads * layout.head_dim *
                                             layout.elem_size);
    gy_py_dev d[4];
    memset(d, 0, sizeof d);
    int64_t n_table = 0;
    if (gy_py_dev_get(&d[0], k, kv_bytes, 1, "k") < 0 ||
        gy_py_dev_get(&d[1], v, kv_bytes, 1, "v") < 0 ||
        gy_py_dev_get(&d[2], storage, gy_py_layout_bytes(&layout), 0, "storage") < 0 ||
        gy_py_dev_get_int32(&d[3], table, &n_table, "block_table") < 0)
        goto fail;
    if (gy_py_check_table(&layout, n_table, start, n_tokens) < 0) goto fail;
    GY_PY_DEV_RUN(d, 4, gy_cuda_kv_gather(d[0].dev, d[1].dev, d[2].dev, &layout, d[3].dev, start,
                                          n_tokens, NULL));
fail:
    gy_py_dev_release(d, 4);
    return NULL;
}

/* kv_copy_heads(dst, dst_layout, dst_blocks, dst_head0, src, src_layout, src_blocks, src_head0,
 *               n_heads) */
static PyObject *gy_py_cuda_kv_copy_heads(PyObject *self, PyObject *args) {
    PyObject *dst, *dst_layout_t, *dst_blocks, *src, *src_layout_t, *src_blocks;
    long long dst_head0, src_head0, n_heads;
    if (!PyArg_ParseTuple(args, "OOOLOOOLL", &dst, &dst_layout_t, &dst_blocks, &dst_head0, &src,
                          &src_layout_t, &src_blocks, &src_head0, &n_heads))
        return NULL;
    gy_kv_layout dl, sl;
    if (gy_py_layout(dst_layout_t, &dl) < 0 || gy_py_layout(src_layout_t, &sl) < 0) return NULL;
    gy_py_dev d[4];
    memset(d, 0, sizeof d);
    int64_t n_dst = 0, n_src = 0;
    if (gy_py_dev_get(&d[0], dst, gy_py_layout_bytes(&dl), 1, "dst") < 0 ||
        gy_py_dev_get_int32(&d[1], dst_blocks, &n_dst, "dst_blocks") < 0 ||
        gy_py_dev_get(&d[2], src, gy_py_layout_bytes(&sl), 0, "src") < 0 ||
        gy_py_dev_get_int32(&d[3], src_blocks, &n_src, "src_blocks") < 0)
        goto fail;
    if (n_dst != n_src) {
        PyErr_Format(PyExc_ValueError, "dst_blocks has %lld entries, src_blocks %lld",
                     (long long)n_dst, (long long)n_src);
        goto fail;
    }
    GY_PY_DEV_RUN(d, 4, gy_cuda_kv_copy_heads(d[0].dev, &dl, d[1].dev, dst_head0, d[2].dev, &sl,
                                              d[3].dev, src_head0, n_heads, n_src, NULL));
fail:
    gy_py_dev_release(d, 4);
    return NULL;
}

/* ---- model kernels ---- */

/* rmsnorm(out, x, w, rows, dim, eps, act_dtype, w_dtype) */
static PyObject *gy_py_cuda_rmsnorm(PyObject *self, PyObject *args) {
    PyObject *out, *x, *w;
    long long rows, dim;
    float eps;
    int act_dtype, w_dtype;
    if (!PyArg_ParseTuple(args, "OOOLLfii", &out, &x, &w, &rows, &dim, &eps, &act_dtype, &w_dtype))
        return NULL;
    const int64_t as = gy_py_dtype_size(act_dtype), ws = as > 0 ? gy_py_dtype_size(w_dtype) : -1;
    if (as <= 0 || ws <= 0) return NULL;
    if (rows < 0 || dim < 0) return PyErr_Format(PyExc_ValueError, "rows and dim must be >= 0");
    gy_py_dev d[3];
    memset(d, 0, sizeof d);
    if (gy_py_dev_get(&d[0], out, (Py_ssize_t)(rows * dim * as), 1, "out") < 0 ||
        gy_py_dev_get(&d[1], x, (Py_ssize_t)(rows * dim * as), 0, "x") < 0 ||
        gy_py_dev_get(&d[2], w, (Py_ssize_t)(dim * ws), 0, "w") < 0)
        goto fail;
    GY_PY_DEV_RUN(d, 3, gy_cuda_rmsnorm(d[0].dev, d[1].dev, d[2].dev, rows, dim, eps,
                                        (gy_dtype)act_dtype, (gy_dtype)w_dtype, NULL));
fail:
    gy_py_dev_release(d, 3);
    return NULL;
}

/* rope(q, k_or_None, positions, n_tokens, n_q_heads, n_kv_heads, head_dim, theta, dtype), in
 * place on q and k */
static PyObject *gy_py_cuda_rope(PyObject *self, PyObject *args) {
    PyObject *q, *k, *positions;
    long long n_tokens, n_q, n_kv, head_dim;
    float theta;
    int dtype;
    if (!PyArg_ParseTuple(args, "OOOLLLLfi", &q, &k, &positions, &n_tokens, &n_q, &n_kv,
                          &head_dim, &theta, &dtype))
        return NULL;
    const int64_t es = gy_py_dtype_size(dtype);
    if (es <= 0) return NULL;
    if (n_tokens < 0 || n_q < 0 || n_kv < 0 || head_dim < 0)
        return PyErr_Format(PyExc_ValueError, "sizes must be >= 0");
    gy_py_dev d[3];
    memset(d, 0, sizeof d);
    if (gy_py_dev_get(&d[0], q, (Py_ssize_t)(n_tokens * n_q * head_dim * es), 1, "q") < 0 ||
        (k != Py_None &&
         gy_py_dev_get(&d[1], k, (Py_ssize_t)(n_tokens * n_kv * head_dim * es), 1, "k") < 0) ||
        gy_py_dev_get(&d[2], positions, (Py_ssize_t)(n_tokens * 4), 0, "positions") < 0)
        goto fail;
    GY_PY_DEV_RUN(d, 3, gy_cuda_rope(d[0].dev, d[1].dev, d[2].dev, n_tokens, n_q,
                                     k != Py_None ? n_kv : 0, head_dim, theta, (gy_dtype)dtype,
                                     NULL));
fail:
    gy_py_dev_release(d, 3);
    return NULL;
}

/* silu_mul(out, x, rows, dim, dtype) */
static PyObject *gy_py_cuda_silu_mul(PyObject *self, PyObject *args) {
    PyObject *out, *x;
    long long rows, dim;
    int dtype;
    if (!PyArg_ParseTuple(args, "OOLLi", &out, &x, &rows, &dim, &dtype)) return NULL;
    const int64_t es = gy_py_dtype_size(dtype);
    if (es <= 0) return NULL;
    if (rows < 0 || dim < 0) return PyErr_Format(PyExc_ValueError, "rows and dim must be >= 0");
    gy_py_dev d[2];
    memset(d, 0, sizeof d);
    if (gy_py_dev_get(&d[0], out, (Py_ssize_t)(rows * dim * es), 1, "out") < 0 ||
        gy_py_dev_get(&d[1], x, (Py_ssize_t)(rows * 2 * dim * es), 0, "x") < 0)
        goto fail;
    GY_PY_DEV_RUN(d, 2, gy_cuda_silu_mul(d[0].dev, d[1].dev, rows, dim, (gy_dtype)dtype, NULL));
fail:
    gy_py_dev_release(d, 2);
    return NULL;
}

/* residual_add(out, a, b, n, dtype) */
static PyObject *gy_py_cuda_residual_add(PyObject *self, PyObject *args) {
    PyObject *out, *a, *b;
    long long n;
    int dtype;
    if (!PyArg_ParseTuple(args, "OOOLi", &out, &a, &b, &n, &dtype)) return NULL;
    const int64_t es = gy_py_dtype_size(dtype);
    if (es <= 0) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "n must be >= 0");
    gy_py_dev d[3];
    memset(d, 0, sizeof d);
    if (gy_py_dev_get(&d[0], out, (Py_ssize_t)(n * es), 1, "out") < 0 ||
        gy_py_dev_get(&d[1], a, (Py_ssize_t)(n * es), 0, "a") < 0 ||
        gy_py_dev_get(&d[2], b, (Py_ssize_t)(n * es), 0, "b") < 0)
        goto fail;
    GY_PY_DEV_RUN(d, 3, gy_cuda_residual_add(d[0].dev, d[1].dev, d[2].dev, n, (gy_dtype)dtype,
                                             NULL));
fail:
    gy_py_dev_release(d, 3);
    return NULL;
}

/* embedding(out, table, ids, n_tokens, vocab, dim, out_dtype, table_dtype) */
static PyObject *gy_py_cuda_embedding(PyObject *self, PyObject *args) {
    PyObject *out, *table, *ids;
    long long n_tokens, vocab, dim;
    int out_dtype, table_dtype;
    if (!PyArg_ParseTuple(args, "OOOLLLii", &out, &table, &ids, &n_tokens, &vocab, &dim,
                          &out_dtype, &table_dtype))
        return NULL;
    const int64_t os = gy_py_dtype_size(out_dtype);
    const int64_t ts = os > 0 ? gy_py_dtype_size(table_dtype) : -1;
    if (os <= 0 || ts <= 0) return NULL;
    if (n_tokens < 0 || vocab < 0 || dim < 0)
        return PyErr_Format(PyExc_ValueError, "sizes must be >= 0");
    gy_py_dev d[3];
    memset(d, 0, sizeof d);
    if (gy_py_dev_get(&d[0], out, (Py_ssize_t)(n_tokens * dim * os), 1, "out") < 0 ||
        gy_py_dev_get(&d[1], table, (Py_ssize_t)(vocab * dim * ts), 0, "table") < 0 ||
        gy_py_dev_get(&d[2], ids, (Py_ssize_t)(n_tokens * 4), 0, "ids") < 0)
        goto fail;
    GY_PY_DEV_RUN(d, 3, gy_cuda_embedding(d[0].dev, d[1].dev, d[2].dev, n_tokens, vocab, dim,
                                          (gy_dtype)out_dtype, (gy_dtype)table_dtype, NULL));
fail:
    gy_py_dev_release(d, 3);
    return NULL;
}

/* argmax(out_int32, logits, rows, vocab, dtype) */
static PyObject *gy_py_cuda_argmax(PyObject *self, PyObject *args) {
    PyObject *out, *logits;
    long long rows, vocab;
    int dtype;
    if (!PyArg_ParseTuple(args, "OOLLi", &out, &logits, &rows, &vocab, &dtype)) return NULL;
    const int64_t es = gy_py_dtype_size(dtype);
    if (es <= 0) return NULL;
    if (rows < 0 || vocab < 0) return PyErr_Format(PyExc_ValueError, "sizes must be >= 0");
    gy_py_dev d[2];
    memset(d, 0, sizeof d);
    if (gy_py_dev_get(&d[0], out, (Py_ssize_t)(rows * 4), 1, "out") < 0 ||
        gy_py_dev_get(&d[1], logits, (Py_ssize_t)(rows * vocab * es), 0, "logits") < 0)
        goto fail;
    GY_PY_DEV_RUN(d, 2, gy_cuda_argmax(d[0].dev, d[1].dev, rows, vocab, (gy_dtype)dtype, NULL));
fail:
    gy_py_dev_release(d, 2);
    return NULL;
}

#define GY_PY_CUDA_FN(name, flags) (PyCFunction)gy_py_cuda_##name, flags

#else /* !GY_WITH_CUDA */

static PyObject *gy_py_cuda_device_count(PyObject *self, PyObject *unused) {
    return PyLong_FromLong(0);
}

static PyObject *gy_py_cuda_unavailable(PyObject *self, PyObject *args) {
    return gy_py_raise(GY_FAIL(GY_ERR_UNAVAILABLE,
                               "CUDA is not available: gyges was not built with CUDA (nvcc was "
                               "not found at build time, or GYGES_CUDA=0)"));
}

#define GY_PY_CUDA_FN(name, flags) (PyCFunction)gy_py_cuda_unavailable, METH_VARARGS

#endif /* GY_WITH_CUDA */

static PyMethodDef gy_py_cuda_methods[] = {
    {"cuda_device_count", (PyCFunction)gy_py_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> number of CUDA devices; 0 without a driver, a device or CUDA support"},
    {"cuda_device_info", GY_PY_CUDA_FN(device_info, METH_VARARGS),
     "cuda_device_info(i) -> dict(index, name, compute_capability, multiprocessors, total_bytes, "
     "free_bytes)"},
    {"cuda_memcpy_htod", GY_PY_CUDA_FN(memcpy_htod, METH_VARARGS),
     "cuda_memcpy_htod(address, src): host buffer -> mapped device memory"},
    {"cuda_memcpy_dtoh", GY_PY_CUDA_FN(memcpy_dtoh, METH_VARARGS),
     "cuda_memcpy_dtoh(dst, address): mapped device memory -> writable host buffer"},
    {"cuda_kv_scatter", GY_PY_CUDA_FN(kv_scatter, METH_VARARGS),
     "cuda_kv_scatter(storage, layout, k, v, block_table, start, n_tokens); layout = (kind, "
     "block_size, n_heads, head_dim, elem_size, n_blocks)"},
    {"cuda_kv_gather", GY_PY_CUDA_FN(kv_gather, METH_VARARGS),
     "cuda_kv_gather(k, v, storage, layout, block_table, start, n_tokens)"},
    {"cuda_kv_copy_heads", GY_PY_CUDA_FN(kv_copy_heads, METH_VARARGS),
     "cuda_kv_copy_heads(dst, dst_layout, dst_blocks, dst_head0, src, src_layout, src_blocks, "
     "src_head0, n_heads)"},
    {"cuda_rmsnorm", GY_PY_CUDA_FN(rmsnorm, METH_VARARGS),
     "cuda_rmsnorm(out, x, w, rows, dim, eps, act_dtype, w_dtype)"},
    {"cuda_rope", GY_PY_CUDA_FN(rope, METH_VARARGS),
     "cuda_rope(q, k_or_None, positions, n_tokens, n_q_heads, n_kv_heads, head_dim, theta, "
     "dtype): in place"},
    {"cuda_silu_mul", GY_PY_CUDA_FN(silu_mul, METH_VARARGS),
     "cuda_silu_mul(out, x, rows, dim, dtype): out = silu(x[:, :dim]) * x[:, dim:]"},
    {"cuda_residual_add", GY_PY_CUDA_FN(residual_add, METH_VARARGS),
     "cuda_residual_add(out, a, b, n, dtype)"},
    {"cuda_embedding", GY_PY_CUDA_FN(embedding, METH_VARARGS),
     "cuda_embedding(out, table, ids, n_tokens, vocab, dim, out_dtype, table_dtype)"},
    {"cuda_argmax", GY_PY_CUDA_FN(argmax, METH_VARARGS),
     "cuda_argmax(out_int32, logits, rows, vocab, dtype)"},
    {NULL, NULL, 0, NULL},
};

int gy_py_cuda_add(PyObject *module) { return PyModule_AddFunctions(module, gy_py_cuda_methods); }
