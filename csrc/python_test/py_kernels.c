/* py_kernels.c: entry points to the CPU kernels (csrc/cpu) on NumPy buffers, for the kernel tests
 * (against float64 NumPy) and the kernel benchmarks; the engine calls the kernels from C. Each
 * takes C-contiguous buffers plus sizes, checks every buffer's byte count against the sizes
 * (ValueError), lets the C kernel validate the rest (gyges errors), and releases the GIL around
 * the C work. `threads` picks a module-level thread pool of that many threads (1 = the
 * calling thread), created on first use and kept for the life of the process. */
#include "py_test.h"

#include "cpu/activation.h"
#include "cpu/argmax.h"
#include "cpu/attention.h"
#include "core/dtype.h"
#include "cpu/embedding.h"
#include "cpu/isa.h"
#include "cpu/kv_write.h"
#include "cpu/linear.h"
#include "cpu/norm.h"
#include "cpu/peak.h"
#include "cpu/rope.h"
#include "cpu/stream.h"
#include "cpu/threadpool.h"
#include "cpu/vexp.h"

#define GY_PY_MAX_THREADS 64
#define GY_PY_MAX_BUFFERS 12

/* Pools by thread count; only touched with the GIL held. */
static gy_threadpool *gy_py_pools[GY_PY_MAX_THREADS + 1];

static int gy_py_pool(int threads, gy_threadpool **out) {
    *out = NULL;
    if (threads < 1 || threads > GY_PY_MAX_THREADS) {
        PyErr_Format(GY_PY_VALUE_ERROR, "threads=%d must be in [1, %d]", threads, GY_PY_MAX_THREADS);
        return -1;
    }
    if (threads == 1) return 0;
    if (gy_py_pools[threads] == NULL) {
        gy_status s = gy_threadpool_init(&gy_py_pools[threads], threads);
        if (s != GY_OK) {
            gy_py_raise(s);
            return -1;
        }
    }
    *out = gy_py_pools[threads];
    return 0;
}

/* The borrowed buffers of one call, released together on every path. */
typedef struct {
    Py_buffer views[GY_PY_MAX_BUFFERS];
    int count;
} gy_py_buffers;

static void *gy_py_borrow(gy_py_buffers *b, PyObject *object, Py_ssize_t bytes, int writable,
                          const char *what) {
    if (b->count >= GY_PY_MAX_BUFFERS) {
        PyErr_SetString(gy_py_error_class(GY_ERR_LIMIT), "too many buffers in one kernel call");
        return NULL;
    }
    if (gy_py_get_buffer(object, &b->views[b->count], bytes, writable, what) < 0) return NULL;
    return b->views[b->count++].buf;
}

static void gy_py_release(gy_py_buffers *b) {
    for (int i = 0; i < b->count; i++) PyBuffer_Release(&b->views[i]);
    b->count = 0;
}

/* bytes = d0 * d1 * d2 * elem, refusing negative sizes and overflow with ValueError. */
static int gy_py_nbytes(Py_ssize_t *bytes, const char *what, long long d0, long long d1,
                        long long d2, long long elem) {
    if (d0 < 0 || d1 < 0 || d2 < 0 || elem <= 0) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s: sizes must not be negative (%lld, %lld, %lld)", what, d0,
                     d1, d2);
        return -1;
    }
    long long r;
    if (__builtin_mul_overflow(d0, d1, &r) || __builtin_mul_overflow(r, d2, &r) ||
        __builtin_mul_overflow(r, elem, &r) || r > PY_SSIZE_T_MAX) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s: size overflows", what);
        return -1;
    }
    *bytes = (Py_ssize_t)r;
    return 0;
}

static int gy_py_dtype(int dtype, const char *what) {
    gy_status s = gy_dtype_check((gy_dtype)dtype, what);
    if (s != GY_OK) {
        gy_py_raise(s);
        return -1;
    }
    return 0;
}

