/* py_comm.c: gyges._C.Comm, a communicator among the ranks of this process (comm/comm.h).
 *
 * Engines call its collectives from C, on their rank threads. Python creates it, reads its
 * statistics, and can call the collectives too, one Python thread per rank (the GIL is released
 * while a rank waits for the others), so that tests and benchmarks can drive every backend:
 * buffers are objects with the buffer protocol (NumPy arrays) for shm, and device addresses
 * (ints) for d2d and nccl, fed with upload/download on the rank's stream. Sizes are checked
 * against the buffers for shm only; a device address is trusted. */
#include "py_common.h"

#include "comm/comm.h"
#ifdef GY_WITH_CUDA
#include "kernels/comm_d2d.h"
#endif

typedef struct {
    PyObject_HEAD
    gy_comm *comm;
} GyCommObject;

static PyObject *gy_py_comm_type;

static const char *const gy_py_channel_names[GY_COMM_CHANNEL_COUNT] = {"compute", "migration"};

struct gy_comm *gy_py_comm_unwrap(PyObject *object) {
    if (!PyObject_TypeCheck(object, (PyTypeObject *)gy_py_comm_type)) {
        PyErr_SetString(GY_PY_TYPE_ERROR, "expected a gyges._C.Comm");
        return NULL;
    }
    return ((GyCommObject *)object)->comm;
}

/* devices: None, an int (every rank), or a sequence of `size` ints. 0, or -1 with an exception. */
static int gy_py_comm_devices(PyObject *object, int32_t size, int32_t *devices, int *given) {
    *given = object != Py_None;
    if (!*given) return 0;
    if (size < 1 || size > GY_COMM_MAX_RANKS) return 0; /* gy_comm_init_config names the error */
    if (PyLong_Check(object)) {
        const long d = PyLong_AsLong(object);
        if (d == -1 && PyErr_Occurred()) return -1;
        for (int32_t r = 0; r < size; r++)
            devices[r] = d < INT32_MIN ? INT32_MIN : d > INT32_MAX ? INT32_MAX : (int32_t)d;
        return 0;
    }
    PyObject *seq = gy_py_sequence(object, "devices must be None, an int or a sequence of ints");
    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != size) {
        PyErr_Format(GY_PY_VALUE_ERROR, "devices lists %zd devices for %d ranks",
                     PySequence_Fast_GET_SIZE(seq), (int)size);
        Py_DECREF(seq);
        return -1;
    }
    for (int32_t r = 0; r < size; r++) {
        const long d = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, r));
        if (d == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        devices[r] = d < INT32_MIN ? INT32_MIN : d > INT32_MAX ? INT32_MAX : (int32_t)d;
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *gy_py_comm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"size", "backend", "devices", "channel", NULL};
    int size;
    const char *backend = "shm", *channel = "compute";
    PyObject *devices_object = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i|sOs", names, &size, &backend,
                                     &devices_object, &channel))
        return NULL;
    gy_comm_config config = {.backend = GY_COMM_BACKEND_COUNT, .size = size};
    for (int k = 0; k < GY_COMM_BACKEND_COUNT; k++)
        if (strcmp(backend, gy_comm_backend_name((gy_comm_backend_kind)k)) == 0)
            config.backend = (gy_comm_backend_kind)k;
    if (config.backend == GY_COMM_BACKEND_COUNT)
        return gy_py_raise(GY_FAIL(GY_ERR_INVALID,
                                   "unknown communicator backend '%s' (expected shm, d2d or nccl)",
                                   backend));
    config.channel = GY_COMM_CHANNEL_COUNT;
    for (int k = 0; k < GY_COMM_CHANNEL_COUNT; k++)
        if (strcmp(channel, gy_py_channel_names[k]) == 0) config.channel = (gy_comm_channel)k;
    if (config.channel == GY_COMM_CHANNEL_COUNT)
        return gy_py_raise(GY_FAIL(GY_ERR_INVALID,
                                   "unknown communicator channel '%s' (expected compute or "
                                   "migration)",
                                   channel));
    int32_t devices[GY_COMM_MAX_RANKS];
    int given;
    if (gy_py_comm_devices(devices_object, size, devices, &given) < 0) return NULL;
    config.devices = given ? devices : NULL;
    gy_comm *comm = NULL;
    gy_status s;
    /* Device backends may spend a while in the driver and NCCL. */
    Py_BEGIN_ALLOW_THREADS
    s = gy_comm_init_config(&comm, &config);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    GyCommObject *self = (GyCommObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        gy_comm_free(comm);
        return NULL;
    }
    self->comm = comm;
    return (PyObject *)self;
}

