/* py_cuda.c: entry points to the CUDA backend for its tests and benchmarks: device info, raw
 * copies to and from device addresses (for the CUDA arena's tests), and launches of the kernels of csrc/kernels/ on host
 * NumPy buffers, for the tests that check them against NumPy.
 *
 * The kernel entry points are deliberately simple: every buffer argument is copied to a fresh
 * device allocation, the kernel runs on the default stream, and the writable ones are copied
 * back. Outputs are copied in too, so whatever the kernel does not write (poison, guard values)
 * comes back unchanged and a test can see it. The GIL is released around the device work.
 * One set of helpers does it for all (gy_py_devs: borrow with the byte count checked, upload,
 * launch, copy back, free, release); arguments are checked before anything reaches the device
 * (the kernels' gy_cuda_<op>_check, the paged tables with gy_cpu_paged_batch_check, the sampler
 * params with gy_sampler_check), so a bad call is refused the same way with or without a GPU.
 * Two timing entry points (cuda_bench_*) keep their data on the device and time launches with
 * events, for benchmarks/bench_cuda_kernels.py.
 *
 * In a build without CUDA, every entry point raises gyges.UnavailableError. (gyges._C answers
 * cuda_device_count, which the package asks.) */
#include "py_test.h"

#ifdef GY_WITH_CUDA
#include <math.h>

#include "core/dtype.h"
#include "cpu/paged.h"
#include "kernels/kernels.h"
#include "kv/kv_layout.h"
#include "sched/sampler.h"
#endif

#ifdef GY_WITH_CUDA

/* ---- buffers that travel to the device ---- */

#define GY_PY_MAX_DEVS 12

/* One device allocation of a call: the copy of a host buffer (a borrowed Python buffer, or
 * memory the entry point built), or scratch that exists on the device only. */
typedef struct gy_py_dev {
    Py_buffer view;
    int held;         /* view holds a Python buffer */
    const void *host; /* bytes copied in (view.buf or the caller's), NULL for scratch */
    void *writeback;  /* copied back here after the kernel, or NULL */
    uint64_t bytes;
    int scratch;      /* device only: nothing copied, and no allocation when bytes is 0 */
    void *dev; /* device copy; NULL before the upload and for empty scratch */
} gy_py_dev;

/* The allocations of one call, released together on every path. */
typedef struct gy_py_devs {
    gy_py_dev d[GY_PY_MAX_DEVS];
    int n;
} gy_py_devs;

#define GY_PY_DEV(ds, i) ((ds).d[(i)].dev)

static gy_py_dev *gy_py_devs_next(gy_py_devs *ds) {
    if (ds->n >= GY_PY_MAX_DEVS) {
        PyErr_SetString(gy_py_error_class(GY_ERR_LIMIT), "too many buffers in one CUDA call");
        return NULL;
    }
    gy_py_dev *d = &ds->d[ds->n];
    memset(d, 0, sizeof *d);
    return d;
}

/* bytes = d0 * d1 * d2 * elem, refusing negative sizes and overflow with ValueError. */
static int gy_py_dev_nbytes(Py_ssize_t *bytes, const char *what, long long d0, long long d1,
                            long long d2, long long elem) {
    long long r;
    if (d0 < 0 || d1 < 0 || d2 < 0 || elem <= 0) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s: sizes must not be negative (%lld, %lld, %lld)", what,
                     d0, d1, d2);
        return -1;
    }
    if (__builtin_mul_overflow(d0, d1, &r) || __builtin_mul_overflow(r, d2, &r) ||
        __builtin_mul_overflow(r, elem, &r) || r > PY_SSIZE_T_MAX) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s: size overflows", what);
        return -1;
    }
    *bytes = (Py_ssize_t)r;
    return 0;
}

/* Borrows `object` as a C-contiguous buffer of exactly d0 * d1 * d2 * elem bytes (any length when
 * elem is 0), writable and copied back when `writeback`. Returns its slot, or -1 with ValueError
 * naming `what`. */
static int gy_py_devs_add(gy_py_devs *ds, PyObject *object, int writeback, const char *what,
                          long long d0, long long d1, long long d2, long long elem) {
    gy_py_dev *d = gy_py_devs_next(ds);
    if (d == NULL) return -1;
    if (elem > 0) {
        Py_ssize_t bytes;
        if (gy_py_dev_nbytes(&bytes, what, d0, d1, d2, elem) < 0 ||
            gy_py_get_buffer(object, &d->view, bytes, writeback, what) < 0)
            return -1;
    } else {
        int flags = PyBUF_C_CONTIGUOUS | (writeback ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(object, &d->view, flags) < 0) {
            PyErr_Clear();
            PyErr_Format(GY_PY_VALUE_ERROR, "%s must be a %sC-contiguous buffer", what,
                         writeback ? "writable " : "");
            return -1;
        }
    }
    d->held = 1;
    d->host = d->view.buf;
    d->writeback = writeback ? d->view.buf : NULL;
    d->bytes = (uint64_t)d->view.len;
    return ds->n++;
}

/* An int32 table of any length, its length in entries to *n. */
static int gy_py_devs_add_int32(gy_py_devs *ds, PyObject *object, int64_t *n, const char *what) {
    const int slot = gy_py_devs_add(ds, object, 0, what, 0, 0, 0, 0);
    if (slot < 0) return -1;
    if (ds->d[slot].bytes % 4 != 0) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s must hold int32 values (%llu bytes)", what,
                     (unsigned long long)ds->d[slot].bytes);
        return -1;
    }
    *n = (int64_t)(ds->d[slot].bytes / 4);
    return slot;
}

/* Host memory the entry point owns (it must outlive the call), copied in. */
static int gy_py_devs_add_host(gy_py_devs *ds, const void *host, uint64_t bytes) {
    gy_py_dev *d = gy_py_devs_next(ds);
    if (d == NULL) return -1;
    d->host = host;
    d->bytes = bytes;
    return ds->n++;
}