/* Runs `call` without the GIL, then releases the buffers and returns None or raises. */
#define GY_PY_RUN(bufs, call)                                                                      \
    do {                                                                                           \
        gy_status s_;                                                                              \
        Py_BEGIN_ALLOW_THREADS s_ = (call);                                                        \
        Py_END_ALLOW_THREADS gy_py_release(&(bufs));                                               \
        if (s_ != GY_OK) return gy_py_raise(s_);                                                   \
        Py_RETURN_NONE;                                                                            \
    } while (0)

#define GY_PY_FAIL(bufs)                                                                           \
    do {                                                                                           \
        gy_py_release(&(bufs));                                                                    \
        return NULL;                                                                               \
    } while (0)

/* ---- linear --------------------------------------------------------------------------------- */

static PyObject *gy_py_linear_common(PyObject *args, int transposed) {
    PyObject *yo, *xo, *wo, *bo;
    int dtype, k_splits, threads;
    long long n, in, out;
    if (!PyArg_ParseTuple(args, "OOOiOLLLii", &yo, &xo, &wo, &dtype, &bo, &n, &in, &out, &k_splits,
                          &threads))
        return NULL;
    const char *name = transposed ? "kernel_linear_t" : "kernel_linear";
    gy_threadpool *pool;
    Py_ssize_t ybytes, xbytes, wbytes, bbytes;
    if (gy_py_dtype(dtype, name) < 0 || gy_py_pool(threads, &pool) < 0 ||
        gy_py_nbytes(&ybytes, name, n, out, 1, 4) < 0 || gy_py_nbytes(&xbytes, name, n, in, 1, 4) < 0 ||
        gy_py_nbytes(&wbytes, name, in, out, 1, gy_dtype_size((gy_dtype)dtype)) < 0 ||
        gy_py_nbytes(&bbytes, name, out, 1, 1, 4) < 0)
        return NULL;
    gy_py_buffers b = {.count = 0};
    float *y = gy_py_borrow(&b, yo, ybytes, 1, "y");
    if (y == NULL) GY_PY_FAIL(b);
    const float *x = gy_py_borrow(&b, xo, xbytes, 0, "x");
    if (x == NULL) GY_PY_FAIL(b);
    const void *w = gy_py_borrow(&b, wo, wbytes, 0, "w");
    if (w == NULL) GY_PY_FAIL(b);
    const float *bias = NULL;
    if (bo != Py_None && (bias = gy_py_borrow(&b, bo, bbytes, 0, "bias")) == NULL) GY_PY_FAIL(b);
    if (transposed)
        GY_PY_RUN(b, gy_cpu_linear_t(y, x, w, (gy_dtype)dtype, bias, n, in, out, k_splits, pool));
    GY_PY_RUN(b, gy_cpu_linear(y, x, w, (gy_dtype)dtype, bias, n, in, out, k_splits, pool));
}

static PyObject *gy_py_kernel_linear(PyObject *self, PyObject *args) {
    return gy_py_linear_common(args, 0);
}

static PyObject *gy_py_kernel_linear_t(PyObject *self, PyObject *args) {
    return gy_py_linear_common(args, 1);
}

static PyObject *gy_py_kernel_add_tree(PyObject *self, PyObject *args) {
    PyObject *oo, *po;
    long long n;
    if (!PyArg_ParseTuple(args, "OOL", &oo, &po, &n)) return NULL;
    Py_ssize_t bytes;
    if (gy_py_nbytes(&bytes, "kernel_add_tree", n, 1, 1, 4) < 0) return NULL;
    PyObject *seq = gy_py_sequence(po, "parts must be a sequence of buffers");
    if (seq == NULL) return NULL;
    const Py_ssize_t n_parts = PySequence_Fast_GET_SIZE(seq);
    if (n_parts < 1 || n_parts > GY_PY_MAX_BUFFERS - 1) {
        PyErr_Format(GY_PY_VALUE_ERROR, "kernel_add_tree: %zd parts, expected 1 to %d", n_parts,
                     GY_PY_MAX_BUFFERS - 1);
        Py_DECREF(seq);
        return NULL;
    }
    gy_py_buffers b = {.count = 0};
    const float *parts[GY_PY_MAX_BUFFERS];
    float *out = gy_py_borrow(&b, oo, bytes, 1, "out");
    for (Py_ssize_t i = 0; out != NULL && i < n_parts; i++)
        if ((parts[i] = gy_py_borrow(&b, PySequence_Fast_GET_ITEM(seq, i), bytes, 0, "part")) == NULL)
            out = NULL;
    Py_DECREF(seq);
    if (out == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_cpu_add_tree(out, parts, (int32_t)n_parts, n));
}