static void gy_py_comm_dealloc(GyCommObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_comm *comm = self->comm;
    self->comm = NULL;
    if (comm != NULL) {
        Py_BEGIN_ALLOW_THREADS
        gy_comm_free(comm); /* device backends wait for their streams */
        Py_END_ALLOW_THREADS
    }
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static int gy_py_comm_is_device(GyCommObject *self) {
    return gy_comm_backend(self->comm) != GY_COMM_BACKEND_SHM;
}

/* ---- buffers: NumPy (shm) or device addresses (d2d, nccl) ---- */

typedef struct gy_py_comm_buf {
    Py_buffer view;
    int held;
    void *ptr;
} gy_py_comm_buf;

/* A device address: any integer (a NumPy int64 from address arithmetic too), never a float or a
 * buffer. A PyArg "O&" converter: 1, or 0 with an exception. */
static int gy_py_comm_address(PyObject *object, void *out) {
    PyObject *index = PyIndex_Check(object) ? PyNumber_Index(object) : NULL;
    if (index == NULL) {
        PyErr_Clear();
        PyErr_Format(GY_PY_TYPE_ERROR, "a device address must be an int, not %.100s",
                     Py_TYPE(object)->tp_name);
        return 0;
    }
    const unsigned long long address = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (address == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *(unsigned long long *)out = address;
    return 1;
}

/* A device address (an int), or a C-contiguous buffer of at least `min_bytes` bytes (writable
 * when `writable`). 0, or -1 with an exception. */
static int gy_py_comm_buf_get(GyCommObject *self, gy_py_comm_buf *b, PyObject *object,
                              int64_t min_bytes, int writable, const char *what) {
    b->held = 0;
    b->ptr = NULL;
    if (gy_py_comm_is_device(self)) {
        unsigned long long address;
        if (!gy_py_comm_address(object, &address)) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) return -1; /* an int out of range */
            PyErr_Clear();
            PyErr_Format(GY_PY_TYPE_ERROR, "%s: a %s communicator takes device addresses (ints)",
                         what, gy_comm_backend_name(gy_comm_backend(self->comm)));
            return -1;
        }
        b->ptr = (void *)(uintptr_t)address;
        return 0;
    }
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, &b->view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(GY_PY_TYPE_ERROR, "%s must be a %sC-contiguous buffer (an shm communicator "
                     "works on host memory)", what, writable ? "writable " : "");
        return -1;
    }
    b->held = 1;
    b->ptr = b->view.buf;
    if (b->view.len < min_bytes) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s has %zd bytes, the call needs %lld", what, b->view.len,
                     (long long)min_bytes);
        return -1;
    }
    return 0;
}

static void gy_py_comm_buf_release(gy_py_comm_buf *b, int n) {
    for (int i = 0; i < n; i++)
        if (b[i].held) {
            PyBuffer_Release(&b[i].view);
            b[i].held = 0;
        }
}

static int gy_py_comm_rank(GyCommObject *self, int rank) {
    if (rank < 0 || rank >= gy_comm_size(self->comm)) {
        gy_py_raise(GY_FAIL(GY_ERR_INVALID, "rank %d is not in a communicator of %d", rank,
                            (int)gy_comm_size(self->comm)));
        return -1;
    }
    return 0;
}

/* ---- collectives ---- */