/* Device scratch of `bytes` bytes (none, and a NULL pointer, when 0). */
static int gy_py_devs_add_scratch(gy_py_devs *ds, uint64_t bytes) {
    gy_py_dev *d = gy_py_devs_next(ds);
    if (d == NULL) return -1;
    d->bytes = bytes;
    d->scratch = 1;
    return ds->n++;
}

/* GIL released. Allocates and fills the device copies. */
static gy_status gy_py_devs_upload(gy_py_devs *ds) {
    for (int i = 0; i < ds->n; i++) {
        gy_py_dev *d = &ds->d[i];
        if (d->scratch && d->bytes == 0) continue;
        GY_TRY(gy_cuda_malloc(&d->dev, d->bytes)); /* 0 bytes: a distinct non-NULL pointer */
        if (!d->scratch) GY_TRY(gy_cuda_memcpy_htod(d->dev, d->host, d->bytes));
    }
    return GY_OK;
}

/* GIL released. After the launch that returned `s`: waits, copies the outputs back when all went
 * well, and frees the device copies in every case. */
static gy_status gy_py_devs_finish(gy_py_devs *ds, gy_status s) {
    if (s == GY_OK) s = gy_cuda_stream_synchronize(NULL);
    for (int i = 0; i < ds->n && s == GY_OK; i++)
        if (ds->d[i].writeback != NULL)
            s = gy_cuda_memcpy_dtoh(ds->d[i].writeback, ds->d[i].dev, ds->d[i].bytes);
    for (int i = 0; i < ds->n; i++) {
        gy_cuda_free(ds->d[i].dev);
        ds->d[i].dev = NULL;
    }
    return s;
}

static void gy_py_devs_release(gy_py_devs *ds) {
    for (int i = 0; i < ds->n; i++)
        if (ds->d[i].held) {
            PyBuffer_Release(&ds->d[i].view);
            ds->d[i].held = 0;
        }
    /* a slot that failed half-way holds no buffer (gy_py_get_buffer releases on error) */
    ds->n = 0;
}

/* The failure path of an entry point: releases what was borrowed, returns NULL. */
static PyObject *gy_py_devs_fail(gy_py_devs *ds) {
    gy_py_devs_release(ds);
    return NULL;
}

/* Runs `launch` between upload and finish with the GIL released, then turns the status into
 * None or an exception, and releases the buffers. */
#define GY_PY_DEVS_RUN(ds, launch)                                                                 \
    do {                                                                                           \
        gy_status gy_run_s_;                                                                       \
        Py_BEGIN_ALLOW_THREADS                                                                     \
        gy_run_s_ = gy_py_devs_upload(&(ds));                                                      \
        if (gy_run_s_ == GY_OK) gy_run_s_ = (launch);                                              \
        gy_run_s_ = gy_py_devs_finish(&(ds), gy_run_s_);                                           \
        Py_END_ALLOW_THREADS                                                                       \
        gy_py_devs_release(&(ds));                                                                 \
        if (gy_run_s_ != GY_OK) return gy_py_raise(gy_run_s_);                                     \
        Py_RETURN_NONE;                                                                            \
    } while (0)

/* Bytes per element of a gy_dtype, or -1 with the gyges error set. */
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

/* Adds a layer's storage for `layout` (its exact byte size). */
static int gy_py_devs_add_layer(gy_py_devs *ds, PyObject *object, const gy_kv_layout *layout,
                                int writeback, const char *what) {
    return gy_py_devs_add(ds, object, writeback, what, gy_kv_layout_layer_elems(layout), 1, 1,
                          layout->elem_size);
}

/* The block table must cover tokens [start, start + n_tokens). */
static int gy_py_check_table(const gy_kv_layout *layout, int64_t n_table, long long start,
                             long long n_tokens) {
    if (n_tokens == 0) return 0;
    const long long need = (start + n_tokens + layout->block_size - 1) / layout->block_size;
    if (start < 0 || need > n_table) {
        PyErr_Format(GY_PY_VALUE_ERROR,
                     "block_table has %lld entries; tokens [%lld, %lld) need %lld (start >= 0)",
                     (long long)n_table, start, start + n_tokens, need);
        return -1;
    }
    return 0;
}

/* The CSR token batch of cpu/paged.h: token_seq, token_pos (n_tokens), bt_indptr (n_seqs + 1),
 * bt_indices (bt_indptr[n_seqs]) borrowed into four slots starting at the returned one. With
 * `check`, the host copies are validated against `layout` (gy_cpu_paged_batch_check, a gyges
 * error naming the first bad entry) and the largest position + 1 goes to *max_len; without, a
 * test can hand the kernels stale tables on purpose. -1 with an exception set on failure. */
static int gy_py_devs_add_batch(gy_py_devs *ds, PyObject *seq_o, PyObject *pos_o,
                                PyObject *indptr_o, PyObject *indices_o, long long n_tokens,
                                long long n_seqs, const gy_kv_layout *layout, int check,
                                const char *what, int64_t *max_len) {
    const int first = gy_py_devs_add(ds, seq_o, 0, "token_seq", n_tokens, 1, 1, 4);
    if (first < 0 || gy_py_devs_add(ds, pos_o, 0, "token_pos", n_tokens, 1, 1, 4) < 0 ||
        gy_py_devs_add(ds, indptr_o, 0, "bt_indptr", n_seqs + 1, 1, 1, 4) < 0)
        return -1;
    const int32_t *indptr = ds->d[first + 2].host;
    const long long n_indices = indptr[n_seqs];
    if (gy_py_devs_add(ds, indices_o, 0, "bt_indices (length bt_indptr[n_seqs])", n_indices, 1,
                       1, 4) < 0)
        return -1;
    *max_len = 0;
    if (check) {
        const gy_cpu_paged_batch batch = {n_tokens, ds->d[first].host, ds->d[first + 1].host,
                                          n_seqs, indptr, ds->d[first + 3].host};
        gy_status s = gy_cpu_paged_batch_check(&batch, layout, what, max_len);
        if (s != GY_OK) {
            gy_py_raise(s);
            return -1;
        }
    }
    return first;
}