static PyObject *gy_py_kernel_add_bias(PyObject *self, PyObject *args) {
    PyObject *yo, *bo;
    long long n, out;
    if (!PyArg_ParseTuple(args, "OOLL", &yo, &bo, &n, &out)) return NULL;
    Py_ssize_t ybytes, bbytes;
    if (gy_py_nbytes(&ybytes, "kernel_add_bias", n, out, 1, 4) < 0 ||
        gy_py_nbytes(&bbytes, "kernel_add_bias", out, 1, 1, 4) < 0)
        return NULL;
    gy_py_buffers b = {.count = 0};
    float *y = gy_py_borrow(&b, yo, ybytes, 1, "y");
    const float *bias = y ? gy_py_borrow(&b, bo, bbytes, 0, "bias") : NULL;
    if (bias == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_cpu_add_bias(y, bias, n, out));
}

/* ---- elementwise and small kernels ---------------------------------------------------------- */

static PyObject *gy_py_kernel_rmsnorm(PyObject *self, PyObject *args) {
    PyObject *oo, *xo, *wo;
    long long n, dim;
    float eps;
    if (!PyArg_ParseTuple(args, "OOOLLf", &oo, &xo, &wo, &n, &dim, &eps)) return NULL;
    Py_ssize_t bytes, wbytes;
    if (gy_py_nbytes(&bytes, "kernel_rmsnorm", n, dim, 1, 4) < 0 ||
        gy_py_nbytes(&wbytes, "kernel_rmsnorm", dim, 1, 1, 4) < 0)
        return NULL;
    gy_py_buffers b = {.count = 0};
    float *out = gy_py_borrow(&b, oo, bytes, 1, "out");
    const float *x = out ? gy_py_borrow(&b, xo, bytes, 0, "x") : NULL;
    const float *w = x ? gy_py_borrow(&b, wo, wbytes, 0, "weight") : NULL;
    if (w == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_cpu_rmsnorm(out, x, w, n, dim, eps));
}

static PyObject *gy_py_kernel_rope_table(PyObject *self, PyObject *args) {
    PyObject *co, *so, *fo;
    long long max_pos, head_dim;
    double mscale;
    if (!PyArg_ParseTuple(args, "OOLLOd", &co, &so, &max_pos, &head_dim, &fo, &mscale))
        return NULL;
    Py_ssize_t bytes, fbytes;
    if (gy_py_nbytes(&bytes, "kernel_rope_table", max_pos, head_dim / 2, 1, 4) < 0 ||
        gy_py_nbytes(&fbytes, "kernel_rope_table", head_dim / 2, 1, 1, 8) < 0)
        return NULL;
    gy_py_buffers b = {.count = 0};
    float *c = gy_py_borrow(&b, co, bytes, 1, "cos");
    float *s = c ? gy_py_borrow(&b, so, bytes, 1, "sin") : NULL;
    const double *f = s ? gy_py_borrow(&b, fo, fbytes, 0, "inv_freq") : NULL;
    if (f == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_cpu_rope_table(c, s, max_pos, head_dim, f, mscale));
}