static PyObject *gy_py_comm_barrier(GyCommObject *self, PyObject *args) {
    int rank;
    if (!PyArg_ParseTuple(args, "i", &rank) || gy_py_comm_rank(self, rank) < 0) return NULL;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_comm_barrier(self->comm, rank);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_comm_all_reduce(GyCommObject *self, PyObject *args) {
    int rank;
    PyObject *object;
    long long n = -1;
    if (!PyArg_ParseTuple(args, "iO|L", &rank, &object, &n) || gy_py_comm_rank(self, rank) < 0)
        return NULL;
    if (gy_py_comm_is_device(self) && n < 0)
        return PyErr_Format(GY_PY_VALUE_ERROR, "all_reduce on device addresses needs n");
    gy_py_comm_buf b;
    if (gy_py_comm_buf_get(self, &b, object, n < 0 ? 0 : 4 * (int64_t)n, 1, "buf") < 0) {
        gy_py_comm_buf_release(&b, 1);
        return NULL;
    }
    if (n < 0) {
        if (b.view.len % 4 != 0) {
            gy_py_comm_buf_release(&b, 1);
            return PyErr_Format(GY_PY_VALUE_ERROR, "buf holds %zd bytes, not float32 values",
                                b.view.len);
        }
        n = b.view.len / 4;
    }
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_comm_all_reduce(self->comm, rank, b.ptr, (int64_t)n);
    Py_END_ALLOW_THREADS
    gy_py_comm_buf_release(&b, 1);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_comm_all_gather(GyCommObject *self, PyObject *args) {
    int rank;
    PyObject *out_object, *in_object;
    long long bytes = -1;
    if (!PyArg_ParseTuple(args, "iOO|L", &rank, &out_object, &in_object, &bytes) ||
        gy_py_comm_rank(self, rank) < 0)
        return NULL;
    if (gy_py_comm_is_device(self) && bytes < 0)
        return PyErr_Format(GY_PY_VALUE_ERROR, "all_gather on device addresses needs nbytes");
    gy_py_comm_buf b[2];
    memset(b, 0, sizeof b);
    if (gy_py_comm_buf_get(self, &b[1], in_object, bytes < 0 ? 0 : bytes, 0, "in") < 0)
        goto fail;
    if (bytes < 0) bytes = b[1].view.len;
    if (gy_py_comm_buf_get(self, &b[0], out_object, bytes * gy_comm_size(self->comm), 1, "out") < 0)
        goto fail;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_comm_all_gather(self->comm, rank, b[0].ptr, b[1].ptr, (int64_t)bytes);
    Py_END_ALLOW_THREADS
    gy_py_comm_buf_release(b, 2);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
fail:
    gy_py_comm_buf_release(b, 2);
    return NULL;
}

/* send(rank, peer, buf, nbytes=None) and recv(rank, peer, buf, nbytes=None): one message. */
static PyObject *gy_py_comm_message(GyCommObject *self, PyObject *args, int receive) {
    int rank, peer;
    PyObject *object;
    long long bytes = -1;
    if (!PyArg_ParseTuple(args, "iiO|L", &rank, &peer, &object, &bytes) ||
        gy_py_comm_rank(self, rank) < 0)
        return NULL;
    if (gy_py_comm_is_device(self) && bytes < 0)
        return PyErr_Format(GY_PY_VALUE_ERROR, "%s on device addresses needs nbytes",
                            receive ? "recv" : "send");
    gy_py_comm_buf b;
    if (gy_py_comm_buf_get(self, &b, object, bytes < 0 ? 0 : bytes, receive, "buf") < 0) {
        gy_py_comm_buf_release(&b, 1);
        return NULL;
    }
    if (bytes < 0) bytes = b.view.len;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = receive ? gy_comm_recv(self->comm, rank, peer, b.ptr, (int64_t)bytes)
                : gy_comm_send(self->comm, rank, peer, b.ptr, (int64_t)bytes);
    Py_END_ALLOW_THREADS
    gy_py_comm_buf_release(&b, 1);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_comm_send(GyCommObject *self, PyObject *args) {
    return gy_py_comm_message(self, args, 0);
}

static PyObject *gy_py_comm_recv(GyCommObject *self, PyObject *args) {
    return gy_py_comm_message(self, args, 1);
}

/* A sequence of `n` ints into out. 0, or -1 with an exception. */
static int gy_py_comm_sizes(PyObject *object, int32_t n, int64_t *out, const char *what) {
    PyObject *seq = gy_py_sequence(object, "sizes must be a sequence of ints");
    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s lists %zd sizes for %d ranks", what,
                     PySequence_Fast_GET_SIZE(seq), (int)n);
        Py_DECREF(seq);
        return -1;
    }
    for (int32_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *gy_py_comm_all_to_all(GyCommObject *self, PyObject *args) {
    int rank;
    PyObject *recv_object, *recv_sizes, *send_object, *send_sizes;
    if (!PyArg_ParseTuple(args, "iOOOO", &rank, &recv_object, &recv_sizes, &send_object,
                          &send_sizes) ||
        gy_py_comm_rank(self, rank) < 0)
        return NULL;
    const int32_t size = gy_comm_size(self->comm);
    int64_t recv_bytes[GY_COMM_MAX_RANKS], send_bytes[GY_COMM_MAX_RANKS];
    if (gy_py_comm_sizes(recv_sizes, size, recv_bytes, "recv_bytes") < 0 ||
        gy_py_comm_sizes(send_sizes, size, send_bytes, "send_bytes") < 0)
        return NULL;
    gy_py_comm_buf b[2 * GY_COMM_MAX_RANKS];
    memset(b, 0, sizeof b);
    PyObject *recv_seq = NULL, *send_seq = NULL;
    recv_seq = gy_py_sequence(recv_object, "recv must be a sequence of buffers or addresses");
    if (recv_seq == NULL) goto fail;
    send_seq = gy_py_sequence(send_object, "send must be a sequence of buffers or addresses");
    if (send_seq == NULL) goto fail;
    if (PySequence_Fast_GET_SIZE(recv_seq) != size || PySequence_Fast_GET_SIZE(send_seq) != size) {
        PyErr_Format(GY_PY_VALUE_ERROR, "recv and send list one buffer per rank (%d)", (int)size);
        goto fail;
    }
    void *recv[GY_COMM_MAX_RANKS];
    const void *send[GY_COMM_MAX_RANKS];
    for (int32_t r = 0; r < size; r++) {
        /* Negative sizes are left to the communicator, which refuses them with the others. */
        const int64_t rb = recv_bytes[r] > 0 ? recv_bytes[r] : 0;
        const int64_t sb = send_bytes[r] > 0 ? send_bytes[r] : 0;
        if (gy_py_comm_buf_get(self, &b[r], PySequence_Fast_GET_ITEM(recv_seq, r), rb, 1,
                               "recv buffer") < 0 ||
            gy_py_comm_buf_get(self, &b[size + r], PySequence_Fast_GET_ITEM(send_seq, r), sb, 0,
                               "send buffer") < 0)
            goto fail;
        recv[r] = b[r].ptr;
        send[r] = b[size + r].ptr;
    }
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_comm_all_to_all(self->comm, rank, recv, recv_bytes, send, send_bytes);
    Py_END_ALLOW_THREADS
    gy_py_comm_buf_release(b, 2 * size);
    Py_DECREF(recv_seq);
    Py_DECREF(send_seq);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
fail:
    gy_py_comm_buf_release(b, 2 * size);
    Py_XDECREF(recv_seq);
    Py_XDECREF(send_seq);
    return NULL;
}

/* ---- streams ---- */

static PyObject *gy_py_comm_set_stream(GyCommObject *self, PyObject *args) {
    int rank;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "iK", &rank, &stream) || gy_py_comm_rank(self, rank) < 0)
        return NULL;
    gy_status s = gy_comm_set_stream(self->comm, rank, (void *)(uintptr_t)stream);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_comm_stream(GyCommObject *self, PyObject *args) {
    int rank;
    if (!PyArg_ParseTuple(args, "i", &rank) || gy_py_comm_rank(self, rank) < 0) return NULL;
    return PyLong_FromUnsignedLongLong((uintptr_t)gy_comm_stream(self->comm, rank));
}

static PyObject *gy_py_comm_stream_priority(GyCommObject *self, PyObject *args) {
    int rank;
    if (!PyArg_ParseTuple(args, "i", &rank) || gy_py_comm_rank(self, rank) < 0) return NULL;
    int32_t priority = 0;
    gy_status s = gy_comm_stream_priority(self->comm, rank, &priority);
    if (s != GY_OK) return gy_py_raise(s);
    return PyLong_FromLong(priority);
}

static PyObject *gy_py_comm_synchronize(GyCommObject *self, PyObject *args) {
    int rank;
    if (!PyArg_ParseTuple(args, "i", &rank) || gy_py_comm_rank(self, rank) < 0) return NULL;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_comm_synchronize(self->comm, rank);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

/* ---- feeding a rank's device buffers (tests, benchmarks) ---- */

/* Host <-> device copy in the order of the rank's stream, with the rank's device current; a
 * download waits for the stream, so the bytes are there when it returns. */
static PyObject *gy_py_comm_transfer(GyCommObject *self, int rank, unsigned long long address,
                                     PyObject *object, int download) {
    if (!gy_py_comm_is_device(self))
        return PyErr_Format(GY_PY_TYPE_ERROR, "upload and download are for device communicators "
                            "(an shm communicator's buffers are host memory already)");
#ifdef GY_WITH_CUDA
    Py_buffer view;
    if (PyObject_GetBuffer(object, &view, PyBUF_C_CONTIGUOUS | (download ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    void *device = (void *)(uintptr_t)address;
    void *stream = gy_comm_stream(self->comm, rank);
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    int32_t previous = -1;
    s = gy_cuda_comm_device_swap(gy_comm_device(self->comm, rank), &previous);
    if (s == GY_OK)
        s = download ? gy_cuda_comm_copy_d2h(view.buf, device, (uint64_t)view.len, stream)
                     : gy_cuda_comm_copy_h2d(device, view.buf, (uint64_t)view.len, stream);
    if (s == GY_OK && download) s = gy_cuda_comm_stream_synchronize(stream);
    if (previous >= 0) {
        int32_t ignored;
        if (gy_cuda_comm_device_swap(previous, &ignored) != GY_OK && s == GY_OK) gy_error_clear();
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
#else
    (void)rank;
    (void)address;
    (void)object;
    (void)download;
    return gy_py_raise(GY_FAIL(GY_ERR_UNAVAILABLE, "gyges was not built with CUDA"));
#endif
}

static PyObject *gy_py_comm_upload(GyCommObject *self, PyObject *args) {
    int rank;
    unsigned long long address;
    PyObject *object;
    if (!PyArg_ParseTuple(args, "iO&O", &rank, gy_py_comm_address, &address, &object) ||
        gy_py_comm_rank(self, rank) < 0)
        return NULL;
    return gy_py_comm_transfer(self, rank, address, object, 0);
}

static PyObject *gy_py_comm_download(GyCommObject *self, PyObject *args) {
    int rank;
    unsigned long long address;
    PyObject *object;
    if (!PyArg_ParseTuple(args, "iOO&", &rank, &object, gy_py_comm_address, &address) ||
        gy_py_comm_rank(self, rank) < 0)
        return NULL;
    return gy_py_comm_transfer(self, rank, address, object, 1);
}

/* ---- statistics and attributes ---- */

static PyObject *gy_py_comm_stats(GyCommObject *self, PyObject *unused) {
    gy_comm_stats st;
    gy_comm_stats_get(self->comm, &st);
    const int32_t n = gy_comm_size(self->comm);
    PyObject *sent = PyList_New(n), *received = PyList_New(n);
    if (sent == NULL || received == NULL) {
        Py_XDECREF(sent);
        Py_XDECREF(received);
        return NULL;
    }
    for (int32_t i = 0; i < n; i++) {
        PyObject *a = PyLong_FromUnsignedLongLong(st.bytes_sent[i]);
        PyObject *b = PyLong_FromUnsignedLongLong(st.bytes_received[i]);
        if (a == NULL || b == NULL) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_DECREF(sent);
            Py_DECREF(received);
            return NULL;
        }
        PyList_SET_ITEM(sent, i, a);
        PyList_SET_ITEM(received, i, b);
    }
    return Py_BuildValue("{sKsNsN}", "calls", (unsigned long long)st.calls, "bytes_sent", sent,
                         "bytes_received", received);
}

static PyObject *gy_py_comm_reset(GyCommObject *self, PyObject *unused) {
    gy_comm_stats_reset(self->comm);
    Py_RETURN_NONE;
}

static PyObject *gy_py_comm_get_size(GyCommObject *self, void *closure) {
    return PyLong_FromLong(gy_comm_size(self->comm));
}

static PyObject *gy_py_comm_get_backend(GyCommObject *self, void *closure) {
    return PyUnicode_FromString(gy_comm_backend_name(gy_comm_backend(self->comm)));
}

static PyObject *gy_py_comm_get_channel(GyCommObject *self, void *closure) {
    return PyUnicode_FromString(gy_py_channel_names[gy_comm_channel_of(self->comm)]);
}

static PyObject *gy_py_comm_get_devices(GyCommObject *self, void *closure) {
    if (!gy_py_comm_is_device(self)) Py_RETURN_NONE;
    const int32_t n = gy_comm_size(self->comm);
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (int32_t r = 0; r < n; r++) {
        PyObject *d = PyLong_FromLong(gy_comm_device(self->comm, r));
        if (d == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, r, d);
    }
    return t;
}

static PyMethodDef gy_py_comm_methods[] = {
    {"barrier", (PyCFunction)gy_py_comm_barrier, METH_VARARGS, "barrier(rank)"},
    {"all_reduce", (PyCFunction)gy_py_comm_all_reduce, METH_VARARGS,
     "all_reduce(rank, buf, n=None): float32 sum over ranks, in place"},
    {"all_gather", (PyCFunction)gy_py_comm_all_gather, METH_VARARGS,
     "all_gather(rank, out, in_, nbytes=None): out = every rank's in_, in rank order"},
    {"all_to_all", (PyCFunction)gy_py_comm_all_to_all, METH_VARARGS,
     "all_to_all(rank, recv, recv_bytes, send, send_bytes): one buffer and size per rank"},
    {"send", (PyCFunction)gy_py_comm_send, METH_VARARGS,
     "send(rank, peer, buf, nbytes=None): buf to rank `peer`, which calls recv(peer, rank, ...)"},
    {"recv", (PyCFunction)gy_py_comm_recv, METH_VARARGS,
     "recv(rank, peer, buf, nbytes=None): fills buf with what rank `peer` sends to `rank`"},
    {"set_stream", (PyCFunction)gy_py_comm_set_stream, METH_VARARGS,
     "set_stream(rank, stream): the cudaStream_t (an int) the rank's collectives go on"},
    {"stream", (PyCFunction)gy_py_comm_stream, METH_VARARGS, "stream(rank) -> int"},
    {"stream_priority", (PyCFunction)gy_py_comm_stream_priority, METH_VARARGS,
     "stream_priority(rank) -> int (lower runs first; 0 for shm)"},
    {"synchronize", (PyCFunction)gy_py_comm_synchronize, METH_VARARGS,
     "synchronize(rank): waits until the rank's stream has done its work"},
    {"upload", (PyCFunction)gy_py_comm_upload, METH_VARARGS,
     "upload(rank, address, buffer): host bytes -> the rank's device memory, on its stream"},
    {"download", (PyCFunction)gy_py_comm_download, METH_VARARGS,
     "download(rank, buffer, address): device bytes -> host buffer, after the rank's stream's "
     "earlier work; returns when they are there"},
    {"stats", (PyCFunction)gy_py_comm_stats, METH_NOARGS, "stats() -> dict"},
    {"reset_stats", (PyCFunction)gy_py_comm_reset, METH_NOARGS, "reset_stats()"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef gy_py_comm_getset[] = {
    {"size", (getter)gy_py_comm_get_size, NULL, "ranks", NULL},
    {"backend", (getter)gy_py_comm_get_backend, NULL, "'shm', 'd2d' or 'nccl'", NULL},
    {"channel", (getter)gy_py_comm_get_channel, NULL, "'compute' or 'migration'", NULL},
    {"devices", (getter)gy_py_comm_get_devices, NULL, "CUDA device of each rank (None: shm)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot gy_py_comm_slots[] = {
    {Py_tp_new, gy_py_comm_new},
    {Py_tp_dealloc, gy_py_comm_dealloc},
    {Py_tp_methods, gy_py_comm_methods},
    {Py_tp_getset, gy_py_comm_getset},
    {Py_tp_doc, "Comm(size, backend='shm', devices=None, channel='compute'): a communicator "
                "among the ranks (threads) of this process; backend 'shm' (host memory), 'd2d' "
                "(virtual workers on one GPU) or 'nccl' (one GPU per rank)."},
    {0, NULL},
};

static PyType_Spec gy_py_comm_spec = {
    .name = "gyges._C.Comm",
    .basicsize = sizeof(GyCommObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_comm_slots,
};

int gy_py_comm_add(PyObject *module) {
    gy_py_comm_type = PyType_FromModuleAndSpec(module, &gy_py_comm_spec, NULL);
    if (gy_py_comm_type == NULL || PyModule_AddObjectRef(module, "Comm", gy_py_comm_type) < 0)
        return -1;
    return 0;
}