/* ---- devices ---- */

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
    gy_kv_layout L;
    if (gy_py_layout(layout_t, &L) < 0) return NULL;
    gy_py_devs ds = {.n = 0};
    int64_t n_table = 0;
    if (gy_py_devs_add_layer(&ds, storage, &L, 1, "storage") < 0 ||
        gy_py_devs_add(&ds, k, 0, "k", n_tokens, L.n_heads, L.head_dim, L.elem_size) < 0 ||
        gy_py_devs_add(&ds, v, 0, "v", n_tokens, L.n_heads, L.head_dim, L.elem_size) < 0 ||
        gy_py_devs_add_int32(&ds, table, &n_table, "block_table") < 0 ||
        gy_py_check_table(&L, n_table, start, n_tokens) < 0)
        return gy_py_devs_fail(&ds);
    GY_PY_DEVS_RUN(ds, gy_cuda_kv_scatter(GY_PY_DEV(ds, 0), &L, GY_PY_DEV(ds, 1),
                                          GY_PY_DEV(ds, 2), GY_PY_DEV(ds, 3), start, n_tokens,
                                          NULL));
}

/* kv_gather(k, v, storage, layout, block_table, start, n_tokens) */
static PyObject *gy_py_cuda_kv_gather(PyObject *self, PyObject *args) {
    PyObject *storage, *layout_t, *k, *v, *table;
    long long start, n_tokens;
    if (!PyArg_ParseTuple(args, "OOOOOLL", &k, &v, &storage, &layout_t, &table, &start, &n_tokens))
        return NULL;
    gy_kv_layout L;
    if (gy_py_layout(layout_t, &L) < 0) return NULL;
    gy_py_devs ds = {.n = 0};
    int64_t n_table = 0;
    if (gy_py_devs_add(&ds, k, 1, "k", n_tokens, L.n_heads, L.head_dim, L.elem_size) < 0 ||
        gy_py_devs_add(&ds, v, 1, "v", n_tokens, L.n_heads, L.head_dim, L.elem_size) < 0 ||
        gy_py_devs_add_layer(&ds, storage, &L, 0, "storage") < 0 ||
        gy_py_devs_add_int32(&ds, table, &n_table, "block_table") < 0 ||
        gy_py_check_table(&L, n_table, start, n_tokens) < 0)
        return gy_py_devs_fail(&ds);
    GY_PY_DEVS_RUN(ds, gy_cuda_kv_gather(GY_PY_DEV(ds, 0), GY_PY_DEV(ds, 1), GY_PY_DEV(ds, 2),
                                         &L, GY_PY_DEV(ds, 3), start, n_tokens, NULL));
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
    gy_py_devs ds = {.n = 0};
    int64_t n_dst = 0, n_src = 0;
    if (gy_py_devs_add_layer(&ds, dst, &dl, 1, "dst") < 0 ||
        gy_py_devs_add_int32(&ds, dst_blocks, &n_dst, "dst_blocks") < 0 ||
        gy_py_devs_add_layer(&ds, src, &sl, 0, "src") < 0 ||
        gy_py_devs_add_int32(&ds, src_blocks, &n_src, "src_blocks") < 0)
        return gy_py_devs_fail(&ds);
    if (n_dst != n_src) {
        PyErr_Format(GY_PY_VALUE_ERROR, "dst_blocks has %lld entries, src_blocks %lld",
                     (long long)n_dst, (long long)n_src);
        return gy_py_devs_fail(&ds);
    }
    GY_PY_DEVS_RUN(ds, gy_cuda_kv_copy_heads(GY_PY_DEV(ds, 0), &dl, GY_PY_DEV(ds, 1), dst_head0,
                                             GY_PY_DEV(ds, 2), &sl, GY_PY_DEV(ds, 3), src_head0,
                                             n_heads, n_src, NULL));
}

/* kv_write(storage, layout, kv_dtype, k, v, act_dtype, token_seq, token_pos, n_tokens, bt_indptr,
 *          bt_indices, n_seqs[, check=1]) */
static PyObject *gy_py_cuda_kv_write(PyObject *self, PyObject *args) {
    PyObject *storage, *layout_t, *k, *v, *seq, *pos, *indptr, *indices;
    int kv_dtype, act_dtype, check = 1;
    long long n_tokens, n_seqs;
    if (!PyArg_ParseTuple(args, "OOiOOiOOLOOL|p", &storage, &layout_t, &kv_dtype, &k, &v,
                          &act_dtype, &seq, &pos, &n_tokens, &indptr, &indices, &n_seqs, &check))
        return NULL;
    gy_kv_layout L;
    if (gy_py_layout(layout_t, &L) < 0) return NULL;
    gy_status s = gy_cuda_kv_write_check(&L, (gy_dtype)kv_dtype, (gy_dtype)act_dtype, n_tokens,
                                         n_seqs);
    if (s != GY_OK) return gy_py_raise(s);
    const int64_t as = gy_dtype_size((gy_dtype)act_dtype);
    gy_py_devs ds = {.n = 0};
    int64_t max_len;
    if (gy_py_devs_add_layer(&ds, storage, &L, 1, "storage") < 0 ||
        gy_py_devs_add(&ds, k, 0, "k", n_tokens, L.n_heads, L.head_dim, as) < 0 ||
        gy_py_devs_add(&ds, v, 0, "v", n_tokens, L.n_heads, L.head_dim, as) < 0 ||
        gy_py_devs_add_batch(&ds, seq, pos, indptr, indices, n_tokens, n_seqs, &L, check,
                             "cuda_kv_write", &max_len) < 0)
        return gy_py_devs_fail(&ds);
    GY_PY_DEVS_RUN(ds, gy_cuda_kv_write(GY_PY_DEV(ds, 0), &L, (gy_dtype)kv_dtype,
                                        GY_PY_DEV(ds, 1), GY_PY_DEV(ds, 2), (gy_dtype)act_dtype,
                                        GY_PY_DEV(ds, 3), GY_PY_DEV(ds, 4), n_tokens,
                                        GY_PY_DEV(ds, 5), GY_PY_DEV(ds, 6), n_seqs, NULL));
}