static PyObject *gy_py_kernel_rope(PyObject *self, PyObject *args) {
    PyObject *xo, *po, *co, *so;
    long long n, n_heads, head_dim, max_pos;
    if (!PyArg_ParseTuple(args, "OOOOLLLL", &xo, &po, &co, &so, &n, &n_heads, &head_dim, &max_pos))
        return NULL;
    Py_ssize_t xbytes, pbytes, tbytes;
    if (gy_py_nbytes(&xbytes, "kernel_rope", n, n_heads, head_dim, 4) < 0 ||
        gy_py_nbytes(&pbytes, "kernel_rope", n, 1, 1, 4) < 0 ||
        gy_py_nbytes(&tbytes, "kernel_rope", max_pos, head_dim / 2, 1, 4) < 0)
        return NULL;
    gy_py_buffers b = {.count = 0};
    float *x = gy_py_borrow(&b, xo, xbytes, 1, "x");
    const int32_t *pos = x ? gy_py_borrow(&b, po, pbytes, 0, "positions") : NULL;
    const float *c = pos ? gy_py_borrow(&b, co, tbytes, 0, "cos") : NULL;
    const float *s = c ? gy_py_borrow(&b, so, tbytes, 0, "sin") : NULL;
    if (s == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_cpu_rope(x, pos, c, s, n, n_heads, head_dim, max_pos));
}

/* out = f(a, b) elementwise over count floats. */
static PyObject *gy_py_binary(PyObject *args, const char *name,
                              gy_status (*fn)(float *, const float *, const float *, int64_t)) {
    PyObject *oo, *ao, *bo;
    long long count;
    if (!PyArg_ParseTuple(args, "OOOL", &oo, &ao, &bo, &count)) return NULL;
    Py_ssize_t bytes;
    if (gy_py_nbytes(&bytes, name, count, 1, 1, 4) < 0) return NULL;
    gy_py_buffers b = {.count = 0};
    float *out = gy_py_borrow(&b, oo, bytes, 1, "out");
    const float *a = out ? gy_py_borrow(&b, ao, bytes, 0, "a") : NULL;
    const float *c = a ? gy_py_borrow(&b, bo, bytes, 0, "b") : NULL;
    if (c == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, fn(out, a, c, count));
}

static PyObject *gy_py_kernel_swiglu(PyObject *self, PyObject *args) {
    return gy_py_binary(args, "kernel_swiglu", gy_cpu_swiglu);
}

static PyObject *gy_py_kernel_add(PyObject *self, PyObject *args) {
    return gy_py_binary(args, "kernel_add", gy_cpu_add);
}

static PyObject *gy_py_kernel_exp(PyObject *self, PyObject *args) {
    PyObject *oo, *xo;
    long long count;
    if (!PyArg_ParseTuple(args, "OOL", &oo, &xo, &count)) return NULL;
    Py_ssize_t bytes;
    if (gy_py_nbytes(&bytes, "kernel_exp", count, 1, 1, 4) < 0) return NULL;
    gy_py_buffers b = {.count = 0};
    float *out = gy_py_borrow(&b, oo, bytes, 1, "out");
    const float *x = out ? gy_py_borrow(&b, xo, bytes, 0, "x") : NULL;
    if (x == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_cpu_exp(out, x, count));
}

static PyObject *gy_py_kernel_embedding(PyObject *self, PyObject *args) {
    PyObject *oo, *to, *ko;
    int dtype;
    long long n, vocab, dim;
    if (!PyArg_ParseTuple(args, "OOiOLLL", &oo, &to, &dtype, &ko, &n, &vocab, &dim)) return NULL;
    Py_ssize_t obytes, tbytes, kbytes;
    if (gy_py_dtype(dtype, "kernel_embedding") < 0 ||
        gy_py_nbytes(&obytes, "kernel_embedding", n, dim, 1, 4) < 0 ||
        gy_py_nbytes(&tbytes, "kernel_embedding", vocab, dim, 1, gy_dtype_size((gy_dtype)dtype)) < 0 ||
        gy_py_nbytes(&kbytes, "kernel_embedding", n, 1, 1, 4) < 0)
        return NULL;
    gy_py_buffers b = {.count = 0};
    float *out = gy_py_borrow(&b, oo, obytes, 1, "out");
    const void *table = out ? gy_py_borrow(&b, to, tbytes, 0, "table") : NULL;
    const int32_t *tokens = table ? gy_py_borrow(&b, ko, kbytes, 0, "tokens") : NULL;
    if (tokens == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_cpu_embedding(out, table, (gy_dtype)dtype, tokens, n, vocab, dim));
}

static PyObject *gy_py_kernel_argmax(PyObject *self, PyObject *args) {
    PyObject *oo, *lo;
    long long n, vocab;
    if (!PyArg_ParseTuple(args, "OOLL", &oo, &lo, &n, &vocab)) return NULL;
    Py_ssize_t obytes, lbytes;
    if (gy_py_nbytes(&obytes, "kernel_argmax", n, 1, 1, 4) < 0 ||
        gy_py_nbytes(&lbytes, "kernel_argmax", n, vocab, 1, 4) < 0)
        return NULL;
    gy_py_buffers b = {.count = 0};
    int32_t *out = gy_py_borrow(&b, oo, obytes, 1, "out");
    const float *logits = out ? gy_py_borrow(&b, lo, lbytes, 0, "logits") : NULL;
    if (logits == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_cpu_argmax(out, logits, n, vocab));
}

/* to_f32(out, x, dtype, count) and from_f32(out, dtype, x, count). */
static PyObject *gy_py_kernel_to_f32(PyObject *self, PyObject *args) {
    PyObject *oo, *xo;
    int dtype;
    long long count;
    if (!PyArg_ParseTuple(args, "OOiL", &oo, &xo, &dtype, &count)) return NULL;
    Py_ssize_t obytes, xbytes;
    if (gy_py_dtype(dtype, "kernel_to_f32") < 0 ||
        gy_py_nbytes(&obytes, "kernel_to_f32", count, 1, 1, 4) < 0 ||
        gy_py_nbytes(&xbytes, "kernel_to_f32", count, 1, 1, gy_dtype_size((gy_dtype)dtype)) < 0)
        return NULL;
    gy_py_buffers b = {.count = 0};
    float *out = gy_py_borrow(&b, oo, obytes, 1, "out");
    const void *x = out ? gy_py_borrow(&b, xo, xbytes, 0, "x") : NULL;
    if (x == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_dtype_to_f32(out, x, (gy_dtype)dtype, count));
}

static PyObject *gy_py_kernel_from_f32(PyObject *self, PyObject *args) {
    PyObject *oo, *xo;
    int dtype;
    long long count;
    if (!PyArg_ParseTuple(args, "OiOL", &oo, &dtype, &xo, &count)) return NULL;
    Py_ssize_t obytes, xbytes;
    if (gy_py_dtype(dtype, "kernel_from_f32") < 0 ||
        gy_py_nbytes(&obytes, "kernel_from_f32", count, 1, 1, gy_dtype_size((gy_dtype)dtype)) < 0 ||
        gy_py_nbytes(&xbytes, "kernel_from_f32", count, 1, 1, 4) < 0)
        return NULL;
    gy_py_buffers b = {.count = 0};
    void *out = gy_py_borrow(&b, oo, obytes, 1, "out");
    const float *x = out ? gy_py_borrow(&b, xo, xbytes, 0, "x") : NULL;
    if (x == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_dtype_from_f32(out, (gy_dtype)dtype, x, count));
}

/* ---- paged KV: kv_write and attention -------------------------------------------------------- */

/* Parses the layout tuple (kind, block_size, n_heads, head_dim, n_blocks) of an fp32 cache and
 * borrows the token and block-table arrays into `batch`. */