/* ---- paged attention ---- */

typedef gy_status (*gy_py_attention_fn)(void *, const void *, gy_dtype, const void *,
                                        const gy_kv_layout *, gy_dtype, const int32_t *,
                                        const int32_t *, int64_t, const int32_t *,
                                        const int32_t *, int64_t, int64_t, int64_t, float, void *,
                                        int64_t, gy_cuda_stream);

/* (out, q, act_dtype, layer, layout, kv_dtype, token_seq, token_pos, n_tokens, bt_indptr,
 *  bt_indices, n_seqs, n_q_heads, max_len, scale[, check=1]); max_len <= 0 takes the batch's own
 *  (with check). The workspace is allocated on the device for the call. */
static PyObject *gy_py_cuda_attention(PyObject *args, gy_py_attention_fn fn, const char *what) {
    PyObject *out, *q, *layer, *layout_t, *seq, *pos, *indptr, *indices;
    int act_dtype, kv_dtype, check = 1;
    long long n_tokens, n_seqs, n_q_heads, max_len;
    float scale;
    if (!PyArg_ParseTuple(args, "OOiOOiOOLOOLLLf|p", &out, &q, &act_dtype, &layer, &layout_t,
                          &kv_dtype, &seq, &pos, &n_tokens, &indptr, &indices, &n_seqs,
                          &n_q_heads, &max_len, &scale, &check))
        return NULL;
    gy_kv_layout L;
    if (gy_py_layout(layout_t, &L) < 0) return NULL;
    /* with check and no max_len, the batch's own is known once its tables are read: 1 for now */
    const long long check_len = max_len <= 0 && check ? 1 : max_len;
    gy_status s = gy_cuda_paged_attention_check((gy_dtype)act_dtype, &L, (gy_dtype)kv_dtype,
                                                n_tokens, n_seqs, n_q_heads, check_len, scale);
    if (s != GY_OK) return gy_py_raise(s);
    const int64_t as = gy_dtype_size((gy_dtype)act_dtype);
    gy_py_devs ds = {.n = 0};
    int64_t batch_len;
    if (gy_py_devs_add(&ds, out, 1, "out", n_tokens, n_q_heads, L.head_dim, as) < 0 ||
        gy_py_devs_add(&ds, q, 0, "q", n_tokens, n_q_heads, L.head_dim, as) < 0 ||
        gy_py_devs_add_layer(&ds, layer, &L, 0, "layer") < 0 ||
        gy_py_devs_add_batch(&ds, seq, pos, indptr, indices, n_tokens, n_seqs, &L, check, what,
                             &batch_len) < 0)
        return gy_py_devs_fail(&ds);
    if (max_len <= 0) max_len = batch_len > 0 ? batch_len : 1;
    const int64_t ws_bytes =
        gy_cuda_paged_attention_workspace_bytes(n_tokens, n_q_heads, L.head_dim, max_len);
    if (gy_py_devs_add_scratch(&ds, (uint64_t)ws_bytes) < 0) return gy_py_devs_fail(&ds);
    GY_PY_DEVS_RUN(ds, fn(GY_PY_DEV(ds, 0), GY_PY_DEV(ds, 1), (gy_dtype)act_dtype,
                          GY_PY_DEV(ds, 2), &L, (gy_dtype)kv_dtype, GY_PY_DEV(ds, 3),
                          GY_PY_DEV(ds, 4), n_tokens, GY_PY_DEV(ds, 5), GY_PY_DEV(ds, 6), n_seqs,
                          n_q_heads, max_len, scale, GY_PY_DEV(ds, 7), ws_bytes, NULL));
}

static PyObject *gy_py_cuda_paged_attention_decode(PyObject *self, PyObject *args) {
    return gy_py_cuda_attention(args, gy_cuda_paged_attention_decode, "cuda_paged_attention_decode");
}

static PyObject *gy_py_cuda_paged_attention_prefill(PyObject *self, PyObject *args) {
    return gy_py_cuda_attention(args, gy_cuda_paged_attention_prefill,
                                "cuda_paged_attention_prefill");
}

/* paged_attention_workspace_bytes(n_tokens, n_q_heads, head_dim, max_len) -> int */
static PyObject *gy_py_cuda_paged_attention_workspace_bytes(PyObject *self, PyObject *args) {
    long long n_tokens, n_q_heads, head_dim, max_len;
    if (!PyArg_ParseTuple(args, "LLLL", &n_tokens, &n_q_heads, &head_dim, &max_len)) return NULL;
    return PyLong_FromLongLong(
        gy_cuda_paged_attention_workspace_bytes(n_tokens, n_q_heads, head_dim, max_len));
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
    gy_py_devs ds = {.n = 0};
    if (gy_py_devs_add(&ds, out, 1, "out", rows, dim, 1, as) < 0 ||
        gy_py_devs_add(&ds, x, 0, "x", rows, dim, 1, as) < 0 ||
        gy_py_devs_add(&ds, w, 0, "w", dim, 1, 1, ws) < 0)
        return gy_py_devs_fail(&ds);
    GY_PY_DEVS_RUN(ds, gy_cuda_rmsnorm(GY_PY_DEV(ds, 0), GY_PY_DEV(ds, 1), GY_PY_DEV(ds, 2), rows,
                                       dim, eps, (gy_dtype)act_dtype, (gy_dtype)w_dtype, NULL));
}

/* rope(q, k_or_None, positions, n_tokens, n_q_heads, n_kv_heads, head_dim, inv_freq, mscale,
 * dtype), in place on q and k; inv_freq: head_dim / 2 float32 */