static int gy_py_paged(gy_py_buffers *b, PyObject *layout_tuple, gy_kv_layout *layout,
                       gy_cpu_paged_batch *batch, PyObject *seq_o, PyObject *pos_o,
                       PyObject *indptr_o, PyObject *indices_o, long long n_tokens,
                       long long n_seqs) {
    int kind;
    long long block_size, n_heads, head_dim, n_blocks;
    if (!PyArg_ParseTuple(layout_tuple, "iLLLL;layout must be (kind, block_size, n_heads, "
                                        "head_dim, n_blocks)",
                          &kind, &block_size, &n_heads, &head_dim, &n_blocks))
        return -1;
    gy_status s = gy_kv_layout_init(layout, (gy_kv_layout_kind)kind, block_size, n_heads, head_dim,
                                    4, n_blocks);
    if (s != GY_OK) {
        gy_py_raise(s);
        return -1;
    }
    if (n_seqs < 0 || n_tokens < 0) {
        PyErr_Format(GY_PY_VALUE_ERROR, "n_tokens=%lld and n_seqs=%lld must not be negative",
                     n_tokens, n_seqs);
        return -1;
    }
    Py_ssize_t tbytes, ibytes;
    if (gy_py_nbytes(&tbytes, "tokens", n_tokens, 1, 1, 4) < 0 ||
        gy_py_nbytes(&ibytes, "bt_indptr", n_seqs + 1, 1, 1, 4) < 0)
        return -1;
    batch->n_tokens = n_tokens;
    batch->n_seqs = n_seqs;
    if ((batch->token_seq = gy_py_borrow(b, seq_o, tbytes, 0, "token_seq")) == NULL ||
        (batch->token_pos = gy_py_borrow(b, pos_o, tbytes, 0, "token_pos")) == NULL ||
        (batch->bt_indptr = gy_py_borrow(b, indptr_o, ibytes, 0, "bt_indptr")) == NULL)
        return -1;
    const long long n_indices = batch->bt_indptr[n_seqs];
    Py_ssize_t xbytes;
    if (gy_py_nbytes(&xbytes, "bt_indices (length bt_indptr[n_seqs])", n_indices, 1, 1, 4) < 0 ||
        (batch->bt_indices = gy_py_borrow(b, indices_o, xbytes, 0, "bt_indices")) == NULL)
        return -1;
    return 0;
}

static PyObject *gy_py_kernel_kv_write(PyObject *self, PyObject *args) {
    PyObject *kvo, *lo, *ko, *vo, *so, *po, *io, *xo;
    long long n_tokens, n_seqs;
    if (!PyArg_ParseTuple(args, "OOOOOOOOLL", &kvo, &lo, &ko, &vo, &so, &po, &io, &xo, &n_tokens,
                          &n_seqs))
        return NULL;
    gy_py_buffers b = {.count = 0};
    gy_kv_layout layout;
    gy_cpu_paged_batch batch;
    if (gy_py_paged(&b, lo, &layout, &batch, so, po, io, xo, n_tokens, n_seqs) < 0) GY_PY_FAIL(b);
    Py_ssize_t cbytes, kbytes;
    if (gy_py_nbytes(&cbytes, "kv", gy_kv_layout_layer_elems(&layout), 1, 1, 4) < 0 ||
        gy_py_nbytes(&kbytes, "k", n_tokens, layout.n_heads, layout.head_dim, 4) < 0)
        GY_PY_FAIL(b);
    float *kv = gy_py_borrow(&b, kvo, cbytes, 1, "kv");
    const float *k = kv ? gy_py_borrow(&b, ko, kbytes, 0, "k") : NULL;
    const float *v = k ? gy_py_borrow(&b, vo, kbytes, 0, "v") : NULL;
    if (v == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_cpu_kv_write(kv, &layout, k, v, &batch));
}