static PyObject *gy_py_cuda_rope(PyObject *self, PyObject *args) {
    PyObject *q, *k, *positions, *inv_freq;
    long long n_tokens, n_q, n_kv, head_dim;
    float mscale;
    int dtype;
    if (!PyArg_ParseTuple(args, "OOOLLLLOfi", &q, &k, &positions, &n_tokens, &n_q, &n_kv,
                          &head_dim, &inv_freq, &mscale, &dtype))
        return NULL;
    const int64_t es = gy_py_dtype_size(dtype);
    if (es <= 0) return NULL;
    if (n_kv < 0) return PyErr_Format(GY_PY_VALUE_ERROR, "sizes must be >= 0");
    gy_py_devs ds = {.n = 0};
    int k_slot = -1;
    if (gy_py_devs_add(&ds, q, 1, "q", n_tokens, n_q, head_dim, es) < 0 ||
        gy_py_devs_add(&ds, positions, 0, "positions", n_tokens, 1, 1, 4) < 0 ||
        gy_py_devs_add(&ds, inv_freq, 0, "inv_freq", head_dim / 2, 1, 1, 4) < 0 ||
        (k != Py_None &&
         (k_slot = gy_py_devs_add(&ds, k, 1, "k", n_tokens, n_kv, head_dim, es)) < 0))
        return gy_py_devs_fail(&ds);
    GY_PY_DEVS_RUN(ds, gy_cuda_rope(GY_PY_DEV(ds, 0), k_slot >= 0 ? GY_PY_DEV(ds, k_slot) : NULL,
                                    GY_PY_DEV(ds, 1), n_tokens, n_q, k_slot >= 0 ? n_kv : 0,
                                    head_dim, GY_PY_DEV(ds, 2), mscale, (gy_dtype)dtype, NULL));
}

/* silu_mul(out, x, rows, dim, dtype) */
static PyObject *gy_py_cuda_silu_mul(PyObject *self, PyObject *args) {
    PyObject *out, *x;
    long long rows, dim;
    int dtype;
    if (!PyArg_ParseTuple(args, "OOLLi", &out, &x, &rows, &dim, &dtype)) return NULL;
    const int64_t es = gy_py_dtype_size(dtype);
    if (es <= 0) return NULL;
    gy_py_devs ds = {.n = 0};
    if (gy_py_devs_add(&ds, out, 1, "out", rows, dim, 1, es) < 0 ||
        gy_py_devs_add(&ds, x, 0, "x", rows, dim, 2, es) < 0)
        return gy_py_devs_fail(&ds);
    GY_PY_DEVS_RUN(ds, gy_cuda_silu_mul(GY_PY_DEV(ds, 0), GY_PY_DEV(ds, 1), rows, dim,
                                        (gy_dtype)dtype, NULL));
}

/* moe_combine(out, ys, weight, slot, shared, gate, n, k, dim, accumulate): fp32 buffers, slot
 * int32; shared and gate may be None */
static PyObject *gy_py_cuda_moe_combine(PyObject *self, PyObject *args) {
    PyObject *out, *ys, *weight, *slot, *shared, *gate;
    long long n, k, dim;
    int accumulate;
    if (!PyArg_ParseTuple(args, "OOOOOOLLLp", &out, &ys, &weight, &slot, &shared, &gate, &n, &k,
                          &dim, &accumulate))
        return NULL;
    gy_py_devs ds = {.n = 0};
    int64_t n_slots = 0;
    int shared_at = -1, gate_at = -1;
    if (gy_py_devs_add(&ds, out, 1, "out", n, dim, 1, 4) < 0 ||
        gy_py_devs_add(&ds, ys, 0, "ys", 0, 0, 0, 0) < 0 ||
        gy_py_devs_add(&ds, weight, 0, "weight", n, k, 1, 4) < 0 ||
        gy_py_devs_add_int32(&ds, slot, &n_slots, "slot") < 0 ||
        (shared != Py_None && (shared_at = gy_py_devs_add(&ds, shared, 0, "shared", n, dim, 1, 4)) < 0) ||
        (gate != Py_None && (gate_at = gy_py_devs_add(&ds, gate, 0, "gate", n, 1, 1, 4)) < 0))
        return gy_py_devs_fail(&ds);
    /* every slot must index a row of ys, as the engine's grouping guarantees */
    const int32_t *slots = ds.d[3].host;
    const int64_t rows = dim > 0 ? (int64_t)(ds.d[1].bytes / 4 / (uint64_t)dim) : 0;
    int bad = n_slots != n * k;
    for (int64_t i = 0; i < n_slots && !bad; i++) bad = slots[i] < 0 || slots[i] >= rows;
    if (bad) {
        PyErr_Format(GY_PY_VALUE_ERROR, "slot must hold n * k indices of ys's %lld rows",
                     (long long)rows);
        return gy_py_devs_fail(&ds);
    }
    GY_PY_DEVS_RUN(ds, gy_cuda_moe_combine(GY_PY_DEV(ds, 0), GY_PY_DEV(ds, 1), GY_PY_DEV(ds, 2),
                                           GY_PY_DEV(ds, 3),
                                           shared_at >= 0 ? GY_PY_DEV(ds, shared_at) : NULL,
                                           gate_at >= 0 ? GY_PY_DEV(ds, gate_at) : NULL, n, k,
                                           dim, accumulate, NULL));
}

/* residual_add(out, a, b, n, dtype) */
static PyObject *gy_py_cuda_residual_add(PyObject *self, PyObject *args) {
    PyObject *out, *a, *b;
    long long n;
    int dtype;
    if (!PyArg_ParseTuple(args, "OOOLi", &out, &a, &b, &n, &dtype)) return NULL;
    const int64_t es = gy_py_dtype_size(dtype);
    if (es <= 0) return NULL;
    gy_py_devs ds = {.n = 0};
    if (gy_py_devs_add(&ds, out, 1, "out", n, 1, 1, es) < 0 ||
        gy_py_devs_add(&ds, a, 0, "a", n, 1, 1, es) < 0 ||
        gy_py_devs_add(&ds, b, 0, "b", n, 1, 1, es) < 0)
        return gy_py_devs_fail(&ds);
    GY_PY_DEVS_RUN(ds, gy_cuda_residual_add(GY_PY_DEV(ds, 0), GY_PY_DEV(ds, 1), GY_PY_DEV(ds, 2),
                                            n, (gy_dtype)dtype, NULL));
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
    gy_py_devs ds = {.n = 0};
    if (gy_py_devs_add(&ds, out, 1, "out", n_tokens, dim, 1, os) < 0 ||
        gy_py_devs_add(&ds, table, 0, "table", vocab, dim, 1, ts) < 0 ||
        gy_py_devs_add(&ds, ids, 0, "ids", n_tokens, 1, 1, 4) < 0)
        return gy_py_devs_fail(&ds);
    GY_PY_DEVS_RUN(ds, gy_cuda_embedding(GY_PY_DEV(ds, 0), GY_PY_DEV(ds, 1), GY_PY_DEV(ds, 2),
                                         n_tokens, vocab, dim, (gy_dtype)out_dtype,
                                         (gy_dtype)table_dtype, NULL));
}

/* argmax(out_int32, logits, rows, vocab, dtype) */
static PyObject *gy_py_cuda_argmax(PyObject *self, PyObject *args) {
    PyObject *out, *logits;
    long long rows, vocab;
    int dtype;
    if (!PyArg_ParseTuple(args, "OOLLi", &out, &logits, &rows, &vocab, &dtype)) return NULL;
    const int64_t es = gy_py_dtype_size(dtype);
    if (es <= 0) return NULL;
    gy_py_devs ds = {.n = 0};
    if (gy_py_devs_add(&ds, out, 1, "out", rows, 1, 1, 4) < 0 ||
        gy_py_devs_add(&ds, logits, 0, "logits", rows, vocab, 1, es) < 0)
        return gy_py_devs_fail(&ds);
    GY_PY_DEVS_RUN(ds, gy_cuda_argmax(GY_PY_DEV(ds, 0), GY_PY_DEV(ds, 1), rows, vocab,
                                      (gy_dtype)dtype, NULL));
}

/* sample(tokens_int32, logits, dtype, rows, vocab, params): params is a sequence of rows tuples
 * (temperature, top_k, top_p, seed, token_index[, min_p]) as for _C.sample, each checked on the
 * host (gy_sampler_check, the error names the row) before anything reaches the device. */