static PyObject *gy_py_kernel_attention(PyObject *self, PyObject *args) {
    PyObject *oo, *qo, *kvo, *lo, *so, *po, *io, *xo;
    long long n_tokens, n_seqs, n_q_heads;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOOLLLi", &oo, &qo, &kvo, &lo, &so, &po, &io, &xo, &n_tokens,
                          &n_seqs, &n_q_heads, &threads))
        return NULL;
    gy_threadpool *pool;
    if (gy_py_pool(threads, &pool) < 0) return NULL;
    gy_py_buffers b = {.count = 0};
    gy_kv_layout layout;
    gy_cpu_paged_batch batch;
    if (gy_py_paged(&b, lo, &layout, &batch, so, po, io, xo, n_tokens, n_seqs) < 0) GY_PY_FAIL(b);
    Py_ssize_t cbytes, qbytes;
    if (gy_py_nbytes(&cbytes, "kv", gy_kv_layout_layer_elems(&layout), 1, 1, 4) < 0 ||
        gy_py_nbytes(&qbytes, "q", n_tokens, n_q_heads, layout.head_dim, 4) < 0)
        GY_PY_FAIL(b);
    float *out = gy_py_borrow(&b, oo, qbytes, 1, "out");
    const float *q = out ? gy_py_borrow(&b, qo, qbytes, 0, "q") : NULL;
    const float *kv = q ? gy_py_borrow(&b, kvo, cbytes, 0, "kv") : NULL;
    if (kv == NULL) GY_PY_FAIL(b);
    GY_PY_RUN(b, gy_cpu_attention(out, q, kv, &layout, &batch, n_q_heads, pool));
}

static PyObject *gy_py_kernel_stream_read(PyObject *self, PyObject *args) {
    PyObject *xo;
    long long n;
    int threads;
    if (!PyArg_ParseTuple(args, "OLi", &xo, &n, &threads)) return NULL;
    gy_threadpool *pool;
    Py_ssize_t bytes;
    if (gy_py_pool(threads, &pool) < 0 || gy_py_nbytes(&bytes, "kernel_stream_read", n, 1, 1, 4) < 0)
        return NULL;
    gy_py_buffers b = {.count = 0};
    const float *x = gy_py_borrow(&b, xo, bytes, 0, "x");
    if (x == NULL) GY_PY_FAIL(b);
    float sum = 0.0f;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS s = gy_cpu_stream_read(&sum, x, n, pool);
    Py_END_ALLOW_THREADS gy_py_release(&b);
    if (s != GY_OK) return gy_py_raise(s);
    return PyFloat_FromDouble(sum);
}

static PyObject *gy_py_kernel_fma_peak(PyObject *self, PyObject *args) {
    int threads;
    double seconds = 0.05;
    if (!PyArg_ParseTuple(args, "i|d", &threads, &seconds)) return NULL;
    gy_threadpool *pool;
    if (gy_py_pool(threads, &pool) < 0) return NULL;
    double flops = 0;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS s = gy_cpu_fma_peak(&flops, seconds, pool);
    Py_END_ALLOW_THREADS if (s != GY_OK) return gy_py_raise(s);
    return PyFloat_FromDouble(flops);
}

/* ---- kernel path (gyges._C.set_cpu_isa switches it) ----------------------------------------- */

static PyObject *gy_py_kernel_isa(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(gy_cpu_isa_name(gy_cpu_isa_get()));
}

static PyObject *gy_py_kernel_isa_best(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(gy_cpu_isa_name(gy_cpu_isa_best()));
}