static PyObject *gy_py_cuda_sample(PyObject *self, PyObject *args) {
    PyObject *out, *logits, *params_o;
    int dtype;
    long long rows, vocab;
    if (!PyArg_ParseTuple(args, "OOiLLO", &out, &logits, &dtype, &rows, &vocab, &params_o))
        return NULL;
    gy_status s = gy_cuda_sample_check((gy_dtype)dtype, rows, vocab);
    if (s != GY_OK) return gy_py_raise(s);
    gy_sampler_params *params;
    int64_t *index;
    if (gy_py_sampler_rows(params_o, rows, vocab, &params, &index) < 0) return NULL;
    PyObject *result = NULL;
    gy_py_devs ds = {.n = 0};
    if (gy_py_devs_add(&ds, out, 1, "tokens", rows, 1, 1, 4) < 0 ||
        gy_py_devs_add(&ds, logits, 0, "logits", rows, vocab, 1,
                       gy_dtype_size((gy_dtype)dtype)) < 0 ||
        gy_py_devs_add_host(&ds, params, (uint64_t)rows * sizeof *params) < 0 ||
        gy_py_devs_add_host(&ds, index, (uint64_t)rows * sizeof *index) < 0 ||
        gy_py_devs_add_scratch(&ds, (uint64_t)gy_cuda_sample_workspace_bytes(rows, vocab)) < 0)
        goto done;
    {
        const int64_t ws_bytes = gy_cuda_sample_workspace_bytes(rows, vocab);
        gy_status st;
        Py_BEGIN_ALLOW_THREADS
        st = gy_py_devs_upload(&ds);
        if (st == GY_OK)
            st = gy_cuda_sample(GY_PY_DEV(ds, 0), GY_PY_DEV(ds, 1), (gy_dtype)dtype, rows, vocab,
                                GY_PY_DEV(ds, 2), GY_PY_DEV(ds, 3), GY_PY_DEV(ds, 4), ws_bytes,
                                NULL);
        st = gy_py_devs_finish(&ds, st);
        Py_END_ALLOW_THREADS
        if (st != GY_OK) {
            gy_py_raise(st);
            goto done;
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    gy_py_devs_release(&ds);
    PyMem_Free(params);
    PyMem_Free(index);
    return result;
}

/* ---- timing, for benchmarks/bench_cuda_kernels.py ---- */

/* Seconds per call of `launch` into *seconds and the outcome into `status`: `repeat` calls
 * between two events, after one untimed call; the events are destroyed on every path. For use
 * with the GIL released. */
#define GY_PY_TIME(status, seconds, repeat, launch)                                                \
    do {                                                                                           \
        gy_cuda_event ev_a_ = NULL, ev_b_ = NULL;                                                  \
        gy_status st_ = gy_cuda_event_create(&ev_a_);                                              \
        if (st_ == GY_OK) st_ = gy_cuda_event_create(&ev_b_);                                      \
        if (st_ == GY_OK) st_ = (launch);                                                          \
        if (st_ == GY_OK) st_ = gy_cuda_event_record(ev_a_, NULL);                                 \
        for (long long i_ = 0; i_ < (repeat) && st_ == GY_OK; i_++) st_ = (launch);                \
        if (st_ == GY_OK) st_ = gy_cuda_event_record(ev_b_, NULL);                                 \
        float ms_ = 0.0f;                                                                          \
        if (st_ == GY_OK) st_ = gy_cuda_event_elapsed_ms(&ms_, ev_a_, ev_b_);                      \
        if (st_ == GY_OK) st_ = gy_cuda_stream_synchronize(NULL);                                  \
        gy_cuda_event_destroy(ev_a_);                                                              \
        gy_cuda_event_destroy(ev_b_);                                                              \
        *(seconds) = (double)ms_ * 1e-3 / (double)(repeat);                                        \
        (status) = st_;                                                                            \
    } while (0)

/* bench_memcpy(bytes, repeat) -> seconds per device-to-device copy of `bytes` */
static PyObject *gy_py_cuda_bench_memcpy(PyObject *self, PyObject *args) {
    long long bytes, repeat;
    if (!PyArg_ParseTuple(args, "LL", &bytes, &repeat)) return NULL;
    if (bytes <= 0 || repeat <= 0)
        return PyErr_Format(GY_PY_VALUE_ERROR, "bytes and repeat must be positive");
    double seconds = 0.0;
    gy_status st = GY_OK;
    Py_BEGIN_ALLOW_THREADS
    void *a = NULL, *b = NULL;
    st = gy_cuda_malloc(&a, (uint64_t)bytes);
    if (st == GY_OK) st = gy_cuda_malloc(&b, (uint64_t)bytes);
    if (st == GY_OK) st = gy_cuda_memset(a, 0x3c, (uint64_t)bytes);
    if (st == GY_OK)
        GY_PY_TIME(st, &seconds, repeat, gy_cuda_memcpy_dtod(b, a, (uint64_t)bytes, NULL));
    gy_cuda_free(a);
    gy_cuda_free(b);
    Py_END_ALLOW_THREADS
    if (st != GY_OK) return gy_py_raise(st);
    return PyFloat_FromDouble(seconds);
}

/* bench_paged_attention(prefill, layout, kv_dtype, act_dtype, n_seqs, context, n_q_heads, repeat)
 * -> seconds per call. Decode: one query token per sequence at position context - 1; prefill:
 * every position of every sequence is a query. Each sequence owns ceil(context / block_size)
 * blocks, spread over the layer in a fixed shuffled order; KV and q hold a constant byte pattern
 * (timing does not depend on the values). Everything lives on the device. */
static PyObject *gy_py_cuda_bench_paged_attention(PyObject *self, PyObject *args) {
    PyObject *layout_t;
    int prefill, kv_dtype, act_dtype;
    long long n_seqs, context, n_q_heads, repeat;
    if (!PyArg_ParseTuple(args, "pOiiLLLL", &prefill, &layout_t, &kv_dtype, &act_dtype, &n_seqs,
                          &context, &n_q_heads, &repeat))
        return NULL;
    gy_kv_layout L;
    if (gy_py_layout(layout_t, &L) < 0) return NULL;
    if (n_seqs <= 0 || context <= 0 || repeat <= 0)
        return PyErr_Format(GY_PY_VALUE_ERROR, "n_seqs, context and repeat must be positive");
    const long long per_seq = (context + L.block_size - 1) / L.block_size;
    if (per_seq * n_seqs > L.n_blocks || per_seq * n_seqs > INT32_MAX)
        return PyErr_Format(GY_PY_VALUE_ERROR, "%lld sequences of %lld blocks do not fit %lld blocks",
                            n_seqs, per_seq, (long long)L.n_blocks);
    const long long n_tokens = prefill ? n_seqs * context : n_seqs;
    gy_status s = gy_cuda_paged_attention_check((gy_dtype)act_dtype, &L, (gy_dtype)kv_dtype,
                                                n_tokens, n_seqs, n_q_heads, context, 1.0f);
    if (s != GY_OK) return gy_py_raise(s);
    /* host tables: a fixed shuffle of the blocks (an LCG, so the layout is the same every run) */
    int32_t *indices = PyMem_Malloc((size_t)(n_seqs * per_seq) * sizeof(int32_t));
    int32_t *indptr = PyMem_Malloc((size_t)(n_seqs + 1) * sizeof(int32_t));
    int32_t *tseq = PyMem_Malloc((size_t)n_tokens * sizeof(int32_t));
    int32_t *tpos = PyMem_Malloc((size_t)n_tokens * sizeof(int32_t));
    if (indices == NULL || indptr == NULL || tseq == NULL || tpos == NULL) {
        PyMem_Free(indices);
        PyMem_Free(indptr);
        PyMem_Free(tseq);
        PyMem_Free(tpos);
        return PyErr_NoMemory();
    }
    const long long n_used = n_seqs * per_seq;
    for (long long i = 0; i < n_used; i++) indices[i] = (int32_t)i;
    uint64_t lcg = 12345;
    for (long long i = n_used - 1; i > 0; i--) {
        lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
        const long long j = (long long)((lcg >> 33) % (uint64_t)(i + 1));
        const int32_t t = indices[i];
        indices[i] = indices[j];
        indices[j] = t;
    }
    for (long long q = 0; q <= n_seqs; q++) indptr[q] = (int32_t)(q * per_seq);
    for (long long t = 0; t < n_tokens; t++) {
        tseq[t] = (int32_t)(prefill ? t / context : t);
        tpos[t] = (int32_t)(prefill ? t % context : context - 1);
    }
    const int64_t as = gy_dtype_size((gy_dtype)act_dtype);
    const uint64_t q_bytes = (uint64_t)(n_tokens * n_q_heads * L.head_dim * as);
    const int64_t ws_bytes =
        gy_cuda_paged_attention_workspace_bytes(n_tokens, n_q_heads, L.head_dim, context);
    gy_py_devs ds = {.n = 0};
    gy_py_devs_add_scratch(&ds, (uint64_t)(gy_kv_layout_layer_elems(&L) * L.elem_size));
    gy_py_devs_add_scratch(&ds, q_bytes);
    gy_py_devs_add_scratch(&ds, q_bytes);
    gy_py_devs_add_host(&ds, tseq, (uint64_t)n_tokens * 4);
    gy_py_devs_add_host(&ds, tpos, (uint64_t)n_tokens * 4);
    gy_py_devs_add_host(&ds, indptr, (uint64_t)(n_seqs + 1) * 4);
    gy_py_devs_add_host(&ds, indices, (uint64_t)n_used * 4);
    gy_py_devs_add_scratch(&ds, (uint64_t)ws_bytes);
    gy_py_attention_fn fn =
        prefill ? gy_cuda_paged_attention_prefill : gy_cuda_paged_attention_decode;
    double seconds = 0.0;
    gy_status st = GY_OK;
    Py_BEGIN_ALLOW_THREADS
    st = gy_py_devs_upload(&ds);
    if (st == GY_OK)
        st = gy_cuda_memset(GY_PY_DEV(ds, 0), 0x3c, ds.d[0].bytes);
    if (st == GY_OK) st = gy_cuda_memset(GY_PY_DEV(ds, 1), 0x3c, q_bytes);
    if (st == GY_OK)
        GY_PY_TIME(st, &seconds, repeat,
                   fn(GY_PY_DEV(ds, 2), GY_PY_DEV(ds, 1), (gy_dtype)act_dtype, GY_PY_DEV(ds, 0),
                      &L, (gy_dtype)kv_dtype, GY_PY_DEV(ds, 3), GY_PY_DEV(ds, 4), n_tokens,
                      GY_PY_DEV(ds, 5), GY_PY_DEV(ds, 6), n_seqs, n_q_heads, context,
                      1.0f / sqrtf((float)L.head_dim), GY_PY_DEV(ds, 7), ws_bytes, NULL));
    st = gy_py_devs_finish(&ds, st);
    Py_END_ALLOW_THREADS
    gy_py_devs_release(&ds);
    PyMem_Free(indices);
    PyMem_Free(indptr);
    PyMem_Free(tseq);
    PyMem_Free(tpos);
    if (st != GY_OK) return gy_py_raise(st);
    return PyFloat_FromDouble(seconds);
}

#define GY_PY_CUDA_FN(name, flags) (PyCFunction)gy_py_cuda_##name, flags

#else /* !GY_WITH_CUDA */

static PyObject *gy_py_cuda_unavailable(PyObject *self, PyObject *args) {
    return gy_py_raise(GY_FAIL(GY_ERR_UNAVAILABLE,
                               "CUDA is not available: gyges was not built with CUDA (nvcc was "
                               "not found at build time, or GYGES_CUDA=0)"));
}

#define GY_PY_CUDA_FN(name, flags) (PyCFunction)gy_py_cuda_unavailable, METH_VARARGS

#endif /* GY_WITH_CUDA */

static PyMethodDef gy_py_cuda_methods[] = {
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
     "cuda_rope(q, k_or_None, positions, n_tokens, n_q_heads, n_kv_heads, head_dim, inv_freq, "
     "mscale, dtype): in place"},
    {"cuda_silu_mul", GY_PY_CUDA_FN(silu_mul, METH_VARARGS),
     "cuda_silu_mul(out, x, rows, dim, dtype): out = silu(x[:, :dim]) * x[:, dim:]"},
    {"cuda_moe_combine", GY_PY_CUDA_FN(moe_combine, METH_VARARGS),
     "cuda_moe_combine(out, ys, weight, slot, shared, gate, n, k, dim, accumulate)"},
    {"cuda_residual_add", GY_PY_CUDA_FN(residual_add, METH_VARARGS),
     "cuda_residual_add(out, a, b, n, dtype)"},
    {"cuda_embedding", GY_PY_CUDA_FN(embedding, METH_VARARGS),
     "cuda_embedding(out, table, ids, n_tokens, vocab, dim, out_dtype, table_dtype)"},
    {"cuda_argmax", GY_PY_CUDA_FN(argmax, METH_VARARGS),
     "cuda_argmax(out_int32, logits, rows, vocab, dtype)"},
    {"cuda_kv_write", GY_PY_CUDA_FN(kv_write, METH_VARARGS),
     "cuda_kv_write(storage, layout, kv_dtype, k, v, act_dtype, token_seq, token_pos, n_tokens, "
     "bt_indptr, bt_indices, n_seqs, check=True)"},
    {"cuda_paged_attention_decode", GY_PY_CUDA_FN(paged_attention_decode, METH_VARARGS),
     "cuda_paged_attention_decode(out, q, act_dtype, layer, layout, kv_dtype, token_seq, "
     "token_pos, n_tokens, bt_indptr, bt_indices, n_seqs, n_q_heads, max_len, scale, "
     "check=True); max_len <= 0: the batch's own"},
    {"cuda_paged_attention_prefill", GY_PY_CUDA_FN(paged_attention_prefill, METH_VARARGS),
     "cuda_paged_attention_prefill(...): the arguments of cuda_paged_attention_decode"},
    {"cuda_paged_attention_workspace_bytes",
     GY_PY_CUDA_FN(paged_attention_workspace_bytes, METH_VARARGS),
     "cuda_paged_attention_workspace_bytes(n_tokens, n_q_heads, head_dim, max_len) -> int"},
    {"cuda_sample", GY_PY_CUDA_FN(sample, METH_VARARGS),
     "cuda_sample(tokens_int32, logits, dtype, rows, vocab, [(temperature, top_k, top_p, seed, "
     "token_index[, min_p])] * rows); a row the CPU sampler would refuse gets -1"},
    {"cuda_bench_memcpy", GY_PY_CUDA_FN(bench_memcpy, METH_VARARGS),
     "cuda_bench_memcpy(bytes, repeat) -> seconds per device-to-device copy"},
    {"cuda_bench_paged_attention", GY_PY_CUDA_FN(bench_paged_attention, METH_VARARGS),
     "cuda_bench_paged_attention(prefill, layout, kv_dtype, act_dtype, n_seqs, context, "
     "n_q_heads, repeat) -> seconds per call"},
    {NULL, NULL, 0, NULL},
};

int gy_py_cuda_add(PyObject *module) { return PyModule_AddFunctions(module, gy_py_cuda_methods); }