static PyMethodDef gy_py_kernel_methods[] = {
    {"kernel_linear", gy_py_kernel_linear, METH_VARARGS,
     "kernel_linear(y, x, w, w_dtype, bias|None, n, in, out, k_splits, threads): y = x @ w.T + bias, w [out, in]"},
    {"kernel_linear_t", gy_py_kernel_linear_t, METH_VARARGS,
     "kernel_linear_t(y, x, wt, w_dtype, bias|None, n, in, out, k_splits, threads): y = x @ wt + bias, wt [in, out]"},
    {"kernel_add_tree", gy_py_kernel_add_tree, METH_VARARGS,
     "kernel_add_tree(out, parts, n): the tree sum of core/tree.h over the parts"},
    {"kernel_add_bias", gy_py_kernel_add_bias, METH_VARARGS, "kernel_add_bias(y, bias, n, out): y += bias per row"},
    {"kernel_rmsnorm", gy_py_kernel_rmsnorm, METH_VARARGS, "kernel_rmsnorm(out, x, weight, n, dim, eps)"},
    {"kernel_rope_table", gy_py_kernel_rope_table, METH_VARARGS,
     "kernel_rope_table(cos, sin, max_pos, head_dim, inv_freq, mscale): tables [max_pos, head_dim / 2]"},
    {"kernel_rope", gy_py_kernel_rope, METH_VARARGS,
     "kernel_rope(x, positions, cos, sin, n, n_heads, head_dim, max_pos): rotates x in place"},
    {"kernel_swiglu", gy_py_kernel_swiglu, METH_VARARGS, "kernel_swiglu(out, gate, up, count)"},
    {"kernel_add", gy_py_kernel_add, METH_VARARGS, "kernel_add(out, a, b, count)"},
    {"kernel_exp", gy_py_kernel_exp, METH_VARARGS, "kernel_exp(out, x, count): the kernels' exponential"},
    {"kernel_embedding", gy_py_kernel_embedding, METH_VARARGS,
     "kernel_embedding(out, table, dtype, tokens, n, vocab, dim)"},
    {"kernel_argmax", gy_py_kernel_argmax, METH_VARARGS, "kernel_argmax(out_int32, logits, n, vocab)"},
    {"kernel_to_f32", gy_py_kernel_to_f32, METH_VARARGS, "kernel_to_f32(out, x, dtype, count)"},
    {"kernel_from_f32", gy_py_kernel_from_f32, METH_VARARGS, "kernel_from_f32(out, dtype, x, count)"},
    {"kernel_kv_write", gy_py_kernel_kv_write, METH_VARARGS,
     "kernel_kv_write(kv, layout, k, v, token_seq, token_pos, bt_indptr, bt_indices, n_tokens, n_seqs); "
     "layout = (kind, block_size, n_heads, head_dim, n_blocks)"},
    {"kernel_attention", gy_py_kernel_attention, METH_VARARGS,
     "kernel_attention(out, q, kv, layout, token_seq, token_pos, bt_indptr, bt_indices, n_tokens, "
     "n_seqs, n_q_heads, threads)"},
    {"kernel_stream_read", gy_py_kernel_stream_read, METH_VARARGS,
     "kernel_stream_read(x, n, threads) -> sum: the read-bandwidth probe of the benchmarks"},
    {"kernel_fma_peak", gy_py_kernel_fma_peak, METH_VARARGS,
     "kernel_fma_peak(threads, seconds=0.05) -> fp32 FLOP/s of FMA chains on every thread: the "
     "compute roofline of the benchmarks"},
    {"kernel_isa", gy_py_kernel_isa, METH_NOARGS, "kernel_isa() -> the kernel path in use"},
    {"kernel_isa_best", gy_py_kernel_isa_best, METH_NOARGS, "kernel_isa_best() -> the best path compiled in"},
    {NULL, NULL, 0, NULL},
};

int gy_py_kernels_add(PyObject *module) {
    if (PyModule_AddIntConstant(module, "DTYPE_F32", GY_DTYPE_F32) < 0 ||
        PyModule_AddIntConstant(module, "DTYPE_F16", GY_DTYPE_F16) < 0 ||
        PyModule_AddIntConstant(module, "DTYPE_BF16", GY_DTYPE_BF16) < 0 ||
        PyModule_AddIntConstant(module, "LINEAR_MAX_K_SPLITS", GY_LINEAR_MAX_K_SPLITS) < 0)
        return -1;
    return PyModule_AddFunctions(module, gy_py_kernel_methods);
}
